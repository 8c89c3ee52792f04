"""Random-access reader: locate the index from the footer, then read only what is asked.

Reads go through ``pread`` (no shared file position), so one Reader serves
many threads at once.  Every chunk's checksum is verified before its bytes
reach a decoder.
"""

from __future__ import annotations

import bisect
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np
import torch

from .. import dtypes
from ..derive import bf16_rne
from ..errors import ChecksumError, FormatError, LimitError, NvckptError, TensorNotFoundError, TruncatedError, UnsupportedCodecError, UnsupportedFeatureError
from ..format.constants import (
    FIRST_OPTIONAL_FRAME,
    FOOTER_SIZE,
    FRAME_HEADER_SIZE,
    FRAME_INDEX,
    FRAME_NAMES,
    MAX_INDEX_LENGTH,
    MAX_META_FRAME_LENGTH,
    PREAMBLE_SIZE,
)
from ..format.index import Index, TensorEntry, parse_index, unpack_index
from ..format.structs import Footer, FrameHeader, Preamble, xxh3
from ..format.tree import unpackb


class Source:
    """Positional reads from a path or a seekable binary file object."""

    def __init__(self, target: Any) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._file = None
        if isinstance(target, (str, os.PathLike)):
            self.name = os.fspath(target)
            self._fd = os.open(self.name, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            self.size = os.fstat(self._fd).st_size
        else:
            self.name = getattr(target, "name", "<stream>")
            self._file = target
            self.size = target.seek(0, os.SEEK_END)
        self.bytes_read = 0

    def pread(self, offset: int, length: int) -> bytes:
        if self._fd is None and self._file is None:
            raise ValueError(f"{self.name}: read from a closed checkpoint")
        if offset < 0 or length < 0 or offset + length > self.size:
            raise TruncatedError(f"read of {length} bytes at {offset} runs past the end of the file ({self.size} bytes)", path=self.name, offset=offset)
        if self._fd is not None:
            parts, got = [], 0
            while got < length:  # pread may return short reads
                part = os.pread(self._fd, length - got, offset + got)
                if not part:
                    raise TruncatedError(f"file ended while reading {length} bytes", path=self.name, offset=offset)
                parts.append(part)
                got += len(part)
            data = parts[0] if len(parts) == 1 else b"".join(parts)
        else:
            with self._lock:
                self._file.seek(offset)
                data = self._file.read(length)
            if len(data) != length:
                raise TruncatedError(f"file ended while reading {length} bytes", path=self.name, offset=offset)
        with self._lock:
            self.bytes_read += length
        return data

    def close(self) -> None:
        """Close a file this Source opened; a caller's file object is only let go of."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._file = None


def locate_index(source: Source) -> tuple[Preamble, Index]:
    """Preamble, footer, INDEX frame: check all of them, return the parsed index."""
    if source.size < PREAMBLE_SIZE:
        raise TruncatedError(f"file is {source.size} bytes, shorter than the preamble", path=source.name, offset=0)
    preamble = Preamble.unpack(source.pread(0, PREAMBLE_SIZE))
    minimum = PREAMBLE_SIZE + FRAME_HEADER_SIZE + FOOTER_SIZE
    if source.size < minimum:
        raise TruncatedError(f"file is {source.size} bytes, too short for an index and footer (try `nvckpt recover`)", path=source.name)
    footer_at = source.size - FOOTER_SIZE
    footer = Footer.unpack(source.pread(footer_at, FOOTER_SIZE), footer_at)
    if footer.index_length > MAX_INDEX_LENGTH:
        raise LimitError(f"index of {footer.index_length} bytes exceeds the limit of {MAX_INDEX_LENGTH}", offset=footer_at)
    if footer.index_offset < PREAMBLE_SIZE or footer.index_offset + FRAME_HEADER_SIZE > footer_at:
        raise FormatError(f"footer's index offset {footer.index_offset} is outside the file", offset=footer_at)
    header = FrameHeader.unpack(source.pread(footer.index_offset, FRAME_HEADER_SIZE), footer.index_offset)
    if header.frame_type != FRAME_INDEX:
        raise FormatError(f"footer points at a {FRAME_NAMES.get(header.frame_type, header.frame_type)} frame, not the INDEX", offset=footer.index_offset)
    payload_at = footer.index_offset + header.payload_skip
    if (header.stored_length != footer.index_length or header.payload_checksum != footer.index_checksum
            or header.raw_length != header.stored_length or payload_at + header.stored_length != footer_at):
        raise FormatError("INDEX frame header disagrees with the footer (length, checksum or position)", offset=footer.index_offset)
    if header.padding_length and any(source.pread(footer.index_offset + FRAME_HEADER_SIZE, header.padding_length)):
        raise FormatError("INDEX frame padding is not zero", offset=footer.index_offset + FRAME_HEADER_SIZE)
    payload = source.pread(payload_at, footer.index_length)
    if xxh3(payload) != footer.index_checksum:
        raise ChecksumError("index checksum does not match", offset=payload_at)
    return preamble, parse_index(unpack_index(payload), footer.index_offset)


def check_supported(entry: TensorEntry, path: str) -> None:
    """Raise for a tensor this reader cannot build (unknown dtype or derived function, SPEC 10 and 8.5)."""
    if entry.unsupported is not None:
        raise UnsupportedFeatureError(entry.unsupported, path=path, tensor=entry.name)


def check_bools(entry: TensorEntry, raw: torch.Tensor, path: str) -> torch.Tensor:
    """SPEC 10: a bool byte is 0 or 1; anything else is undefined behaviour in torch's kernels."""
    if entry.dtype.name == "bool" and bool((raw > 1).any()):
        raise FormatError("bool tensor holds a byte other than 0 and 1", path=path, tensor=entry.name)
    return raw


class Reader:
    def __init__(self, target: Any, *, workers: int | None = None, max_tensor_bytes: int | None = None) -> None:
        if max_tensor_bytes is not None and (type(max_tensor_bytes) is not int or max_tensor_bytes < 0):
            raise ValueError(f"max_tensor_bytes must be a non-negative integer or None, got {max_tensor_bytes!r}")
        self.max_tensor_bytes = max_tensor_bytes
        self.source = Source(target)
        self.path = self.source.name
        try:
            self.preamble, self.index = locate_index(self.source)
        except NvckptError as exc:
            self.source.close()
            raise exc.located(path=self.path)
        except BaseException:
            self.source.close()
            raise
        self._workers = workers or os.cpu_count() or 1
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------
    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.source.close()

    def _map(self, fn, items: list) -> list:
        if len(items) <= 1 or self._workers == 1:
            return [fn(x) for x in items]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="nvckpt-decode")
        return list(self._pool.map(fn, items))

    # -- names -------------------------------------------------------------
    def entry(self, name: str) -> TensorEntry:
        tid = self.index.paths.get(name)
        if tid is None:
            for e in self.index.tensors:  # internal bases are reachable by name too
                if e.name == name:
                    return e
            raise TensorNotFoundError(f"no tensor named {name!r}", path=self.path)
        return self.index.tensors[tid]

    # -- chunks ------------------------------------------------------------
    def read_payload(self, entry: TensorEntry, i: int) -> bytes:
        """The stored bytes of chunk ``i``, checksum verified."""
        c = entry.chunks[i]
        try:
            data = self.source.pread(c.offset, c.stored_length)
        except NvckptError as exc:
            raise exc.located(tensor=entry.name, chunk=i)
        if xxh3(data) != c.checksum:
            raise ChecksumError("chunk checksum does not match its stored bytes", path=self.path, tensor=entry.name, chunk=i, offset=c.offset)
        return data

    def decode_payload(self, entry: TensorEntry, i: int, data: bytes) -> memoryview:
        c = entry.chunks[i]
        pipeline = self.index.codecs[c.codec_id]
        try:
            out = memoryview(pipeline.decode(memoryview(data), c.raw_length))
        except UnsupportedCodecError as exc:
            w = self.index.writer
            exc.reason += f" [codec id {c.codec_id}; file written by {w.get('name', '?')} {w.get('version', '?')}]"
            raise exc.located(path=self.path, tensor=entry.name, chunk=i, offset=c.offset)
        except NvckptError as exc:
            raise exc.located(path=self.path, tensor=entry.name, chunk=i, offset=c.offset)
        except Exception as exc:  # a decoder rejecting its input
            raise FormatError(f"{pipeline.describe()} could not decode the chunk: {exc}", path=self.path, tensor=entry.name, chunk=i, offset=c.offset) from None
        if out.nbytes != c.raw_length:
            raise FormatError(f"chunk decoded to {out.nbytes} bytes, raw_length is {c.raw_length}", path=self.path, tensor=entry.name, chunk=i, offset=c.offset)
        return out

    def chunks_for(self, entry: TensorEntry, start: int, stop: int) -> range:
        """Indices of the chunks that hold raw bytes [start, stop)."""
        if stop <= start or not entry.chunks:
            return range(0)
        starts = [c.raw_start for c in entry.chunks]
        first = bisect.bisect_right(starts, start) - 1
        last = bisect.bisect_left(starts, stop)
        return range(first, last)

    def check_size(self, entry: TensorEntry, nbytes: int) -> None:
        """The caller's limit on the bytes one read materializes (SPEC.md 16), checked before allocating."""
        if self.max_tensor_bytes is not None and nbytes > self.max_tensor_bytes:
            raise LimitError(f"reading it would materialize {nbytes} bytes, more than max_tensor_bytes="
                             f"{self.max_tensor_bytes}", path=self.path, tensor=entry.name)

    def raw_range(self, entry: TensorEntry, start: int, stop: int) -> torch.Tensor:
        """Raw bytes [start, stop) of a stored tensor as uint8, reading only the chunks that hold them."""
        assert entry.chunks is not None
        self.check_size(entry, stop - start)
        out = torch.empty(stop - start, dtype=torch.uint8)
        view = out.numpy()

        def fill(i: int) -> None:
            c = entry.chunks[i]
            raw = np.frombuffer(self.decode_payload(entry, i, self.read_payload(entry, i)), dtype=np.uint8)
            lo, hi = max(start, c.raw_start), min(stop, c.raw_start + c.raw_length)
            view[lo - start : hi - start] = raw[lo - c.raw_start : hi - c.raw_start]

        self._map(fill, list(self.chunks_for(entry, start, stop)))
        return out

    # -- tensors -----------------------------------------------------------
    def tensor(self, entry: TensorEntry, cache: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Load one whole tensor on the CPU.  ``cache`` shares bases between views."""
        if cache is not None and entry.tensor_id in cache:
            return cache[entry.tensor_id]
        check_supported(entry, self.path)
        dtype = dtypes.to_torch(entry.dtype.name)
        if entry.view is not None:
            base = self.tensor(self.index.tensors[entry.view["base"]], cache)
            result = base.as_strided(entry.shape, entry.view["stride"], entry.view["offset"])
        elif entry.derived is not None:
            source = self.tensor(self.index.tensors[entry.derived["source"]], cache)
            result = bf16_rne(source)
        else:
            raw = check_bools(entry, self.raw_range(entry, 0, entry.nbytes), self.path)
            if entry.checksum is not None and xxh3(raw.numpy()) != entry.checksum:
                raise ChecksumError("tensor checksum does not match its decoded bytes", path=self.path, tensor=entry.name)
            result = raw.view(dtype).reshape(entry.shape) if entry.nbytes else torch.empty(entry.shape, dtype=dtype)
        if cache is not None:
            cache[entry.tensor_id] = result
        return result

    def rows(self, entry: TensorEntry, first: int, stop: int) -> torch.Tensor:
        """Rows [first, stop) of dim 0, decoding only the chunks that hold them."""
        if entry.chunks is None:
            return self.tensor(entry)[first:stop]
        check_supported(entry, self.path)
        dtype = dtypes.to_torch(entry.dtype.name)
        row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
        shape = (stop - first,) + entry.shape[1:]
        if row_bytes == 0 or stop <= first:
            return torch.empty(shape, dtype=dtype)
        raw = check_bools(entry, self.raw_range(entry, first * row_bytes, stop * row_bytes), self.path)
        return raw.view(dtype).reshape(shape)


def read_meta_frame(source: Source, offset: int, header: FrameHeader) -> Any:
    """The msgpack payload of a CODEC or TENSOR frame: length limit and checksum checked first."""
    if header.stored_length > MAX_META_FRAME_LENGTH or header.raw_length != header.stored_length:
        raise LimitError(f"frame payload length {header.stored_length} is invalid (limit {MAX_META_FRAME_LENGTH})", offset=offset)
    payload = source.pread(offset + header.payload_skip, header.stored_length)
    if xxh3(payload) != header.payload_checksum:
        raise ChecksumError("frame payload checksum does not match", offset=offset)
    try:
        return unpackb(payload)
    except NvckptError:
        raise
    except Exception as exc:  # msgpack raises several types on bad input
        raise FormatError(f"frame payload is not valid msgpack: {exc}", offset=offset) from None


def scan_frames(source: Source, start: int = PREAMBLE_SIZE) -> Iterator[tuple[int, FrameHeader]]:
    """Walk frames front to back without the index (streaming reader, recovery).

    Yields (frame offset, header) until the INDEX frame, the end of the file,
    or the first damaged header (raising its error)."""
    offset = start
    while offset + FRAME_HEADER_SIZE <= source.size:
        header = FrameHeader.unpack(source.pread(offset, FRAME_HEADER_SIZE), offset)
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


__all__ = ["Reader", "Source", "locate_index", "scan_frames"]
