"""Chunk policies (SPEC 12.1): how a tensor's raw bytes are cut into chunks.

A ``ChunkPolicy`` says, for a tensor's shape and element size, which byte
ranges its chunks are; a new policy is a class here, given to a save as its
``chunk_size``.  The default, ``RowChunks``: chunks hold whole rows of dim 0
where a row fits in the target size, so a row slice decodes only the chunks
holding its rows; a row larger than the target is cut into pieces.  The target
is the engine's own unless the caller names one: 1 MiB on the CPU (zstd's
sweet spot on 2 cores), 4 MiB on the GPU (nvCOMP ANS runs ~600 GB/s on 4 MiB
chunks, ~340 on 1 MiB).  Readers do not care how a file was cut: they read
byte ranges (SPEC 8.4).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

from ..format.constants import MAX_CHUNK_LENGTH

MiB = 1 << 20
CPU_CHUNK_SIZE = 1 * MiB
GPU_CHUNK_SIZE = 4 * MiB


def check_chunk_size(chunk_size: object) -> int:
    """``chunk_size`` if it is an int in 1..MAX_CHUNK_LENGTH (SPEC 16), else ValueError naming the range."""
    if type(chunk_size) is not int or not 1 <= chunk_size <= MAX_CHUNK_LENGTH:
        raise ValueError(f"chunk_size must be an integer in 1..{MAX_CHUNK_LENGTH}, got {chunk_size!r}")
    return chunk_size


@runtime_checkable
class ChunkPolicy(Protocol):
    """Where a tensor's chunks are.  Hashable and equal by value: a plan's layout keeps its cut per policy."""

    def ranges(self, shape: tuple[int, ...], itemsize: int) -> Sequence[tuple[int, int]]:
        """(byte start, byte length) of each chunk of a C-contiguous tensor, in order, covering its bytes
        exactly, each 1..MAX_CHUNK_LENGTH bytes (SPEC 16); none for an empty tensor."""
        ...


@dataclass(frozen=True)
class RowChunks:
    """Whole rows of dim 0 per chunk, about ``size`` raw bytes each (see the module docstring)."""

    size: int

    def __post_init__(self) -> None:
        check_chunk_size(self.size)

    def ranges(self, shape: tuple[int, ...], itemsize: int) -> Sequence[tuple[int, int]]:
        """As many whole rows of dim 0 per chunk as fit in ``size`` bytes; a row larger than ``size`` is cut into pieces."""
        return chunk_ranges(shape, itemsize, self.size)


def chunk_policy(value: Any) -> ChunkPolicy:
    """A save's ``chunk_size`` as a policy: an int is ``RowChunks(value)``; a ChunkPolicy is itself."""
    if isinstance(value, ChunkPolicy) and not isinstance(value, (int, type)):
        hash(value)  # TypeError for an unhashable policy: the layout cache keys on it
        return value
    return RowChunks(check_chunk_size(value))


def checked_ranges(policy: ChunkPolicy, shape: tuple[int, ...], itemsize: int) -> list[tuple[int, int]]:
    """``policy.ranges``, checked to tile the tensor's bytes as SPEC 8.4 requires (ValueError otherwise)."""
    ranges = list(policy.ranges(shape, itemsize))
    if isinstance(policy, RowChunks):
        return ranges  # correct by construction (tests/test_plan_layout.py)
    at = 0
    for start, length in ranges:
        if start != at or type(length) is not int or not 1 <= length <= MAX_CHUNK_LENGTH:
            raise ValueError(f"chunk policy {policy!r} cut a {list(shape)} tensor into ranges that do not tile its "
                             f"bytes in order with 1..{MAX_CHUNK_LENGTH} bytes each: {ranges[:4]}...")
        at += length
    if at != math.prod(shape) * itemsize:
        raise ValueError(f"chunk policy {policy!r} covered {at} of the {math.prod(shape) * itemsize} bytes of a "
                         f"{list(shape)} tensor")
    return ranges


def chunk_ranges(shape: tuple[int, ...], itemsize: int, chunk_size: int) -> list[tuple[int, int]]:
    """(byte start, byte length) of each chunk of a C-contiguous tensor."""
    shape = tuple(shape)
    if math.prod(shape) * itemsize > 64 * chunk_size:
        return list(_ranges.__wrapped__(shape, itemsize, chunk_size))  # long lists are not kept
    return list(_ranges(shape, itemsize, chunk_size))


# A model repeats its shapes (each layer's, again in its optimizer state): their short chunk lists are kept.
@functools.lru_cache(maxsize=4096)
def _ranges(shape: tuple[int, ...], itemsize: int, chunk_size: int) -> tuple[tuple[int, int], ...]:
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return ()
    row_bytes = nbytes // shape[0] if shape else nbytes
    step = max(itemsize, chunk_size - chunk_size % itemsize)
    if row_bytes <= step:
        per = (step // row_bytes) * row_bytes
        return tuple((s, min(per, nbytes - s)) for s in range(0, nbytes, per))
    out = []
    for row in range(0, nbytes, row_bytes):
        out.extend((row + s, min(step, row_bytes - s)) for s in range(0, row_bytes, step))
    return tuple(out)


__all__ = ["CPU_CHUNK_SIZE", "GPU_CHUNK_SIZE", "ChunkPolicy", "RowChunks", "chunk_policy", "check_chunk_size",
           "checked_ranges", "chunk_ranges"]
