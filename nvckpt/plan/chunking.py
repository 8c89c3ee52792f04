"""THE chunk policy (SPEC 12.1): how a tensor's raw bytes are cut into chunks.

Chunks hold whole rows of dim 0 where a row fits in the target size, so a row
slice decodes only the chunks holding its rows; a row larger than the target
is cut into pieces.  The target is the engine's own unless the caller names
one: 1 MiB on the CPU (zstd's sweet spot on 2 cores), 4 MiB on the GPU
(nvCOMP ANS runs ~600 GB/s on 4 MiB chunks, ~340 on 1 MiB).
"""

from __future__ import annotations

import functools
import math

from ..format.constants import MAX_CHUNK_LENGTH

MiB = 1 << 20
CPU_CHUNK_SIZE = 1 * MiB
GPU_CHUNK_SIZE = 4 * MiB


def check_chunk_size(chunk_size: object) -> int:
    if type(chunk_size) is not int or not 1 <= chunk_size <= MAX_CHUNK_LENGTH:
        raise ValueError(f"chunk_size must be an integer in 1..{MAX_CHUNK_LENGTH}, got {chunk_size!r}")
    return chunk_size


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


__all__ = ["CPU_CHUNK_SIZE", "GPU_CHUNK_SIZE", "check_chunk_size", "chunk_ranges"]
