"""The GPU engine: a save's chunks compressed on the GPU with nvCOMP, in a pipeline.

Stages, all overlapping:

1. encode: chunks are grouped into batches (``batching.plan_batches``: one
   codec, similar sizes, output of at most ``BATCH_BYTES``), each encoded by
   one batched nvCOMP call on the engine's compute stream, up to ``INFLIGHT``
   batches ahead of the writer;
2. copy out: an encoded batch goes to pinned host memory in runs of chunks
   (``batching.copy_groups``), one device-to-host copy per run on a copy
   stream, into a fixed pool of pinned slots (``PINNED_SLOTS`` x ``SLOT_BYTES``);
3. hand over: the generator yields each chunk as a memoryview of its slot with
   its XXH3-64 (computed by a small thread pool; xxhash releases the GIL) and
   a ``release`` callback; the writer (ContainerWriter -> FileSink, whose I/O
   threads write with O_DIRECT) copies it out and calls release, which frees
   the slot once all its chunks are written.  No free slot: the generator
   waits for the writer, so a slow disk slows encoding instead of growing memory.

Beside them, when the save wants tensor checksums, ``CHECKSUM_WORKERS``
threads compute the XXH3-64 of every tensor's raw bytes (device-to-host copies
through two pinned pieces of ``PIECE_BYTES`` each) in the order the tensors are
first written.

Memory beyond the caller's tensors: GPU about (INFLIGHT + 1) x (BATCH_BYTES of
output + BATCH_BYTES of scratch for the byte-plane split or staged inputs);
pinned host memory PINNED_SLOTS x SLOT_BYTES + CHECKSUM_WORKERS x 2 x
PIECE_BYTES (384 MiB by default; torch keeps freed pinned blocks for the next
save).  Never proportional to the checkpoint (except ``snapshot``, which copies
the state on purpose).  The defaults are module attributes; change them before
a save.  On the H200 (tools/bench_results/bench_h200.md) a 7.2 GB state saves
at the disk's O_DIRECT speed: the GPU encodes it in ~36 ms of GPU time.

Codecs: "auto"/"ans" -> nvcomp-ans with the data-type mode of each dtype;
"portable" -> the CPU engine's pipelines (byteshuffle+zstd / zstd), made on the
GPU with the byte-plane split and nvCOMP Zstd's RAW (standard) frames; raw
where a chunk would not shrink.

``snapshot(plan)`` (async_save) copies the state so the caller may change it at
once: see its docstring for the strategy and its fallback.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

import torch
import xxhash

from .. import dtypes
from ..codecs import RAW, NvcompAns, Pipeline, portable
from ..errors import NvckptError
from ..format.structs import xxh3
from . import nvcomp_backend as nb
from .batching import Batch, ChunkJob, SlotPool, aligned_host_buffer, copy_groups, first_use_order, plan_batches
from .container import EncodedChunk, TensorFrame
from .plan import PlannedTensor, SavePlan

MiB = 1 << 20
CHUNK_SIZE = 4 * MiB  # the engine's default chunk: nvCOMP runs ~600 GB/s on 4 MiB chunks, ~340 on 1 MiB
BATCH_BYTES = 1024 * MiB  # output bytes of one batched encode (fixed cost ~0.4 ms per call)
MAX_BATCH_CHUNKS = 8192
INFLIGHT = 2  # encoded batches ahead of the copy-out stage
SLOT_BYTES = 64 * MiB  # one pinned slot; must hold the largest chunk's capacity (16 MiB chunk -> ~16.1 MiB)
PINNED_SLOTS = 4  # 256 MiB: ~0.1 s of a 2.3 GB/s disk ahead of the writer is plenty; pinning costs ~0.4 s/GB once
PIECE_BYTES = 16 * MiB  # tensor-checksum staging (two pieces per worker)
CHECKSUM_WORKERS = 4  # threads hashing whole tensors (one XXH3 stream runs ~6 GB/s on the H200 host)
HASH_WORKERS = 4  # threads hashing chunks
SNAPSHOT_RESERVE = 1024 * MiB  # GPU memory left free beside a device snapshot and the engine's own batches

last_stats: dict[str, Any] = {}  # figures of the last save through this engine (for benchmarks)


def available() -> bool:
    return nb.available()


def writer_info() -> dict[str, Any]:
    return {"nvcomp": nb.nvcomp_version()}


# -- codecs --------------------------------------------------------------------------------
def pipeline_chooser(codec: str, zstd_level: int, nvcomp_version: str) -> Callable[[PlannedTensor], Pipeline]:
    """The pipeline of each tensor on the GPU engine."""
    if codec in ("auto", "ans"):
        cache: dict[str, Pipeline] = {}

        def ans(t: PlannedTensor) -> Pipeline:
            dt = nb.ans_data_type(t.entry["dtype"])
            if dt not in cache:
                cache[dt] = Pipeline((NvcompAns(dt, nvcomp_version, "raw"),))
            return cache[dt]
        return ans
    if codec == "portable":
        return lambda t: portable(dtypes.DTYPES[t.entry["dtype"]].itemsize, zstd_level)
    raise ValueError(f"the GPU engine encodes codec 'auto', 'ans' or 'portable', not {codec!r}")


# -- devices: where batches are encoded ------------------------------------------------------
@dataclass
class _Encoded:
    """One batch after its encode call was issued."""

    batch: Batch
    inputs: list[torch.Tensor]  # the chunks' raw bytes on the device (views or staged copies)
    capacity: int
    buffer: torch.Tensor  # chunk i at [i * capacity, i * capacity + sizes[i])
    result: Any  # nb.EncodedBatch or None
    sizes_known: list[int] | None = None
    timing: tuple[Any, Any] | None = None

    def sizes(self) -> list[int]:
        if self.sizes_known is None:
            self.sizes_known = self.result.sizes()  # waits for the encode
        return self.sizes_known


_streams: dict[Any, tuple[Any, Any]] = {}
_streams_lock = threading.Lock()


def engine_streams(device: torch.device) -> tuple[Any, Any]:
    """The (compute, copy) streams of a device, made once: buffers that torch's allocator caches
    on them are reused by the next save instead of staying reserved for a stream nobody uses."""
    with _streams_lock:
        pair = _streams.get(device)
        if pair is None:
            pair = _streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return pair


class CudaDevice:
    """Encodes on one CUDA device: nvCOMP on a compute stream, copies out on a copy stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = torch.device("cpu")
        self.stream, self.copy_stream = engine_streams(device)
        self._codecs: dict[Hashable, nb.GpuCodec] = {}

    def wait_for_caller(self, event: Any) -> None:
        """Order the engine's streams after the caller's pending work (or the snapshot's copies)."""
        caller = torch.cuda.current_stream(self.device)
        for s in (self.stream, self.copy_stream):
            s.wait_stream(caller)
            if event is not None:
                s.wait_event(event)

    def codec(self, pipeline: Pipeline) -> nb.GpuCodec:
        c = self._codecs.get(pipeline)
        if c is None:
            op = nb.gpu_op_for(pipeline)
            if op is None:
                raise NvckptError(f"pipeline {pipeline.describe()} does not encode on the GPU")
            c = self._codecs[pipeline] = nb.codec_for(op[0], op[1], op[2], device=self.device, stream=self.stream)
            c.timing = True
        return c

    def capacity(self, pipeline: Pipeline, length: int) -> int:
        c = self.codec(pipeline)
        return nb._align(c.max_compressed_size(length), c.comp_alignment)

    def host_buffer(self, size: int) -> torch.Tensor:
        return aligned_host_buffer(size, pin=True)

    def flat(self, t: PlannedTensor) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            return t.flat_bytes()

    def encode(self, batch: Batch, sources: dict[int, torch.Tensor]) -> _Encoded:
        codec = self.codec(batch.key)
        inputs = [sources[j.tensor_id][j.start: j.start + j.length] for j in batch.jobs]
        with torch.cuda.stream(self.stream):
            away = [i for i, x in enumerate(inputs) if x.device != self.device]
            if away:  # chunks of tensors on the CPU (an optimizer's step counts) or another GPU
                offs, p = [], 0
                for i in away:
                    offs.append(p)
                    p += nb._align(inputs[i].numel(), 512)
                stage = torch.empty(p, dtype=torch.uint8, device=self.device)
                for i, o in zip(away, offs):
                    dst = stage[o: o + inputs[i].numel()]
                    dst.copy_(inputs[i])
                    inputs[i] = dst
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            result = codec.encode(inputs)
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
        if result.capacity != batch.capacity:
            raise NvckptError(f"engine bug: planned capacity {batch.capacity} != nvCOMP's {result.capacity}")
        return _Encoded(batch, inputs, result.capacity, result.buffer, result, None, (start, end))

    def copy_out(self, enc: _Encoded, first: int, stop: int, lengths: list[int], raw: list[int],
                 slot: torch.Tensor) -> Any:
        """Issue the copies of chunks [first, stop) into ``slot``; returns an event to wait for."""
        cap = enc.capacity
        used = (stop - 1 - first) * cap + lengths[stop - 1]
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(enc.result.event)
            slot[:used].copy_(enc.buffer[first * cap: first * cap + used], non_blocking=True)
            for i in raw:  # chunks stored raw: their input bytes replace the encoded ones
                n = enc.inputs[i].numel()
                slot[(i - first) * cap: (i - first) * cap + n].copy_(enc.inputs[i], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        return done

    def wait(self, event: Any) -> None:
        event.synchronize()

    def ready(self, event: Any) -> bool:
        return bool(event.query())

    def piece_to_host(self, src: torch.Tensor, dst: torch.Tensor, stream: Any) -> Any:
        with torch.cuda.stream(stream):
            dst[: src.numel()].copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    def side_stream(self, ready: Any) -> Any:
        s = torch.cuda.Stream(self.device)
        s.wait_stream(self.stream)
        if ready is not None:
            s.wait_event(ready)
        return s

    def finish(self) -> None:
        self.stream.synchronize()
        self.copy_stream.synchronize()

    def timing_report(self, timings: list[Any]) -> dict[str, Any]:
        return timing_report(timings)


class HostDevice:
    """The same engine with the CPU codecs on the CPU: runs the scheduling in CI without a GPU.

    "Device" memory and "pinned" memory are plain host memory; copies are
    immediate and events are None.
    """

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.host = self.device

    def wait_for_caller(self, event: Any) -> None:
        pass

    @staticmethod
    def capacity(pipeline: Pipeline, length: int) -> int:
        return length + (length >> 7) + 64  # anything longer than the chunk is stored raw anyway

    def host_buffer(self, size: int) -> torch.Tensor:
        return aligned_host_buffer(size, pin=False)

    def flat(self, t: PlannedTensor) -> torch.Tensor:
        flat = t.flat_bytes()
        return flat if flat.device.type == "cpu" else flat.cpu()

    def encode(self, batch: Batch, sources: dict[int, torch.Tensor]) -> _Encoded:
        cap = batch.capacity
        out = torch.zeros(cap * len(batch.jobs), dtype=torch.uint8)
        inputs, sizes = [], []
        view = out.numpy()
        for i, j in enumerate(batch.jobs):
            raw = sources[j.tensor_id][j.start: j.start + j.length]
            inputs.append(raw)
            data = memoryview(batch.key.encode(memoryview(raw.numpy()))).cast("B")
            n = data.nbytes
            if n <= cap:
                view[i * cap: i * cap + n] = data
            sizes.append(n)
        return _Encoded(batch, inputs, cap, out, None, sizes)

    def copy_out(self, enc: _Encoded, first: int, stop: int, lengths: list[int], raw: list[int],
                 slot: torch.Tensor) -> Any:
        cap = enc.capacity
        used = (stop - 1 - first) * cap + lengths[stop - 1]
        slot[:used].copy_(enc.buffer[first * cap: first * cap + used])
        for i in raw:
            n = enc.inputs[i].numel()
            slot[(i - first) * cap: (i - first) * cap + n].copy_(enc.inputs[i])
        return None

    def wait(self, event: Any) -> None:
        pass

    def ready(self, event: Any) -> bool:
        return True

    def piece_to_host(self, src: torch.Tensor, dst: torch.Tensor, stream: Any) -> Any:
        dst[: src.numel()].copy_(src)
        return None

    def side_stream(self, ready: Any) -> Any:
        return None

    def finish(self) -> None:
        pass

    def timing_report(self, timings: list[Any]) -> dict[str, Any]:
        return {}


def timing_report(timings: list[tuple]) -> dict[str, Any]:
    """GPU time of batched calls from CUDA events: (stage start, stage end, nvCOMP start, nvCOMP end, codec, bytes).

    "stage" spans everything the engine puts on the stream for a batch (zero
    fill of the output, byte-plane split, alignment copies, the nvCOMP call);
    "codec" the nvCOMP call alone.  GB/s are of uncompressed bytes."""
    per: dict[str, dict[str, float]] = {}
    for a, b, c, d, key, n in timings:
        r = per.setdefault(key, {"bytes": 0, "batches": 0, "stage_seconds": 0.0, "codec_seconds": 0.0,
                                 "largest_batch_bytes": 0, "largest_batch_codec_GBps": None})
        r["bytes"] += n
        r["batches"] += 1
        r["stage_seconds"] += a.elapsed_time(b) / 1e3
        if c is not None:
            seconds = c.elapsed_time(d) / 1e3
            r["codec_seconds"] += seconds
            if n > r["largest_batch_bytes"] and seconds > 0:  # the batch that carries the bulk of the data
                r["largest_batch_bytes"], r["largest_batch_codec_GBps"] = n, n / seconds / 1e9
    for r in per.values():
        r["stage_GBps"] = r["bytes"] / r["stage_seconds"] / 1e9 if r["stage_seconds"] else None
        r["codec_GBps"] = r["bytes"] / r["codec_seconds"] / 1e9 if r["codec_seconds"] else None
    total = sum(r["bytes"] for r in per.values())
    stage = sum(r["stage_seconds"] for r in per.values())
    codec = sum(r["codec_seconds"] for r in per.values())
    return {"gpu_stage_seconds": stage, "gpu_codec_seconds": codec, "gpu_bytes": total,
            "stage_GBps": total / stage / 1e9 if stage else None, "codec_GBps": total / codec / 1e9 if codec else None,
            "per_codec": per}


# -- tensor checksums ------------------------------------------------------------------------
class TensorChecksums:
    """XXH3-64 of whole tensors, computed by ``workers`` threads in the order the writer needs them.

    Each worker takes the next tensor of the list and hashes it alone (the
    hash of one tensor is sequential), through its own two pinned pieces."""

    def __init__(self, dev: Any, tensors: list[PlannedTensor], ready: Any, piece_bytes: int, workers: int = 1) -> None:
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
        flat = t.flat_bytes() if stream is None else _on_stream(stream, t.flat_bytes)
        if flat.device.type == "cpu":
            return xxh3(memoryview(flat.numpy()))
        h = xxhash.xxh3_64()
        n = flat.numel()
        if not pieces:
            pieces.extend(self.dev.host_buffer(self.piece_bytes) for _ in range(2))
        pending: deque = deque()
        for k, lo in enumerate(range(0, n, self.piece_bytes)):
            part = flat[lo: lo + self.piece_bytes]
            buf = pieces[k % 2]
            pending.append((self.dev.piece_to_host(part, buf, stream), buf, part.numel()))
            if len(pending) == 2:
                self._hash(h, *pending.popleft())
            if self.stop.is_set():
                break
        while pending:
            self._hash(h, *pending.popleft())
        return h.intdigest()

    def _hash(self, h: Any, event: Any, buf: torch.Tensor, n: int) -> None:
        self.dev.wait(event)
        h.update(memoryview(buf[:n].numpy()))

    def get(self, tensor_id: int) -> int:
        start = time.perf_counter()
        with self._cond:
            while tensor_id not in self.results and self.error is None and any(th.is_alive() for th in self._threads):
                self._cond.wait(0.5)
            self.waited += time.perf_counter() - start
            if tensor_id in self.results:
                return self.results[tensor_id]
            if self.error is not None:
                raise NvckptError(f"computing tensor checksums failed: {self.error}") from self.error
            raise NvckptError(f"engine bug: no checksum for tensor {tensor_id}")

    def close(self) -> None:
        self.stop.set()
        for th in self._threads:
            th.join()


def _on_stream(stream: Any, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    with torch.cuda.stream(stream):
        return fn()


# -- the pipeline ---------------------------------------------------------------------------
@dataclass
class _Group:
    """Chunks [first, stop) of an encoded batch, on their way through one pinned slot."""

    enc: _Encoded
    first: int
    stop: int
    slot: int
    view: Any  # numpy view of the slot
    raw: set[int]
    event: Any
    hashes: list[Future] | None = None
    left: int = 0
    pool: SlotPool | None = field(default=None, repr=False)

    def release_one(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.pool.give(self.slot)

    def payload(self, i: int) -> memoryview:
        at = (i - self.first) * self.enc.capacity
        n = self.enc.batch.jobs[i].length if i in self.raw else self.enc.sizes()[i]
        return memoryview(self.view[at: at + n])


def encode_gpu(plan: SavePlan, *, codec: str = "auto", zstd_level: int = 1,
               tensor_checksums: bool = True) -> Iterator[TensorFrame | EncodedChunk]:
    """Items for ContainerWriter: every tensor's TensorFrame, then its chunks, encoded on the GPU."""
    device = _engine_device(plan)
    choose = pipeline_chooser(codec, zstd_level, nb.nvcomp_version())
    return encode_batches(plan, choose, CudaDevice(device), tensor_checksums=tensor_checksums,
                          ready=getattr(plan, "_nvckpt_ready", {}).get(device))


def _engine_device(plan: SavePlan) -> torch.device:
    for t in plan.tensors:
        if t.data is not None and t.data.device.type == "cuda":
            return torch.device("cuda", t.data.device.index if t.data.device.index is not None else torch.cuda.current_device())
    return torch.device("cuda", torch.cuda.current_device())


def encode_batches(
    plan: SavePlan,
    choose: Callable[[PlannedTensor], Pipeline],
    dev: Any,
    *,
    tensor_checksums: bool = True,
    ready: Any = None,
    batch_bytes: int | None = None,
    max_batch_chunks: int | None = None,
    inflight: int | None = None,
    slot_bytes: int | None = None,
    pinned_slots: int | None = None,
    piece_bytes: int | None = None,
    hash_workers: int | None = None,
) -> Iterator[TensorFrame | EncodedChunk]:
    """The pipeline over any device (CudaDevice, or HostDevice for tests); see the module docstring."""
    batch_bytes = batch_bytes or BATCH_BYTES
    max_batch_chunks = max_batch_chunks or MAX_BATCH_CHUNKS
    inflight = inflight or INFLIGHT
    slot_bytes = slot_bytes or SLOT_BYTES
    pinned_slots = pinned_slots or PINNED_SLOTS
    piece_bytes = piece_bytes or PIECE_BYTES
    hash_workers = hash_workers or HASH_WORKERS
    # Runs in the caller's thread up to the first next(): order after the caller's stream now.
    dev.wait_for_caller(ready)
    return _pipeline(plan, choose, dev, tensor_checksums, ready, batch_bytes, max_batch_chunks, inflight,
                     slot_bytes, pinned_slots, piece_bytes, hash_workers)


def _pipeline(plan: SavePlan, choose: Callable[[PlannedTensor], Pipeline], dev: Any, tensor_checksums: bool,
              ready: Any, batch_bytes: int, max_batch_chunks: int, inflight: int, slot_bytes: int,
              pinned_slots: int, piece_bytes: int, hash_workers: int) -> Iterator[TensorFrame | EncodedChunk]:
    started = time.perf_counter()
    stats: dict[str, Any] = {"engine": type(dev).__name__}
    pipelines: dict[int, Pipeline] = {}
    jobs: list[ChunkJob] = []
    for t in plan.tensors:
        if t.data is not None and t.chunks:
            pipelines[t.tensor_id] = p = choose(t)
            jobs.extend(ChunkJob(t.tensor_id, i, s, n, p) for i, (s, n) in enumerate(t.chunks))
    batches = plan_batches(jobs, dev.capacity, batch_bytes=batch_bytes, max_chunks=max_batch_chunks)
    for b in batches:
        if b.capacity > slot_bytes:
            raise ValueError(f"SLOT_BYTES ({slot_bytes}) is smaller than one chunk's output capacity ({b.capacity})")
    # Chunks left per tensor: its flat bytes are dropped after the last one is encoded.
    left = {tid: 0 for tid in pipelines}
    for j in jobs:
        left[j.tensor_id] += 1
    by_id = {t.tensor_id: t for t in plan.tensors}
    order = [by_id[tid] for tid in first_use_order(batches)]

    checks = TensorChecksums(dev, order, ready, piece_bytes, CHECKSUM_WORKERS) if tensor_checksums and order else None
    hasher = ThreadPoolExecutor(hash_workers, thread_name_prefix="nvckpt-chunk-xxh3")
    pool: SlotPool | None = None
    announced: set[int] = set()
    sources: dict[int, torch.Tensor] = {}
    timings: list[Any] = []  # (start, end) events of each encode call; not the batches (their memory)
    waits = {"encode": 0.0, "copy_out": 0.0, "chunk_xxh3": 0.0, "writer": 0.0}  # where the generator's time went
    raw_bytes = stored = nraw = 0
    try:
        # Tensors without chunks (views, derived, empty) first: a truncated file still has them.
        for t in plan.tensors:
            if not (t.data is not None and t.chunks):
                checksum = None
                if t.data is not None and tensor_checksums:
                    checksum = xxh3(b"")
                announced.add(t.tensor_id)
                yield TensorFrame(t.tensor_id, checksum)
        if not batches:
            return
        pool = SlotPool(pinned_slots, slot_bytes, dev.host_buffer)
        pool_views = [s.numpy() for s in pool.slots]
        todo = deque(batches)
        encoded: deque[_Encoded] = deque()
        cursor: list[Any] = [None, None]  # [groups of encoded[0], index of the next group]
        copied: deque[_Group] = deque()

        def submit() -> None:
            b = todo.popleft()
            for j in b.jobs:
                if j.tensor_id not in sources:
                    sources[j.tensor_id] = dev.flat(by_id[j.tensor_id])
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
                g.hashes = [hasher.submit(xxh3, g.payload(i)) for i in range(g.first, g.stop)]

        while True:
            while todo and len(encoded) < inflight:
                submit()
            # Copy out the oldest encoded batch while pinned slots are free.
            while encoded and pool.free:
                enc = encoded[0]
                if cursor[0] is None:
                    t0 = time.perf_counter()
                    sizes = enc.sizes()
                    waits["encode"] += time.perf_counter() - t0
                    raws = [i for i, (n, j) in enumerate(zip(sizes, enc.batch.jobs)) if n >= j.length]
                    lengths = [j.length if n >= j.length else n for n, j in zip(sizes, enc.batch.jobs)]
                    cursor[:] = [(copy_groups(enc.capacity, lengths, slot_bytes), lengths, set(raws)), 0]
                groups, lengths, raws = cursor[0]
                first, stop = groups[cursor[1]]
                slot = pool.take()
                raw_here = sorted(i for i in raws if first <= i < stop)
                event = dev.copy_out(enc, first, stop, lengths, raw_here, pool.slots[slot])
                copied.append(_Group(enc, first, stop, slot, pool_views[slot], set(raw_here), event,
                                     left=stop - first, pool=pool))
                cursor[1] += 1
                if cursor[1] == len(groups):
                    encoded.popleft()
                    if enc.timing is not None:
                        codec_events = getattr(enc.result, "codec_events", None) or (None, None)
                        timings.append((*enc.timing, *codec_events, enc.batch.key.describe(), enc.batch.raw_bytes))
                    cursor[:] = [None, None]
                    if todo:
                        submit()  # keep the GPU ahead of the copies
            if not copied:
                if not encoded and not todo:
                    break
                if not pool.free:
                    raise NvckptError("engine bug: every pinned slot is held but none is being written")
                continue
            group = copied.popleft()
            start_hashing(group)
            if copied and dev.ready(copied[0].event):
                start_hashing(copied[0])  # overlap the next group's checksums with this group's writes
            enc = group.enc
            for k, i in enumerate(range(group.first, group.stop)):
                job = enc.batch.jobs[i]
                if job.tensor_id not in announced:
                    announced.add(job.tensor_id)
                    yield TensorFrame(job.tensor_id, checks.get(job.tensor_id) if checks else None)
                payload = group.payload(i)
                is_raw = i in group.raw
                raw_bytes += job.length
                stored += payload.nbytes
                nraw += is_raw
                t0 = time.perf_counter()
                checksum = group.hashes[k].result()
                t1 = time.perf_counter()
                waits["chunk_xxh3"] += t1 - t0
                yield EncodedChunk(job.tensor_id, job.chunk_index, RAW if is_raw else enc.batch.key, payload,
                                   job.length, checksum, group.release_one)
                waits["writer"] += time.perf_counter() - t1  # the writer copying it out (and waiting for the disk)
        stats.update(batches=len(batches), chunks=len(jobs), raw_chunks=nraw, raw_bytes=raw_bytes, stored_bytes=stored)
    finally:
        if checks is not None:
            checks.close()
            stats["tensor_checksum_seconds"] = checks.seconds
            waits["tensor_checksum"] = checks.waited
        stats["waits"] = waits
        hasher.shutdown(wait=True, cancel_futures=True)
        dev.finish()  # nothing may still read the sources or write the slots
        if "batches" in stats:
            stats.update(dev.timing_report(timings))
        stats["seconds"] = time.perf_counter() - started
        sources.clear()
        last_stats.clear()
        last_stats.update(stats)


# -- async_save snapshot ------------------------------------------------------------------
def snapshot(plan: SavePlan) -> None:
    """Copy the state the plan holds, so the caller may change its tensors as soon as this returns.

    Strategy, chosen by measurement (tools/bench_results/bench_h200.md): a
    device-to-device copy of every CUDA tensor into one new buffer per device
    and dtype, issued on the caller's current stream with grouped copy kernels
    (``torch._foreach_copy_``).  It is asynchronous: the copies are ordered
    before anything the caller does next on that stream (an optimizer step),
    so the caller is blocked only for the launches and the Python around
    them (tens of microseconds per tensor), while the copies run at HBM speed
    (~2 TB/s: a few ms for 6 GB).  The engine's streams wait for an event
    recorded after them.  Compressing into device memory instead would need
    as much memory at its peak (nvCOMP reserves its output bound, larger than
    the input, until sizes are known) and a host sync to learn the sizes, so
    it is not used.

    Fallback when the device lacks room (free + cached memory less than the
    state + SNAPSHOT_RESERVE + the engine's own batches): the tensors are
    copied to (pageable) host memory, which blocks the caller for the
    device-to-host copy (~0.5 s for 6 GB) but cannot fail for lack of GPU
    memory.  CPU tensors are cloned.
    """
    events: dict[torch.device, Any] = {}
    strategies: dict[str, str] = {}
    by_device: dict[torch.device, list[PlannedTensor]] = {}
    with torch.no_grad():
        for t in plan.tensors:
            if t.data is None:
                continue
            if t.data.device.type == "cuda":
                by_device.setdefault(t.data.device, []).append(t)
            else:
                t.data = t.data.clone(memory_format=torch.contiguous_format)
        for device, ts in by_device.items():
            need = sum(nb._align(t.nbytes, 512) for t in ts)
            if _device_room(device) >= need + SNAPSHOT_RESERVE + (INFLIGHT + 1) * 2 * BATCH_BYTES:
                by_dtype: dict[torch.dtype, list[PlannedTensor]] = {}
                for t in ts:
                    by_dtype.setdefault(t.data.dtype, []).append(t)
                for dtype, group in by_dtype.items():
                    _copy_group(group, dtype, device)
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(device))
                events[device] = ev
                strategies[str(device)] = "device"
            else:
                for t in ts:
                    t.data = t.data.to("cpu", memory_format=torch.contiguous_format)
                strategies[str(device)] = "host"
    plan._nvckpt_ready = events  # type: ignore[attr-defined]  # read by encode_gpu()
    plan._nvckpt_snapshot = strategies  # type: ignore[attr-defined]
    last_snapshot.clear()
    last_snapshot.update(strategies)


def _copy_group(group: list[PlannedTensor], dtype: torch.dtype, device: torch.device) -> None:
    """Copy tensors of one dtype into one new buffer, each starting 512-byte aligned (as nvCOMP likes)."""
    item = group[0].data.element_size()
    sizes: list[int] = []
    for t in group:
        n = t.data.numel()
        sizes += [n, -(n * item) % 512 // item]
    flat = torch.empty(sum(sizes), dtype=dtype, device=device)
    copies = list(torch.split_with_sizes(flat, sizes)[0::2])
    sources = [t.data.reshape(-1) for t in group]
    try:
        torch._foreach_copy_(copies, sources)  # grouped kernels: few launches for many tensors
    except (RuntimeError, NotImplementedError, TypeError):  # a dtype without foreach kernels
        for c, s in zip(copies, sources):
            c.copy_(s)
    for t, c in zip(group, copies):
        t.data = c.view(t.data.shape)


last_snapshot: dict[str, str] = {}  # device -> "device" or "host": what the last snapshot did


def _device_room(device: torch.device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(0, cached))


__all__ = ["available", "writer_info", "encode_gpu", "encode_batches", "snapshot", "pipeline_chooser",
           "CudaDevice", "HostDevice", "TensorChecksums", "CHUNK_SIZE", "last_stats", "last_snapshot"]
