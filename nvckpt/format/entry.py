"""One tensor entry (SPEC 8.3-8.5): its type, and the one parser for index entries and TENSOR frames."""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from itertools import accumulate, chain, islice
from operator import add, mul
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Sequence

from ..errors import FormatError, LimitError, UnsupportedFeatureError, brief
from . import dtypes
from .bulk import ChunkColumns
from .tree import Ext, check_depth, key_type, shown
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
_COMMON_KEYS = frozenset(("name", "dtype", "shape", "chunks", "checksum", "nchunks"))
_KNOWN_KEYS = _COMMON_KEYS | {"view", "derived", "internal"}


class Chunk(NamedTuple):
    offset: int  # file offset of the payload
    stored_length: int
    raw_length: int
    codec_id: int
    checksum: int
    raw_start: int  # where its bytes start in the tensor's raw bytes


class ChunkStore:
    """The chunk tables of one index as columns of u64 (48 bytes a chunk, not a Python object each).

    Every tensor's ChunkTable is a slice of one store, so a file of a million
    one-chunk tensors costs six arrays, not six million."""

    __slots__ = ("offset", "stored", "raw", "codec", "checksum", "start")

    def __init__(self) -> None:
        self.offset, self.stored, self.raw = array("Q"), array("Q"), array("Q")
        self.codec, self.checksum, self.start = array("H"), array("Q"), array("Q")

    def __len__(self) -> int:
        return len(self.offset)

    def nbytes(self) -> int:
        return len(self) * 42

    def add_columns(self, columns: list[Any], starts: Any) -> "ChunkTable":
        """``add`` for numpy columns (u64, codec u16): copied in as bytes."""
        lo = len(self.offset)
        for column, values in zip((self.offset, self.stored, self.raw, self.codec, self.checksum, self.start),
                                  (*columns, starts)):
            column.frombytes(values.astype(values.dtype.newbyteorder("=")).tobytes())
        return ChunkTable(self, lo, len(self.offset) - lo)

    def add_rows(self, columns: dict[str, Any], lo: int, hi: int, starts: Any, whole: bool = False) -> None:
        """Chunks ``lo .. hi-1`` of the compiled reader's chunk columns (nvckpt.format.bulk.LazyEntries.columns),
        ``starts`` where each starts in its tensor's raw bytes (u64, bytes or numpy); ``whole``: all of them,
        each column let go once copied."""
        for column, key, size in ((self.offset, "offset", 8), (self.stored, "stored", 8), (self.raw, "raw", 8),
                                  (self.codec, "codec", 2), (self.checksum, "checksum", 8)):
            column.frombytes(memoryview(columns.pop(key) if whole else columns[key])[lo * size: hi * size])
        self.start.frombytes(starts if isinstance(starts, bytes) else memoryview(starts).cast("B"))

    def add_one(self, offset: int, stored: int, raw: int, codec: int, checksum: int) -> "ChunkTable":
        """A table of one chunk."""
        lo = len(self.offset)
        self.offset.append(offset)
        self.stored.append(stored)
        self.raw.append(raw)
        self.codec.append(codec)
        self.checksum.append(checksum)
        self.start.append(0)
        return ChunkTable(self, lo, 1)

    def add(self, columns: tuple[Any, Any, Any, Any, Any], starts: Any) -> "ChunkTable":
        """Append one tensor's columns (offset, stored, raw, codec, checksum; raw starts); returns its table."""
        lo = len(self.offset)
        for column, values in zip((self.offset, self.stored, self.raw, self.codec, self.checksum), columns):
            column.extend(values)
        self.start.extend(starts)
        return ChunkTable(self, lo, len(self.offset) - lo)


class ChunkTable(Sequence[Chunk]):
    """A tensor's chunk table: chunks [lo, lo + n) of a ChunkStore."""

    __slots__ = ("_s", "_lo", "_n")

    def __init__(self, store: ChunkStore | None = None, lo: int = 0, n: int = 0) -> None:
        self._s = store if store is not None else ChunkStore()
        self._lo, self._n = lo, n

    def append(self, offset: int, stored: int, raw: int, codec: int, checksum: int) -> None:
        """Add a chunk at the end (only to the last table of its store)."""
        s = self._s
        if self._lo + self._n != len(s):
            raise RuntimeError("only the last table of a ChunkStore can grow")
        s.start.append(self.raw_bytes)
        s.offset.append(offset)
        s.stored.append(stored)
        s.raw.append(raw)
        s.codec.append(codec)
        s.checksum.append(checksum)
        self._n += 1

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Chunk:  # type: ignore[override]
        if not -self._n <= i < self._n:
            raise IndexError("chunk index out of range")
        j = self._lo + (i % self._n)
        s = self._s
        return Chunk(s.offset[j], s.stored[j], s.raw[j], s.codec[j], s.checksum[j], s.start[j])

    def columns(self, first: int = 0, stop: int | None = None) -> list[array]:
        """offset, stored, raw, codec, checksum and raw start of chunks [first, stop), as arrays."""
        stop = self._n if stop is None else stop
        s, lo, hi = self._s, self._lo + first, self._lo + stop
        return [c[lo:hi] for c in (s.offset, s.stored, s.raw, s.codec, s.checksum, s.start)]

    def _cols(self) -> list[Any]:
        return self.columns()

    def __iter__(self) -> Iterator[Chunk]:
        return map(Chunk, *self._cols())

    @property
    def raw_bytes(self) -> int:
        if not self._n:
            return 0
        j = self._lo + self._n - 1
        return self._s.start[j] + self._s.raw[j]

    @property
    def stored_bytes(self) -> int:
        return sum(self._s.stored[self._lo: self._lo + self._n])

    def codec_ids(self) -> list[int]:
        """The codec ids used, in order of first use."""
        return list(dict.fromkeys(self._s.codec[self._lo: self._lo + self._n]))

    def covering(self, start: int, stop: int) -> range:
        """Indices of the chunks that hold raw bytes [start, stop)."""
        if stop <= start or not self._n:
            return range(0)
        lo, hi, starts = self._lo, self._lo + self._n, self._s.start
        return range(bisect_right(starts, start, lo, hi) - 1 - lo, bisect_left(starts, stop, lo, hi) - lo)

    def to_json(self) -> list[list[int]]:
        return [list(c[:5]) for c in self]


@dataclass(slots=True)
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


class EntryTable(Sequence[TensorEntry]):
    """The index's tensor entries, by tensor id.  The entries the compiled reader reads (nvckpt.format.bulk:
    data, view and derived entries as a writer makes them, what a training state is made of) and the plain
    data entries of one chunk (``plain_entries``) are kept as columns, and their TensorEntry is made each
    time one is read: a million of them take ~50 bytes each here (and 42 a chunk in the store), not the
    ~250 of a TensorEntry, its ChunkTable and its checksum int.  Any other entry is kept as it was parsed.
    Every entry's name is kept as UTF-8 in one blob (``name_blob``, entry i's ending at ``name_ends[i]``), a
    str made only when one is asked for."""

    __slots__ = ("store", "_objs", "name_blob", "name_ends", "_dtype", "_shape", "_sum", "_has_sum", "_kind",
                 "_internal", "_ref", "_nchunks", "_at", "_view_offset", "_view_stride", "_view_end", "_shapes",
                 "_shape_ids")

    _DTYPES = list(dtypes.DTYPES.values())
    _DTYPE_IDS = {d.name: i for i, d in enumerate(_DTYPES)}
    # An entry's kind (``_kind``; the compiled reader's "kind" column): DATA, VIEW, DERIVED + its function's
    # place in DERIVED_FUNCTIONS, or OBJECT (kept as parsed, in ``_objs``).
    DATA, VIEW, DERIVED, OBJECT = 0, 1, 2, 255

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self._objs: list[TensorEntry | None] = []  # None: an entry in the columns
        self.name_blob = bytearray()
        self.name_ends = array("Q")
        self._dtype, self._shape, self._has_sum = array("B"), array("I"), bytearray()
        self._sum = array("Q")
        self._kind, self._internal = bytearray(), bytearray()
        self._ref = array("I")  # a view's base, a derived tensor's source
        self._nchunks = array("I")
        self._at = array("Q")  # a data entry's first chunk in the store; a view's row of the _view_ columns
        self._view_offset, self._view_stride, self._view_end = array("Q"), array("I"), array("Q")
        # one tuple per distinct shape (and view stride), shared by the entries
        self._shapes: list[tuple[int, ...]] = []
        self._shape_ids: dict[tuple[int, ...], int] = {}

    def append(self, entry: TensorEntry) -> None:
        self._objs.append(entry)
        self.name_blob += entry.name.encode("utf-8", "surrogatepass")
        self.name_ends.append(len(self.name_blob))
        self._dtype.append(0)
        self._shape.append(0)
        self._sum.append(0)
        self._has_sum.append(0)
        self._kind.append(self.OBJECT)
        self._internal.append(entry.internal)
        self._ref.append(0)
        self._nchunks.append(0)
        self._at.append(0)

    def extend_plain(self, names: list[str], types: list[str], shapes: list[list[int]],
                     checksums: list[int | None], first_chunk: int) -> None:
        """Plain entries of one chunk each, whose chunks are the store's from ``first_chunk`` on, in order."""
        n = len(names)
        ids, distinct = self._shape_ids, self._shapes

        def shape_id(dims: list[int]) -> int:
            t = tuple(dims)
            i = ids.get(t)
            if i is None:
                i = ids[t] = len(distinct)
                distinct.append(t)
            return i

        self._objs.extend([None] * n)
        encoded = [name.encode("utf-8", "surrogatepass") for name in names]
        ends = accumulate(map(len, encoded), initial=len(self.name_blob))
        next(ends)  # (the blob's end before them)
        self.name_ends.extend(ends)
        self.name_blob += b"".join(encoded)
        self._dtype.extend(map(self._DTYPE_IDS.__getitem__, types))
        self._shape.extend(map(shape_id, shapes))
        self._has_sum.extend([c is not None for c in checksums])
        self._sum.extend([c or 0 for c in checksums])
        self._kind += bytes(n)  # (DATA)
        self._internal += bytes(n)
        self._ref.frombytes(bytes(4 * n))
        self._nchunks.extend([1] * n)
        self._at.extend(range(first_chunk, first_chunk + n))

    def extend_columns(self, columns: dict[str, Any], rows: tuple[int, int], chunks: tuple[int, int],
                       views: tuple[int, int], whole: bool = False) -> Any:
        """Rows ``rows`` of the compiled reader's columns (nvckpt.format.bulk.LazyEntries.columns), their chunks
        (rows ``chunks`` of its chunk columns) added to the store and their views (rows ``views`` of its view
        columns) to this table; ``whole``: all of them, each column let go once copied.  Returns each entry's
        first chunk in the store (numpy u64)."""
        import numpy as np

        def take(key: str) -> memoryview:
            return memoryview(columns.pop(key) if whole else columns[key])

        (lo, hi), (c0, c1), (v0, v1) = rows, chunks, views
        n = hi - lo
        if not self._shapes:
            self._shapes = columns["shapes"]
            self._shape_ids = {t: i for i, t in enumerate(self._shapes)}
        elif self._shapes is not columns["shapes"]:
            raise RuntimeError("an EntryTable takes one compiled reader's columns")
        store = self.store
        first = len(store)
        nchunks = np.frombuffer(take("nchunks"), dtype=np.uint32)[lo:hi]
        held = nchunks[nchunks > 0]
        if len(held) == c1 - c0:  # (one chunk an entry that has any, each starting its tensor's raw bytes)
            starts: Any = bytes(8 * (c1 - c0))
        else:  # where each chunk starts in its tensor's raw bytes: the raw lengths before it, its entry's own
            raw = np.frombuffer(columns["raw"], dtype=np.uint64)[c0:c1]
            starts = np.cumsum(raw) - raw
            starts -= np.repeat(starts[(np.cumsum(held) - held).astype(np.intp)], held.astype(np.intp))
            del raw
        del held
        store.add_rows(columns, c0, c1, starts, whole)
        firsts = np.empty(n, dtype=np.uint64)  # each entry's first chunk: those before it in the store
        firsts[0] = first
        np.cumsum(nchunks[:-1], dtype=np.uint64, out=firsts[1:])
        firsts[1:] += np.uint64(first)
        kind = take("kind")[lo:hi]
        at = firsts
        if v1 > v0:  # a view's row of the view columns instead
            at = firsts.copy()
            is_view = np.frombuffer(kind, dtype=np.uint8) == self.VIEW
            at[is_view] = np.arange(len(self._view_offset), len(self._view_offset) + v1 - v0, dtype=np.uint64)
            self._view_offset.frombytes(take("view_offset")[8 * v0: 8 * v1])
            self._view_stride.frombytes(take("view_stride")[4 * v0: 4 * v1])
            self._view_end.frombytes(take("view_end")[8 * v0: 8 * v1])
        ends = np.frombuffer(take("name_ends"), dtype=np.uint64)
        start = int(ends[lo - 1]) if lo else 0
        base = len(self.name_blob) - start
        self.name_blob += take("names")[start: int(ends[hi - 1])]
        self.name_ends.frombytes(memoryview(ends[lo:hi] + np.uint64(base) if base else ends[lo:hi]).cast("B"))
        del ends
        self._objs.extend([None] * n)
        self._dtype.frombytes(take("dtype")[lo:hi])
        self._shape.frombytes(take("shape")[4 * lo: 4 * hi])
        self._has_sum += take("has_sum")[lo:hi]
        self._sum.frombytes(take("sum")[8 * lo: 8 * hi])
        self._kind += kind
        self._internal += take("internal")[lo:hi]
        self._ref.frombytes(take("ref")[4 * lo: 4 * hi])
        self._nchunks.frombytes(memoryview(nchunks).cast("B"))
        self._at.frombytes(memoryview(at).cast("B"))
        return firsts

    def __len__(self) -> int:
        return len(self._objs)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        e = self._objs[i]
        if e is not None:
            return e
        if i < 0:
            i += len(self._objs)
        kind = self._kind[i]
        chunks = view = derived = None
        nchunks = 0
        if kind == self.DATA:
            nchunks = self._nchunks[i]
            chunks = ChunkTable(self.store, self._at[i], nchunks)
        elif kind == self.VIEW:
            at = self._at[i]
            view = {"base": self._ref[i], "offset": self._view_offset[at],
                    "stride": list(self._shapes[self._view_stride[at]])}
        else:
            derived = {"function": DERIVED_FUNCTIONS[kind - self.DERIVED], "source": self._ref[i]}
        return TensorEntry(i, self.name(i), self._DTYPES[self._dtype[i]], self._shapes[self._shape[i]], chunks, view,
                           derived, self._sum[i] if self._has_sum[i] else None, self._internal[i] == 1, nchunks, None)

    def __iter__(self) -> Iterator[TensorEntry]:
        return map(self.__getitem__, range(len(self)))

    def names(self, lo: int, hi: int) -> list[str]:
        """The names of entries ``lo .. hi-1``."""
        return list(map(self.name, range(lo, hi)))

    def references_to_check(self) -> list[int]:
        """The ids, in order, of the view and derived entries whose base or source (SPEC 8.5) may be wrong:
        every one kept as parsed, and those in the columns that the rules checked on whole columns do not
        clear (``reference_problem`` says what is wrong, if anything)."""
        import numpy as np

        kind = np.frombuffer(self._kind, dtype=np.uint8)
        objs = np.flatnonzero(kind == self.OBJECT)
        suspects = [int(i) for i in objs if not self._objs[i].is_data]
        rows = np.flatnonzero((kind != self.DATA) & (kind != self.OBJECT))
        if not len(rows):
            return suspects
        ref = np.frombuffer(self._ref, dtype=np.uint32)[rows].astype(np.intp)
        there = ref < len(kind)
        src = np.where(there, ref, 0)
        dtype, shape = np.frombuffer(self._dtype, dtype=np.uint8), np.frombuffer(self._shape, dtype=np.uint32)
        fine = there & (ref != rows) & (kind[src] == self.DATA)  # a stored tensor, not itself
        own = kind[rows]
        same_shape = shape[src] == shape[rows]  # (one id per distinct shape)
        for j, function in enumerate(DERIVED_FUNCTIONS):
            these = own == self.DERIVED + j
            if function == "copy":
                fine[these] &= (dtype[src] == dtype[rows])[these] & same_shape[these]
            elif function == "bf16_rne":
                fine[these] &= ((dtype[rows] == self._DTYPE_IDS["bfloat16"]) & (dtype[src] == self._DTYPE_IDS["float32"])
                                & same_shape)[these]
            else:  # (a function the columns do not know the rules of: checked one by one)
                fine[these] = False
        views = own == self.VIEW
        if views.any():  # a 1-D base of the entry's dtype, long enough for every element it addresses
            length = np.array([t[0] if len(t) == 1 else -1 for t in self._shapes], dtype=np.int64)
            base_length = length[shape[src[views]]]
            end = np.frombuffer(self._view_end, dtype=np.uint64)[np.frombuffer(self._at, dtype=np.uint64)[rows[views]]]
            fine[views] &= ((dtype[src] == dtype[rows])[views] & (base_length >= 0)
                            & (end <= base_length.clip(0).astype(np.uint64)))
        return sorted(suspects + rows[~fine].tolist())

    def name(self, i: int) -> str:
        """Entry ``i``'s name (no TensorEntry made)."""
        e = self._objs[i]
        if e is not None:
            return e.name
        if i < 0:
            i += len(self._objs)
        ends = self.name_ends
        return self.name_blob[ends[i - 1] if i else 0: ends[i]].decode("utf-8", "surrogatepass")

    def not_internal(self) -> list[int]:
        """The ids of the entries not marked internal (no TensorEntry made for one in the columns)."""
        import numpy as np

        return np.flatnonzero(np.frombuffer(self._internal, dtype=np.uint8) == 0).tolist()


def not_internal(tensors: Sequence[TensorEntry]) -> list[int]:
    """The ids of ``tensors`` (an index's entries) that are not marked internal."""
    if isinstance(tensors, EntryTable):
        return tensors.not_internal()
    return [e.tensor_id for e in tensors if not e.internal]


def check_int(value: Any, what: str, lo: int = 0, hi: int = U64_MAX) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise FormatError(f"{what} must be an integer in {lo}..{hi}, got {shown(value)}")
    return value


def check_map(value: Any, what: str) -> dict:
    """A map of SPEC 8 or 11: str keys only (SPEC 1)."""
    if not isinstance(value, dict):
        raise FormatError(f"{what} must be a map, got {_type_of(value)}")
    for key in value:
        if not isinstance(key, str):
            raise FormatError(f"{what} has a key of type {key_type(key)}; its keys must be strings")
    return value


def check_list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise FormatError(f"{what} must be an array, got {_type_of(value)}")
    return value


def _type_of(value: Any) -> str:
    return shown(value) if isinstance(value, Ext) else type(value).__name__


def parse_entry(tid: int, raw: Any, *, ncodecs: int | None = None, index_offset: int | None = None,
                store: ChunkStore | None = None) -> TensorEntry:
    """Check one entry of the index (``ncodecs`` and ``index_offset`` given: it has a chunk table) or
    one TENSOR frame's description (neither given: it has ``nchunks``), SPEC 8.3-8.5.

    ``store`` collects the chunk tables of an index (the overlap check runs over it, SPEC 8.4)."""
    in_index = ncodecs is not None
    if in_index and store is not None and type(raw) is dict:
        quick = _quick_entry(tid, raw, ncodecs, index_offset, store)  # type: ignore[arg-type]
        if quick is not None:
            return quick
    raw = check_map(raw, f"tensor {tid}")
    inner = 4 if in_index else 2  # the level of the entry's values: index > tensors > entry, or a TENSOR frame's
    if len(raw) > 5 or not raw.keys() <= _COMMON_KEYS:  # unknown keys (ignored, but bounded: SPEC 9, "Parser bound")
        for key in raw.keys() - _KNOWN_KEYS:
            check_depth(raw[key], f"tensor {tid}: {brief(key)}", inner)
    name = raw.get("name")
    if not isinstance(name, str):
        raise FormatError(f"tensor {tid}: 'name' must be a string" + ("" if name is None else f", got {shown(name)}"))
    where = f"tensor {name!r:.200}"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise LimitError(f"{where}: name longer than {MAX_NAME_BYTES} bytes")
    unsupported = None
    try:
        dtype = dtypes.from_name(raw.get("dtype"))
    except UnsupportedFeatureError as exc:  # SPEC 10: fail when the tensor is read, not at open
        dtype, unsupported = dtypes.unknown(raw["dtype"]), exc.reason
    dims = check_list(raw.get("shape"), f"{where}: 'shape'")
    if len(dims) > MAX_RANK:  # SPEC 8.3, 16: the count before its elements
        raise LimitError(f"{where}: rank {len(dims)} exceeds {MAX_RANK}")
    shape = tuple(check_int(d, f"{where}: shape dimension") for d in dims)
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
    if "checksum" in raw:  # optional, but an int when present: nil is not "absent" (SPEC 1, Types)
        check_int(checksum, f"{where}: 'checksum'")
    internal = raw.get("internal", False)
    if type(internal) is not bool:
        raise FormatError(f"{where}: 'internal' must be a boolean")

    chunks = None
    if in_index and "chunks" in raw:
        chunk_list = raw["chunks"]
        if not isinstance(chunk_list, ChunkColumns):
            check_list(chunk_list, f"{where}: 'chunks'")
        chunks = _parse_chunks(where, chunk_list, dtype, nbytes,
                               unsupported is None, ncodecs, index_offset, store if store is not None else ChunkStore())
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
        check_depth(view, f"{where}: 'view'", inner)
        check_int(view.get("base"), f"{where}: view base", 0, MAX_TENSORS)
        check_int(view.get("offset"), f"{where}: view offset", 0, MAX_TENSOR_BYTES)
        stride = check_list(view.get("stride"), f"{where}: view stride")
        if len(stride) != len(shape):
            raise FormatError(f"{where}: view stride has {len(stride)} entries for rank {len(shape)}")
        for s in stride:
            check_int(s, f"{where}: view stride", 0, MAX_TENSOR_BYTES)
    if "derived" in raw:
        derived = check_map(raw["derived"], f"{where}: 'derived'")
        check_depth(derived, f"{where}: 'derived'", inner)
        if not isinstance(derived.get("function"), str):  # only an unknown *name* waits for the read (SPEC 8.5, 1)
            raise FormatError(f"{where}: 'derived' has no 'function'" if "function" not in derived else
                              f"{where}: derived 'function' must be a string, got {brief(derived['function'], 60)}")
        if derived["function"] not in DERIVED_FUNCTIONS:  # SPEC 8.5: fail when the tensor is read, not at open
            unsupported = unsupported or (f"unknown derived function {brief(derived.get('function'), 60)} "
                                          f"(known: {', '.join(DERIVED_FUNCTIONS)})")
        check_int(derived.get("source"), f"{where}: derived source", 0, MAX_TENSORS)
    return TensorEntry(tid, name, dtype, shape, chunks, view, derived, checksum, internal, nchunks, unsupported)


def _quick_entry(tid: int, raw: dict, ncodecs: int, index_offset: int, store: ChunkStore) -> TensorEntry | None:
    """The common data entry ({name, dtype, shape, chunks[, checksum]}, every value of the plain type, one
    chunk or a few) checked with fewer steps; None for anything else, which parse_entry checks in full."""
    name, dt, shape, chunk_list = raw.get("name"), raw.get("dtype"), raw.get("shape"), raw.get("chunks")
    checksum = raw.get("checksum")
    if not (type(name) is str and type(dt) is str and type(shape) is list and type(chunk_list) is list
            and len(raw) == (4 if checksum is None else 5) and len(name) <= MAX_NAME_BYTES // 4
            and len(shape) <= MAX_RANK and 1 <= len(chunk_list) < 16
            and (checksum is None or type(checksum) is int and 0 <= checksum <= U64_MAX)):
        return None
    dtype = dtypes.DTYPES.get(dt)
    if dtype is None:
        return None
    for d in shape:
        if type(d) is not int or not 0 < d <= U64_MAX:
            return None
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_TENSOR_BYTES or len(chunk_list) > nbytes:
        return None
    lowest = PREAMBLE_SIZE + FRAME_HEADER_SIZE
    total = 0
    for c in chunk_list:
        if type(c) is not list or len(c) != 5:
            return None
        off, stored, rawlen, codec, check = c
        if not (type(off) is int and type(stored) is int and type(rawlen) is int and type(codec) is int
                and type(check) is int and lowest <= off and 1 <= stored <= MAX_CHUNK_LENGTH
                and 1 <= rawlen <= MAX_CHUNK_LENGTH and 0 <= codec < ncodecs and 0 <= check <= U64_MAX
                and off + stored <= index_offset and not rawlen % dtype.itemsize):
            return None
        total += rawlen
    if total != nbytes:
        return None
    table = _checked_chunks("", chunk_list, dtype, nbytes, True, ncodecs, index_offset, store)
    return TensorEntry(tid, name, dtype, tuple(shape), table, None, None, checksum, False, len(table), None)


_PLAIN_KEYS = ({"name", "dtype", "shape", "chunks"}, {"name", "dtype", "shape", "chunks", "checksum"})


def plain_entries(batch: list, start: int, ncodecs: int, index_offset: int, table: EntryTable) -> int:
    """Adds to ``table`` the entries of the longest run of ``batch[start:]`` (decoded index entries; the next
    tensors of ``table``) that are plain data entries of one chunk, {name, dtype, shape, chunks[, checksum]} with every
    value of its plain type and no dimension 0: what a state of many small tensors is made of.  Checked as
    ``parse_entry`` checks them (SPEC 8.3, 8.4), but a column of the run at a time, and their chunks added to
    its store at once, with no Python step per check and entry.  Returns how many; any check that fails sends
    the whole run back (0), so that parse_entry says which entry is wrong and how."""
    store = table.store
    count = 0
    if (start == 0 and set(map(type, batch)) == {dict}
            and all(len(set(keys)) == len(keys) and set(keys) in _PLAIN_KEYS for keys in set(map(tuple, batch)))):
        lists = [e["chunks"] for e in batch]  # a whole batch of plain entries: no Python step per entry
        if set(map(type, lists)) == {list} and set(map(len, lists)) == {1}:
            count = len(batch)
    if not count:
        plain4, plain5 = _PLAIN_KEYS
        for e in islice(batch, start, None):
            if type(e) is not dict or not (e.keys() == plain4 or e.keys() == plain5):
                break
            c = e["chunks"]
            if type(c) is not list or len(c) != 1:
                break
            count += 1
    if not count:
        return 0
    rows = batch if start == 0 and count == len(batch) else batch[start: start + count]
    names = [e["name"] for e in rows]
    dts = [e["dtype"] for e in rows]
    dims_of = [e["shape"] for e in rows]
    chunks = [e["chunks"][0] for e in rows]
    sums = [e.get("checksum") for e in rows]
    if (set(map(type, names)) != {str} or max(map(len, names)) > MAX_NAME_BYTES // 4
            or set(map(type, dts)) != {str} or set(map(type, dims_of)) != {list}
            or max(map(len, dims_of)) > MAX_RANK or set(map(type, chunks)) != {list} or set(map(len, chunks)) != {5}):
        return 0
    types = [dtypes.DTYPES.get(d) for d in dts]
    dims = list(chain.from_iterable(dims_of))
    flat = list(chain.from_iterable(chunks))
    given = [c for c in sums if c is not None]
    if any(e.get("checksum", 0) is None for e in rows):  # a checksum key whose value is nil: parse_entry refuses it
        return 0
    if (not all(types) or not set(map(type, dims)) <= {int} or min(dims, default=1) < 1
            or set(map(type, flat)) != {int} or not set(map(type, given)) <= {int}
            or min(given, default=0) < 0 or max(given, default=0) > U64_MAX):
        return 0
    try:
        columns = array("Q", flat)
    except OverflowError:  # a negative value or one of 2^64 or more
        return 0
    off, stored, raw, codec, check = (columns[i::5] for i in range(5))
    if (min(off) < PREAMBLE_SIZE + FRAME_HEADER_SIZE or min(stored) < 1 or max(stored) > MAX_CHUNK_LENGTH
            or min(raw) < 1 or max(raw) > MAX_CHUNK_LENGTH or max(codec) >= ncodecs
            or max(map(add, off, stored)) > index_offset
            or list(map(mul, map(math.prod, dims_of), (t.itemsize for t in types))) != raw.tolist()):
        return 0  # (raw equal to the tensor's bytes, so within MAX_TENSOR_BYTES and a multiple of the item size)
    lo = len(store)
    for column, values in zip((store.offset, store.stored, store.raw, store.codec, store.checksum),
                              (off, stored, raw, array("H", codec), check)):
        column.extend(values)
    store.start.frombytes(bytes(8 * count))
    table.extend_plain(names, dts, dims_of, sums, lo)
    return count


def _parse_chunks(where: str, chunk_list: list, dtype: dtypes.DType, nbytes: int, known: bool,
                  ncodecs: int, index_offset: int, store: ChunkStore) -> ChunkTable:
    if known and len(chunk_list) > nbytes:  # every chunk holds at least one byte
        raise FormatError(f"{where}: {len(chunk_list)} chunks for {nbytes} bytes")
    if not len(chunk_list):
        if known and nbytes:  # SPEC 8.4: the raw lengths add up to nbytes, here none at all
            raise FormatError(f"{where}: the chunk table is empty, shape and dtype need {nbytes} raw bytes")
        table: ChunkTable | None = store.add(((), (), (), (), ()), ())
    elif isinstance(chunk_list, ChunkColumns):
        table = _column_chunks(chunk_list.columns, dtype, nbytes, known, ncodecs, index_offset, store)
        if table is None:
            chunk_list = chunk_list.as_list()
    elif len(chunk_list) >= 16:
        table = _fast_chunks(chunk_list, dtype, nbytes, known, ncodecs, index_offset, store)
    else:
        table = None  # a few chunks: the per-chunk checks are quicker
    if table is None:  # something is wrong, or unusual: the per-chunk checks say what, in order
        table = _checked_chunks(where, chunk_list, dtype, nbytes, known, ncodecs, index_offset, store)
    return table


def _fast_chunks(chunk_list: list, dtype: dtypes.DType, nbytes: int, known: bool, ncodecs: int, index_offset: int,
                 store: ChunkStore) -> ChunkTable | None:
    """The checks of _checked_chunks on whole columns, without a Python step per chunk (a million
    chunks in well under a second); None where any check fails, or on anything unusual."""
    if set(map(type, chunk_list)) != {list} or set(map(len, chunk_list)) != {5}:
        return None
    if set(map(type, chain.from_iterable(chunk_list))) != {int}:  # no bool, float or other type
        return None
    try:
        flat = array("Q", chain.from_iterable(chunk_list))
    except OverflowError:  # a negative value or one of 2^64 or more
        return None
    off, stored, raw, codec, check = (flat[i::5] for i in range(5))
    if (min(off) < PREAMBLE_SIZE + FRAME_HEADER_SIZE or min(stored) < 1 or max(stored) > MAX_CHUNK_LENGTH
            or min(raw) < 1 or max(raw) > MAX_CHUNK_LENGTH or max(codec) >= ncodecs
            or max(map(add, off, stored)) > index_offset):
        return None
    if known and (sum(raw) != nbytes or (dtype.itemsize > 1 and any(map(dtype.itemsize.__rmod__, raw)))):
        return None
    starts = array("Q", accumulate(raw, initial=0))
    starts.pop()
    return store.add((off, stored, raw, array("H", codec), check), starts)


def _column_chunks(columns: list[Any], dtype: dtypes.DType, nbytes: int, known: bool, ncodecs: int,
                   index_offset: int, store: ChunkStore) -> ChunkTable | None:
    """_fast_chunks for numpy columns (nvckpt.format.bulk): the same checks, None where any fails."""
    import numpy as np

    off, stored, raw, codec, check = columns
    if (int(off.min()) < PREAMBLE_SIZE + FRAME_HEADER_SIZE or int(off.max()) > index_offset
            or int(stored.min()) < 1 or int(stored.max()) > MAX_CHUNK_LENGTH or int(raw.min()) < 1
            or int(raw.max()) > MAX_CHUNK_LENGTH or int(codec.max()) >= ncodecs
            or int((off + stored).max()) > index_offset):
        return None
    if known and (int(raw.sum()) != nbytes or (dtype.itemsize > 1 and bool((raw % dtype.itemsize).any()))):
        return None
    starts = np.cumsum(raw) - raw
    return store.add_columns([off, stored, raw, codec.astype(np.uint16), check], starts)


def _checked_chunks(where: str, chunk_list: list, dtype: dtypes.DType, nbytes: int, known: bool,
                    ncodecs: int, index_offset: int, store: ChunkStore) -> ChunkTable:
    if len(chunk_list) == 1 and known:
        c = chunk_list[0]
        if (type(c) is list and len(c) == 5 and all(type(v) is int for v in c)
                and PREAMBLE_SIZE + FRAME_HEADER_SIZE <= c[0] <= U64_MAX and 1 <= c[1] <= MAX_CHUNK_LENGTH
                and c[2] == nbytes <= MAX_CHUNK_LENGTH and not nbytes % (dtype.itemsize or 1)  # SPEC 8.4, 16
                and 0 <= c[3] < ncodecs and 0 <= c[4] <= U64_MAX and c[0] + c[1] <= index_offset):
            return store.add_one(c[0], c[1], c[2], c[3], c[4])
    offs: list[int] = []
    storeds: list[int] = []
    raws: list[int] = []
    codecs: list[int] = []
    checks: list[int] = []
    starts: list[int] = []
    total = 0
    lowest = PREAMBLE_SIZE + FRAME_HEADER_SIZE
    for i, c in enumerate(chunk_list):
        if type(c) is not list or len(c) != 5:
            raise FormatError(f"{where}: chunk {i} must be [offset, stored_length, raw_length, codec, checksum]")
        off, stored, rawlen, codec, check = c
        if not (type(off) is int and type(stored) is int and type(rawlen) is int and type(codec) is int
                and type(check) is int and lowest <= off <= U64_MAX and 1 <= stored <= MAX_CHUNK_LENGTH
                and 1 <= rawlen <= MAX_CHUNK_LENGTH and 0 <= codec <= MAX_CODECS and 0 <= check <= U64_MAX):
            check_int(off, f"{where}: chunk {i} offset", lowest)
            check_int(stored, f"{where}: chunk {i} stored_length", 1, MAX_CHUNK_LENGTH)
            check_int(rawlen, f"{where}: chunk {i} raw_length", 1, MAX_CHUNK_LENGTH)
            check_int(codec, f"{where}: chunk {i} codec id", 0, MAX_CODECS)
            check_int(check, f"{where}: chunk {i} checksum")
        if codec >= ncodecs:
            raise FormatError(f"{where}: chunk {i} uses codec id {codec}, the codec table has {ncodecs}")
        if off + stored > index_offset:
            raise FormatError(f"{where}: chunk {i} ({off}..{off + stored}) runs past the index at {index_offset}")
        if known and dtype.itemsize > 1 and rawlen % dtype.itemsize:
            raise FormatError(f"{where}: chunk {i} raw_length {rawlen} is not a multiple of the item size {dtype.itemsize}")
        offs.append(off)
        storeds.append(stored)
        raws.append(rawlen)
        codecs.append(codec)
        checks.append(check)
        starts.append(total)
        total += rawlen
    if known and total != nbytes:
        raise FormatError(f"{where}: chunks hold {total} raw bytes, shape and dtype need {nbytes}")
    return store.add((offs, storeds, raws, codecs, checks), starts)


def check_overlaps(store: ChunkStore, names: Any) -> None:
    """SPEC 8.4: no two chunks of an index share a stored byte.  ``names(i)`` -> (tensor name, chunk index)
    of the store's chunk i.  A writer lists chunks in file order, so one pass in order usually settles it."""
    import numpy as np

    off, stored = store.offset, store.stored
    if len(off) < 2:
        return
    o = np.frombuffer(off, dtype=np.uint64)
    ends = o + np.frombuffer(stored, dtype=np.uint64)  # (the parser has each within the file: no wrap)
    if (ends[:-1] <= o[1:]).all():
        return
    order = np.argsort(o, kind="stable")  # (chunks at one offset in the order listed)
    clash = np.flatnonzero(o[order[1:]] < ends[order[:-1]])
    if len(clash):  # the first overlap in offset order
        a, b = int(order[clash[0]]), int(order[clash[0] + 1])
        (a_name, a_chunk), (b_name, b_chunk) = names(a), names(b)
        raise FormatError(f"chunk {b_chunk} of tensor {b_name!r:.200} at offset {off[b]} overlaps "
                          f"chunk {a_chunk} of tensor {a_name!r:.200} ({off[a]}..{ends[a]})")


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


__all__ = ["Chunk", "ChunkStore", "ChunkTable", "check_overlaps", "EntryTable", "TensorEntry", "not_internal", "parse_entry", "plain_entries",
           "reference_problem", "check_int", "check_map", "check_list"]
