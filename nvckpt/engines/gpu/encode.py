"""The GPU engine: a save's chunks compressed on the GPU with nvCOMP, in a pipeline.

Stages, all overlapping:

1. encode: chunks are grouped into batches (``batching.plan_batches``: one
   codec, similar sizes, output of at most ``batch_bytes``; the next save of
   the same state reuses the plan), each encoded by one batched nvCOMP call
   on the engine's compute stream (given byte ranges of the sources, not a
   tensor view per chunk), up to ``inflight`` batches ahead of the writer;
2. copy out: an encoded batch goes to pinned host memory in runs of chunks
   (``batching.copy_groups``), packed (the compressed bytes, not nvCOMP's
   worst-case bound per chunk), by device-to-host copies on a copy stream,
   into a fixed pool of pinned slots (``pinned_slots`` x ``slot_bytes``);
3. hand over: the generator yields each chunk as a memoryview of its slot with
   its XXH3-64 (computed by a small thread pool, a few tasks per run; xxhash releases the GIL) and
   a ``release`` callback; the writer (ContainerWriter -> FileSink, whose I/O
   threads write with O_DIRECT) copies it out and calls release, which frees
   the slot once all its chunks are written.  No free slot: the generator
   waits for the writer, so a slow disk slows encoding instead of growing memory.

Beside them, when the save wants tensor checksums, ``checksum_workers``
threads compute the XXH3-64 of every tensor's raw bytes (device-to-host copies
through two pinned pieces of ``piece_bytes`` each; a non-contiguous tensor's
pieces are staged on the device first, as its chunks are for the encode: no
path copies a whole tensor) in the order the tensors are first written.

Memory beyond the caller's tensors: GPU about (inflight + 1) x (batch_bytes of
output + batch_bytes of scratch for the byte-plane split or staged inputs; staged
inputs that are small beside the budget are set aside as a whole instead),
plus two slots for packing runs before their copy out (``gather_bytes``);
pinned host memory pinned_slots x slot_bytes + checksum_workers x 2 x
piece_bytes (384 MiB by default; torch keeps freed pinned blocks for the next
save).  Never proportional to the checkpoint.  The knobs are
``nvckpt.GpuSaveOptions``.  On the H200 (benchmarks/results/bench_h200.md) a
7.2 GB state saves at the disk's O_DIRECT speed: the GPU encodes it in ~36 ms
of GPU time.

Codecs (nvckpt.codecs.presets): "auto"/"ans" -> nvcomp-ans with the data-type
mode of each dtype; raw where a chunk would not shrink.  "portable" is not
encoded here: a save with it goes to the CPU engine whatever device holds the
tensors (nvckpt.codecs.planes codes it with libzstd), so a portable file is the
same bytes whichever engine would have written it; nvCOMP's zstd writes other
(valid) frames than libzstd and has no literals-only mode.  Pipelines given
explicitly with byteshuffle+zstd still run here, through nvCOMP Zstd.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..._fork import Lock
from ..._signals import leave_to_main_thread
from ..._threads import WorkerPool
from ...codecs.base import Pipeline
from ...codecs.registry import RAW
from ...format.structs import xxh3
from ...options import GpuSaveOptions, default_memory_budget, default_pinned_limit
from ...plan.walk import PlannedTensor, SavePlan
from ..items import EncodedChunk, TensorReady
from .backend import GATHER_BUFFERS, STAGE_ALIGN, Backend, Encoded
from .batching import Batch, ChunkJob, SlotPool, SlotRun, copy_groups, first_use_order, plan_batches
from .hashing import device_digest
from .memory import DEVICE_MEMORY
from .pinned import PINNED, cached_allocator


# -- tensor checksums ------------------------------------------------------------------------
class TensorChecksums:
    """XXH3-64 of whole tensors, computed by ``workers`` threads in the order the writer needs them.

    Each worker takes the next tensor of the list and hashes it alone (the
    hash of one tensor is sequential), through its own two pinned pieces."""

    def __init__(self, dev: Backend, tensors: list[PlannedTensor], ready: Any, piece_bytes: int, workers: int = 1) -> None:
        self.dev = dev
        self.tensors = tensors
        self.ready = ready
        self.piece_bytes = piece_bytes
        self.results: dict[int, int] = {}
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self._cond = threading.Condition()
        self._next = 0
        self.seconds = 0.0
        self.waited = 0.0  # time the writer waited for a checksum
        self._started = time.perf_counter()
        self._threads = [threading.Thread(target=self._run, name="nvckpt-tensor-checksums", daemon=True)
                         for _ in range(max(1, min(workers, len(tensors))))]
        for th in self._threads:
            th.start()

    def _take(self) -> PlannedTensor | None:
        with self._cond:
            if self._next >= len(self.tensors) or self.stop.is_set() or self.error is not None:
                return None
            self._next += 1
            return self.tensors[self._next - 1]

    def _run(self) -> None:
        leave_to_main_thread()
        try:
            stream = self.dev.side_stream(self.ready)
            pieces: list[torch.Tensor] = []
            while (t := self._take()) is not None:
                with torch.no_grad():
                    value = self._digest(t, stream, pieces)
                with self._cond:
                    self.results[t.tensor_id] = value
                    self._cond.notify_all()
        except BaseException as exc:  # reported to the writer's thread by get()
            with self._cond:
                self.error = exc
                self._cond.notify_all()
        finally:
            self.seconds = max(self.seconds, time.perf_counter() - self._started)

    def _digest(self, t: PlannedTensor, stream: Any, pieces: list[torch.Tensor]) -> int:
        # Flat bytes, or a non-contiguous tensor that device_digest stages a piece at a time (no whole copy).
        return device_digest(self.dev, self.dev.source(t.data), stream, pieces, self.piece_bytes, self.stop)

    def get(self, tensor_id: int) -> int:
        start = time.perf_counter()
        with self._cond:
            while tensor_id not in self.results and self.error is None and any(th.is_alive() for th in self._threads):
                self._cond.wait(0.5)
            self.waited += time.perf_counter() - start
            if tensor_id in self.results:
                return self.results[tensor_id]
            if self.error is not None:
                raise self.error
            raise RuntimeError(f"no checksum was computed for tensor {tensor_id}")

    def wait_all(self) -> None:
        """Until every tensor is hashed (raises what a worker raised)."""
        for th in self._threads:
            th.join()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.stop.set()
        for th in self._threads:
            th.join()


# -- the pipeline ---------------------------------------------------------------------------
@dataclass
class _Group:
    """A run of an encoded batch's chunks (``batching.SlotRun``) on its way through one pinned slot.

    ``enc`` keeps the batch's device buffers alive until the copy into the slot is done
    (``detach``); the group then needs only host-side facts about its chunks."""

    enc: Encoded | None
    run: SlotRun
    slot: int
    view: Any  # numpy view of the slot
    raw: set[int]
    event: Any
    hashes: "_Digests | None" = None
    slots: "_Slots | None" = field(default=None, repr=False)
    lengths: list[int] = field(default_factory=list)
    jobs: list[ChunkJob] = field(default_factory=list)
    pipeline: Pipeline | None = None

    def __post_init__(self) -> None:
        self.jobs, self.pipeline = self.enc.batch.jobs, self.enc.batch.key

    @property
    def first(self) -> int:
        return self.run.first

    @property
    def stop(self) -> int:
        return self.run.stop

    def detach(self, dev: Backend) -> None:
        """Wait for the copy into the slot, then let the batch's device memory go."""
        if self.enc is not None:
            dev.wait(self.event)
            self.enc = None

    def release_one(self) -> None:
        self.slots.release(self.slot)

    def payload(self, i: int) -> memoryview:
        at = self.run.offsets[i - self.run.first]
        return memoryview(self.view[at: at + self.lengths[i]])


class _Slots:
    """The pool's slots as runs fill them: a slot goes back to the pool once every chunk in it is written
    and no later run can go into it any more (the slot the last run went into stays open)."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.views: dict[int, Any] = {}
        self.refs: dict[int, int] = {}  # chunks not yet released, +1 for the open slot
        self.open: int | None = None
        self.fill = 0  # bytes used in the open slot
        self._lock = threading.Lock()

    def place(self, run: SlotRun) -> int | None:
        """The slot ``run`` goes into (the open one, or a new one: None when none is free)."""
        if run.shares:
            slot = self.open
        else:
            self.close_open()  # no later run goes into it (with one slot, the writer must be able to free it)
            slot = self.pool.take()
            if slot is None:
                return None
            if slot not in self.views:
                self.views[slot] = self.pool.slots[slot].numpy()
            with self._lock:
                self.refs[slot] = 1
            self.open = slot
        with self._lock:
            self.refs[slot] += run.stop - run.first
        self.fill = run.used
        return slot

    def start(self) -> int | None:
        """Where the next batch's first run may continue (``copy_groups(start=)``)."""
        return None if self.open is None else self.fill

    def close_open(self) -> None:
        if self.open is not None:
            slot, self.open = self.open, None
            self.release(slot)

    def release(self, slot: int) -> None:
        with self._lock:
            self.refs[slot] -= 1
            done = self.refs[slot] == 0
            if done:
                del self.refs[slot]
        if done:
            self.pool.give(slot)


class _Digests:
    """The XXH3-64 of a group's chunks, computed by a few tasks of consecutive chunks, about equal in bytes (one
    per hash worker): a task per chunk cost a future, a queue hand-off and a wake-up each, thousands per save,
    each taking the GIL from the training loop's thread while the save's writer runs."""

    def __init__(self, pool: WorkerPool, work: list[tuple[Callable[[memoryview], int], memoryview]],
                 parts: int) -> None:
        total = sum(p.nbytes for _, p in work) or 1
        cuts, acc, start = [], 0, 0
        for k, (_, p) in enumerate(work):
            acc += p.nbytes
            if len(cuts) + 1 < parts and acc * parts >= total * (len(cuts) + 1) and k + 1 < len(work):
                cuts.append((start, k + 1))
                start = k + 1
        cuts.append((start, len(work)))
        self._futures = deque(pool.submit(_digest_all, work[a:b]) for a, b in cuts)
        self._done: list[int] = []

    def get(self, k: int) -> int:
        """The checksum of the group's k-th chunk (waits for its task)."""
        while k >= len(self._done):
            self._done.extend(self._futures.popleft().result())
        return self._done[k]


def _digest_all(work: list[tuple[Callable[[memoryview], int], memoryview]]) -> list[int]:
    return [digest(payload) for digest, payload in work]


def _checked(pipeline: Pipeline) -> Callable[[memoryview], int]:
    """XXH3-64 of a chunk the device wrote, after the codec's check of stored bytes (zstd: SPEC 11.4's window
    bound): a file nvckpt writes must be one that every reader (and nvckpt itself) accepts."""
    def digest(payload: memoryview) -> int:
        try:
            pipeline.check_stored(payload)
        except ValueError as exc:
            raise RuntimeError(f"nvCOMP wrote a {pipeline.describe()} chunk that the format does not allow: "
                               f"{exc}") from None
        return xxh3(payload)

    return digest


def encode_batches(plan: SavePlan, choose: Callable[[str], Pipeline], dev: Backend, options: GpuSaveOptions, *,
                   tensor_checksums: bool = True, ready: Any = None, stats: dict[str, Any] | None = None,
                   read_ahead: threading.Event | None = None) -> Iterator[TensorReady | EncodedChunk]:
    """Items for the frame writer: every tensor's TensorReady, then its chunks, encoded on ``dev``.

    ``choose(dtype name)`` is the pipeline of a tensor; ``ready``: an event the
    engine's streams wait for (the caller's work, or a snapshot's copies);
    ``stats`` is filled with what the run measured.  ``read_ahead`` (async_save):
    encode and copy out every chunk into pinned host memory before handing any
    to the writer (as far as ``pinned_limit`` allows), then set the event: from
    then on nothing reads the caller's tensors."""
    # Runs in the calling thread up to the first next(): order after that thread's stream now.
    dev.wait_for_caller(ready)
    return _pipeline(plan, choose, dev, options, tensor_checksums, ready, {} if stats is None else stats, read_ahead)


def batch_bytes_for(options: GpuSaveOptions, dev: Backend, *, scratch: bool = True, staged: int = 0) -> tuple[int, int]:
    """(batch_bytes, budget): batches shrunk so that the engine's device memory stays within the budget.

    Per batch alive the engine holds its output (batch_bytes), nvCOMP's own temporary memory (measured
    on the H200: up to about half a batch) and, with ``scratch``, as much again for byte planes (nvCOMP
    zstd after a byte-plane split) or inputs staged from another device; inflight + 1 batches are
    alive at once, beside two slots for packing copies (``gather_bytes``).  ``staged``: without
    ``scratch``, the device bytes that staging the chunks of tensors elsewhere takes (``staged_bytes``):
    each chunk is staged in one batch, so the batches alive never hold more than that; where it is
    small beside the room (a lazy save's few MB of small copies in host memory) it is set aside and
    the batches keep their size, else every batch reserves scratch."""
    batch_bytes, budget, _, _ = _batch_plan(options, dev, scratch, staged)
    return batch_bytes, budget


def save_budget(options: GpuSaveOptions, dev: Backend) -> int:
    """The device memory nvckpt may hold on ``dev``: GpuSaveOptions.memory_budget, else the default share."""
    return options.memory_budget or default_memory_budget(dev.memory_total())


def _batch_plan(options: GpuSaveOptions, dev: Backend, scratch: bool, staged: int,
                budget: int | None = None) -> tuple[int, int, bool, int]:
    """batch_bytes_for's (batch_bytes, budget), and what it decided: scratch per batch, and the staged bytes set
    aside as a whole (0 where none are, or where they are too many and every batch reserves scratch instead).
    ``budget``: the memory this engine was granted (DEVICE_MEMORY), when less than the save's budget."""
    budget = budget or save_budget(options, dev)
    room = budget - gather_bytes(options, budget)
    if not scratch and staged:
        if staged * _STAGED_SHARE <= room:
            room -= staged
        else:
            scratch, staged = True, 0
    return min(options.batch_bytes, room * 2 // (_halves(scratch) * (options.inflight + 1))), budget, scratch, staged


# Staged inputs up to 1/8 of the engine's room are set aside as a whole; more, and every batch reserves scratch.
_STAGED_SHARE = 8


def staged_bytes(tensors: list[PlannedTensor], dev: Backend) -> int:
    """Device bytes the staging of ``tensors``' chunks takes at most: those of tensors on another device or
    not contiguous, each at a STAGE_ALIGN-aligned offset of its batch's staging buffer (stage_parts)."""
    return sum(n + STAGE_ALIGN for t in tensors if t.data.device != dev.device or not t.data.is_contiguous()
               for _, n in t.chunks)


def _halves(scratch: bool) -> int:
    """Device memory per batch alive, in halves of its output: output, nvCOMP's temporary, scratch."""
    return 5 if scratch else 3


def gather_bytes(options: GpuSaveOptions, budget: int) -> int:
    """Device memory that packs runs of compressed chunks before their one copy each to the host: two slots'
    worth (one packed while the other is copied), when the budget has room for sixteen (else each chunk
    is copied by itself)."""
    return GATHER_BUFFERS * options.slot_bytes if budget >= 8 * GATHER_BUFFERS * options.slot_bytes else 0


# The batch plans of the last few saves, by what decides them (backend, batch size, each tensor's codec and
# chunks): a training job saves the same state again and again, and planning its thousands of chunks costs
# milliseconds of host time that an async_save's caller would wait for.
_PLANS: "OrderedDict[tuple, tuple[list[Batch], dict[int, int]]]" = OrderedDict()
_PLANS_KEPT = 4
_PLANS_LOCK = Lock()  # a forked child gets it unlocked (nvckpt._fork)


# A copy group's chunk frames go to the file in one write (EncodedChunk.flush): the writer's thread then
# takes the GIL about once per group instead of a few times per chunk, and each time it does, a training
# loop's thread waits (probe_slowdown_h200.md: a quarter of the chunks cut the step's slowdown while
# saving from +3.6 to +1.0 %).  False writes each frame at once (probe_slowdown's A/B).
RUN_WRITES = True


def _cached_plan(key: tuple, make: Callable[[], tuple[list[Batch], dict[int, int]]]) -> tuple[list[Batch], dict[int, int]]:
    """The batches (never changed once made) of ``key``'s save, made by ``make()`` unless one of the last saves had them."""
    with _PLANS_LOCK:
        hit = _PLANS.get(key)
        if hit is not None:
            _PLANS.move_to_end(key)
            return hit
    made = make()
    with _PLANS_LOCK:
        _PLANS[key] = made
        while len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    return made


def _pipeline(plan: SavePlan, choose: Callable[[str], Pipeline], dev: Backend, options: GpuSaveOptions,
              tensor_checksums: bool, ready: Any, stats: dict[str, Any],
              read_ahead: threading.Event | None) -> Iterator[TensorReady | EncodedChunk]:
    stored = [t for t in plan.tensors if t.data is not None and t.chunks]
    # Scratch per batch for byte planes; chunks staged from another device or a non-contiguous tensor take
    # what they need (set aside as a whole where that is small, else scratch per batch too).
    scratch = any((op := choose(dtype).device_op()) is not None and op.planes
                  for dtype in {t.entry["dtype"] for t in stored})
    staged = 0 if scratch else staged_bytes(stored, dev)
    # The engine's memory comes from the process's account, which other saves (and this save's own snapshot)
    # draw from too: it may get less than the budget (its batches shrink), or wait for others to give some back.
    grant = None
    lease = dev.lease()  # the engine's buffers, from nvCOMP's probe of its bound (capacity) on
    try:
        if stored:
            full = save_budget(options, dev)
            lengths = {(t.entry["dtype"], n) for t in stored for _, n in t.chunks}
            biggest = max(dev.capacity(choose(d), n) for d, n in lengths)
            need = _halves(scratch) * (options.inflight + 1) * biggest // 2 + gather_bytes(options, full) + staged
            if need > full or biggest > options.slot_bytes:
                need = 0  # no room for one chunk even alone: planning says what to change
            grant = DEVICE_MEMORY.take_work(dev.device, full, need, full, owner=plan)
        yield from _granted(plan, choose, dev, options, tensor_checksums, ready, stats, read_ahead,
                            scratch, staged, grant, lease)
    finally:
        lease.end()  # every batch of this save is done with (on success, failure or close): to the device,
        if grant is not None:  # then to the account
            grant.release()


def _granted(plan: SavePlan, choose: Callable[[str], Pipeline], dev: Backend, options: GpuSaveOptions,
             tensor_checksums: bool, ready: Any, stats: dict[str, Any], read_ahead: threading.Event | None,
             scratch: bool, staged: int, grant: Any, lease: Any) -> Iterator[TensorReady | EncodedChunk]:
    started = time.perf_counter()
    inflight, slot_bytes = options.inflight, options.slot_bytes
    batch_bytes, budget, scratch, staged = _batch_plan(options, dev, scratch, staged,
                                                       grant.nbytes if grant is not None else None)
    gather = gather_bytes(options, budget) > 0
    stats.update(engine=type(dev).__name__, memory_budget=budget, batch_bytes=batch_bytes, gather=gather,
                 staged_bytes=staged)
    left: dict[int, int] = {}  # chunks left per tensor: its flat bytes are dropped after the last one is encoded
    by_id = {t.tensor_id: t for t in plan.tensors}
    counts = {"batches": 0, "chunks": 0}

    memo: dict[tuple[int, int], int] = {}

    def capacity(key: Pipeline, length: int) -> int:
        # Asked twice per chunk (thousands per save); the pipelines are alive here, so id() is a cheap key.
        k = (id(key), length)
        cap = memo.get(k)
        if cap is None:
            cap = memo[k] = dev.capacity(key, length)
        return cap

    def plan_some(tensors: list[PlannedTensor]) -> list[Batch]:
        tensors = [t for t in tensors if t.data is not None and t.chunks]
        dtypes = {t.entry["dtype"] for t in tensors}
        key = (type(dev), dev.device, batch_bytes, options.max_batch_chunks,
               tuple(sorted((d, choose(d)) for d in dtypes)),  # compared once per dtype, not once per tensor
               tuple((t.tensor_id, t.entry["dtype"], tuple(t.chunks)) for t in tensors))
        planned, per_tensor = _cached_plan(key, lambda: _plan(tensors))
        for b in planned:
            if b.capacity > slot_bytes:
                raise ValueError(f"GpuSaveOptions.slot_bytes ({slot_bytes}) is smaller than one chunk's output capacity ({b.capacity})")
        for tid, n in per_tensor.items():
            left[tid] = left.get(tid, 0) + n
        counts["batches"] += len(planned)
        counts["chunks"] += sum(per_tensor.values())
        return planned

    def _plan(tensors: list[PlannedTensor]) -> tuple[list[Batch], dict[int, int]]:
        jobs: list[ChunkJob] = []
        per_tensor: dict[int, int] = {}
        for t in tensors:
            p = choose(t.entry["dtype"])
            jobs.extend(ChunkJob(t.tensor_id, i, s, n, p) for i, (s, n) in enumerate(t.chunks))
            per_tensor[t.tensor_id] = len(t.chunks)
        biggest = max((capacity(j.key, j.length) for j in jobs), default=0)
        if biggest > batch_bytes:
            raise ValueError(f"GpuSaveOptions.memory_budget {budget} is too small for this save: one chunk needs "
                             f"{biggest} bytes of output, so the budget must be at least "
                             f"{_halves(scratch) * (inflight + 1) * biggest // 2 + gather_bytes(options, budget) + staged} "
                             "(or use smaller chunks, or fewer batches in flight)")
        return plan_batches(jobs, capacity, batch_bytes=batch_bytes, max_chunks=options.max_batch_chunks), per_tensor

    # Tensors whose storage is not decided yet (derived-tensor candidates, plan_save(defer=True)) come
    # last: every other tensor is read while the candidates are verified (in the caller's thread).
    later = plan.undecided
    if later and tensor_checksums:
        dev.ordered(plan.decide)  # the checksum threads hash a fixed list of tensors: decide first
        later = set()
    batches = plan_some([t for t in plan.tensors if t.tensor_id not in later])
    order = [by_id[tid] for tid in first_use_order(batches)]

    checks = (TensorChecksums(dev, order, ready, options.piece_bytes, options.checksum_workers)
              if tensor_checksums and order else None)
    hasher = WorkerPool(options.hash_workers, "nvckpt-chunk-xxh3")  # nvckpt's own: an async save may run at exit
    pool: SlotPool | None = None
    announced: set[int] = set()
    sources: dict[int, torch.Tensor] = {}
    waits = {"encode": 0.0, "copy_out": 0.0, "chunk_xxh3": 0.0, "writer": 0.0}  # where the generator's time went
    raw_bytes = stored = nraw = 0
    todo = deque(batches)
    encoded: deque[Encoded] = deque()
    copied: deque[_Group] = deque()
    enc: Encoded | None = None
    try:
        def chunkless(tensors: list[PlannedTensor]) -> Iterator[TensorReady]:
            for t in tensors:
                if not (t.data is not None and t.chunks):
                    checksum = None
                    if t.data is not None and tensor_checksums:
                        checksum = xxh3(b"")
                    announced.add(t.tensor_id)
                    yield TensorReady(t.tensor_id, checksum)

        def settle() -> list[PlannedTensor]:
            """Wait for the candidates' verification (or run it); their batches go last.  Returns them."""
            nonlocal later
            if not later:
                return []
            t0 = time.perf_counter()
            dev.ordered(plan.decide)  # no-op once the caller's thread has decided; else run here, in order
            waits["decided"] = time.perf_counter() - t0
            tensors = [by_id[tid] for tid in sorted(later)]
            later = set()
            todo.extend(plan_some(tensors))
            return tensors

        # Tensors without chunks (views, derived, empty) first: a truncated file still has them.
        yield from chunkless([t for t in plan.tensors if t.tensor_id not in later])
        if not todo and later:
            yield from chunkless(settle())
        if not todo:
            return
        stats["setup_seconds"] = time.perf_counter() - started
        if read_ahead is not None:  # room for the whole compressed state, as far as the limit allows
            count = max(options.pinned_slots, (options.pinned_limit or default_pinned_limit()) // slot_bytes)
            pool = SlotPool(count, slot_bytes, cached_allocator(dev.host_buffer), lazy=True)
        else:
            pool = SlotPool(options.pinned_slots, slot_bytes, cached_allocator(dev.host_buffer))
        slots = _Slots(pool)
        cursor: list[Any] = [None, None]  # [groups of encoded[0], index of the next group]

        def submit() -> None:
            # Batches alive on the device: those not yet copied out, and those whose copy is still running.
            holding = [g for g in copied if g.enc is not None]
            while holding and len(encoded) + len({id(g.enc) for g in holding}) > inflight:
                holding.pop(0).detach(dev)
                holding = [g for g in holding if g.enc is not None]
            b = todo.popleft()
            for j in b.jobs:
                if j.tensor_id not in sources:
                    sources[j.tensor_id] = dev.source(by_id[j.tensor_id].data)
            encoded.append(dev.encode(b, sources))
            for j in b.jobs:  # the batch holds views of what it needs
                left[j.tensor_id] -= 1
                if left[j.tensor_id] == 0:
                    del sources[j.tensor_id]

        def start_hashing(g: _Group) -> None:
            if g.hashes is None:
                t0 = time.perf_counter()
                dev.wait(g.event)
                waits["copy_out"] += time.perf_counter() - t0
                digest = _checked(g.pipeline) if g.pipeline.checks_stored else xxh3
                g.hashes = _Digests(hasher, [(digest if i not in g.raw else xxh3, g.payload(i))
                                             for i in range(g.first, g.stop)], options.hash_workers)

        while True:
            if later and not todo:
                yield from chunkless(settle())
            while todo and len(encoded) < inflight:
                submit()
            # Copy out the oldest encoded batch while pinned slots are free.
            while encoded:
                enc = encoded[0]
                if cursor[0] is None:
                    t0 = time.perf_counter()
                    # Wait through torch, which lets go of the GIL (nvCOMP's own wait for the sizes does
                    # not): the caller's thread runs meanwhile (a training step, derived-tensor checks).
                    dev.wait(enc.event)
                    sizes = enc.sizes()
                    waits["encode"] += time.perf_counter() - t0
                    raws = [i for i, (n, j) in enumerate(zip(sizes, enc.batch.jobs)) if n >= j.length]
                    lengths = [j.length if n >= j.length else n for n, j in zip(sizes, enc.batch.jobs)]
                    runs = copy_groups(enc.capacity, lengths, slot_bytes, start=slots.start())
                    cursor[:] = [(runs, lengths, set(raws)), 0]
                groups, lengths, raws = cursor[0]
                run = groups[cursor[1]]
                slot = slots.place(run)
                if slot is None:
                    break  # no free slot: the writer must release some first
                raw_here = sorted(i for i in raws if run.first <= i < run.stop)
                event = dev.copy_out(enc, run, raw_here, pool.slots[slot], gather)
                copied.append(_Group(enc, run, slot, slots.views[slot], set(raw_here), event,
                                     slots=slots, lengths=lengths))
                cursor[1] += 1
                if cursor[1] == len(groups):
                    encoded.popleft()
                    cursor[:] = [None, None]
                    if todo:
                        submit()  # keep the GPU ahead of the copies
            if not encoded and not todo and not later:
                slots.close_open()  # nothing more goes into it: its chunks' releases free it
            if not copied:
                if not encoded and not todo and not later:
                    break
                if not pool.free:
                    raise RuntimeError("every pinned slot is held but none is being written")
                continue
            for g in copied:
                if g.enc is not None and dev.ready(g.event):
                    g.detach(dev)
            if read_ahead is not None and not read_ahead.is_set():
                if (todo or encoded or later) and pool.free:
                    continue  # read every tensor before writing anything
                if not todo and not encoded and not later:
                    t0 = time.perf_counter()
                    # Every encode is done (it read the caller's tensors); copies of compressed chunks read
                    # the engine's own buffers and may go on after the caller is released, but chunks stored
                    # raw are copied out of the caller's tensors themselves: wait for those.
                    for g in copied:
                        if g.raw:
                            dev.wait(g.event)
                    if checks is not None:
                        checks.wait_all()
                    stats["tensors_read_seconds"] = time.perf_counter() - started
                    waits["copy_out"] += time.perf_counter() - t0
                    read_ahead.set()
                    # Nothing is left on the device once the copies out are done: its memory goes back to
                    # the account then, not once the disk has the file (the next save may want it meanwhile).
                    for g in copied:
                        g.detach(dev)
                    enc = None  # the last batch's buffers
                    dev.finish()
                    lease.end()
                    if grant is not None:
                        grant.release()
            if later:  # the writer gets a chunk: every tensor's storage must be known by then
                yield from chunkless(settle())
            group = copied.popleft()
            start_hashing(group)
            group.detach(dev)
            if copied and dev.ready(copied[0].event):
                start_hashing(copied[0])  # overlap the next group's checksums with this group's writes
            for k, i in enumerate(range(group.first, group.stop)):
                job = group.jobs[i]
                if job.tensor_id not in announced:
                    announced.add(job.tensor_id)
                    yield TensorReady(job.tensor_id, checks.get(job.tensor_id) if checks else None)
                payload = group.payload(i)
                is_raw = i in group.raw
                raw_bytes += job.length
                stored += payload.nbytes
                nraw += is_raw
                t0 = time.perf_counter()
                checksum = group.hashes.get(k)
                t1 = time.perf_counter()
                waits["chunk_xxh3"] += t1 - t0
                yield EncodedChunk(job.tensor_id, job.chunk_index, RAW if is_raw else group.pipeline, payload,
                                   job.length, checksum, group.release_one,
                                   flush=not RUN_WRITES or i == group.stop - 1)
                waits["writer"] += time.perf_counter() - t1  # the writer copying it out (and waiting for the disk)
        stats.update(batches=counts["batches"], chunks=counts["chunks"], raw_chunks=nraw, raw_bytes=raw_bytes,
                     stored_bytes=stored)
    finally:
        if checks is not None:
            checks.close()
            stats["tensor_checksum_seconds"] = checks.seconds
            waits["tensor_checksum"] = checks.waited
        stats["waits"] = waits
        hasher.shutdown(wait=True, cancel_futures=True)
        dev.finish()  # nothing may still read the sources or write the slots
        # The device buffers go now, not with this frame: an error's traceback keeps the frame alive, and a
        # buffer alive when the lease ends would not go back to the device with the rest.
        encoded.clear()
        for g in copied:
            g.enc = None  # also where a frame of the traceback (submit's) still holds the group
        copied.clear()
        enc = None
        if read_ahead is not None:
            read_ahead.set()  # also on an error: whoever waits sees the save's outcome next
        if pool is not None:
            stats["pinned_bytes"] = len(pool.slots) * slot_bytes
            PINNED.give(pool.slots)
        if "batches" in stats:
            stats.update(dev.timing_report())
        stats["seconds"] = time.perf_counter() - started
        sources.clear()


__all__ = ["encode_batches", "TensorChecksums"]
