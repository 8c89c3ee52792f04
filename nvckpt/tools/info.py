"""`nvckpt info` and `nvckpt ls`: what a file holds, read from its index alone."""

from __future__ import annotations

import os
from contextlib import closing
from typing import Any, Iterator

from ..format.entry import TensorEntry
from ..format.tree import PathValue
from ..read.reader import ChunkReader
from ._util import ratio


def _codec_descriptions(reader: ChunkReader, entry: TensorEntry) -> list[str]:
    if entry.view is not None:
        return [f"view of {reader.index.tensors[entry.view['base']].name}"]
    if entry.derived is not None:
        return [f"{entry.derived['function']} of {reader.index.tensors[entry.derived['source']].name}"]
    return [reader.pipelines[cid].describe() for cid in entry.chunks.codec_ids()]


def tensor_rows(reader: ChunkReader) -> list[dict[str, Any]]:
    """One record per index entry, plus one per extra path of a tied tensor (kind "alias")."""
    rows = []
    for entry in reader.index.tensors:
        stored = entry.stored_bytes
        # A view or derived tensor stores no bytes of its own.
        raw = entry.nbytes if entry.chunks is not None else 0
        rows.append({
            "name": entry.name,
            "tensor_id": entry.tensor_id,
            "dtype": entry.dtype.name,
            "shape": list(entry.shape),
            "nbytes": entry.nbytes,
            "raw_bytes": raw,
            "stored_bytes": stored,
            "ratio": ratio(raw, stored),
            "chunks": len(entry.chunks or ()),
            "codecs": _codec_descriptions(reader, entry),
            "kind": entry.kind,
            "loads_as": "ndarray" if entry.name in reader.index.arrays else "tensor",  # SPEC 9.3
        })
    for path, tid in reader.index.paths.items():
        entry = reader.index.tensors[tid]
        if path != entry.name:
            rows.append({
                "name": path, "tensor_id": tid, "dtype": entry.dtype.name, "shape": list(entry.shape),
                "nbytes": entry.nbytes, "raw_bytes": 0, "stored_bytes": 0, "ratio": None, "chunks": 0,
                "codecs": [f"alias of {entry.name}"], "kind": "alias",
                "loads_as": "ndarray" if path in reader.index.arrays else "tensor",
            })
    return rows


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """Everything `nvckpt info` prints, as JSON-able data."""
    with closing(ChunkReader(path, workers=1)) as reader:
        return describe_reader(reader)


def describe_reader(reader: ChunkReader) -> dict[str, Any]:
    index = reader.index
    kinds = {"data": 0, "view": 0, "derived": 0, "internal": 0}
    dtypes: dict[str, dict[str, Any]] = {}
    codecs = [{"id": cid, "pipeline": _informative(p.to_json()), "description": p.describe(), "chunks": 0,
               "raw_bytes": 0, "stored_bytes": 0} for cid, p in enumerate(reader.pipelines)]
    raw_total = stored_total = chunk_total = 0
    for entry in index.tensors:
        kinds[entry.kind] += 1
        if entry.chunks is None:
            continue
        d = dtypes.setdefault(entry.dtype.name, {"tensors": 0, "raw_bytes": 0, "stored_bytes": 0})
        d["tensors"] += 1
        d["raw_bytes"] += entry.nbytes
        d["stored_bytes"] += entry.stored_bytes
        raw_total += entry.nbytes
        stored_total += entry.stored_bytes
        chunk_total += len(entry.chunks)
        for c in entry.chunks:
            codecs[c.codec_id]["chunks"] += 1
            codecs[c.codec_id]["raw_bytes"] += c.raw_length
            codecs[c.codec_id]["stored_bytes"] += c.stored_length
    for group in list(dtypes.values()) + codecs:
        group["ratio"] = ratio(group["raw_bytes"], group["stored_bytes"])
    loaded = sum(e.nbytes for e in index.tensors if not e.internal)
    file_bytes = reader.source.size
    return {
        "path": reader.path,
        "file_bytes": file_bytes,
        "format": f"nvckpt {reader.preamble.version_major}.{reader.preamble.version_minor}",
        "index_version": list(index.version),
        "writer": _informative(index.writer),
        "entries": len(index.tensors),
        "kinds": kinds,
        "keys": len(index.paths),
        "ndarrays": len(index.arrays),  # names that load as NumPy arrays (SPEC 9.3)
        "paths": sum(1 for _ in path_values(index.tree)),  # pathlib paths in the saved object (SPEC 9.3)
        "required_features": [FEATURE_NAMES.get(b, f"bit {b}") for b in range(32)
                              if reader.preamble.required_features >> b & 1],
        "chunks": chunk_total,
        "raw_bytes": raw_total,
        "stored_bytes": stored_total,
        "ratio": ratio(raw_total, stored_total),
        # What load() materializes (views and derived tensors included) against the whole file.
        "loaded_bytes": loaded,
        "file_ratio": ratio(loaded, file_bytes),
        "overhead_bytes": file_bytes - stored_total,
        "dtypes": dict(sorted(dtypes.items(), key=lambda kv: -kv[1]["raw_bytes"])),
        "codecs": codecs,
        "metadata": index.metadata,
    }


FEATURE_NAMES = {1: "typed tree (9.2)", 2: "arrays and paths (9.3)"}  # required_features bits (SPEC 3)


def path_values(node: Any) -> Iterator[PathValue]:
    """Every pathlib path (ext 10) of a tree."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, PathValue):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _informative(value: Any) -> Any:
    """A value as JSON holds it, where the file may hold any msgpack (the writer map, SPEC 8.2; an unregistered
    codec's configuration, 11.1): bins, exts (kept as stored) and non-str keys are shown as their repr."""
    if isinstance(value, dict):
        return {k if isinstance(k, str) else repr(getattr(k, "value", k)): _informative(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_informative(v) for v in value]
    if value is None or isinstance(value, (str, int, float)):
        return value
    return repr(value)


def list_tensors(path: str | os.PathLike) -> list[dict[str, Any]]:
    with closing(ChunkReader(path, workers=1)) as reader:
        return tensor_rows(reader)
