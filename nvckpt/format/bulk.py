"""Decoding a large index without a Python object per chunk, and without all of it at once (SPEC 15.1, 20).

A plain ``msgpack.unpackb`` of an index that lists a million chunks builds
three million Python objects (a list and two large ints a chunk), about 170
bytes a chunk, and then every check walks them again.  Here an index of
``STREAM_FROM`` bytes or more (any index, where the compiled reader below is
built) is decoded in pieces:

* the top-level map one value at a time;
* the ``"tensors"`` array as a ``LazyEntries``: the byte range of each entry
  is found first (msgpack's ``skip``, no objects built), and each entry is
  decoded only when the parser asks for it, then dropped;
* an entry of ``BIG_ENTRY`` bytes or more key by key, and its chunk list, when
  it has ``COLUMNS_FROM`` chunks or more, straight from the msgpack bytes into
  five u64 columns (numpy): a ``ChunkColumns``.

Every rule of the plain decoding holds (one object, valid msgpack, unique keys,
the ext types, nesting, the memory budget): on anything unusual a piece is
decoded the plain way, so the errors and their messages are the same.

Where the compiled column reader (``nvckpt.format._columns``) is built, the top-level map's values are found
by it, the entries of ``"tensors"`` as a writer makes them (data entries of any number of chunks, views and
derived tensors, with their optional keys) are read by it into columns (``LazyEntries.columns``,
taken by ``nvckpt.format.index.parse_index`` a run at a time), and a ``"tree"`` made of containers, scalars,
tuples and tensor references is only checked here and kept as its bytes (``LazyTree``): its paths are read
from them, and it is decoded when something first asks for it.  Whatever it does not take (anything
unusual) goes the Python way above, with its messages.

Only the ``"tree"`` value has its ext types decoded (tuples, tensor references, SPEC 9.2's); every
other value keeps its exts as ``tree.Ext``, their data unparsed: under a key a reader ignores they MAY be
anything (SPEC 1, 8.1, 8.2), and under a known key the type checks reject them.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping
from itertools import accumulate
from typing import Any, Callable

import msgpack

from ..errors import NvckptError
from . import tree
from .constants import DERIVED_FUNCTIONS, MAX_NAME_BYTES

try:
    from . import _columns as compiled
except ImportError:  # not compiled here: the Python way, the same decisions
    compiled = None

# Index payloads from this size on are decoded in pieces.  Below it one msgpack call decodes the whole
# index faster than the pieces' Python steps (opening a 255-tensor training state's file: 2.7 against
# 3.6-4.8 ms; an 8,000-tensor one's: 91 against 115 ms), and its objects take a few times the payload's
# size at most (~30 MB for an index of 4 MiB).
STREAM_FROM = 4 << 20
# Where the compiled reader is built it reads every index, whatever its size: an 8,000-tensor training state's
# (bf16 weights derived from fp32 masters, optimizer states) opened and its keys listed in 10 against 350 ms
# decoded whole, a 255-tensor one's in 1.4 against 15 ms (2 shared cores).
BIG_ENTRY = 16 << 10  # tensor entries from this size on are decoded key by key
COLUMNS_FROM = 1024  # chunk lists from this length on are decoded as columns

# Bytes after an int's tag byte: positive fixint 0; uint 8/16/32/64; int 8/16/32/64.  255: not an int
# nvckpt accepts here (negative fixints too: the per-chunk checks report those).
_WIDTH = bytes(0 if t < 0x80 else {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}.get(t, 255)
               for t in range(256))


class ChunkColumns:
    """A chunk list decoded from its msgpack bytes: offset, stored, raw, codec, checksum as numpy u64 columns.

    ``as_list()`` decodes the same bytes the plain way (for the per-chunk checks and their messages)."""

    __slots__ = ("columns", "_source")

    def __init__(self, columns: list[Any], source: Callable[[], list]) -> None:
        self.columns = columns
        self._source = source

    def __len__(self) -> int:
        return len(self.columns[0])

    def as_list(self) -> list:
        return self._source()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.columns)


class LazyEntries:
    """The index's "tensors" array: entry i is decoded from its bytes when it is read (under the memory
    budget of the decoding that found it), its errors those of the plain decoding."""

    __slots__ = ("_data", "_bounds", "_budget", "columns")

    def __init__(self, data: memoryview | None, bounds: Any, columns: dict[str, Any] | None = None) -> None:
        self._data = data
        self._bounds = bounds
        self._budget = getattr(tree._nesting, "budget", None)
        # The compiled reader's columns (nvckpt.format._columns.entries): "in_columns" marks the entries it
        # read (data, view and derived entries as a writer makes them), whose values are in the other columns.
        self.columns = columns

    def __len__(self) -> int:
        return len(self._bounds) - 1

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < len(self):
            raise IndexError(i)
        previous = getattr(tree._nesting, "budget", None)
        tree._nesting.budget = self._budget
        try:
            with tree.msgpack_errors("index", f"tensor {i}'s entry", where=f" (tensor {i})"):
                return decode_entry(self._data[self._bounds[i]: self._bounds[i + 1]])
        finally:
            tree._nesting.budget = previous

    def __iter__(self) -> Any:
        return map(self.__getitem__, range(len(self)))

    def row(self, r: int) -> dict[str, Any]:
        """The data entry of row ``r`` of the compiled reader's columns, as its decoding gives it (its values are
        all in the columns: the index's bytes may be gone).  Only a data entry's row can fail the checks that
        the parser makes a column at a time (its chunks against the codec table and the index offset)."""
        import numpy as np

        c = self.columns
        if c["kind"][r] != _DATA:
            raise ValueError(f"row {r} is not a data entry's")
        ends = memoryview(c["name_ends"]).cast("Q")
        first = int(np.frombuffer(c["nchunks"], dtype=np.uint32)[:r].sum(dtype=np.uint64))
        entry: dict[str, Any] = {
            "name": c["names"][ends[r - 1] if r else 0: ends[r]].decode("utf-8"),
            "dtype": _DTYPES[c["dtype"][r]][0],
            "shape": list(c["shapes"][memoryview(c["shape"]).cast("I")[r]]),
            "chunks": [[memoryview(c[k]).cast("H" if k == "codec" else "Q")[i]
                        for k in ("offset", "stored", "raw", "codec", "checksum")]
                       for i in range(first, first + memoryview(c["nchunks"]).cast("I")[r])]}
        if c["has_sum"][r]:
            entry["checksum"] = memoryview(c["sum"]).cast("Q")[r]
        if c["internal"][r]:
            entry["internal"] = True
        return entry

    def plain(self, lo: int, hi: int) -> list | None:
        """Entries ``lo .. hi-1`` decoded by one msgpack call with plain maps (no Python step per map), for the
        parser's plain-entries path (nvckpt.format.entry.plain_entries): a million one-chunk entries took 5-10 s
        one call each.  None where that would not be the plain decoding's result: under a memory budget (which
        counts every container), an entry that is not a map of at most 15 pairs (fixmap), one that holds a key
        twice (its dict has fewer items than its header says), or bytes that do not decode; the caller then
        reads the entries one by one (``self[i]``), which says what is wrong.  A map nested in an entry is not
        checked for repeated keys here: the plain-entries path accepts no entry whose values hold a map."""
        if self._budget is not None or not 0 <= lo < hi <= len(self):
            return None
        import numpy as np

        bounds = np.frombuffer(self._bounds, dtype=np.uint64)[lo:hi + 1].astype(np.intp)
        starts = bounds[:-1]
        heads = np.frombuffer(self._data, dtype=np.uint8)[starts]
        if ((heads & 0xF0) != 0x80).any():
            return None
        # A plain entry (one chunk, one name, a shape) is at most a few KiB; a larger one (a long chunk list)
        # is read alone, through the chunk-list columns, not decoded here into a list per chunk (1M chunks:
        # +200 MB).
        if int(np.diff(bounds).max()) > _PLAIN_ENTRY_BYTES:
            return None
        body = self._data[self._bounds[lo]: self._bounds[hi]]
        try:
            with tree.msgpack_errors("index", f"tensors {lo}..{hi - 1}"):
                entries = msgpack.unpackb(_array_header(hi - lo) + bytes(body), ext_hook=tree._plain_ext_hook,
                                          raw=False, strict_map_key=False, use_list=True)
        except NvckptError:
            return None
        if list(map(len, entries)) != (heads & 0x0F).tolist():
            return None
        return entries


_PLAIN_ENTRY_BYTES = MAX_NAME_BYTES + 1024  # name, dtype, shape (<= MAX_RANK ints), one chunk, checksum


def _array_header(n: int) -> bytes:
    """msgpack's header of an array of ``n`` items."""
    if n < 16:
        return bytes((0x90 | n,))
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


def _unpacker(size: int) -> msgpack.Unpacker:
    budget = getattr(tree._nesting, "budget", None) is not None
    return msgpack.Unpacker(ext_hook=tree._counted_plain_ext_hook if budget else tree._plain_ext_hook, raw=False,
                            strict_map_key=False, use_list=True,
                            object_pairs_hook=tree._counted_map if budget else tree.unique_map,
                            list_hook=tree._counted_list if budget else None, max_buffer_size=max(size, 1))


def _spend(n: int) -> None:
    budget = getattr(tree._nesting, "budget", None)
    if budget is not None:
        budget.spend(n)


class _Irregular(Exception):
    """Something the piecewise decoding does not handle: decode the plain way."""


def decode_index(payload: Any) -> Any:
    """The INDEX payload as ``tree.unpackb`` decodes it (the "tree" value with its ext types decoded, SPEC 9),
    with "tensors" as LazyEntries where it is large."""
    try:
        return _decode_top(memoryview(payload).cast("B"), lazy=len(payload) >= STREAM_FROM or compiled is not None)
    except NvckptError:
        raise
    except (_Irregular, ValueError, msgpack.OutOfData):
        return tree.unpackb(payload)  # not what a writer makes: the plain way says what is wrong


class LazyTree:
    """The index's "tree" value as its bytes, checked by the compiled reader (``_columns.tree_paths``): a tree
    of maps with str or int keys, arrays, tuples, scalars and tensor references, which ``tree.unpackb``
    decodes without an error; ``paths`` (a PathTable of its tensor paths) and ``max_tid`` (its largest
    tensor id) were read from the bytes, and ``decode()`` gives the tree.  (Under a memory budget the tree
    is decoded with the index, where the budget counts it.)"""

    __slots__ = ("data", "paths", "max_tid")

    def __init__(self, data: bytes, paths: "PathTable", max_tid: int) -> None:
        self.data, self.paths, self.max_tid = data, paths, max_tid

    def decode(self) -> Any:
        with tree.msgpack_errors("index", f"the index's tree of {len(self.data)} bytes"):
            return tree.unpackb(self.data, tree=True)


class PathTable(Mapping[str, int]):
    """Every tree path to a tensor -> its tensor id (``Index.paths``), as the compiled reader found them
    (``_columns.tree_paths``): their UTF-8 in one blob, a u32 tensor id each and a hash table, not a dict of
    a str and an int per tensor (a million paths: ~40 MB, against ~130 MB and a second of dict inserts).
    A str is made when a path is listed, the hash table when one is first looked up; ``values()`` and
    ``items()`` are lists."""

    __slots__ = ("blob", "ends", "tids", "_slots")

    def __init__(self, blob: bytes, ends: bytes, tids: bytes) -> None:
        self.blob = blob
        self.ends = memoryview(ends).cast("Q")
        self.tids = memoryview(tids).cast("I")
        self._slots: bytes | None = None

    @classmethod
    def of(cls, paths: Mapping[str, int]) -> "PathTable":
        """The same columns from a dict of paths (a tree decoded the Python way), for the compiled name checks."""
        encoded = [p.encode("utf-8", "surrogatepass") for p in paths]
        return cls(b"".join(encoded), array("Q", accumulate(map(len, encoded))).tobytes(),
                   array("I", paths.values()).tobytes())

    def __len__(self) -> int:
        return len(self.tids)

    def _place(self, key: object) -> int:
        if not isinstance(key, str):
            return -1
        if self._slots is None:
            self._slots = compiled.names_table(self.blob, self.ends, len(self), True)[1]  # (paths all differ)
        return compiled.path_index(self.blob, self.ends, self._slots, str(key))

    def __getitem__(self, key: str) -> int:
        i = self._place(key)
        if i < 0:
            raise KeyError(key)
        return self.tids[i]

    def __contains__(self, key: object) -> bool:
        return self._place(key) >= 0

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        i = self._place(key)
        return default if i < 0 else self.tids[i]

    def __iter__(self) -> Iterator[str]:
        return iter(compiled.strings(self.blob, self.ends, 0, len(self)))

    def values(self) -> list[int]:  # type: ignore[override]
        return self.tids.tolist()

    def items(self) -> list[tuple[str, int]]:  # type: ignore[override]
        return list(zip(self, self.tids.tolist()))

    def __repr__(self) -> str:
        return f"PathTable({len(self)} paths)"

    def __reduce__(self) -> tuple:
        return PathTable, (self.blob, self.ends.tobytes(), self.tids.tobytes())


def _decode_top(data: memoryview, lazy: bool = True) -> Any:
    if lazy and compiled is not None:
        spans = compiled.map_spans(data)
        if spans is not None:
            return _decode_spans(data, spans)
    u = _unpacker(len(data))
    u.feed(data)
    pairs = []
    for _ in range(u.read_map_header()):
        key = u.unpack()
        start = u.tell()
        u.skip()
        end = u.tell()
        if key == "tensors" and lazy:
            value: Any = _entries(data[start:end])
        else:
            value = tree.unpackb(data[start:end], tree=key == "tree")
        pairs.append((key, value))
    if u.tell() != len(data):
        raise _Irregular("bytes after the index map")
    return (tree._counted_map if getattr(tree._nesting, "budget", None) is not None else tree.unique_map)(pairs)


def _decode_spans(data: memoryview, spans: list[tuple[int, int, int, int]]) -> Any:
    """_decode_top's result from the top-level map's spans (``_columns.map_spans``): no copy of the index."""
    budget = getattr(tree._nesting, "budget", None)
    # The tree's paths first (tree_paths reports nothing, so the errors keep their order): they are made
    # before the entries' columns, while less memory is taken.
    trees = [(v0, v1) for k0, k1, v0, v1 in spans if data[k0:k1] == b"\xa4tree"]
    found = compiled.tree_paths(data[trees[0][0]:trees[0][1]]) if budget is None and len(trees) == 1 else None
    pairs = []
    for k0, k1, v0, v1 in spans:
        key = tree.unpackb(data[k0:k1])
        value: Any = None
        if key == "tensors":
            value = _column_entries(data[v0:v1])
        elif key == "tree" and found is not None:
            value = LazyTree(bytes(data[v0:v1]), PathTable(*found[:3]), found[3])
        if value is None:
            value = tree.unpackb(data[v0:v1], tree=key == "tree")
        pairs.append((key, value))
    return (tree._counted_map if budget is not None else tree.unique_map)(pairs)


def _column_entries(data: memoryview) -> Any:
    """The "tensors" array as LazyEntries with the compiled reader's columns; None where it does not take it."""
    columns = compiled.entries(data, _DTYPES, DERIVED_FUNCTIONS)
    if columns is None:
        return _entries(data)  # (not an array, or bytes msgpack would refuse: the Python way says what)
    bounds = memoryview(columns.pop("bounds")).cast("Q")
    _spend(bounds.nbytes + sum(len(v) for k, v in columns.items() if k != "shapes") + 64 * len(columns["shapes"]))
    # Entries all in the columns: none is decoded from its bytes, and the index's bytes can go before they are
    # parsed.
    return LazyEntries(data if 0 in columns["in_columns"] else None, bounds, columns)


def _entries(data: memoryview) -> Any:
    u = _unpacker(len(data))
    u.feed(data)
    try:
        n = u.read_array_header()
    except ValueError:
        return tree.unpackb(data)  # not an array: the index parser reports it
    skip, tell = u.skip, u.tell
    bounds = array("Q", [tell()])
    bounds.extend([skip() or tell() for _ in range(n)])
    if bounds[-1] != len(data):
        raise _Irregular("bytes after the tensors array")
    _spend(bounds.itemsize * len(bounds))
    return LazyEntries(data, bounds)


def decode_entry(data: memoryview) -> Any:
    """One tensor entry; a large one key by key, with its chunk list as ChunkColumns where it is long."""
    if len(data) < BIG_ENTRY:
        return tree.unpackb(data)
    try:
        return _decode_big_entry(data)
    except NvckptError:
        raise
    except (_Irregular, ValueError, msgpack.OutOfData):
        return tree.unpackb(data)


def _decode_big_entry(data: memoryview) -> Any:
    u = _unpacker(len(data))
    u.feed(data)
    pairs = []
    for _ in range(u.read_map_header()):
        key = u.unpack()
        if key == "chunks":
            value: Any = _chunks(u, data)
        else:
            value = u.unpack()
        pairs.append((key, value))
    if u.tell() != len(data):
        raise _Irregular("bytes after the entry")
    return tree.unique_map(pairs)


def _chunks(u: msgpack.Unpacker, data: memoryview) -> Any:
    try:
        n = u.read_array_header()
    except ValueError:
        return u.unpack()  # not an array: the entry parser reports it
    first = u.tell()
    if n < COLUMNS_FROM:
        items = [u.unpack() for _ in range(n)]
        _spend(64 + 8 * n)
        return items
    skip, tell = u.skip, u.tell
    ends = [skip() or tell() for _ in range(n)]
    body = data[first: ends[-1]]

    def as_list() -> list:
        header = b"\xdd" + n.to_bytes(4, "big")
        return tree.unpackb(header + bytes(body))

    columns = _columns(data, first, ends)
    if columns is None:
        return as_list()
    out = ChunkColumns(columns, as_list)
    _spend(out.nbytes)
    return out


def _columns(data: memoryview, first: int, ends: list[int]) -> list[Any] | None:
    """Five u64 columns of [u64, u64, u64, u64, u64] arrays, decoded with no Python step per chunk;
    None where an element is not a fixarray of 5 non-negative ints."""
    import numpy as np
    from numpy.lib.stride_tricks import as_strided

    n = len(ends)
    end = np.array(ends, dtype=np.int64)
    pos = np.empty(n, dtype=np.int64)
    pos[0] = first
    pos[1:] = end[:-1]
    size = -(-(len(data) + 16) // 8) * 8
    padded = np.zeros(size, dtype=np.uint8)
    padded[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    if (padded[pos] != 0x95).any():
        return None
    # word[p]: the 8 bytes from byte p, big-endian (an unaligned, overlapping view: no copy)
    word = as_strided(padded.view(">u8"), shape=(size - 8,), strides=(1,))
    width_of = np.frombuffer(_WIDTH, dtype=np.uint8)
    pos += 1
    columns = []
    for _ in range(5):
        tag = padded[pos]
        width = width_of[tag]
        if (width == 255).any():
            return None
        if (tag >= 0xD0).any() and (padded[pos[tag >= 0xD0] + 1] >= 0x80).any():
            return None  # a negative int
        shift = ((8 - width.astype(np.int64)) * 8).clip(0, 63).astype(np.uint64)
        value = word[pos + 1].astype(np.uint64) >> shift
        fixint = width == 0
        if fixint.any():
            value[fixint] = tag[fixint]
        columns.append(value)
        pos += 1
        pos += width
    if (pos != end).any():
        return None
    return columns


def _dtype_table() -> tuple[tuple[str, int], ...]:
    from .dtypes import DTYPES

    return tuple((d.name, d.itemsize) for d in DTYPES.values())


_DTYPES = _dtype_table()  # (the order of EntryTable._DTYPES: a dtype's id is its place here)
_DATA = 0  # the "kind" column's value of a data entry (EntryTable.DATA)

__all__ = ["ChunkColumns", "LazyEntries", "LazyTree", "PathTable", "decode_index", "decode_entry", "STREAM_FROM", "BIG_ENTRY", "COLUMNS_FROM"]
