"""Frames (SPEC 4-7): the writer of a file's frames, and the walks a reader makes over them.

``FrameWriter`` appends frames to a stream that never seeks: a TENSOR frame
before the first chunk of its tensor, CODEC frames on first use, CHUNK frames
padded to the alignment, then the INDEX frame and the footer.  It knows
entries (maps) and pipelines (anything with ``to_json()``), not torch.

``locate_index`` (random access), ``iter_frames`` (streaming, recovery) and
``read_meta_frame`` read through any *source*: an object with ``read(offset,
length) -> bytes``, ``size`` and ``name`` (nvckpt.io.source.ByteSource).
"""

from __future__ import annotations

import errno

from typing import Any, Hashable, Iterator, Protocol, Sequence

import msgpack

from .._gc import paused as gc_paused
from ..errors import ChecksumError, FormatError, LimitError, TruncatedError, UnsupportedFeatureError
from .constants import (
    DEFAULT_ALIGNMENT,
    FIRST_OPTIONAL_FRAME,
    FOOTER_SIZE,
    FRAME_CHUNK,
    FRAME_CODEC,
    FRAME_HEADER_SIZE,
    FRAME_INDEX,
    FRAME_NAMES,
    FRAME_TENSOR,
    MAX_ALIGNMENT,
    MAX_CHUNK_LENGTH,
    MAX_CODECS,
    MAX_INDEX_LENGTH,
    MAX_META_FRAME_LENGTH,
    ARRAYS_PATHS_MINOR,
    FEATURE_ARRAYS_PATHS,
    FEATURE_TYPED_TREE,
    KNOWN_REQUIRED_FEATURES,
    PREAMBLE_SIZE,
    TYPED_TREE_MINOR,
    VERSION_MAJOR,
    VERSION_MINOR,
)
from .index import Index, parse_index, unpack_index
from .structs import Footer, FrameHeader, Preamble, pack_frame_header, xxh3
from .tree import check_depth, msgpack_errors, pack_tree, stored_ext, tree_features, unpackb

_ZEROS = bytes(MAX_ALIGNMENT)
_JOINED = 4096  # payloads up to this size are copied behind their frame header into one write


class PipelineLike(Protocol, Hashable):
    def to_json(self) -> list[dict[str, Any]]: ...


def check_alignment(alignment: object) -> None:
    if type(alignment) is not int or not 1 <= alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two in 1..{MAX_ALIGNMENT}, got {alignment!r}")


class FrameWriter:
    """The frames of one file, in order.

    ``entries[i]``: tensor i's index entry without ``"chunks"`` (name, dtype,
    shape, view / derived, internal); ``chunk_lengths[i]``: the raw length of
    each of its chunks, as planned.  Misuse (a chunk before its tensor, twice,
    of another length) is a bug in the caller and raises AssertionError-like
    ``RuntimeError``, never a file of the wrong shape."""

    def __init__(self, stream: Any, entries: Sequence[dict[str, Any]], chunk_lengths: Sequence[Sequence[int]], *,
                 alignment: int = DEFAULT_ALIGNMENT, required_features: int = 0) -> None:
        check_alignment(alignment)
        if len(entries) != len(chunk_lengths):
            raise ValueError("one list of chunk lengths per entry")
        self.stream = stream
        self.entries = entries
        self.chunk_lengths = list(chunk_lengths)
        self.alignment = alignment
        self.position = 0
        self._pending: list[Any] | None = None  # while deferring (defer()): what flush() writes, in order
        self.codec_ids: dict[Any, int] = {}
        self.codec_table: list[Any] = []
        self.announced: list[bool] = [False] * len(entries)
        self.checksums: dict[int, int] = {}
        self.chunks: list[list[list[int] | None]] = [[None] * len(c) for c in chunk_lengths]
        if required_features & ~KNOWN_REQUIRED_FEATURES:
            raise RuntimeError(f"unknown required features 0x{required_features:x}")
        # The lowest version that describes the file (SPEC 19): 1.1 only when it uses a 1.1 feature.
        self.version = (VERSION_MAJOR, ARRAYS_PATHS_MINOR if required_features & FEATURE_ARRAYS_PATHS
                        else TYPED_TREE_MINOR if required_features & FEATURE_TYPED_TREE else VERSION_MINOR)
        self.required_features = required_features
        self._packer = msgpack.Packer(default=stored_ext)  # one per writer (not thread-safe): a TENSOR frame per tensor, thousands per save
        self._write(Preamble(self.version[0], self.version[1], required_features).pack())

    def defer(self) -> None:
        """Hold what is written from now on until ``flush()``, which hands it to the stream at once
        (``write_many`` where the stream has it: one call, no Python between the copies).  The caller
        keeps every payload's memory alive until then."""
        if self._pending is None:
            self._pending = []

    def flush(self) -> None:
        """Write what ``defer()`` held, in order; later writes go straight to the stream again."""
        pending, self._pending = self._pending, None
        if not pending:
            return
        write_many = getattr(self.stream, "write_many", None)
        if write_many is not None:
            write_many(pending)
            return
        for data in pending:
            self._write_out(data, memoryview(data).nbytes)

    def _write(self, data: Any, nbytes: int | None = None) -> None:
        size = memoryview(data).nbytes if nbytes is None else nbytes
        if self._pending is not None:
            self._pending.append(data)
        else:
            self._write_out(data, size)
        self.position += size

    def _write_out(self, data: Any, size: int) -> None:
        n = self.stream.write(data)
        if n is not None and n < size:  # a raw stream (a socket, a pipe) may take fewer bytes than given
            self._write_rest(memoryview(data).cast("B")[n:])

    def _write_rest(self, rest: memoryview) -> None:
        while rest.nbytes:
            n = self.stream.write(rest)
            if n is None:  # a non-blocking stream that would block: the file would lose bytes
                raise BlockingIOError(errno.EAGAIN, "the stream is non-blocking and took no bytes; give a blocking one")
            if n <= 0:
                raise OSError(errno.EIO, f"the stream took no bytes of the {rest.nbytes} left to write")
            rest = rest[n:]

    def _frame(self, head: bytes, padding: int, stored: int, payload: Any) -> int:
        """Write one frame (``head``: its packed header, ``padding`` bytes after it, ``stored`` payload bytes);
        returns the payload's offset."""
        # Header and padding in one write, and a small payload with them: a save writes thousands of frames
        # (two per small tensor), and each write costs host time.
        if padding:
            head += _ZEROS[:padding]
        offset = self.position + len(head)
        if stored <= _JOINED:
            self._write(b"".join((head, payload)), len(head) + stored)
        else:
            self._write(head, len(head))
            self._write(payload, stored)
        return offset

    def _meta_frame(self, ftype: int, payload: bytes, **ids: int) -> int:
        if ftype != FRAME_INDEX and len(payload) > MAX_META_FRAME_LENGTH:
            raise LimitError(f"a {FRAME_NAMES[ftype]} frame of {len(payload)} bytes exceeds {MAX_META_FRAME_LENGTH}")
        n = len(payload)
        return self._frame(pack_frame_header(ftype, n, n, xxh3(payload), **ids), 0, n, payload)

    def codec_id(self, pipeline: PipelineLike) -> int:
        cid = self.codec_ids.get(pipeline)
        if cid is None:
            cid = len(self.codec_table)
            if cid >= MAX_CODECS:
                raise LimitError(f"more than {MAX_CODECS} distinct codec pipelines")
            self._meta_frame(FRAME_CODEC, msgpack.packb(pipeline.to_json(), default=stored_ext), codec_id=cid)
            self.codec_ids[pipeline] = cid
            self.codec_table.append(pipeline)
        return cid

    def _entry(self, tensor_id: int) -> dict[str, Any]:
        entry = dict(self.entries[tensor_id])
        if tensor_id in self.checksums:
            entry["checksum"] = self.checksums[tensor_id]
        return entry

    def tensor(self, tensor_id: int, checksum: int | None = None, chunk_lengths: Sequence[int] | None = None) -> None:
        """The TENSOR frame of a tensor; ``checksum``: XXH3-64 of its raw bytes, if known; ``chunk_lengths``:
        its chunks' raw lengths where they were not known when the writer was made (a derived-tensor
        candidate verified meanwhile: none once it is derived)."""
        if self.announced[tensor_id]:
            raise RuntimeError(f"tensor {tensor_id} announced twice")
        if chunk_lengths is not None:
            self.chunk_lengths[tensor_id] = list(chunk_lengths)
            self.chunks[tensor_id] = [None] * len(chunk_lengths)
        if checksum is not None:
            self.checksums[tensor_id] = checksum
        entry = self._entry(tensor_id)
        entry["nchunks"] = len(self.chunk_lengths[tensor_id])
        self._meta_frame(FRAME_TENSOR, self._packer.pack(entry), tensor_id=tensor_id)
        self.announced[tensor_id] = True

    def chunk(self, tensor_id: int, index: int, pipeline: PipelineLike, payload: Any, raw_length: int,
              checksum: int | None = None) -> None:
        """One CHUNK frame; ``checksum`` is XXH3-64 of ``payload``, computed here when None."""
        if not self.announced[tensor_id]:
            raise RuntimeError(f"chunk {index} of tensor {tensor_id} came before its TENSOR frame")
        if self.chunks[tensor_id][index] is not None:
            raise RuntimeError(f"chunk {index} of tensor {tensor_id} written twice")
        if raw_length != self.chunk_lengths[tensor_id][index]:
            raise RuntimeError(f"chunk {index} of tensor {tensor_id}: raw length {raw_length} != planned "
                               f"{self.chunk_lengths[tensor_id][index]}")
        stored = memoryview(payload).nbytes
        if stored > MAX_CHUNK_LENGTH:
            raise LimitError(f"encoded chunk of {stored} bytes exceeds {MAX_CHUNK_LENGTH}")
        cid = self.codec_id(pipeline)
        checksum = xxh3(payload) if checksum is None else checksum
        padding = 0
        if stored >= self.alignment > 1:
            padding = -(self.position + FRAME_HEADER_SIZE) % self.alignment
        head = pack_frame_header(FRAME_CHUNK, stored, raw_length, checksum, cid, tensor_id, index, padding)
        offset = self._frame(head, padding, stored, payload)
        self.chunks[tensor_id][index] = [offset, stored, raw_length, cid, checksum]

    def finish(self, tree: Any, metadata: dict[str, Any], writer_info: dict[str, Any], *,
               packed_tree: bytes | None = None) -> int:
        """Write the INDEX frame and the footer; returns the file's length.

        ``tree`` holds TensorRefs; its typed extensions need ``required_features`` (SPEC 9.2); ``packed_tree``:
        ``pack_tree(tree)`` where the caller has it (check_index_floor returns it).  An index over
        MAX_INDEX_LENGTH raises LimitError before the INDEX frame is written (SPEC 16: a writer fails first)."""
        self.flush()
        for tid, entry in enumerate(self.entries):
            if not self.announced[tid]:
                raise RuntimeError(f"tensor {entry['name']!r} was never written")
            if any(c is None for c in self.chunks[tid]):
                raise RuntimeError(f"tensor {entry['name']!r} is missing chunks")
        if tree_features(tree) & ~self.required_features:
            raise RuntimeError("the tree holds typed extensions but the preamble did not declare them")
        tensors = []
        for tid, entry in enumerate(self.entries):
            out = self._entry(tid)
            if "view" not in entry and "derived" not in entry:
                out["chunks"] = self.chunks[tid]
            tensors.append(out)
        index = {
            "format": "nvckpt",
            "version": list(self.version),
            "writer": writer_info,
            "codecs": [p.to_json() for p in self.codec_table],
            "tensors": tensors,
            "tree": _Packed(pack_tree(tree) if packed_tree is None else packed_tree),
            "metadata": metadata,
        }
        payload = _pack_index(index)
        if len(payload) > MAX_INDEX_LENGTH:
            raise LimitError(f"the index would be {len(payload)} bytes, more than the limit of {MAX_INDEX_LENGTH} "
                             "(too many tensors or chunks, or too large a tree or metadata)")
        index_offset = self.position
        self._meta_frame(FRAME_INDEX, payload)
        self._write(Footer(index_offset, len(payload), xxh3(payload)).pack())
        return self.position


def check_index_floor(entries: Sequence[dict[str, Any]], chunk_lengths: Sequence[Sequence[int]], tree: Any,
                      metadata: dict[str, Any], writer_info: dict[str, Any]) -> bytes:
    """SPEC 16: refuse, before the first byte is written, an object whose index cannot fit in
    MAX_INDEX_LENGTH: its entries, tree and metadata as they will be packed, and at least 6 bytes
    a chunk (so this never refuses an index that would fit; ``finish`` checks the exact size).
    Returns the packed tree (for ``FrameWriter.finish``)."""
    packed_tree = pack_tree(tree)
    floor = len(packed_tree) + len(msgpack.packb(metadata, use_bin_type=True, default=stored_ext))
    floor += len(msgpack.packb(writer_info, use_bin_type=True, default=stored_ext))
    if floor <= MAX_INDEX_LENGTH:
        chunks = 6 * sum(map(len, chunk_lengths))
        # The entries are packed only when a bound on their size does not fit: a name is at most 4 bytes a
        # character in UTF-8, a dimension 9 (a view's stride 9 more), the other fields a few dozen bytes.
        # (A save packs thousands of them again for the index; this runs beside training in an async_save.)
        bound = sum(4 * len(e["name"]) + 18 * len(e["shape"]) + 256 for e in entries)
        if floor + bound + chunks > MAX_INDEX_LENGTH:
            floor += sum(len(msgpack.packb(e, use_bin_type=True, default=stored_ext)) for e in entries) + chunks
    if floor > MAX_INDEX_LENGTH:
        raise LimitError(f"the index would be at least {floor} bytes, more than the limit of {MAX_INDEX_LENGTH} "
                         "(too many tensors or chunks, or too large a tree or metadata); nothing was written")
    return packed_tree


class _Packed:
    """Pre-packed msgpack bytes (the tree, with its ext types) to splice into the index."""

    def __init__(self, data: bytes) -> None:
        self.data = data


def _pack_index(index: dict[str, Any]) -> bytes:
    # msgpack-python cannot splice packed bytes, so write the map header by hand.
    packer = msgpack.Packer(use_bin_type=True, default=stored_ext)
    out = [packer.pack_map_header(len(index))]
    for key, value in index.items():
        out.append(packer.pack(key))
        out.append(value.data if isinstance(value, _Packed) else packer.pack(value))
    return b"".join(out)


# -- reading -----------------------------------------------------------------------------------
def locate_index(source: Any, *, max_index_memory: int | None = None) -> tuple[Preamble, Index]:
    """Preamble, footer, INDEX frame: check all of them, return the parsed index.

    ``max_index_memory`` bounds the memory the decoded index may take (LimitError)."""
    # SPEC 3: a file shorter than the preamble is FormatError unless its bytes start the magic (TruncatedError).
    preamble = Preamble.unpack(source.read(0, min(source.size, PREAMBLE_SIZE)))
    minimum = PREAMBLE_SIZE + FRAME_HEADER_SIZE + FOOTER_SIZE
    if source.size < minimum:
        raise TruncatedError(f"file is {source.size} bytes, too short for an index and footer (try `nvckpt recover`)", path=source.name)
    footer_at = source.size - FOOTER_SIZE
    footer = Footer.unpack(source.read(footer_at, FOOTER_SIZE), footer_at)
    if footer.index_length > MAX_INDEX_LENGTH:
        raise LimitError(f"index of {footer.index_length} bytes exceeds the limit of {MAX_INDEX_LENGTH}", offset=footer_at)
    # SPEC 5 check 6, before the INDEX frame header is read (check 7): the header and index_length bytes fit
    # between the preamble and the footer.
    if footer.index_offset < PREAMBLE_SIZE or footer.index_offset + FRAME_HEADER_SIZE + footer.index_length > footer_at:
        raise FormatError(f"footer's index (offset {footer.index_offset}, {footer.index_length} bytes after a "
                          f"{FRAME_HEADER_SIZE}-byte header) does not fit between the preamble and the footer at {footer_at}",
                          offset=footer_at)
    header = FrameHeader.unpack(source.read(footer.index_offset, FRAME_HEADER_SIZE), footer.index_offset)
    if header.frame_type != FRAME_INDEX:  # SPEC 5 check 7: FormatError for every other type, 5-127 included
        raise FormatError(f"footer points at a {FRAME_NAMES.get(header.frame_type, f'type {header.frame_type}')} "
                          "frame, not the INDEX frame", offset=footer.index_offset)
    payload_at = footer.index_offset + header.payload_skip
    if (header.stored_length != footer.index_length or header.payload_checksum != footer.index_checksum
            or header.raw_length != header.stored_length or payload_at + header.stored_length != footer_at):
        raise FormatError("INDEX frame header disagrees with the footer (length, checksum or position)", offset=footer.index_offset)
    if header.padding_length and any(source.read(footer.index_offset + FRAME_HEADER_SIZE, header.padding_length)):
        raise FormatError("INDEX frame padding is not zero", offset=footer.index_offset + FRAME_HEADER_SIZE)
    payload = source.read(payload_at, footer.index_length)
    if xxh3(payload) != footer.index_checksum:
        raise ChecksumError("index checksum does not match", offset=payload_at)
    # Decoding a large index builds millions of containers, none cyclic (a 1M-tensor index: 7 s of 9 were collections).
    with gc_paused():
        data = unpack_index(payload, max_index_memory)
        del payload  # (what parse_index no longer needs of it is let go: memory for the names it builds)
        index = parse_index(data, footer.index_offset, preamble.required_features)
    return preamble, index


def read_meta_frame(source: Any, offset: int, header: FrameHeader) -> Any:
    """The msgpack payload of a CODEC or TENSOR frame: length limit and checksum checked first."""
    if header.stored_length > MAX_META_FRAME_LENGTH or header.raw_length != header.stored_length:
        raise LimitError(f"frame payload length {header.stored_length} is invalid (limit {MAX_META_FRAME_LENGTH})", offset=offset)
    payload = source.read(offset + header.payload_skip, header.stored_length)
    if xxh3(payload) != header.payload_checksum:
        raise ChecksumError("frame payload checksum does not match", offset=offset)
    with msgpack_errors("frame payload", f"a frame payload of {len(payload)} bytes", offset=offset):
        value = unpackb(payload)
    check_depth(value, f"the {FRAME_NAMES.get(header.frame_type, 'frame')} frame payload")
    return value


def iter_frames(source: Any, start: int = PREAMBLE_SIZE) -> Iterator[tuple[int, FrameHeader]]:
    """Walk frames front to back without the index (streaming reader, recovery).

    Yields (frame offset, header) until the INDEX frame, the end of the file,
    or the first damaged header (raising its error)."""
    offset = start
    while offset + FRAME_HEADER_SIZE <= source.size:
        header = FrameHeader.unpack(source.read(offset, FRAME_HEADER_SIZE), offset)
        end = offset + header.payload_skip + header.stored_length
        if end > source.size:
            raise TruncatedError(f"{FRAME_NAMES.get(header.frame_type, 'frame')} payload runs past the end of the file", path=source.name, offset=offset)
        if header.frame_type not in FRAME_NAMES and header.frame_type < FIRST_OPTIONAL_FRAME:
            raise UnsupportedFeatureError(f"unknown required frame type {header.frame_type}", path=source.name, offset=offset)
        yield offset, header
        if header.frame_type == FRAME_INDEX:
            return
        offset = end
    if offset != source.size:
        raise TruncatedError("file ends inside a frame header", path=source.name, offset=offset)


__all__ = ["FrameWriter", "check_alignment", "check_index_floor", "locate_index", "read_meta_frame", "iter_frames"]
