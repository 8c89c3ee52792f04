"""A DCP directory written by torch's own ``FileSystemWriter`` (``.metadata`` and ``__<rank>_<n>.distcp``
files), for ``nvckpt info | ls`` and as a source of ``convert`` / ``merge``, in one command.

Its ``.metadata`` is a pickle, which torch's ``FileSystemReader`` reads with ``pickle.load`` (so reading it
can run code from the directory), and its non-tensor values are torch.save bytes.  So nvckpt reads such a
directory only when told it is trusted (``--allow-pickle``), and then as torch does: the metadata with
``FileSystemReader``, the whole state with DCP's own load into an empty state dict, as torch's
``dcp_to_torch_save`` does (its dict keys as DCP stores them: str, an optimizer's ints included).
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

from ..sharded.layout import MANIFEST, METADATA
from ..errors import FormatError, UnsupportedFeatureError
from ..format.tree import escape
from ._util import ProgressFactory, ratio

FORMAT = "torch.distributed.checkpoint directory (FileSystemWriter)"
_DATA_FILE = re.compile(r"__(\d+)_(\d+)\.distcp\Z")


def is_filesystem_directory(path: str | os.PathLike) -> bool:
    """A directory with DCP's ``.metadata`` and no nvckpt manifest: FileSystemWriter's layout."""
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))
            and not os.path.isfile(os.path.join(path, MANIFEST)))


def require_trust(path: str | os.PathLike, allow_pickle: bool) -> None:
    """Refuse to read ``path`` without the caller's word that it is trusted (its .metadata is a pickle)."""
    if not allow_pickle:
        raise UnsupportedFeatureError(
            f"{os.fspath(path)} is a DCP directory of torch's FileSystemWriter: its {METADATA} is a pickle, which "
            "torch reads with pickle.load (it may run code from the directory); if you trust it, --allow-pickle "
            "reads it")


def _metadata(path: str | os.PathLike) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(os.fspath(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign pickle raises anything
        raise FormatError(f"{METADATA} cannot be read as DCP's metadata ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:160]})", path=os.fspath(path)) from None


def _name(path: Any) -> str:
    """A value's name as nvckpt names it (its keys joined by "/", escaped) from DCP's planner path."""
    return "/".join(escape(p) for p in path)


def _dtype_name(dtype: Any) -> str:
    from ..tensors.dtypes import name_of

    try:
        return name_of(dtype)
    except Exception:  # noqa: BLE001 - a dtype nvckpt has no name for: torch's own
        return str(dtype).removeprefix("torch.")


def list_directory(path: str | os.PathLike) -> list[dict[str, Any]]:
    """One row per value of the state, as `nvckpt ls DIR` prints them: names as nvckpt names them (the DCP
    name in "fqn"), dtype, shape, chunks, the .distcp files holding them, raw and stored bytes."""
    return _scan(path)[0]


def _scan(path: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The rows of list_directory, and the raw tensor bytes each .distcp file holds."""
    import math

    md = _metadata(path)
    stored: dict[str, int] = {}
    files: dict[str, set[str]] = {}
    raw_in: dict[str, int] = {}
    metas = md.state_dict_metadata
    for index, info in (md.storage_data or {}).items():
        file = os.fspath(info.relative_path)
        stored[index.fqn] = stored.get(index.fqn, 0) + int(info.length)
        files.setdefault(index.fqn, set()).add(file)
        meta = metas.get(index.fqn)
        if hasattr(meta, "size"):
            offsets = tuple(index.offset or ())
            chunk = next((c for c in meta.chunks if tuple(c.offsets) == offsets), None)
            if chunk is not None:
                raw_in[file] = raw_in.get(file, 0) + math.prod(chunk.sizes) * meta.properties.dtype.itemsize
    rows = []
    planner = md.planner_data or {}
    for fqn, meta in metas.items():
        name = _name(planner.get(fqn) or (fqn,))
        if hasattr(meta, "size"):
            nbytes = math.prod(meta.size) * meta.properties.dtype.itemsize
            rows.append({"name": name, "fqn": fqn, "dtype": _dtype_name(meta.properties.dtype),
                         "shape": list(meta.size), "shards": len(meta.chunks), "files": sorted(files.get(fqn, ())),
                         "nbytes": nbytes, "stored_bytes": stored.get(fqn, 0),
                         "ratio": ratio(nbytes, stored.get(fqn, 0)), "kind": "tensor"})
        else:
            rows.append({"name": name, "fqn": fqn, "dtype": "-", "shape": [], "shards": 1,
                         "files": sorted(files.get(fqn, ())), "nbytes": 0, "stored_bytes": stored.get(fqn, 0),
                         "ratio": None, "kind": "object"})
    return rows, raw_in


def describe_directory(path: str | os.PathLike) -> dict[str, Any]:
    """What `nvckpt info DIR` prints of a FileSystemWriter directory (the keys of an nvckpt directory's)."""
    rows, raw_in = _scan(path)
    directory = os.fspath(path)
    named = {f for r in rows for f in r["files"]}
    problems = []
    out_files = []
    for name in sorted(named | {n for n in os.listdir(directory) if _DATA_FILE.match(n)}):
        where = os.path.join(directory, name)
        rank = _DATA_FILE.match(name)
        size = os.path.getsize(where) if os.path.isfile(where) else 0
        row: dict[str, Any] = {"file": name, "rank": int(rank.group(1)) if rank else None, "bytes": size,
                               "raw_bytes": raw_in.get(name, 0), "ratio": ratio(raw_in.get(name, 0), size)}
        if not os.path.isfile(where):
            row["error"] = "missing"
            problems.append({"message": f"data file {name} is missing", "tensor": None})
        out_files.append(row)
    tensors = [r for r in rows if r["kind"] == "tensor"]
    raw = sum(r["nbytes"] for r in tensors)
    stored = sum(f["bytes"] for f in out_files)
    ranks = {f["rank"] for f in out_files if f["rank"] is not None}
    return {"path": directory, "format": FORMAT, "world_size": len(ranks) or None, "save_id": None,
            "files": out_files, "tensors": len(tensors), "objects": len(rows) - len(tensors),
            "shards": sum(r["shards"] for r in tensors), "raw_bytes": raw, "stored_bytes": stored,
            "ratio": ratio(raw, stored), "problems": problems}


def read_state(path: str | os.PathLike, make_bar: ProgressFactory) -> Any:
    """The whole state, as DCP's own load into an empty state dict gives it (torch's dcp_to_torch_save)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    rows = list_directory(path)  # the metadata read once up front: a damaged one is one FormatError
    bar = make_bar("reading", sum(r["nbytes"] for r in rows))
    state: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            _load_state_dict(state, storage_reader=FileSystemReader(os.fspath(path)),
                             planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps a failure (a BaseException)
        raise FormatError(f"DCP could not load it ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})",
                          path=os.fspath(path)) from None
    finally:
        bar.update(sum(r["nbytes"] for r in rows))
        bar.close()
    return state


__all__ = ["is_filesystem_directory", "require_trust", "list_directory", "describe_directory", "read_state", "FORMAT"]
