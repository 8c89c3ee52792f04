"""What an engine hands the frame writer, in an order SPEC 6 allows: a tensor, then its chunks."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from ..codecs.base import Pipeline


class TensorReady(NamedTuple):
    """Tensor ``tensor_id`` may be announced (its TENSOR frame); ``checksum``: XXH3-64 of its raw bytes, if known."""

    tensor_id: int
    checksum: int | None = None


class EncodedChunk(NamedTuple):
    tensor_id: int
    chunk_index: int
    pipeline: Pipeline
    payload: Any  # bytes-like (buffer protocol)
    raw_length: int
    checksum: int | None = None  # XXH3-64 of payload; computed by the writer when None
    release: Callable[[], None] | None = None  # called once the payload is written
    # False: the writer may hold this chunk's frame and write it with the next chunk whose flush is True
    # (its payload stays valid until its release); an engine whose chunks lie together says so per run.
    flush: bool = True


__all__ = ["TensorReady", "EncodedChunk"]
