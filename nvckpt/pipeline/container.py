"""ContainerWriter: the frames of SPEC.md, appended to a stream that never seeks.

Engines hand it items in any order that SPEC.md allows: a TensorFrame before
the first chunk of its tensor, then EncodedChunks.  It assigns codec ids,
writes CODEC frames on first use, pads large payloads to the alignment,
records every chunk for the index, and ends with the INDEX frame and footer.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import msgpack

from ..codecs import Pipeline
from ..errors import LimitError, NvckptError
from ..format.constants import (
    DEFAULT_ALIGNMENT,
    FRAME_CHUNK,
    FRAME_CODEC,
    FRAME_HEADER_SIZE,
    FRAME_INDEX,
    FRAME_TENSOR,
    MAX_ALIGNMENT,
    MAX_CHUNK_LENGTH,
    MAX_CODECS,
    VERSION_MAJOR,
    VERSION_MINOR,
)
from ..format.structs import Footer, FrameHeader, Preamble, xxh3
from ..format.tree import pack_tree
from .plan import SavePlan


class TensorFrame(NamedTuple):
    """Announces a tensor; ``checksum`` is XXH3-64 of its raw bytes, if the engine has it."""

    tensor_id: int
    checksum: int | None = None


class EncodedChunk(NamedTuple):
    tensor_id: int
    chunk_index: int
    pipeline: Pipeline
    payload: Any  # bytes-like (buffer protocol)
    raw_length: int
    checksum: int | None = None  # XXH3-64 of payload; computed here when None
    release: Callable[[], None] | None = None  # called once the payload is written


_ZEROS = bytes(MAX_ALIGNMENT)


def check_alignment(alignment: object) -> None:
    if type(alignment) is not int or not 1 <= alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two in 1..{MAX_ALIGNMENT}, got {alignment!r}")


class ContainerWriter:
    def __init__(self, stream: Any, plan: SavePlan, *, alignment: int = DEFAULT_ALIGNMENT,
                 optional_features: int = 0) -> None:
        check_alignment(alignment)
        self.stream = stream
        self.plan = plan
        self.alignment = alignment
        self.position = 0
        self.codec_ids: dict[Pipeline, int] = {}
        self.codec_table: list[Pipeline] = []
        self.announced: list[bool] = [False] * len(plan.tensors)
        self.checksums: dict[int, int] = {}
        self.chunks: list[list[list[int] | None]] = [[None] * len(t.chunks) for t in plan.tensors]
        self._write(Preamble(optional_features=optional_features).pack())

    def _write(self, data: Any) -> None:
        self.stream.write(data)
        self.position += memoryview(data).nbytes

    def _frame(self, header: FrameHeader, payload: Any) -> int:
        """Write one frame; returns the payload's offset."""
        self._write(header.pack())
        if header.padding_length:
            self._write(_ZEROS[: header.padding_length])
        offset = self.position
        self._write(payload)
        return offset

    def _meta_frame(self, ftype: int, payload: bytes, **ids: int) -> int:
        return self._frame(FrameHeader(ftype, len(payload), len(payload), xxh3(payload), **ids), payload)

    def codec_id(self, pipeline: Pipeline) -> int:
        cid = self.codec_ids.get(pipeline)
        if cid is None:
            cid = len(self.codec_table)
            if cid >= MAX_CODECS:
                raise LimitError(f"more than {MAX_CODECS} distinct codec pipelines")
            self._meta_frame(FRAME_CODEC, msgpack.packb(pipeline.to_json()), codec_id=cid)
            self.codec_ids[pipeline] = cid
            self.codec_table.append(pipeline)
        return cid

    def write(self, item: TensorFrame | EncodedChunk) -> None:
        if isinstance(item, TensorFrame):
            self._announce(item)
        else:
            self._chunk(item)

    def _entry(self, tensor_id: int) -> dict[str, Any]:
        entry = dict(self.plan.tensors[tensor_id].entry)
        if tensor_id in self.checksums:
            entry["checksum"] = self.checksums[tensor_id]
        return entry

    def _announce(self, item: TensorFrame) -> None:
        tid = item.tensor_id
        if self.announced[tid]:
            raise NvckptError(f"tensor {tid} announced twice (engine bug)")
        if item.checksum is not None:
            self.checksums[tid] = item.checksum
        entry = self._entry(tid)
        entry["nchunks"] = len(self.plan.tensors[tid].chunks)
        self._meta_frame(FRAME_TENSOR, msgpack.packb(entry), tensor_id=tid)
        self.announced[tid] = True

    def _chunk(self, chunk: EncodedChunk) -> None:
        tid, index = chunk.tensor_id, chunk.chunk_index
        try:
            if not self.announced[tid]:
                raise NvckptError(f"chunk {index} of tensor {tid} came before its TENSOR frame (engine bug)")
            if self.chunks[tid][index] is not None:
                raise NvckptError(f"chunk {index} of tensor {tid} written twice (engine bug)")
            start, length = self.plan.tensors[tid].chunks[index]
            if chunk.raw_length != length:
                raise NvckptError(f"chunk {index} of tensor {tid}: raw length {chunk.raw_length} != planned {length}")
            stored = memoryview(chunk.payload).nbytes
            if stored > MAX_CHUNK_LENGTH:
                raise LimitError(f"encoded chunk of {stored} bytes exceeds {MAX_CHUNK_LENGTH}")
            cid = self.codec_id(chunk.pipeline)
            checksum = xxh3(chunk.payload) if chunk.checksum is None else chunk.checksum
            padding = 0
            if stored >= self.alignment > 1:
                padding = -(self.position + FRAME_HEADER_SIZE) % self.alignment
            header = FrameHeader(FRAME_CHUNK, stored, chunk.raw_length, checksum, codec_id=cid,
                                 tensor_id=tid, chunk_index=index, padding_length=padding)
            offset = self._frame(header, chunk.payload)
            self.chunks[tid][index] = [offset, stored, chunk.raw_length, cid, checksum]
        finally:
            if chunk.release is not None:
                chunk.release()

    def finish(self, writer_info: dict[str, Any]) -> int:
        """Write the INDEX frame and the footer; returns the file's length."""
        for tid, t in enumerate(self.plan.tensors):
            if not self.announced[tid]:
                raise NvckptError(f"tensor {t.name!r} was never written (engine bug)")
            if any(c is None for c in self.chunks[tid]):
                raise NvckptError(f"tensor {t.name!r} is missing chunks (engine bug)")
        tensors = []
        for tid, t in enumerate(self.plan.tensors):
            entry = self._entry(tid)
            if t.entry.get("view") is None and t.entry.get("derived") is None:
                entry["chunks"] = self.chunks[tid]
            tensors.append(entry)
        index = {
            "format": "nvckpt",
            "version": [VERSION_MAJOR, VERSION_MINOR],
            "writer": writer_info,
            "codecs": [p.to_json() for p in self.codec_table],
            "tensors": tensors,
            "tree": _Packed(pack_tree(self.plan.tree)),
            "metadata": self.plan.metadata,
        }
        payload = _pack_index(index)
        index_offset = self.position
        self._meta_frame(FRAME_INDEX, payload)
        self._write(Footer(index_offset, len(payload), xxh3(payload)).pack())
        return self.position


class _Packed:
    """Pre-packed msgpack bytes (the tree, with its ext types) to splice into the index."""

    def __init__(self, data: bytes) -> None:
        self.data = data


def _pack_index(index: dict[str, Any]) -> bytes:
    # msgpack-python cannot splice packed bytes, so write the map header by hand.
    packer = msgpack.Packer(use_bin_type=True)
    out = [packer.pack_map_header(len(index))]
    for key, value in index.items():
        out.append(packer.pack(key))
        out.append(value.data if isinstance(value, _Packed) else packer.pack(value))
    return b"".join(out)
