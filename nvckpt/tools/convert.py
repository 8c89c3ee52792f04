"""`nvckpt convert`: between nvckpt, safetensors and torch.save files and DCP directories, in every direction.

A source is read into memory as the object it holds (a tree of dicts, lists
and tensors) and written in the target format:

- nvckpt keeps everything (tree, scalars, tied tensors, metadata).
- safetensors holds a flat map of tensors and str->str metadata.  The tree is
  flattened to tensor names (the same paths nvckpt uses); non-tensor values
  are dropped unless ``keep_tree``, which stores the whole tree (msgpack,
  base64) in the metadata so that converting back restores it.  nvckpt
  metadata goes into safetensors metadata: str values as themselves, and the
  whole map as JSON under ``nvckpt.metadata`` when that is not enough.
  Tensors sharing storage are written as copies (safetensors refuses shared
  tensors).
- torch.save files are read with ``torch.load(weights_only=True)``: a file that
  needs arbitrary code to load is refused.  They hold no metadata.
- a DCP directory (format "dcp": nvckpt.dcp.Writer's, recognised by its
  manifest) is read as its global tensors assembled from the rank files
  (nvckpt.sharded.assemble), nested as the saved state dict; as a target it is
  written from this one process (one rank file, loadable at any world size).
  ``nvckpt merge`` and ``nvckpt split`` are these two directions to nvckpt.
- a DCP directory of torch's own FileSystemWriter (format "dcp-filesystem")
  is read, given ``allow_pickle`` (its metadata is a pickle), as torch's
  ``dcp_to_torch_save`` reads it (nvckpt.tools.filesystem_dcp).
- ``allow_pickle``: the caller trusts the source, so a torch.save file is read
  with ``torch.load(weights_only=False)`` (a legacy file holding NumPy values,
  a Namespace, ...), and a FileSystemWriter directory is read at all.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..codecs.presets import PRESETS
from ..errors import FormatError, NvckptError, UnsupportedFeatureError, UnsupportedObjectError
from ..format.tree import TensorRef, check_tree, escape, pack_tree, resolve_refs, unpack_tree
from ..io.atomic import atomic_output
from ..options import LoadOptions, SaveOptions
from ._util import (
    FILE_FORMATS,
    ProgressFactory,
    UnknownFormatError,
    UsageError,
    WHAT_FORMAT,
    check_output_folder,
    nest_by_name,
    null_bar,
    on_device,
    overwrites_source,
    sniff_format,
)

if TYPE_CHECKING:  # torch is imported only once a conversion runs (a usage error answers without it)
    import torch

FORMATS = ("nvckpt", "safetensors", "torch", "dcp", "dcp-filesystem")
EXTENSIONS = {".nvckpt": "nvckpt", ".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch",
              ".ckpt": "torch"}  # .ckpt: Lightning's (torch.save inside, or nvckpt with NvckptCheckpointIO: sniffed)
CODECS = PRESETS

# safetensors metadata keys written by nvckpt (SPEC-independent convention of this tool).
META_JSON = "nvckpt.metadata"  # the whole nvckpt metadata, as JSON
META_TREE = "nvckpt.tree"  # base64 of the msgpack tree (as in the index), tensors referenced by position in...
META_TREE_NAMES = "nvckpt.tree_names"  # ...this JSON list of safetensors tensor names


def format_of(path: str | os.PathLike, explicit: str | None = None, *, sniff: bool = False) -> str:
    """The format of ``path``: ``explicit``; else (``sniff``, for a source) what its content is; else its extension."""
    from .filesystem_dcp import is_filesystem_directory

    if explicit is not None:
        if explicit not in FORMATS:
            raise UsageError(f"unknown format {explicit!r} (choose from {', '.join(FORMATS)})")
        if explicit == "dcp" and is_filesystem_directory(path):  # merge: either kind of DCP directory
            return "dcp-filesystem"
        return explicit
    from ..sharded.layout import is_dcp_directory

    if is_dcp_directory(path):
        return "dcp"
    if sniff and is_filesystem_directory(path):
        return "dcp-filesystem"
    if sniff and not os.path.exists(path):  # a source that is not there: say so, not "cannot tell the format"
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fspath(path))
    if sniff and os.path.isdir(path):  # a folder that is no nvckpt DCP directory: what it is, as info says it
        from ..sharded.layout import read_manifest

        read_manifest(path)
    found = sniff_format(path) if sniff else None
    if found is not None:
        return found
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext not in EXTENSIONS:
        raise UnknownFormatError(
            f"cannot tell the format of {os.fspath(path)!r} from its extension {ext or '(none)'!r} "
            f"(known: {', '.join(EXTENSIONS)})",
            f"say it with --from/--to ({', '.join(FILE_FORMATS)}; a DCP directory: `nvckpt split`)",
        )
    return EXTENSIONS[ext]


@dataclass
class Loaded:
    """A source file in memory: the saved object, its metadata, notes on what could not be kept."""

    tree: Any
    metadata: dict[str, Any]
    derived: bool = False  # the nvckpt source stored bf16 tensors as derived: keep doing so
    notes: list[str] = field(default_factory=list)


@dataclass
class ConvertReport:
    src: str
    dst: str
    src_format: str
    dst_format: str
    tensors: int  # distinct tensors
    raw_bytes: int  # their bytes
    src_bytes: int
    dst_bytes: int
    seconds: float
    notes: list[str] = field(default_factory=list)  # what the target format could not keep

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _tensors(tree: Any) -> list[torch.Tensor]:
    """Distinct tensors of a tree (a tied tensor counts once)."""
    import torch

    seen: dict[int, torch.Tensor] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            seen.setdefault(id(node), node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return list(seen.values())


# -- readers ---------------------------------------------------------------

def read_nvckpt(path: str | os.PathLike, make_bar: ProgressFactory, *, device: str | None = None) -> Loaded:
    """The object in an nvckpt file.  nvcomp-ans chunks decode only with nvCOMP on a GPU: a file that holds
    them is loaded on the GPU where there is one (``device`` None), else on the CPU."""
    import torch

    from ..session.load import Checkpoint

    with Checkpoint(path) as probe:
        needs_gpu = any(p.needs_gpu for p in probe.file.pipelines)
        total = sum(e.nbytes for e in probe.file.index.tensors if e.chunks is not None)
        derived = any(e.derived is not None for e in probe.file.index.tensors)
    if device is None:
        device = "cuda" if needs_gpu and torch.cuda.is_available() else "cpu"
    bar = make_bar("reading", total)
    try:
        with Checkpoint(path, LoadOptions(device=device)) as ck:
            tree = ck.load(progress=bar.update)
            metadata = dict(ck.metadata())
    finally:
        bar.close()
    return Loaded(tree, metadata, derived)


def _import_safetensors():
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        raise UnsupportedFeatureError("safetensors is not installed: pip install 'nvckpt[convert]'") from None
    return safetensors


def _check_readable(path: str) -> None:
    """The OSError that opening ``path`` for reading gives (missing, a directory, no permission), with its name."""
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    with open(path, "rb"):
        pass


def read_safetensors(path: str | os.PathLike, make_bar: ProgressFactory) -> Loaded:
    safetensors = _import_safetensors()
    path = os.fspath(path)
    _check_readable(path)  # safetensors says "No such file" for a file it may not read
    size = os.path.getsize(path)
    try:
        handle = safetensors.safe_open(path, framework="pt", device="cpu")
    except safetensors.SafetensorError as exc:
        raise FormatError(f"not a valid safetensors file: {exc}", path=path) from None
    bar = make_bar("reading", size)
    try:
        with handle as f:
            meta = dict(f.metadata() or {})
            tensors = {}
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
                bar.update(tensors[name].nbytes)
    except safetensors.SafetensorError as exc:
        raise FormatError(f"not a valid safetensors file: {exc}", path=path) from None
    finally:
        bar.close()

    notes = []
    if META_TREE in meta:
        tree = _tree_from_metadata(meta, tensors, path)
    else:
        tree = nest_by_name(list(tensors.items()))
        if tree is None:
            tree = dict(tensors)
            notes.append("tensor names do not nest into one tree (e.g. 'a' and 'a/b'); written as a flat map, "
                         "so names with '/' or '~' are escaped in nvckpt")
    if META_JSON in meta:
        try:
            metadata = json.loads(meta[META_JSON])
        except ValueError as exc:
            raise FormatError(f"metadata {META_JSON!r} is not valid JSON: {exc}", path=path) from None
        if not isinstance(metadata, dict):
            raise FormatError(f"metadata {META_JSON!r} is not a JSON object", path=path)
    else:
        metadata = {k: v for k, v in meta.items() if k not in (META_TREE, META_TREE_NAMES)}
    return Loaded(tree, metadata, notes=notes)


def _tree_from_metadata(meta: dict[str, str], tensors: dict[str, torch.Tensor], path: str) -> Any:
    from ..session.load import torch_value

    try:
        names = json.loads(meta.get(META_TREE_NAMES, ""))
        tree = unpack_tree(base64.b64decode(meta[META_TREE], validate=True))
    except (ValueError, NvckptError) as exc:
        raise FormatError(f"metadata {META_TREE!r} does not hold a valid tree: {exc}", path=path) from None
    if not isinstance(names, list) or any(n not in tensors for n in names):
        raise FormatError(f"metadata {META_TREE_NAMES!r} names tensors the file does not hold", path=path)
    check_tree(tree, len(names))
    return resolve_refs(tree, lambda i: tensors[names[i]], torch_value)  # dtype and device leaves as torch's


def read_torch(path: str | os.PathLike, *, allow_pickle: bool = False) -> Loaded:
    """The object in a torch.save file: ``torch.load(weights_only=True)``, or, given ``allow_pickle`` (a file
    the caller trusts), ``weights_only=False``, which runs the file's pickle."""
    import torch

    path = os.fspath(path)
    _check_readable(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        from ..sharded.assemble import weights_only_reason

        reason = weights_only_reason(exc)
        if "global" in reason.lower() and not allow_pickle:  # a class or function the file would import
            raise UnsupportedObjectError(
                f"torch.load(weights_only=True) refused it ({reason}); nvckpt reads a torch.save file without "
                "running code from it unless told the file is trusted: --allow-pickle (runs its pickle)",
                path=path) from None
        raise FormatError(f"not a readable torch.save file ({reason})", path=path) from None
    except OSError:  # the system refused (permissions, I/O): not damage in the file
        raise
    except Exception as exc:  # torch.load raises many types (KeyError, RuntimeError, EOFError...) on bad input
        text = " ".join(str(exc).split())
        text = text if len(text) <= 160 else text[:160] + "..."
        raise FormatError(f"not a readable torch.save file ({type(exc).__name__}: {text})", path=path) from None
    return Loaded(obj, {})


# -- writers ---------------------------------------------------------------

def read_dcp(path: str | os.PathLike, make_bar: ProgressFactory) -> Loaded:
    """The state in a DCP directory, its global tensors assembled from the shards (on the GPU where the
    rank files hold GPU-only chunks and there is one)."""
    import torch

    from ..session.load import Checkpoint
    from ..sharded.assemble import assemble
    from ..sharded.layout import read_manifest

    m = read_manifest(path)
    needs_gpu = False
    for name in m.files:
        with Checkpoint(m.store.open_source(name)) as probe:
            needs_gpu = needs_gpu or any(p.needs_gpu for p in probe.file.pipelines)
    device = "cuda" if needs_gpu and torch.cuda.is_available() else "cpu"
    bar = make_bar("reading", sum(t.nbytes for t in m.tensors.values()))
    try:
        tree = assemble(path, device=device, progress=bar.update)
    finally:
        bar.close()
    return Loaded(tree, {"nvckpt.dcp": {"world_size": m.world_size, "save_id": m.save_id}})


def write_dcp(loaded: Loaded, dst: str | os.PathLike, *, codec: str, zstd_level: int) -> tuple[int, list[str]]:
    from ..dcp.split import write_directory
    from ..sharded.layout import read_manifest

    if codec not in CODECS:
        raise UsageError(f"codec must be one of {', '.join(CODECS)}, got {codec!r}")
    tree = loaded.tree
    notes = []
    if not isinstance(tree, dict):
        tree = {"state": tree}
        notes.append("the source holds no dict at its top: the DCP state dict is {'state': <it>}")
    if loaded.metadata:
        notes.append("metadata is not kept in a DCP directory")
    write_directory(tree, dst, codec=codec, zstd_level=zstd_level)
    return _size(dst), notes + ([] if read_manifest(dst).tensors else ["the directory holds no tensors"])


def _size(path: str | os.PathLike) -> int:
    """A file's size, or the total of a directory's files (at a URL too)."""
    from .remote import is_url

    if is_url(path):
        from ..io.source import open_source
        from ..sharded.layout import is_dcp_directory, read_manifest

        if is_dcp_directory(path):
            m = read_manifest(path)
            return sum(m.store.size(n) or 0 for n in m.store.entries())
        with contextlib.closing(open_source(path)) as source:
            return source.size
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def _check_output_directory(path: str | os.PathLike) -> None:
    from .remote import is_url

    if is_url(path):  # a prefix in a store: nothing to make first (the Writer checks the bucket)
        return
    final = os.path.abspath(os.fspath(path))
    if os.path.exists(final) and not os.path.isdir(final):
        raise FileExistsError(17, "exists and is not a directory", os.fspath(path))
    if not os.path.isdir(os.path.dirname(final)):
        raise FileNotFoundError(2, "No such directory", os.path.dirname(final))


def write_nvckpt(loaded: Loaded, dst: str | os.PathLike, *, codec: str, zstd_level: int, make_bar: ProgressFactory) -> int:
    from ..session.save import SaveSession

    if codec not in CODECS:
        raise UsageError(f"codec must be one of {', '.join(CODECS)}, got {codec!r}")
    options = SaveOptions(codec=codec, zstd_level=zstd_level, metadata=loaded.metadata, derive_bf16=loaded.derived)
    bar = make_bar("writing", sum(t.nbytes for t in _tensors(loaded.tree)))
    try:
        return SaveSession(loaded.tree, dst, options, progress=bar.update).run().file_bytes
    finally:
        bar.close()


def flatten(tree: Any) -> tuple[dict[str, torch.Tensor], Any, list[str], list[str]]:
    """Tensors by name (every path, aliases included), the tree with TensorRefs into the name
    list, the names those refs index, and the paths of the non-tensor values."""
    import torch

    from ..plan.walk import typed_leaf

    tensors: dict[str, torch.Tensor] = {}
    first: dict[int, int] = {}  # id(tensor) -> position in names (ties refer to the first path)
    names: list[str] = []
    dropped: list[str] = []

    def walk(node: Any, parts: tuple[str, ...]) -> Any:
        path = "/".join(parts)
        if isinstance(node, torch.Tensor):
            if path in tensors:
                raise UnsupportedObjectError(f"two tensors would both be named {path!r} (keys must stay distinct after str())")
            tensors[path] = node
            if id(node) not in first:
                first[id(node)] = len(names)
                names.append(path)
            return TensorRef(first[id(node)])
        if isinstance(node, dict):
            return {k: walk(v, parts + (escape(k),)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            items = [walk(v, parts + (str(i),)) for i, v in enumerate(node)]
            return tuple(items) if isinstance(node, tuple) else items
        dropped.append(path)
        typed = typed_leaf(node, path)  # a torch.dtype or torch.device as the tree stores it (SPEC 9.2)
        return node if typed is None else typed

    refs = walk(tree, ())
    return tensors, refs, names, dropped


def unshared(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """Contiguous CPU tensors of which no two share memory (safetensors refuses shared tensors);
    and how many had to be copied for that."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    copies = 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.numel():
            if t.untyped_storage().data_ptr() in storages:
                t = t.clone()
                copies += 1
            storages.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out, copies


def safetensors_metadata(metadata: dict[str, Any]) -> dict[str, str]:
    """nvckpt metadata as safetensors' str->str map (see the module docstring)."""
    out = {k: v for k, v in metadata.items() if isinstance(v, str)}
    # transformers refuses safetensors files whose metadata lacks "format".
    out.setdefault("format", "pt")
    if out != metadata:
        out[META_JSON] = json.dumps(metadata, ensure_ascii=False, allow_nan=True)
    return out


def write_safetensors(loaded: Loaded, dst: str | os.PathLike, *, keep_tree: bool) -> tuple[int, list[str]]:
    st = _import_safetensors().torch
    tensors, refs, names, dropped = flatten(loaded.tree)
    notes = []
    out, copies = unshared(tensors)
    meta = safetensors_metadata(loaded.metadata)
    if keep_tree:
        meta[META_TREE] = base64.b64encode(pack_tree(refs)).decode("ascii")
        meta[META_TREE_NAMES] = json.dumps(names, ensure_ascii=False)
    elif dropped:
        shown = ", ".join(repr(p) for p in dropped[:3]) + (", ..." if len(dropped) > 3 else "")
        notes.append(f"{len(dropped)} non-tensor values are not written (safetensors holds only tensors): {shown}; "
                     "--keep-tree stores the whole structure in the metadata")
    if copies:
        notes.append(f"{copies} tensors that shared storage with another were written as copies "
                     "(safetensors stores no shared tensors)")
    unsupported = sorted({str(t.dtype) for t in out.values() if t.dtype not in _safetensors_dtypes(st)})
    if unsupported:
        raise UnsupportedObjectError(f"safetensors cannot store dtype {', '.join(unsupported)}")
    return written("safetensors", dst, lambda tmp: st.save_file(out, tmp, metadata=meta)), notes


def _safetensors_dtypes(st) -> set[torch.dtype]:
    import torch

    # safetensors keeps its dtype tables private: _SIZE holds every dtype save_file writes (_TYPES, the
    # names load_file reads, leaves out float8_e8m0fnu and float4_e2m1fn_x2, which it writes and reads).
    for name in ("_SIZE", "_TYPES"):
        table = getattr(st, name, None)
        if isinstance(table, dict) and table:
            return set(table) if name == "_SIZE" else set(table.values())
    return {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
            torch.int16, torch.int8, torch.uint8, torch.bool}


def write_torch(loaded: Loaded, dst: str | os.PathLike) -> tuple[int, list[str]]:
    import torch

    notes = []
    if loaded.metadata:
        notes.append(f"the metadata ({', '.join(map(repr, list(loaded.metadata)[:5]))}) is dropped: "
                     "torch.save files have no metadata")
    return written("torch.save", dst, lambda tmp: torch.save(loaded.tree, tmp)), notes


def written(writer: str, dst: str | os.PathLike, write: Any) -> int:
    """``write(tmp)`` through the atomic replace; returns the file's size.  A foreign writer's failure to
    write (safetensors' SafetensorError, torch's RuntimeError from its zip writer) is the OSError it is."""
    with atomic_output(dst) as tmp:
        try:
            write(tmp)
        except OSError:
            raise
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            named = re.search(r"os error (\d+)", str(exc))  # safetensors (Rust) quotes the OS error's number
            code = int(named.group(1)) if named else errno.ENOSPC if _disk_full(tmp) else errno.EIO
            raise OSError(code, f"{os.strerror(code)} ({writer} failed: {first[:160]})", os.fspath(dst)) from None
        return os.path.getsize(tmp)


def _disk_full(path: str) -> bool:
    try:
        return shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free < (1 << 20)
    except OSError:
        return False


def _check_convertible(tree: Any, src: str) -> None:
    """Refuse, before any progress bar, copy or size touches them, tensors without plain bytes (a sparse tensor
    has no nbytes nor contiguous(); nvckpt and safetensors store neither; a meta tensor holds no data): the
    check nvckpt.save makes, as its UnsupportedObjectError naming the source (exit 3 in the CLI)."""
    import torch

    from ..plan.walk import refuse_without_bytes

    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(tree, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, torch.Tensor):
            if id(node) not in seen:
                seen.add(id(node))
                try:
                    refuse_without_bytes(node, path)
                except UnsupportedObjectError as exc:
                    raise exc.located(path=src)
            continue
        if isinstance(node, dict):
            stack.extend((v, f"{path}/{escape(k)}" if path else escape(k)) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(node))


# -- the tool --------------------------------------------------------------

def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    src_format: str | None = None,
    dst_format: str | None = None,
    codec: str = "auto",
    zstd_level: int = 1,
    keep_tree: bool = False,
    allow_pickle: bool = False,
    progress: ProgressFactory | None = None,
) -> ConvertReport:
    """Convert ``src`` to ``dst``; formats from the extensions unless given.  ``allow_pickle``: the source is
    trusted (a torch.save file is read with weights_only=False; a FileSystemWriter directory is read)."""
    start = time.perf_counter()
    told = src_format
    src_format = format_of(src, src_format, sniff=True)
    dst_format = format_of(dst, dst_format)
    if overwrites_source(src, dst):
        raise UsageError("the destination would overwrite the source (the same file, or a file inside the source "
                         "directory)")
    if dst_format == "dcp":
        _check_output_directory(dst)
    else:
        check_output_folder(dst)
    make_bar = progress or null_bar
    try:
        if src_format == "nvckpt":
            loaded = read_nvckpt(src, make_bar)
        elif src_format == "dcp":
            loaded = read_dcp(src, make_bar)
        elif src_format == "dcp-filesystem":
            from .filesystem_dcp import read_state, require_trust

            require_trust(src, allow_pickle)
            loaded = Loaded(read_state(src, make_bar), {})
        elif src_format == "safetensors":
            loaded = read_safetensors(src, make_bar)
        else:
            loaded = read_torch(src, allow_pickle=allow_pickle)
    except NvckptError as exc:
        found = sniff_format(src) if told is not None else None
        if found is not None and found != src_format:  # a wrong --from: say what the file is
            exc.reason += f" (its content is {WHAT_FORMAT[found]}: drop --from, or say --from {found})"
            exc.located()  # the message again, with the reason
        raise
    notes = list(loaded.notes)
    _check_convertible(loaded.tree, os.fspath(src))
    if dst_format != "nvckpt":
        loaded.tree = on_device(loaded.tree, "cpu")
    if dst_format == "nvckpt":
        try:
            size = write_nvckpt(loaded, dst, codec=codec, zstd_level=zstd_level, make_bar=make_bar)
        except UnsupportedObjectError as exc:  # what the source holds: name it
            raise exc.located(path=os.fspath(src))
    elif dst_format == "dcp":
        try:
            size, more = write_dcp(loaded, dst, codec=codec, zstd_level=zstd_level)
        except UnsupportedObjectError as exc:  # a key a DCP directory cannot give back: in the source
            raise exc.located(path=os.fspath(src))
        notes += more
    elif dst_format == "safetensors":
        size, more = write_safetensors(loaded, dst, keep_tree=keep_tree)
        notes += more
    else:
        size, more = write_torch(loaded, dst)
        notes += more
    tensors = _tensors(loaded.tree)
    return ConvertReport(
        os.fspath(src), os.fspath(dst), src_format, dst_format, len(tensors),
        sum(t.nbytes for t in tensors), _size(src), size, time.perf_counter() - start, notes,
    )


__all__ = ["convert", "ConvertReport", "format_of", "flatten", "FORMATS", "FILE_FORMATS", "EXTENSIONS", "CODECS",
           "UnknownFormatError"]
