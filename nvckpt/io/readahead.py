"""Bounded read-ahead: the ranges of a whole load fetched ahead of the decoding, in order.

On an object store every read is a request that waits on the network; a load
that fetched a group of chunks and then decoded it left the connection idle
while it decoded, and the CPU idle while it fetched.  ``ReadAhead`` keeps the
next ranges' requests in flight while the current ones decode:

- the caller's ranges (a run of chunks each, in file order) are grouped into
  spans: neighbours (``max_gap`` apart) share a span of up to ``piece`` bytes,
  so that many small tensors cost a few requests; a range larger than
  ``piece`` (one chunk that large) is a span of its own, fetched as
  concurrent ``piece``-sized GETs into a buffer of its own;
- a span of up to ``piece`` bytes is fetched into one of at most ``slots``
  buffers of ``piece`` bytes, kept and reused for the whole load: memory stays
  at ``slots * piece`` whatever the checkpoint's size (fresh buffers per
  request left the allocator's arenas holding several times that), and the
  requests in flight are bounded too;
- ``take(i)`` waits for range ``i`` and returns a view of its bytes;
  ``done(i)`` says the caller is through with it; a span whose ranges are all
  done frees its buffer for the next span to be sent.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable, Sequence

import numpy as np

from .ranges import Coalescing, coalesce


class _Span:
    __slots__ = ("start", "length", "left", "cost", "buffer", "slot", "futures")

    def __init__(self, start: int, length: int, left: int, cost: int) -> None:
        self.start, self.length, self.left, self.cost = start, length, left, cost
        self.buffer: Any = None
        self.slot = False
        self.futures: list[Future] = []


class ReadAhead:
    """``ranges`` (offset, length) fetched ahead through ``fetch_into(start, end, view)`` on ``pool`` (see the
    module docstring).  A context manager: leaving it cancels what was not sent and waits for what was
    (the fetches write into buffers it owns)."""

    def __init__(self, fetch_into: Callable[[int, int, memoryview], None], pool: Executor,
                 ranges: Sequence[tuple[int, int]], *, piece: int, slots: int, max_gap: int) -> None:
        self._fetch_into = fetch_into
        self._pool = pool
        self._piece = piece
        self._slots = max(1, slots)
        offsets = [o for o, _ in ranges]
        lengths = [n for _, n in ranges]
        reads = coalesce(offsets, lengths, Coalescing(max_gap=max_gap, max_span=piece, alone_from=piece + 1))
        self._spans = [_Span(r.start, r.length, r.stop - r.first, -(-r.length // piece)) for r in reads]
        self._where: list[tuple[int, int]] = [(0, 0)] * len(ranges)  # range -> (span, offset in it)
        for k, r in enumerate(reads):
            for i in r.members:
                self._where[i] = (k, offsets[i] - r.start)
        self._lengths = lengths
        self._free: list[np.ndarray] = []  # slot buffers not in use
        self._made = 0  # slot buffers allocated
        self._used = 0  # slots' worth of buffers held by spans sent and not yet done
        self._lock = threading.Lock()
        self._next = 0  # the next span to send
        self._closed = False
        self._send()

    def _send(self, upto: int = -1) -> None:
        """Send the next spans while their buffers fit in ``slots`` (at least one span, so one larger than
        them all still goes), and every span up to ``upto`` whatever they hold (a caller waits for it)."""
        with self._lock:
            while not self._closed and self._next < len(self._spans):
                span = self._spans[self._next]
                if self._next > upto and self._used and self._used + span.cost > self._slots:
                    return
                self._next += 1
                self._used += span.cost
                if span.length <= self._piece:
                    if self._free:
                        span.buffer = self._free.pop()
                    else:  # not zeroed: every byte of it a span uses is fetched into it first
                        span.buffer = np.empty(self._piece, dtype=np.uint8)
                        self._made += 1
                    span.slot = True
                    view = memoryview(span.buffer)[: span.length]
                    span.futures = [self._pool.submit(self._fetch_into, span.start, span.start + span.length, view)]
                    continue
                span.buffer = np.empty(span.length, dtype=np.uint8)  # one chunk larger than a piece: concurrent GETs
                view = memoryview(span.buffer)
                span.futures = [self._pool.submit(self._fetch_into, span.start + a,
                                                  span.start + min(a + self._piece, span.length),
                                                  view[a: min(a + self._piece, span.length)])
                                for a in range(0, span.length, self._piece)]

    def take(self, i: int) -> memoryview:
        """The bytes of range ``i`` (waits for its span; raises what its fetch raised), valid until ``done(i)``."""
        k, at = self._where[i]
        self._send(upto=k)  # sent already, unless earlier spans are still held (taken out of order)
        span = self._spans[k]
        for f in span.futures:
            f.result()
        return memoryview(span.buffer)[at: at + self._lengths[i]]

    def done(self, i: int) -> None:
        """The caller is through with range ``i``'s bytes: once its span's ranges all are, the span's buffer
        goes to the next span."""
        span = self._spans[self._where[i][0]]
        with self._lock:
            span.left -= 1
            if span.left:
                return
            self._used -= span.cost
            if span.slot and not self._closed:
                self._free.append(span.buffer)
            span.buffer, span.futures = None, []
        self._send()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            futures = [f for s in self._spans for f in s.futures]
        for f in futures:
            f.cancel()
        for f in futures:
            if not f.cancelled():
                try:
                    f.exception()
                except BaseException:  # noqa: BLE001 - a fetch's error is raised by take(), not here
                    pass
        for s in self._spans:
            s.buffer, s.futures = None, []
        self._free.clear()

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ReadAhead"]
