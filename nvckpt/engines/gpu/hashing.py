"""XXH3-64 of device bytes: device-to-host copies through two pinned pieces, hashed while the next copies."""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any

import torch
import xxhash

from ...tensors.staging import is_flat_bytes, stage_parts


def device_digest(backend: Any, flat: torch.Tensor, stream: Any, pieces: list[torch.Tensor], piece_bytes: int,
                  stop: Any = None) -> int:
    """XXH3-64 of the bytes of ``flat``: a 1-D uint8 tensor, or a non-contiguous tensor (its C-order bytes,
    each piece staged on the device from views of it: no contiguous copy of the whole tensor); ``pieces``: a
    list the caller keeps per thread (filled here with two host buffers of ``piece_bytes`` on first use).
    ``stop`` (an Event) ends the hashing early."""
    strided = not is_flat_bytes(flat)
    if flat.device.type == "cpu" and not strided:
        return xxhash.xxh3_64_intdigest(memoryview(flat.numpy()))
    if not pieces:
        pieces.extend(backend.host_buffer(piece_bytes) for _ in range(2))
    h = xxhash.xxh3_64()
    pending: deque = deque()

    def hash_oldest() -> None:
        event, buf, n, _ = pending.popleft()
        backend.wait(event)
        h.update(memoryview(buf[:n].numpy()))

    size = flat.element_size()
    total = flat.numel() * size
    step = max(size, piece_bytes - piece_bytes % size) if strided else piece_bytes  # staged pieces: whole elements
    for k, lo in enumerate(range(0, total, step)):
        if strided:  # the piece's bytes staged on the stream the copy runs on (kept alive until it is hashed)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                (part, at, n), = stage_parts([(flat, lo, min(step, total - lo))], [0], 512, flat.device)
            part = part[at: at + n]
        else:
            part = flat[lo: lo + piece_bytes]
        buf = pieces[k % 2]
        pending.append((backend.to_host(part, buf, stream), buf, part.numel(), part))
        if len(pending) == 2:
            hash_oldest()
        if stop is not None and stop.is_set():
            break
    while pending:
        hash_oldest()
    return h.intdigest()


__all__ = ["device_digest"]
