#!/usr/bin/env python3
"""Hostile files, and every reading path of nvckpt run over them under a memory cap.

The files (issue 10): nests and counts that random mutation never reaches
(tuples 200 deep, arrays 5000 deep, lying container sizes, a million tiny
items) in every msgpack payload nvckpt parses (index, tree, metadata, writer,
unknown keys, entries, views, codec configurations, TENSOR and CODEC frames);
indexes of very many chunks and tensors; a legal small file that declares a
tensor of GiBs, a 64 GiB stride-0 view; padding and bool bytes a reader
rejects.  ``build(folder)`` writes them.

``check(path)`` runs one file through every path (open and load on the CPU,
``untrusted=True``, ``info``, ``ls``, ``verify``, ``recover``, the GPU
loader's code on the host backend) and returns, per path, "ok" or the
NvckptError class it raised; anything else is a bug ("BUG ...").
``check_all(paths)`` forks one child per file from a process that has
imported torch once, caps the child's address space (RLIMIT_AS), and reports
its outcomes, whether it crashed (a signal) and its peak memory (VmHWM).

    python3 tools/hostile.py --out /tmp/hostile          # write the files, check them, print a table
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import resource
import struct
import sys
import tempfile
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import msgpack  # noqa: E402
import xxhash  # noqa: E402

from conformance import craft  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30

#: Conformance cases of issue 10 and before that these paths should also survive.
CONFORMANCE = ["tree-tuple-depth-200", "metadata-depth-2000", "tensor-frame-unknown-key-depth-200",
               "codec-frame-configuration-depth-200", "valid-ignored-tuples-depth-200",
               "index-array-count-2p32", "tree-map-count-2p32", "metadata-str-length-2p32", "chunk-list-long-negative",
               "chunk-list-long-bool", "chunk-list-long-overlap", "valid-many-chunks", "tree-depth-100000",
               "chunk-frame-padding-nonzero", "bool-byte-2", "zstd-bomb-declared", "zstd-bomb-undeclared"]


# -- files ----------------------------------------------------------------------------------------

def index_only_file(index: dict, data: bytes) -> bytes:
    """A file of ``data`` (after 48 zero bytes: chunk payloads start at 72) and an INDEX frame, no other frames:
    valid for a random-access reader, which reads no CHUNK frame; a streaming reader finds no frames."""
    body = craft.Preamble().pack() + bytes(48) + data
    payload = msgpack.packb(index, use_bin_type=True)
    frame = craft.Frame(craft.INDEX, payload)
    out = body + frame.header() + payload
    return out + craft.Footer(len(body), len(payload), xxhash.xxh3_64_intdigest(payload)).pack()


def _index(tensors: list, tree: Any, codecs: list | None = None) -> dict:
    return {"format": "nvckpt", "version": [1, 0], "writer": {"name": "hostile"},
            "codecs": codecs or [[{"name": "raw", "configuration": {}}]], "tensors": tensors, "tree": tree, "metadata": {}}


def _ref(tid: int) -> msgpack.ExtType:
    return msgpack.ExtType(1, struct.pack("<I", tid))


def many_chunks(n: int) -> bytes:
    """One uint8 tensor of ``n`` one-byte raw chunks: about 20 bytes of index a chunk (issue 10: 1M -> 19 MB)."""
    data = bytes(i * 7 & 0xFF for i in range(n))
    h = xxhash.xxh3_64_intdigest
    chunks = [[72 + i, 1, 1, 0, h(data[i:i + 1])] for i in range(n)]
    return index_only_file(_index([{"name": "t", "dtype": "uint8", "shape": [n], "chunks": chunks,
                                    "checksum": h(data)}], {"t": _ref(0)}), data)


def many_tensors(n: int) -> bytes:
    """``n`` one-byte tensors of one chunk each, every one in the tree."""
    data = bytes(i * 7 & 0xFF for i in range(n))
    h = xxhash.xxh3_64_intdigest
    tensors = [{"name": f"t{i}", "dtype": "uint8", "shape": [1], "chunks": [[72 + i, 1, 1, 0, h(data[i:i + 1])]],
                "checksum": h(data[i:i + 1])} for i in range(n)]
    return index_only_file(_index(tensors, {f"t{i}": _ref(i) for i in range(n)}), data)


def huge_tensor(nbytes: int) -> bytes:
    """A legal file (every frame, every checksum) declaring a uint8 tensor of ``nbytes`` zeros in 16 MiB zstd chunks
    of a few hundred bytes each: 8 GiB in about 300 KB."""
    import zstandard

    from nvckpt.codecs import Pipeline, Zstd
    from nvckpt.format.frames import FrameWriter
    from nvckpt.format.tree import TensorRef

    chunk = 16 * MiB
    assert nbytes % chunk == 0
    payload = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(bytes(chunk))
    n = nbytes // chunk
    out = io.BytesIO()
    w = FrameWriter(out, [{"name": "huge", "dtype": "uint8", "shape": [nbytes]}], [[chunk] * n], alignment=1)
    w.tensor(0)
    pipeline = Pipeline((Zstd(3),))
    for i in range(n):
        w.chunk(0, i, pipeline, payload, chunk)
    w.finish({"huge": TensorRef(0)}, {}, {"name": "hostile"})
    return out.getvalue()


def stride0_view(nbytes: int) -> bytes:
    """A valid file: views "a" (one element) and "b" (stride 0, ``nbytes`` large) of a float32 base of two."""
    import torch

    import nvckpt

    base = torch.ones(2)
    buf = io.BytesIO()
    nvckpt.save({"a": base[:1], "b": base[1:]}, buf, codec="raw")
    nv = craft.parse(buf.getvalue())
    tensors = nv.index["tensors"]
    view = next(e for e in tensors if e["name"] == "b")
    view["shape"] = [nbytes // 4]
    view["view"]["stride"] = [0]
    nv.index["tensors"] = tensors
    craft.sync_tensor_frames(nv)
    return craft.build(nv)


def nest_bombs(seed_file: bytes) -> dict[str, bytes]:
    """The seed file with a deep nest or a huge count at every place a payload holds a value."""
    fuzz = _fuzz()
    rng = random.Random(10)
    out = {}
    kinds = {
        "tuples-200": lambda r: fuzz.deep_nest(r, 200, "tuple"),
        "arrays-5000": lambda r: fuzz.deep_nest(r, 5000, "list"),
        "maps-1025": lambda r: fuzz.deep_nest(r, 1025, "map"),
        "mixed-1024": lambda r: fuzz.deep_nest(r, 1024, "mixed"),
        "array-count-2p32": lambda r: b"\xdd\xff\xff\xff\xff\xc0",
        "empty-maps-200k": lambda r: b"\xdd" + (200_000).to_bytes(4, "big") + b"\x80" * 200_000,
    }
    for place in fuzz.PLACES:
        for kind, make in kinds.items():
            out[f"{place}-{kind}"] = fuzz.place_hostile(seed_file, rng, make(rng), place)
    return out


def _fuzz() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("nvckpt_fuzz", os.path.join(ROOT, "tools", "fuzz.py"))
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def seed_file() -> bytes:
    """A small valid file with a view, a tuple and metadata: every payload kind has somewhere to go."""
    import torch

    import nvckpt

    flat = torch.arange(12.0)
    buf = io.BytesIO()
    nvckpt.save({"a": flat[:4], "b": flat[2:10], "t": (1, 2.5), "w": torch.ones(3, dtype=torch.bool)}, buf,
                metadata={"step": 3}, codec="zstd")
    return buf.getvalue()


def build(folder: str, *, chunks: int = 100_000, tensors: int = 20_000, huge: int = 2 * GiB) -> list[str]:
    """Write the hostile files into ``folder``; returns their paths."""
    os.makedirs(folder, exist_ok=True)
    files: dict[str, bytes] = {
        f"many-chunks-{chunks}": many_chunks(chunks),
        f"many-tensors-{tensors}": many_tensors(tensors),
        f"huge-tensor-{huge >> 30}g": huge_tensor(huge),
        "stride0-view-64g": stride0_view(64 * GiB),
    }
    files.update(nest_bombs(seed_file()))
    paths = []
    for name, data in files.items():
        path = os.path.join(folder, f"{name}.nvckpt")
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    for cid in CONFORMANCE:
        paths.append(os.path.join(ROOT, "conformance", "files", f"{cid}.nvckpt"))
    return paths


# -- every reading path ---------------------------------------------------------------------------

def _outcome(fn: Any) -> str:
    import nvckpt

    try:
        fn()
        return "ok"
    except nvckpt.NvckptError as exc:
        return type(exc).__name__
    except Exception as exc:  # the property is broken: report it with where it happened
        tb = traceback.extract_tb(exc.__traceback__)
        inner = [f for f in tb if "nvckpt" in f.filename] or tb
        return f"BUG {type(exc).__name__}@{os.path.basename(inner[-1].filename)}:{inner[-1].lineno}: {str(exc)[:160]}"


def check(path: str, scratch: str, peaks: dict[str, int] | None = None) -> dict[str, str]:
    """Every reading path over one file: {path name: "ok" or the NvckptError class name, or "BUG ..."};
    ``peaks`` gets each path's peak memory above where it started (bytes)."""
    peaks = {} if peaks is None else peaks
    import nvckpt
    from nvckpt import cli
    from nvckpt.testing.host import HostBackend
    from nvckpt.engines.gpu.decode import decode_entries
    from nvckpt.options import GpuLoadOptions
    from nvckpt.tools.info import describe, list_tensors
    from nvckpt.tools.recover import recover
    from nvckpt.tools.verify import verify

    def load() -> None:
        nvckpt.load(path, workers=2)

    def load_untrusted() -> None:
        with nvckpt.open(path, untrusted=True, max_tensor_bytes=256 * MiB) as ck:
            ck.load()
            for name in ck.keys():
                ck.get_slice(name)[:1] if ck.index.tensors[ck.index.paths[name]].shape else None

    def gpu_host() -> None:
        with nvckpt.open(path) as ck:
            stored = [e for e in ck.index.tensors if e.chunks is not None]
            decode_entries(ck.file, stored, HostBackend(),
                           GpuLoadOptions(read_span_bytes=4 * MiB, decode_batch_bytes=32 * MiB, read_buffers=3,
                                          direct_io=False))

    def verify_all() -> None:
        report = verify(path, workers=2)
        if not report.ok:
            raise nvckpt.FormatError(f"verify: {report.problems[0]}")

    def recover_all() -> None:
        dst = os.path.join(scratch, "recovered.nvckpt")
        try:
            recover(path, dst)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dst)

    def cli_run(*argv: str) -> None:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
            code = cli.main(list(argv))
        if code not in (0, 1, 3):
            raise RuntimeError(f"nvckpt {' '.join(argv[:1])} exited {code}")

    paths = {
        "load": load, "untrusted": load_untrusted,
        "info": lambda: json.dumps(describe(path)), "ls": lambda: json.dumps(list_tensors(path)),
        "cli-info": lambda: cli_run("info", path), "cli-ls": lambda: cli_run("ls", path),
        "verify": verify_all, "recover": recover_all, "gpu-host": gpu_host,
    }
    out = {}
    for name, fn in paths.items():
        _peak_reset()
        start = _status("VmRSS")
        out[name] = _outcome(fn)
        peaks[name] = max(0, _status("VmHWM") - start)
    return out


def _peak_reset() -> None:
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def check_all(paths: list[str], *, cap_extra: int = 3 * GiB // 2) -> list[dict[str, Any]]:
    """``check`` each file in a forked child whose address space is capped at its parent's + ``cap_extra``.

    Each record: file, bytes, outcomes (per path), crashed (the signal, if the child died of one),
    grew (peak RSS above the child's start, bytes)."""
    import torch  # noqa: F401  (imported once, before the forks)

    import nvckpt  # noqa: F401
    from nvckpt.engines.gpu import decode  # noqa: F401
    from nvckpt.tools import info, recover, verify  # noqa: F401

    results = []
    scratch = tempfile.mkdtemp(prefix="nvckpt-hostile-")
    for path in paths:
        r, w = os.pipe()
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # the child: cap, run, report, exit without cleanup
            os.close(r)
            try:
                vm = _status("VmSize")
                resource.setrlimit(resource.RLIMIT_AS, (vm + cap_extra, resource.RLIM_INFINITY))
                peaks: dict[str, int] = {}
                outcomes = check(path, scratch, peaks)
                report = {"outcomes": outcomes, "grew": max(peaks.values()), "peaks": peaks}
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                report = {"outcomes": {"child": f"BUG {type(exc).__name__}: {str(exc)[:200]}"}, "grew": 0}
            os.write(w, json.dumps(report).encode())
            os.close(w)
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            text = f.read()
        _, status = os.waitpid(pid, 0)
        record: dict[str, Any] = {"file": os.path.basename(path), "bytes": os.path.getsize(path),
                                  "crashed": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                                  "seconds": round(time.perf_counter() - started, 2)}
        record.update(json.loads(text) if text else {"outcomes": {}, "grew": None})
        results.append(record)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "nvckpt-hostile"))
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--tensors", type=int, default=20_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = check_all(build(args.out, chunks=args.chunks, tensors=args.tensors))
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for rec in results:
            outcomes = " ".join(f"{k}={v}" for k, v in rec["outcomes"].items())
            peaks = ", ".join(f"{k} {v >> 20}" for k, v in (rec.get("peaks") or {}).items())
            print(f"{rec['file']}: {rec['bytes']} bytes, grew {(rec['grew'] or 0) >> 20} MiB ({peaks}), "
                  f"{rec['seconds']} s, crashed={rec['crashed']}: {outcomes}")
    bad = [r for r in results if r["crashed"] or any(v.startswith("BUG") for v in r["outcomes"].values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
