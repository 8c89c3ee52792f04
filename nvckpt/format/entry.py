"""One tensor entry (SPEC 8.3-8.5): its type, and the one parser for index entries and TENSOR frames."""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Sequence

from ..errors import FormatError, LimitError, UnsupportedFeatureError
from . import dtypes
from .constants import (
    DERIVED_FUNCTIONS,
    FRAME_HEADER_SIZE,
    MAX_CHUNK_LENGTH,
    MAX_CODECS,
    MAX_NAME_BYTES,
    MAX_RANK,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
    PREAMBLE_SIZE,
)

U64_MAX = (1 << 64) - 1


class Chunk(NamedTuple):
    offset: int  # file offset of the payload
    stored_length: int
    raw_length: int
    codec_id: int
    checksum: int
    raw_start: int  # where its bytes start in the tensor's raw bytes


class ChunkTable(Sequence[Chunk]):
    """A tensor's chunk table as columns of u64 (48 bytes a chunk, not a Python object each)."""

    __slots__ = ("_offset", "_stored", "_raw", "_codec", "_checksum", "_start")

    def __init__(self) -> None:
        self._offset, self._stored, self._raw = array("Q"), array("Q"), array("Q")
        self._codec, self._checksum, self._start = array("H"), array("Q"), array("Q")

    def append(self, offset: int, stored: int, raw: int, codec: int, checksum: int) -> None:
        self._start.append(self._start[-1] + self._raw[-1] if self._raw else 0)
        self._offset.append(offset)
        self._stored.append(stored)
        self._raw.append(raw)
        self._codec.append(codec)
        self._checksum.append(checksum)

    def __len__(self) -> int:
        return len(self._offset)

    def __getitem__(self, i: int) -> Chunk:  # type: ignore[override]
        return Chunk(self._offset[i], self._stored[i], self._raw[i], self._codec[i], self._checksum[i], self._start[i])

    def __iter__(self) -> Iterator[Chunk]:
        return map(Chunk, self._offset, self._stored, self._raw, self._codec, self._checksum, self._start)

    @property
    def raw_bytes(self) -> int:
        return self._start[-1] + self._raw[-1] if self._raw else 0

    @property
    def stored_bytes(self) -> int:
        return sum(self._stored)

    def codec_ids(self) -> list[int]:
        """The codec ids used, in order of first use."""
        return list(dict.fromkeys(self._codec))

    def covering(self, start: int, stop: int) -> range:
        """Indices of the chunks that hold raw bytes [start, stop)."""
        if stop <= start or not self._start:
            return range(0)
        return range(bisect_right(self._start, start) - 1, bisect_left(self._start, stop))

    def to_json(self) -> list[list[int]]:
        return [list(c[:5]) for c in self]


@dataclass
class TensorEntry:
    tensor_id: int
    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    chunks: ChunkTable | None  # None: a view or derived tensor (or a TENSOR frame, which lists no chunks)
    view: dict[str, Any] | None
    derived: dict[str, Any] | None
    checksum: int | None
    internal: bool
    nchunks: int  # len(chunks) in an index; as declared in a TENSOR frame
    unsupported: str | None = None  # why this reader cannot build the tensor (raised when it is read)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def stored_bytes(self) -> int:
        return self.chunks.stored_bytes if self.chunks is not None else 0

    @property
    def is_data(self) -> bool:
        return self.view is None and self.derived is None

    @property
    def kind(self) -> str:
        if self.view is not None:
            return "view"
        if self.derived is not None:
            return "derived"
        return "internal" if self.internal else "data"

    def description(self) -> dict[str, Any]:
        """The map a TENSOR frame holds for this entry (SPEC 8.3), as the writer wrote it."""
        out: dict[str, Any] = {"name": self.name, "dtype": self.dtype.name, "shape": list(self.shape)}
        for key in ("view", "derived", "checksum"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.internal:
            out["internal"] = True
        out["nchunks"] = self.nchunks
        return out


def check_int(value: Any, what: str, lo: int = 0, hi: int = U64_MAX) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise FormatError(f"{what} must be an integer in {lo}..{hi}, got {value!r:.80}")
    return value


def check_map(value: Any, what: str) -> dict:
    """A map of SPEC 8 or 11: str keys only (SPEC 1)."""
    if not isinstance(value, dict):
        raise FormatError(f"{what} must be a map, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise FormatError(f"{what} has a key of type {type(key).__name__}; its keys must be strings")
    return value


def check_list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise FormatError(f"{what} must be an array, got {type(value).__name__}")
    return value


def parse_entry(tid: int, raw: Any, *, ncodecs: int | None = None, index_offset: int | None = None,
                ranges: list | None = None) -> TensorEntry:
    """Check one entry of the index (``ncodecs`` and ``index_offset`` given: it has a chunk table) or
    one TENSOR frame's description (neither given: it has ``nchunks``), SPEC 8.3-8.5.

    ``ranges`` collects (offset, end, tensor id, chunk index) of every chunk, for the overlap check."""
    in_index = ncodecs is not None
    raw = check_map(raw, f"tensor {tid}")
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
        dtype, unsupported = dtypes.unknown(raw["dtype"]), exc.reason
    shape = tuple(check_int(d, f"{where}: shape dimension") for d in check_list(raw.get("shape"), f"{where}: 'shape'"))
    if len(shape) > MAX_RANK:
        raise LimitError(f"{where}: rank {len(shape)} exceeds {MAX_RANK}")
    nbytes = math.prod(shape) * dtype.itemsize
    # SPEC 8.3: span, the non-zero dimensions times itemsize (1 for an unknown dtype), bounds every sub-product.
    span = math.prod(d or 1 for d in shape) * (dtype.itemsize or 1)
    if span > MAX_TENSOR_BYTES:
        raise LimitError(f"{where}: shape {list(shape)} spans {span} bytes, more than the limit of {MAX_TENSOR_BYTES}")
    kinds = [k for k in ("chunks", "view", "derived") if k in raw]
    if in_index and len(kinds) != 1:
        raise FormatError(f"{where}: needs exactly one of 'chunks', 'view', 'derived', has {kinds}")
    if not in_index and ("chunks" in raw or len(kinds) > 1):
        raise FormatError(f"{where}: a TENSOR frame has 'nchunks' and at most one of 'view', 'derived'")
    checksum = raw.get("checksum")
    if checksum is not None:
        check_int(checksum, f"{where}: 'checksum'")
    internal = raw.get("internal", False)
    if type(internal) is not bool:
        raise FormatError(f"{where}: 'internal' must be a boolean")

    chunks = None
    if in_index and "chunks" in raw:
        chunks = _parse_chunks(tid, where, check_list(raw["chunks"], f"{where}: 'chunks'"), dtype, nbytes,
                               unsupported is None, ncodecs, index_offset, ranges)
        nchunks = len(chunks)
    elif in_index:
        nchunks = 0
    else:
        nchunks = check_int(raw.get("nchunks"), f"{where}: 'nchunks'")
        if kinds and nchunks:
            raise FormatError(f"{where}: a view or derived tensor has no chunks")
        if unsupported is None and nchunks > nbytes:
            raise FormatError(f"{where}: {nchunks} chunks for {nbytes} bytes")
    view = derived = None
    if "view" in raw:
        view = check_map(raw["view"], f"{where}: 'view'")
        check_int(view.get("base"), f"{where}: view base", 0, MAX_TENSORS)
        check_int(view.get("offset"), f"{where}: view offset", 0, MAX_TENSOR_BYTES)
        stride = check_list(view.get("stride"), f"{where}: view stride")
        if len(stride) != len(shape):
            raise FormatError(f"{where}: view stride has {len(stride)} entries for rank {len(shape)}")
        for s in stride:
            check_int(s, f"{where}: view stride", 0, MAX_TENSOR_BYTES)
    if "derived" in raw:
        derived = check_map(raw["derived"], f"{where}: 'derived'")
        if derived.get("function") not in DERIVED_FUNCTIONS:  # SPEC 8.5: fail when the tensor is read, not at open
            unsupported = unsupported or (f"unknown derived function {derived.get('function')!r:.60} "
                                          f"(known: {', '.join(DERIVED_FUNCTIONS)})")
        check_int(derived.get("source"), f"{where}: derived source", 0, MAX_TENSORS)
    return TensorEntry(tid, name, dtype, shape, chunks, view, derived, checksum, internal, nchunks, unsupported)


def _parse_chunks(tid: int, where: str, chunk_list: list, dtype: dtypes.DType, nbytes: int, known: bool,
                  ncodecs: int, index_offset: int, ranges: list | None) -> ChunkTable:
    if known and len(chunk_list) > nbytes:  # every chunk holds at least one byte
        raise FormatError(f"{where}: {len(chunk_list)} chunks for {nbytes} bytes")
    table = ChunkTable()
    total = 0
    lowest = PREAMBLE_SIZE + FRAME_HEADER_SIZE
    for i, c in enumerate(chunk_list):
        if type(c) is not list or len(c) != 5:
            raise FormatError(f"{where}: chunk {i} must be [offset, stored_length, raw_length, codec, checksum]")
        off, stored, rawlen, codec, check = c
        # The common case in one test; the messages come from check_int.
        if not (type(off) is int and type(stored) is int and type(rawlen) is int and type(codec) is int
                and type(check) is int and lowest <= off and 1 <= stored <= MAX_CHUNK_LENGTH
                and 1 <= rawlen <= MAX_CHUNK_LENGTH and 0 <= codec < ncodecs and 0 <= check <= U64_MAX
                and off <= U64_MAX):
            check_int(off, f"{where}: chunk {i} offset", lowest)
            check_int(stored, f"{where}: chunk {i} stored_length", 1, MAX_CHUNK_LENGTH)
            check_int(rawlen, f"{where}: chunk {i} raw_length", 1, MAX_CHUNK_LENGTH)
            check_int(codec, f"{where}: chunk {i} codec id", 0, MAX_CODECS)
            check_int(check, f"{where}: chunk {i} checksum")
            raise FormatError(f"{where}: chunk {i} uses codec id {codec}, the codec table has {ncodecs}")
        if off + stored > index_offset:
            raise FormatError(f"{where}: chunk {i} ({off}..{off + stored}) runs past the index at {index_offset}")
        if known and rawlen % dtype.itemsize:
            raise FormatError(f"{where}: chunk {i} raw_length {rawlen} is not a multiple of the item size {dtype.itemsize}")
        table.append(off, stored, rawlen, codec, check)
        if ranges is not None:
            ranges.append((off, off + stored, tid, i))
        total += rawlen
    if known and total != nbytes:
        raise FormatError(f"{where}: chunks hold {total} raw bytes, shape and dtype need {nbytes}")
    return table


def reference_problem(entry: TensorEntry, lookup: Any) -> str | None:
    """What is wrong with a view's base or a derived tensor's source (SPEC 8.5), or None.

    ``lookup(tensor_id)`` gives another entry, or None where there is none (an index
    always has it; a recovering reader may have lost it)."""
    if entry.view is not None:
        bid = entry.view["base"]
        base = None if bid == entry.tensor_id else lookup(bid)
        if base is None:
            return f"view base {bid} does not exist"
        if not base.is_data or len(base.shape) != 1 or base.dtype != entry.dtype:
            return f"view base {base.name!r} must be a stored 1-D tensor of dtype {entry.dtype.name}"
        if entry.numel:
            last = entry.view["offset"] + sum((d - 1) * s for d, s in zip(entry.shape, entry.view["stride"]))
            if last >= base.numel:
                return f"view reaches element {last}, base {base.name!r} has {base.numel}"
    if entry.derived is not None:
        sid = entry.derived["source"]
        source = None if sid == entry.tensor_id else lookup(sid)
        if source is None:
            return f"derived source {sid} does not exist"
        if entry.derived.get("function") not in DERIVED_FUNCTIONS:
            return None  # its rules are unknown; reading it raises UnsupportedFeatureError
        if entry.derived["function"] == "copy":
            if source.dtype.name != entry.dtype.name or not source.is_data or source.shape != entry.shape:
                return (f"copy needs a stored source of the same dtype and shape (source {source.name!r} is "
                        f"{source.dtype.name} {list(source.shape)}, the entry {entry.dtype.name} {list(entry.shape)})")
        elif entry.dtype.name != "bfloat16" or source.dtype.name != "float32" or not source.is_data or source.shape != entry.shape:
            return (f"bf16_rne needs a bfloat16 tensor derived from a stored float32 tensor of the same shape "
                    f"(source {source.name!r} is {source.dtype.name} {list(source.shape)})")
    return None


__all__ = ["Chunk", "ChunkTable", "TensorEntry", "parse_entry", "reference_problem", "check_int", "check_map", "check_list"]
