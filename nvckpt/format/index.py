"""The index: parse it and check every rule of SPEC.md before anything trusts it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .. import dtypes
from ..codecs import Pipeline, pipeline_from_json
from ..derive import FUNCTIONS
from ..errors import FormatError, LimitError, NvckptError, UnsupportedFeatureError
from .constants import (
    EXT_TENSOR,
    EXT_TUPLE,
    FRAME_HEADER_SIZE,
    MAX_CHUNK_LENGTH,
    MAX_CODECS,
    MAX_NAME_BYTES,
    MAX_RANK,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
    MAX_TREE_DEPTH,
    PREAMBLE_SIZE,
    VERSION_MAJOR,
)
from .tree import TensorRef, check_tree, leaf_paths, unpackb

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class Chunk:
    offset: int
    stored_length: int
    raw_length: int
    codec_id: int
    checksum: int
    raw_start: int  # where its bytes start in the tensor's raw bytes


@dataclass
class TensorEntry:
    tensor_id: int
    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...] | None  # None: view or derived
    view: dict[str, Any] | None
    derived: dict[str, Any] | None
    checksum: int | None
    internal: bool
    unsupported: str | None = None  # why this reader cannot build the tensor (raised when it is read)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored_length for c in self.chunks or ())


@dataclass
class Index:
    writer: dict[str, Any]
    codecs: list[Pipeline]
    tensors: list[TensorEntry]
    tree: Any
    metadata: dict[str, Any]
    version: tuple[int, int]
    paths: dict[str, int]  # every tree path to a tensor (aliases too) -> tensor id


def _int(value: Any, what: str, lo: int = 0, hi: int = _U64) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise FormatError(f"{what} must be an integer in {lo}..{hi}, got {value!r:.80}")
    return value


def _map(value: Any, what: str) -> dict:
    """A map of SPEC 8 or 11: str keys only (SPEC 1)."""
    if not isinstance(value, dict):
        raise FormatError(f"{what} must be a map, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise FormatError(f"{what} has a key of type {type(key).__name__}; its keys must be strings")
    return value


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise FormatError(f"{what} must be an array, got {type(value).__name__}")
    return value


def unpack_index(payload: bytes) -> dict[str, Any]:
    try:
        data = unpackb(payload)
    except NvckptError:
        raise
    except RecursionError:
        raise LimitError("index nesting is too deep") from None
    except Exception as exc:  # msgpack raises several types on malformed input
        raise FormatError(f"index is not valid msgpack: {exc}") from None
    return _map(data, "index")


def parse_index(data: dict[str, Any], index_offset: int) -> Index:
    """Validate a decoded index.  Chunk payloads must lie in [preamble end, index_offset)."""
    if data.get("format") != "nvckpt":
        raise FormatError(f"index 'format' is {data.get('format')!r:.40}, expected 'nvckpt'")
    version = _list(data.get("version"), "index 'version'")
    if len(version) != 2 or any(type(v) is not int or not 0 <= v <= 0xFFFF for v in version):
        raise FormatError(f"index 'version' must be [major, minor], got {version!r:.80}")
    if version[0] != VERSION_MAJOR:
        raise FormatError(f"index version {version[0]}.{version[1]} disagrees with the preamble's {VERSION_MAJOR}.x")
    writer = _map(data.get("writer", {}), "index 'writer'")
    metadata = _map(data.get("metadata", {}), "index 'metadata'")
    _check_metadata(metadata)

    codec_list = _list(data.get("codecs"), "index 'codecs'")
    if len(codec_list) > MAX_CODECS:
        raise LimitError(f"{len(codec_list)} codecs exceed the limit of {MAX_CODECS}")
    codecs = [pipeline_from_json(c) for c in codec_list]

    raw_tensors = _list(data.get("tensors"), "index 'tensors'")
    if len(raw_tensors) > MAX_TENSORS:
        raise LimitError(f"{len(raw_tensors)} tensors exceed the limit of {MAX_TENSORS}")
    tensors: list[TensorEntry] = []
    names: set[str] = set()
    ranges: list[tuple[int, int, int, int]] = []  # (offset, end, tensor, chunk)
    for tid, raw in enumerate(raw_tensors):
        entry = _parse_entry(tid, _map(raw, f"tensor {tid}"), len(codecs), index_offset, ranges)
        if entry.name in names:
            raise FormatError(f"duplicate tensor name {entry.name!r}")
        names.add(entry.name)
        tensors.append(entry)

    ranges.sort()
    for (a_off, a_end, a_t, a_c), (b_off, _, b_t, b_c) in zip(ranges, ranges[1:]):
        if b_off < a_end:
            raise FormatError(
                f"chunk {b_c} of tensor {tensors[b_t].name!r} at offset {b_off} overlaps chunk {a_c} of "
                f"tensor {tensors[a_t].name!r} ({a_off}..{a_end})"
            )
    for entry in tensors:
        _check_references(entry, tensors)

    if "tree" not in data:
        raise FormatError("index has no 'tree'")
    tree = data["tree"]
    check_tree(tree, len(tensors))
    paths: dict[str, int] = {}
    by_name = {e.name: e.tensor_id for e in tensors}
    for path, ref in leaf_paths(tree):
        # SPEC 14.1: a name identifies one tensor, whether it is an entry's name or a path's.
        if paths.setdefault(path, ref.tensor_id) != ref.tensor_id or by_name.get(path, ref.tensor_id) != ref.tensor_id:
            raise FormatError(f"the name {path!r:.200} stands for two different tensors")
    return Index(writer, codecs, tensors, tree, metadata, (version[0], version[1]), paths)


def _check_metadata(node: Any) -> None:
    """SPEC 8.6: JSON-like values (no ext types, str keys), nested at most MAX_TREE_DEPTH deep (root = 1)."""
    stack = [(node, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_TREE_DEPTH:
                raise LimitError(f"metadata nesting exceeds the limit of {MAX_TREE_DEPTH}")
            if isinstance(item, dict) and not all(isinstance(k, str) for k in item):
                raise FormatError("metadata keys must be strings")
            stack.extend((x, depth + 1) for x in (item.values() if isinstance(item, dict) else item))
        elif item is not None and type(item) not in (bool, int, float, str):
            raise FormatError(f"metadata holds a {type(item).__name__}; only JSON-like values are allowed")


def _parse_entry(tid: int, raw: dict, ncodecs: int, index_offset: int, ranges: list) -> TensorEntry:
    name = raw.get("name")
    if not isinstance(name, str):
        raise FormatError(f"tensor {tid}: 'name' must be a string")
    where = f"tensor {name!r:.200}"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise LimitError(f"{where}: name longer than {MAX_NAME_BYTES} bytes")
    unsupported = None
    try:
        dtype = dtypes.from_name(raw.get("dtype"))
    except UnsupportedFeatureError as exc:  # SPEC 10: fail when the tensor is read, not at open
        dtype, unsupported = dtypes.DType(raw["dtype"], 0, False), exc.reason
    shape = tuple(_int(d, f"{where}: shape dimension") for d in _list(raw.get("shape"), f"{where}: 'shape'"))
    if len(shape) > MAX_RANK:
        raise LimitError(f"{where}: rank {len(shape)} exceeds {MAX_RANK}")
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    # SPEC 8.3: span, the non-zero dimensions times itemsize (1 for an unknown dtype), bounds every sub-product.
    span = math.prod(d or 1 for d in shape) * (dtype.itemsize or 1)
    if span > MAX_TENSOR_BYTES:
        raise LimitError(f"{where}: shape {list(shape)} spans {span} bytes, more than the limit of {MAX_TENSOR_BYTES}")
    kinds = [k for k in ("chunks", "view", "derived") if k in raw]
    if len(kinds) != 1:
        raise FormatError(f"{where}: needs exactly one of 'chunks', 'view', 'derived', has {kinds}")
    checksum = raw.get("checksum")
    if checksum is not None:
        _int(checksum, f"{where}: 'checksum'")
    internal = raw.get("internal", False)
    if type(internal) is not bool:
        raise FormatError(f"{where}: 'internal' must be a boolean")

    chunks = None
    if "chunks" in raw:
        chunk_list = _list(raw["chunks"], f"{where}: 'chunks'")
        if unsupported is None and len(chunk_list) > nbytes:  # every chunk holds at least one byte
            raise FormatError(f"{where}: {len(chunk_list)} chunks for {nbytes} bytes")
        parsed, total = [], 0
        for i, c in enumerate(chunk_list):
            c = _list(c, f"{where}: chunk {i}")
            if len(c) != 5:
                raise FormatError(f"{where}: chunk {i} must be [offset, stored_length, raw_length, codec, checksum]")
            off = _int(c[0], f"{where}: chunk {i} offset", PREAMBLE_SIZE + FRAME_HEADER_SIZE)
            stored = _int(c[1], f"{where}: chunk {i} stored_length", 1, MAX_CHUNK_LENGTH)
            rawlen = _int(c[2], f"{where}: chunk {i} raw_length", 1, MAX_CHUNK_LENGTH)
            codec = _int(c[3], f"{where}: chunk {i} codec id", 0, MAX_CODECS)
            if codec >= ncodecs:
                raise FormatError(f"{where}: chunk {i} uses codec id {codec}, the codec table has {ncodecs}")
            check = _int(c[4], f"{where}: chunk {i} checksum")
            if off + stored > index_offset:
                raise FormatError(f"{where}: chunk {i} ({off}..{off + stored}) runs past the index at {index_offset}")
            if unsupported is None and rawlen % dtype.itemsize:
                raise FormatError(f"{where}: chunk {i} raw_length {rawlen} is not a multiple of the item size {dtype.itemsize}")
            parsed.append(Chunk(off, stored, rawlen, codec, check, total))
            ranges.append((off, off + stored, tid, i))
            total += rawlen
        if unsupported is None and total != nbytes:
            raise FormatError(f"{where}: chunks hold {total} raw bytes, shape and dtype need {nbytes}")
        chunks = tuple(parsed)
    view = derived = None
    if "view" in raw:
        view = _map(raw["view"], f"{where}: 'view'")
        _int(view.get("base"), f"{where}: view base", 0, MAX_TENSORS)
        _int(view.get("offset"), f"{where}: view offset", 0, MAX_TENSOR_BYTES)
        stride = _list(view.get("stride"), f"{where}: view stride")
        if len(stride) != len(shape):
            raise FormatError(f"{where}: view stride has {len(stride)} entries for rank {len(shape)}")
        for s in stride:
            _int(s, f"{where}: view stride", 0, MAX_TENSOR_BYTES)
    if "derived" in raw:
        derived = _map(raw["derived"], f"{where}: 'derived'")
        if derived.get("function") not in FUNCTIONS:  # SPEC 8.5: fail when the tensor is read, not at open
            unsupported = unsupported or f"unknown derived function {derived.get('function')!r:.60} (known: {', '.join(FUNCTIONS)})"
        _int(derived.get("source"), f"{where}: derived source", 0, MAX_TENSORS)
    return TensorEntry(tid, name, dtype, shape, chunks, view, derived, checksum, internal, unsupported)


def _check_references(entry: TensorEntry, tensors: list[TensorEntry]) -> None:
    where = f"tensor {entry.name!r:.200}"
    if entry.view is not None:
        bid = entry.view["base"]
        if bid >= len(tensors) or bid == entry.tensor_id:
            raise FormatError(f"{where}: view base {bid} does not exist")
        base = tensors[bid]
        if base.chunks is None or len(base.shape) != 1 or base.dtype != entry.dtype:
            raise FormatError(f"{where}: view base {base.name!r} must be a stored 1-D tensor of dtype {entry.dtype.name}")
        if entry.numel:
            last = entry.view["offset"] + sum((d - 1) * s for d, s in zip(entry.shape, entry.view["stride"]))
            if last >= base.numel:
                raise FormatError(f"{where}: view reaches element {last}, base {base.name!r} has {base.numel}")
    if entry.derived is not None:
        sid = entry.derived["source"]
        if sid >= len(tensors) or sid == entry.tensor_id:
            raise FormatError(f"{where}: derived source {sid} does not exist")
        source = tensors[sid]
        if entry.derived.get("function") not in FUNCTIONS:
            return  # its rules are unknown; reading it raises UnsupportedFeatureError
        if entry.dtype.name != "bfloat16" or source.dtype.name != "float32" or source.chunks is None or source.shape != entry.shape:
            raise FormatError(
                f"{where}: bf16_rne needs a bfloat16 tensor derived from a stored float32 tensor of the same shape "
                f"(source {source.name!r} is {source.dtype.name} {list(source.shape)})"
            )


__all__ = ["Chunk", "TensorEntry", "Index", "unpack_index", "parse_index", "TensorRef", "EXT_TENSOR", "EXT_TUPLE"]
