"""Scheduling of the GPU engines, kept apart from CUDA so that CI tests it on CPU.

* ``plan_batches``: which chunks share one batched nvCOMP call (same codec,
  similar size, bounded output memory);
* ``copy_groups``: how an encoded batch's chunks are packed into pinned slots,
  and the device-to-host copies that move them;
* ``SlotPool``: a fixed set of host buffers handed out and returned, the
  bound on the pinned memory of a save or a load.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, NamedTuple, Sequence

import torch


class ChunkJob(NamedTuple):
    """One chunk to encode: bytes [start, start + length) of a tensor's raw bytes.  A tuple: a save makes
    thousands (a frozen dataclass costs ~4x the host time to make)."""

    tensor_id: int
    chunk_index: int
    start: int
    length: int
    key: Hashable  # chunks of one key can share a batched call (the codec pipeline)


@dataclass
class Batch:
    """Chunks of one key encoded by one call; every chunk gets ``capacity`` output bytes."""

    key: Hashable
    jobs: list[ChunkJob] = field(default_factory=list)
    capacity: int = 0

    @property
    def raw_bytes(self) -> int:
        return sum(j.length for j in self.jobs)

    @property
    def out_bytes(self) -> int:
        return self.capacity * len(self.jobs)


def size_class(length: int) -> int:
    """Chunks of one class differ by less than 4x in size, which bounds the output space a
    small chunk wastes in a batch (nvCOMP gives every entry the bound of the largest),
    while a tensor's tail chunk still usually shares the batch of other tails (each
    batched call has a fixed cost of ~0.4 ms)."""
    return max(0, length - 1).bit_length() // 2


def plan_batches(
    jobs: Iterable[ChunkJob],
    capacity: Callable[[Hashable, int], int],
    *,
    batch_bytes: int,
    max_chunks: int,
) -> list[Batch]:
    """Cut chunks into batches of one key and one size class, in first-come order.

    A batch closes when one more chunk would push its output (chunks x
    capacity of the largest) past ``batch_bytes`` or its count past
    ``max_chunks``.  Open batches are flushed at the end in the order they
    were opened, so a tensor's full-size chunks stay together in file order
    while its small tail joins the other small chunks of its codec.
    """
    if batch_bytes <= 0 or max_chunks <= 0:
        raise ValueError("batch_bytes and max_chunks must be positive")
    open_batches: dict[tuple[Hashable, int], Batch] = {}
    opened: list[Batch] = []  # every batch, in the order it was opened
    closed: list[Batch] = []
    for job in jobs:
        if job.length <= 0:
            raise ValueError(f"chunk {job.chunk_index} of tensor {job.tensor_id} is empty")
        cap = capacity(job.key, job.length)
        if cap < job.length:
            raise ValueError(f"capacity {cap} of a {job.length}-byte chunk is smaller than the chunk")
        if cap > batch_bytes:
            raise ValueError(f"a {job.length}-byte chunk needs {cap} output bytes, more than a batch of {batch_bytes}")
        group = (job.key, size_class(job.length))
        batch = open_batches.get(group)
        if batch is not None:
            grown = max(batch.capacity, cap)
            if (len(batch.jobs) + 1) * grown > batch_bytes or len(batch.jobs) >= max_chunks:
                closed.append(batch)
                batch = None
        if batch is None:
            batch = open_batches[group] = Batch(job.key)
            opened.append(batch)
        batch.jobs.append(job)
        batch.capacity = max(batch.capacity, cap)
    still_open = {id(b) for b in open_batches.values()}
    closed.extend(b for b in opened if id(b) in still_open)
    return closed


def first_use_order(batches: Sequence[Batch]) -> list[int]:
    """Tensor ids in the order their first chunk is written."""
    seen: dict[int, None] = {}
    for b in batches:
        for j in b.jobs:
            seen.setdefault(j.tensor_id, None)
    return list(seen)


COPY_GAP = 256 << 10  # unused output bytes after a chunk that one copy may carry rather than start another


@dataclass(frozen=True)
class SlotRun:
    """Chunks [first, stop) of an encoded batch that go into one pinned slot.

    Chunk i lands at ``offsets[i - first]`` of the slot.  ``copies`` are the
    device-to-host copies that move them: (first chunk, stop chunk, device offset,
    slot offset, bytes).  ``shares``: the run goes into the slot the previous
    batch's last run went into, after its bytes; else into a slot of its own."""

    first: int
    stop: int
    offsets: tuple[int, ...]
    copies: tuple[tuple[int, int, int, int, int], ...]
    shares: bool = False

    @property
    def used(self) -> int:
        """Where the run's bytes end in its slot."""
        return max(s + n for _, _, _, s, n in self.copies)


def copy_groups(capacity: int, lengths: Sequence[int], slot_bytes: int, *, start: int | None = None,
                max_gap: int | None = None) -> list[SlotRun]:
    """How a batch's chunks go into pinned slots: runs of chunks, each run in one slot, packed.

    Chunk i sits at i * capacity in device memory with ``lengths[i]`` bytes used.
    Chunks are packed one after another, so pinned memory and the copies hold
    the compressed bytes, not the codec's worst case (for nvCOMP ANS ~1.6x the
    raw chunk); consecutive chunks whose unused tail is at most ``max_gap``
    (default ``COPY_GAP``) share one copy (many small chunks cost one copy, not
    many).  ``start``: the bytes already used in the slot the previous batch
    ended in: the first run continues there when its first chunk fits
    (``shares``), so small batches do not take a slot each.
    """
    max_gap = COPY_GAP if max_gap is None else max_gap
    runs: list[SlotRun] = []
    shares = bool(lengths) and start is not None and start + lengths[0] <= slot_bytes
    first, pos = 0, start if shares else 0
    offsets: list[int] = []
    copies: list[list[int]] = []  # [first chunk, stop chunk, device offset, slot offset, bytes]
    for i, n in enumerate(lengths):
        if n > capacity or n > slot_bytes:
            raise ValueError(f"chunk {i} of {n} bytes does not fit a capacity of {capacity} / slot of {slot_bytes}")
        joins = (i > first and capacity - lengths[i - 1] <= max_gap
                 and copies[-1][3] + (i - copies[-1][0]) * capacity + n <= slot_bytes)
        if joins:
            at = copies[-1][3] + (i - copies[-1][0]) * capacity
        else:
            if i > first and pos + n > slot_bytes:  # this slot is full: the run ends before chunk i
                runs.append(SlotRun(first, i, tuple(offsets), tuple(map(tuple, copies)), shares and not runs))
                first, pos, offsets, copies = i, 0, [], []
            at = pos
            copies.append([i, i, i * capacity, at, 0])
        offsets.append(at)
        copies[-1][1] = i + 1
        copies[-1][4] = at + n - copies[-1][3]
        pos = at + n
    if lengths:
        runs.append(SlotRun(first, len(lengths), tuple(offsets), tuple(map(tuple, copies)), shares and not runs))
    return runs


class SlotPool:
    """``count`` host buffers of ``size`` bytes: take() one, give() it back (thread-safe).

    ``lazy``: a buffer is allocated when first needed, not up front (pinning
    memory costs ~0.4 s per GB, and the first reads need only a few)."""

    def __init__(self, count: int, size: int, allocate: Callable[[int], torch.Tensor], *, lazy: bool = False) -> None:
        if count < 1 or size < 1:
            raise ValueError("a SlotPool needs at least one slot of at least one byte")
        self.size = size
        self.count = count
        self._allocate = allocate
        self.slots = [] if lazy else [allocate(size) for _ in range(count)]
        self._free = list(range(len(self.slots)))
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free) + self.count - len(self.slots)

    def take(self) -> int | None:
        """A free slot's number, or None when none is free."""
        with self._lock:
            if not self._free and len(self.slots) < self.count:
                self.slots.append(self._allocate(self.size))
                return len(self.slots) - 1
            return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        with self._lock:
            if slot in self._free:
                raise RuntimeError(f"slot {slot} returned twice")
            self._free.append(slot)


def aligned_host_buffer(size: int, *, pin: bool, align: int = 4096) -> torch.Tensor:
    """A 1-D uint8 host tensor of ``size`` bytes whose address is a multiple of ``align``
    (pinned with ``pin``: page-locked for fast, asynchronous copies to and from a GPU)."""
    buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    if buf.data_ptr() % align == 0:
        return buf
    buf = torch.empty(size + align, dtype=torch.uint8, pin_memory=pin)
    skip = -buf.data_ptr() % align
    return buf[skip: skip + size]


__all__ = ["ChunkJob", "Batch", "size_class", "plan_batches", "first_use_order", "copy_groups", "SlotRun", "COPY_GAP",
           "SlotPool", "aligned_host_buffer"]
