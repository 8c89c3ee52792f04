"""XXH3-64 of device bytes: device-to-host copies through two pinned pieces, hashed while the next copies."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import xxhash


def device_digest(backend: Any, flat: torch.Tensor, stream: Any, pieces: list[torch.Tensor], piece_bytes: int,
                  stop: Any = None) -> int:
    """XXH3-64 of the 1-D uint8 tensor ``flat``; ``pieces``: a list the caller keeps per thread (filled here
    with two host buffers of ``piece_bytes`` on first use).  ``stop`` (an Event) ends the hashing early."""
    if flat.device.type == "cpu":
        return xxhash.xxh3_64_intdigest(memoryview(flat.numpy()))
    if not pieces:
        pieces.extend(backend.host_buffer(piece_bytes) for _ in range(2))
    h = xxhash.xxh3_64()
    pending: deque = deque()

    def hash_oldest() -> None:
        event, buf, n = pending.popleft()
        backend.wait(event)
        h.update(memoryview(buf[:n].numpy()))

    for k, lo in enumerate(range(0, flat.numel(), piece_bytes)):
        part = flat[lo: lo + piece_bytes]
        buf = pieces[k % 2]
        pending.append((backend.to_host(part, buf, stream), buf, part.numel()))
        if len(pending) == 2:
            hash_oldest()
        if stop is not None and stop.is_set():
            break
    while pending:
        hash_oldest()
    return h.intdigest()


__all__ = ["device_digest"]
