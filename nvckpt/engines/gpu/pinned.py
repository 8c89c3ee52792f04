"""Page-locked host buffers kept across saves and loads: pinning costs ~0.4 s per GB, so it is paid once.

``PINNED`` is the process's cache (state, not a setting): pools take slots from
it and give them back when a save or load ends; ``release()``
(``nvckpt.release_pinned_memory()``) frees what is not in use.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch


class PinnedCache:
    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.in_use = 0  # bytes handed out and not yet given back

    def take(self, size: int, allocate: Callable[[int], torch.Tensor]) -> torch.Tensor:
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            self.in_use += size
        if buf is None:
            try:
                buf = allocate(size)
            except BaseException:
                with self._lock:
                    self.in_use -= size
                raise
        return buf

    def give(self, buffers: list[torch.Tensor]) -> None:
        """Buffers handed out by ``take`` back to the cache."""
        with self._lock:
            self.in_use -= sum(buf.numel() for buf in buffers)
            self._add(buffers)

    def keep(self, buffers: list[torch.Tensor]) -> None:
        """Add new buffers to the cache (not handed out before)."""
        with self._lock:
            self._add(buffers)

    def _add(self, buffers: list[torch.Tensor]) -> None:  # under the lock
        for buf in buffers:
            self._free.setdefault(buf.numel(), []).append(buf)

    def cached_of(self, size: int) -> int:
        """Buffers of ``size`` bytes kept for the next save or load."""
        with self._lock:
            return len(self._free.get(size, ()))

    @property
    def cached(self) -> int:
        """Bytes kept for the next save or load."""
        with self._lock:
            return sum(b.numel() for bufs in self._free.values() for b in bufs)

    def release(self) -> int:
        """Free every cached buffer (torch's own pinned-memory cache too); returns the bytes let go."""
        with self._lock:
            freed = sum(b.numel() for bufs in self._free.values() for b in bufs)
            self._free.clear()
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None and torch.cuda.is_available():
            empty()
        return freed


PINNED = PinnedCache()


def release_pinned_memory() -> int:
    """Free the page-locked host memory nvckpt keeps between saves and loads; returns the bytes freed."""
    return PINNED.release()


def reserve_pinned_memory(nbytes: int, *, slot_bytes: int | None = None) -> int:
    """Pin ``nbytes`` of host memory now, in the slots an async_save on the GPU engine holds its compressed
    chunks in, so that the first async_save of the process does not pin them while the caller waits
    (~0.4 s per GB; later saves reuse them anyway).  About the size of one checkpoint file is enough;
    buffers already kept count towards it.  Returns the bytes nvckpt keeps pinned in such slots.
    ``slot_bytes``: that of the GpuSaveOptions the saves use, when not the default.
    ``nvckpt.release_pinned_memory()`` frees them."""
    from ...options import GpuSaveOptions
    from .batching import aligned_host_buffer

    size = GpuSaveOptions.slot_bytes if slot_bytes is None else int(slot_bytes)
    if size <= 0 or nbytes < 0:
        raise ValueError(f"reserve_pinned_memory needs nbytes >= 0 and slot_bytes > 0, got {nbytes} and {size}")
    want = -(-int(nbytes) // size)
    missing = want - PINNED.cached_of(size)
    if missing > 0:
        if not torch.cuda.is_available():
            raise RuntimeError("reserve_pinned_memory needs CUDA: page-locked memory is for copies from a GPU")
        PINNED.keep([aligned_host_buffer(size, pin=True) for _ in range(missing)])
    return PINNED.cached_of(size) * size


def cached_allocator(allocate: Callable[[int], Any]) -> Callable[[int], Any]:
    return lambda size: PINNED.take(size, allocate)


__all__ = ["PINNED", "PinnedCache", "release_pinned_memory", "reserve_pinned_memory", "cached_allocator"]
