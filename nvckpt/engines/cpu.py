"""The CPU engine: encode chunks with the host codecs on a thread pool.

zstd (libzstd), numpy and xxhash release the GIL, so the pool keeps every core busy while the
caller's thread writes frames in order.  What keeps it from being the bottleneck:

* chunks are read straight from the tensor's memory (no copy for a contiguous CPU tensor) and a
  portable chunk is coded into a reusable output buffer (``_Buffers``), handed to the writer and
  given back once the writer has copied it (``EncodedChunk.release``): no allocation per chunk, and
  the buffers are kept for the next save (up to 64 MiB);
* small chunks are grouped into one task (an optimizer's thousands of step counters cost one task
  per ~256 KiB, not one per tensor), and portable chunks under ``TINY`` bytes are stored raw without
  trying a coder (SPEC 12.4: a frame header per byte plane would eat what coding saves);
* a tensor's checksum (XXH3-64 of its raw bytes, one sequential pass) is a task of its own, so it
  runs beside the chunks' coding instead of before it in the writer's thread.

At most ``window`` tasks are in flight, which bounds memory to a few chunks beyond the tensor
being saved.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, wait
from typing import Any, Callable, Iterator

import numpy as np
import torch

from .._threads import TASK_BYTES, TASK_PIECES, host_pool
from ..codecs.base import Pipeline
from ..codecs.presets import chooser
from ..codecs.registry import RAW
from ..errors import NvckptError
from ..format.structs import xxh3
from ..io.target import SinkOptions
from ..options import SaveOptions
from ..plan.chunking import CPU_CHUNK_SIZE
from ..plan.walk import PlannedTensor, SavePlan
from .base import Prepared
from .items import EncodedChunk, TensorReady

# The sink's blocks: the last block's write is the one the encoder cannot overlap, so smaller blocks shorten
# the tail (MiniLM bf16 saved at 0.71 GB/s with 16 MiB blocks, 0.92 with 2 MiB on the 2-core VM, whose disk
# takes 2 MiB O_DIRECT writes as fast as 16 MiB ones); the GPU engine keeps the sink's 16 MiB (its disk).
CPU_BLOCK = 2 << 20
CPU_BLOCKS = 16
TINY = 256  # chunks below this many bytes are stored raw (per-plane frame headers alone would not pay)


def host_bytes(t: PlannedTensor) -> memoryview:
    """The tensor's raw bytes in CPU memory (copied from a GPU if need be)."""
    flat = t.flat_bytes()
    if not flat.is_cpu:  # (is_cpu: no torch.device made per tensor)
        flat = flat.cpu()
    return memoryview(flat.numpy())


class _Buffers:
    """Reusable output buffers of one size class each (a chunk's bound), shared by the workers and kept
    for the next save, up to ``keep`` bytes: fresh memory costs a page fault per 4 KiB on first touch,
    and a process that gave its free memory back to the OS (glibc's trim) paid them on every save."""

    def __init__(self, keep: int = 0) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self._keep = keep
        self._kept = 0

    def take(self, size: int) -> np.ndarray:
        cls = max(1 << 16, 1 << (size - 1).bit_length())
        with self._lock:
            free = self._free.get(cls)
            if free:
                self._kept -= cls
                return free.pop()
        return np.empty(cls, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._keep and self._kept + buf.nbytes > self._keep:
                return  # beyond what is kept: freed
            self._kept += buf.nbytes
            self._free.setdefault(buf.nbytes, []).append(buf)

    def _after_fork_in_child(self) -> None:
        # A fork while a parent's thread held the lock leaves it held in the child: a new one, and no buffers.
        self._lock = threading.Lock()
        self._free = {}
        self._kept = 0


# The CPU engine's buffers, kept between saves: a save holds at most its window of chunks (4 per worker
# and 2, each at most a chunk's bound; 1 MiB chunks by default), so 64 MiB keeps a whole save's set.
_KEPT = _Buffers(keep=64 << 20)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_KEPT._after_fork_in_child)


def encode_chunk(pipeline: Pipeline, raw: memoryview, buffers: _Buffers | None = None
                 ) -> tuple[Pipeline, Any, int, Callable[[], None] | None]:
    """Encode one chunk, falling back to raw where coding would not shrink it.

    Returns (pipeline used, payload, XXH3-64 of the payload, release callback or None)."""
    n = raw.nbytes
    if pipeline.is_raw or (pipeline.planar and n < TINY):
        return RAW, raw, xxh3(raw), None
    bound = pipeline.encode_bound(n)
    if bound is None:
        try:
            encoded = pipeline.encode(raw)
        except ValueError as exc:  # a caller's pipeline that does not fit the tensor (byteshuffle(4) on fp16)
            raise NvckptError(f"{pipeline.describe()} cannot encode a chunk of {n} bytes: {exc}") from None
        if memoryview(encoded).nbytes >= n:
            return RAW, raw, xxh3(raw), None
        return pipeline, encoded, xxh3(encoded), None
    buffers = buffers or _Buffers()
    out = buffers.take(bound)
    size = pipeline.encode_into(raw, out)
    if size >= n:
        buffers.give(out)
        return RAW, raw, xxh3(raw), None
    payload = memoryview(out)[:size]
    return pipeline, payload, xxh3(payload), lambda: buffers.give(out)


class _Known:
    """A small tensor's checksum, hashed at once: what drain() asks of a Future, without its lock and
    condition (a save of thousands of small tensors made one each)."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def result(self) -> int:
        return self.value


def _encode_group(items: list[tuple[Pipeline, memoryview]], buffers: _Buffers) -> list[tuple]:
    return [encode_chunk(p, raw, buffers) for p, raw in items]


def encode_cpu(
    plan: SavePlan,
    choose: Callable[[str], Pipeline],
    *,
    workers: int | None = None,
    tensor_checksums: bool = True,
) -> Iterator[TensorReady | EncodedChunk]:
    workers = workers or os.cpu_count() or 1
    window = 4 * workers + 2
    buffers = _KEPT
    # In order: ("tensor", tensor_id, checksum future or None) or ("chunks", [(tensor, index)], future of results).
    # A tensor's TENSOR frame comes before its chunks (SPEC 6); chunks of a group may be of several tensors.
    pending: deque[tuple] = deque()

    def drain(limit: int) -> Iterator[TensorReady | EncodedChunk]:
        while len(pending) > limit:
            item = pending.popleft()
            if item[0] == "tensor":
                yield TensorReady(item[1], None if item[2] is None else item[2].result())
                continue
            _, where, future = item
            try:
                results = iter(future.result())
            except NvckptError as exc:
                t, index = next(w for w in where if isinstance(w[1], int))
                raise exc.located(tensor=t.name, chunk=index)
            for t, index in where:
                if not isinstance(index, int):  # the tensor's TENSOR frame, in its place before its chunks
                    yield TensorReady(t.tensor_id, None if index is None else index.result())
                    continue
                pipeline, payload, checksum, release = next(results)
                yield EncodedChunk(t.tensor_id, index, pipeline, payload, t.chunks[index][1], checksum, release)

    pool = host_pool(workers)
    group: list[tuple[Pipeline, memoryview]] = []
    where: list[tuple[PlannedTensor, int]] = []
    size = 0

    def flush() -> None:
        nonlocal group, where, size
        if group:
            pending.append(("chunks", where, pool.submit(_encode_group, group, buffers)))
            group, where, size = [], [], 0

    # Derived-tensor candidates (plan_save(defer=True)) are verified on a worker while the other tensors are
    # coded, and come last: verifying first left every core but one idle for that long.
    later = plan.undecided
    # The bytes of the tensors already in host memory and contiguous (views, no copies) are taken before any
    # task starts: torch's calls let go of the GIL, and beside a worker that runs Python each one waits to get
    # it back (a view: up to the 5 ms switch interval), which made a save of thousands of small tensors 3x slower.
    with torch.no_grad():
        ready = {t.tensor_id: host_bytes(t) for t in plan.tensors
                 if t.data is not None and t.tensor_id not in later and t.data.is_cpu
                 and t.data.is_contiguous()}
    decision = pool.submit(plan.decide) if later else None

    def add(t: PlannedTensor) -> Iterator[TensorReady | EncodedChunk]:
        nonlocal size
        if t.data is None:
            if group:
                where.append((t, None))
            else:
                pending.append(("tensor", t.tensor_id, None))
            return
        raw = ready.pop(t.tensor_id, None)
        if raw is None:
            with torch.no_grad():
                raw = host_bytes(t)
        if not tensor_checksums:
            checksum = None
        elif raw.nbytes < TASK_BYTES:
            checksum = _Known(xxh3(raw))
        else:
            checksum = pool.submit(xxh3, raw)
        if group:  # announced inside the open group, so that frames keep the tensors' order
            where.append((t, checksum))
        else:
            pending.append(("tensor", t.tensor_id, checksum))
        pipeline = choose(t.entry["dtype"])
        for index, (start, length) in enumerate(t.chunks):
            if length >= TASK_BYTES:
                flush()
                pending.append(("chunks", [(t, index)],
                                pool.submit(_encode_group, [(pipeline, raw[start: start + length])], buffers)))
                yield from drain(window)
                continue
            group.append((pipeline, raw[start: start + length]))
            where.append((t, index))
            size += length
            if size >= TASK_BYTES or len(group) >= TASK_PIECES:
                flush()
                yield from drain(window)

    try:
        for t in plan.tensors:
            if t.tensor_id not in later:
                yield from add(t)
        if decision is not None:
            decision.result()
            for t in plan.tensors:
                if t.tensor_id in later:
                    yield from add(t)
        flush()
        yield from drain(0)
    finally:
        # The threads are shared (nvckpt._threads): what has not started is dropped, and what runs
        # is waited for, so that no task reads the tensors or the buffers after the save has ended.
        futures = [item[2] for item in pending if isinstance(item[2], Future)] + ([decision] if decision else [])
        futures += [w[1] for item in pending if item[0] == "chunks" for w in item[1] if isinstance(w[1], Future)]
        wait([f for f in futures if not f.cancel()])


class CpuEngine:
    """The CPU engine (see the module docstring) as a save asks it (nvckpt.engines.base.Engine)."""

    name = "cpu"
    chunk_size = CPU_CHUNK_SIZE
    alignment = 1  # the CPU reader reads chunks where they are

    def sink_options(self, options: SaveOptions) -> SinkOptions:
        return SinkOptions(direct=options.direct_io, block_size=CPU_BLOCK, blocks=CPU_BLOCKS)

    def prepare_async(self, plan: SavePlan, options: SaveOptions, lazy: bool = False) -> Prepared:
        """Copy the state into host memory (the CPU engine reads nothing ahead)."""
        plan.decide()
        with torch.no_grad():
            for t in plan.tensors:
                if t.data is not None:
                    t.data = torch.empty(t.data.shape, dtype=t.data.dtype, device="cpu").copy_(t.data)
        return Prepared(snapshot={"cpu": "host"})

    def prepare_lazy(self, plan: SavePlan, options: SaveOptions, ready: Any, tensors_read: threading.Event) -> Prepared:
        prepared = self.prepare_async(plan, options)
        tensors_read.set()
        return prepared

    def encode(self, plan: SavePlan, prepared: Prepared, options: SaveOptions,
               stats: dict[str, Any]) -> tuple[Iterator[TensorReady | EncodedChunk], dict[str, Any]]:
        # Derived-tensor candidates are verified by encode_cpu itself, beside its coding of the rest.
        return encode_cpu(plan, chooser(options.codec, options.zstd_level), workers=options.workers,
                          tensor_checksums=options.tensor_checksums is not False), {}
