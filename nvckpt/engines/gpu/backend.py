"""Where the GPU engines run: a device backend.

The encode and decode pipelines (encode.py, decode.py) are written against
``Backend``; ``CudaBackend`` runs them on a CUDA device with nvCOMP, and
``nvckpt.testing.host.HostBackend`` runs the very same scheduling with the host
codecs in plain memory, so that CI tests the engines' logic without a GPU.

Events stand for "this device work is done": ``wait(event)`` blocks on one,
``ready(event)`` polls it; the host backend's work is done when issued (None).

An engine run (a save's encode, a load's decode) holds a ``lease()`` of its backend
from before its first buffer until every buffer it made is gone.  On CUDA the
buffers of the leases come from private pools of torch's caching allocator (one
per allocating thread), which go back to the device when the last lease ends:
torch caches a freed block for the stream it was allocated on, and blocks
cached for the engine's streams were kept from the training (about the budget,
for good) and multiplied per stream when saves of different block sizes
overlapped.
"""

from __future__ import annotations

import contextlib
import threading

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Protocol

import torch

from ..._fork import Lock
from ...codecs.base import DeviceOp, Pipeline
from ...tensors.staging import align_up, stage_parts
from ...tensors import flat_bytes
from .batching import Batch, SlotRun, aligned_host_buffer


@dataclass
class Encoded:
    """One batch after its encode call was issued."""

    batch: Batch
    parts: list[tuple[torch.Tensor, int, int]]  # chunk i's raw bytes: (tensor, start, length), on the device
    capacity: int
    buffer: torch.Tensor  # chunk i at [i * capacity, i * capacity + sizes[i])
    result: Any  # nvcomp EncodedBatch, or None on the host
    sizes_known: list[int] | None = None
    timing: tuple[Any, Any] | None = None

    def sizes(self) -> list[int]:
        if self.sizes_known is None:
            self.sizes_known = self.result.sizes()  # waits for the encode
        return self.sizes_known

    def input(self, i: int) -> torch.Tensor:
        """Chunk i's raw bytes (a view: made only for the few chunks stored raw)."""
        base, start, n = self.parts[i]
        return base[start: start + n]

    @property
    def event(self) -> Any:
        return None if self.result is None else self.result.event


class Backend(Protocol):
    device: torch.device

    # -- both directions --
    def lease(self) -> "Lease": ...
    def memory_total(self) -> int | None: ...
    def host_buffer(self, size: int) -> torch.Tensor: ...
    def to_host(self, src: torch.Tensor, dst: torch.Tensor, stream: Any) -> Any: ...
    def side_stream(self, after: Any) -> Any: ...
    def flat(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def source(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def mark(self) -> Any: ...
    def caller_mark(self) -> Any: ...
    def wait(self, event: Any) -> None: ...
    def ready(self, event: Any) -> bool: ...
    def finish(self) -> None: ...
    def timing_report(self) -> dict[str, Any]: ...
    # -- encode --
    def wait_for_caller(self, event: Any) -> None: ...
    def ordered(self, fn: Callable[[], Any]) -> Any: ...
    def capacity(self, pipeline: Pipeline, length: int) -> int: ...
    def encode(self, batch: Batch, sources: dict[int, torch.Tensor]) -> Encoded: ...
    def copy_out(self, enc: Encoded, run: SlotRun, raw: list[int], slot: torch.Tensor, gather: bool = False) -> Any: ...
    # -- decode --
    def route(self, pipeline: Pipeline) -> Any: ...
    def alloc(self, nbytes: int) -> torch.Tensor: ...
    def dest(self, nbytes: int) -> torch.Tensor: ...
    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def upload_async(self, dst: torch.Tensor, src: torch.Tensor) -> Any: ...
    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def device_reads(self, source: Any, required: bool) -> Any: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def unshuffle(self, dst: torch.Tensor, planes: torch.Tensor, k: int) -> None: ...
    def decode(self, key: Hashable, payloads: list[torch.Tensor], outs: list[torch.Tensor]) -> None: ...


class Lease:
    """An engine run's hold on its backend's device memory; ``end()`` (idempotent) once none of the buffers
    it made is alive: the last lease of a backend to end hands their memory back to the device."""

    __slots__ = ("_end",)

    def __init__(self, end: Callable[[], None]) -> None:
        self._end: Callable[[], None] | None = end

    def end(self) -> None:
        end, self._end = self._end, None
        if end is not None:
            end()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end()


def _pieces(run: SlotRun, raw: list[int]) -> list[tuple[int, int, int, int, int]]:
    """The run's copies from the batch's output: all but those of chunks stored raw (copied from their inputs)."""
    stored_raw = set(raw)
    return [(a, b, d, at, n) for a, b, d, at, n in run.copies if not stored_raw.issuperset(range(a, b))]


def _packable(pieces: list[tuple[int, int, int, int, int]]) -> bool:
    """More than one piece, back to back in the slot: one packed device buffer, one copy to the host."""
    return len(pieces) > 1 and all(p[3] + p[4] == q[3] for p, q in zip(pieces, pieces[1:]))


def _copy_raw(enc: Encoded, run: SlotRun, raw: list[int], slot: torch.Tensor, *, non_blocking: bool) -> None:
    for i in raw:
        x = enc.input(i)
        at = run.offsets[i - run.first]
        slot[at: at + x.numel()].copy_(x, non_blocking=non_blocking)


def _copy_run(enc: Encoded, run: SlotRun, raw: list[int], slot: torch.Tensor, *, non_blocking: bool,
              gather: bool) -> None:
    """The run's copies from the batch's output, then the input bytes of its chunks stored raw.

    ``gather``: first pack the run's pieces on the device (one copy kernel at device-memory speed),
    then move them with one device-to-host copy: a copy per chunk costs more of the link's time."""
    pieces = _pieces(run, raw)
    if gather and _packable(pieces):
        packed = torch.cat([enc.buffer[d: d + n] for _, _, d, _, n in pieces])
        at = pieces[0][3]
        slot[at: at + packed.numel()].copy_(packed, non_blocking=non_blocking)
    else:
        for _, _, device_at, slot_at, n in pieces:
            slot[slot_at: slot_at + n].copy_(enc.buffer[device_at: device_at + n], non_blocking=non_blocking)
    _copy_raw(enc, run, raw, slot, non_blocking=non_blocking)


def _batch_parts(batch: Batch, sources: dict[int, torch.Tensor], device: Any,
                 staged: Callable[[torch.Tensor], bool]) -> list[tuple[torch.Tensor, int, int]]:
    """(tensor, start, length) of each chunk of ``batch``; the chunks of the tensors ``staged`` picks (on
    another device, not contiguous) copied into one buffer on ``device``, on the current stream."""
    parts = [(sources[j.tensor_id], j.start, j.length) for j in batch.jobs]
    distinct = {id(p[0]): p[0] for p in parts}
    picked = {k for k, x in distinct.items() if staged(x)}
    if picked:
        idx = [i for i, p in enumerate(parts) if id(p[0]) in picked]
        for i, part in zip(idx, stage_parts(parts, idx, STAGE_ALIGN, device)):
            parts[i] = part
    return parts


STAGE_ALIGN = 512  # offset alignment of a staged chunk in its batch's staging buffer (staged_bytes counts it)

GATHER_BUFFERS = 2  # device buffers of a slot each that pack runs before their copy out (double buffering)


# -- CUDA ---------------------------------------------------------------------------------------
_streams: dict[Any, tuple[Any, Any]] = {}
_streams_lock = Lock()  # a forked child gets it unlocked (nvckpt._fork)


def device_streams(device: torch.device) -> tuple[Any, Any, Any]:
    """The engines' (compute, copy, gather) streams of a device, made once: buffers that torch's allocator
    caches on them are reused by the next save or load instead of staying reserved for a stream nobody uses."""
    with _streams_lock:
        streams = _streams.get(device)
        if streams is None:
            streams = _streams[device] = tuple(torch.cuda.Stream(device) for _ in range(3))
        return streams


def cuda_device(device: Any) -> torch.device:
    device = torch.device(device)
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


_no_pools: set[Any] = set()  # devices whose allocator made no private pool (cudaMallocAsync, say): not asked again


def _private_pool(device: torch.device) -> Any:
    """A new private pool of torch's caching allocator on ``device``, or None where torch has none that takes
    one thread's allocations (before 2.8 they routed those of a stream, the training's among them) or its
    allocator makes none."""
    if device in _no_pools or not hasattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool"):
        return None
    try:
        with torch.cuda.device(device):
            return torch.cuda.MemPool()
    except (RuntimeError, TypeError, AttributeError):
        _no_pools.add(device)  # the engines then allocate as torch's allocator does by default
        return None


class CudaBackend:
    """nvCOMP on the device's compute stream, device-to-host copies on its copy stream; the engine's buffers
    in a private pool while a lease is held (see the module's docstring)."""

    def __init__(self, device: Any, *, gpu_zstd: bool = False, timing: bool = False) -> None:
        from ...codecs.nvcomp import device as nb  # imported lazily: nvCOMP is optional

        self._nb = nb
        self.device = cuda_device(device)
        self.stream, self.copy_stream, self.gather_stream = device_streams(self.device)
        self._packing: list[list[Any]] = []  # [device buffer, event of the copy that last read it]
        self.gpu_zstd = gpu_zstd
        self.timing = timing
        self.timings: list[tuple] = []  # (stage start, stage end, codec start, codec end, label, bytes)
        self._fetch_streams = threading.local()
        self._leases = 0
        # A pool per allocating thread: torch routes one thread's allocations to a pool, and refuses to route
        # a second thread's to a pool another thread is routing to.
        self._pools: dict[int, Any] = {}
        self._pool_lock = threading.Lock()
        self._inside = threading.local()  # the allocating methods nest (encode stages its parts)

    def lease(self) -> Lease:
        with self._pool_lock:
            self._leases += 1
        return Lease(self._end_lease)

    def _end_lease(self) -> None:
        with self._pool_lock:
            self._leases -= 1
            if self._leases:
                return
            pools, self._pools = self._pools, {}
        if pools:
            self.finish()  # nothing queued may still use the pools' memory
            # Dropping a pool frees its cached blocks (cudaFree).  A block still alive (a buffer someone kept)
            # is freed into torch's cache of released pools instead, which torch empties before it reports
            # an out-of-memory error.
            pools.clear()

    @contextlib.contextmanager
    def _allocating(self) -> Any:
        """This thread's allocations made inside come from its private pool of the leases (none held: torch's
        default pool)."""
        if getattr(self._inside, "yes", False):
            yield
            return
        me = threading.get_ident()
        with self._pool_lock:
            pool = self._pools.get(me)
            if pool is None and self._leases:
                pool = _private_pool(self.device)
                if pool is not None:
                    self._pools[me] = pool
        # What torch.cuda.use_mem_pool does where it routes a thread's allocations (before torch 2.8 it routed
        # a stream's).
        c, index = torch._C, self.device.index
        if pool is not None:
            try:
                c._cuda_beginAllocateCurrentThreadToPool(index, pool.id)
            except RuntimeError:  # an allocator that routes nothing to pools
                _no_pools.add(self.device)
                pool = None
        if pool is None:
            yield
            return
        self._inside.yes = True
        try:
            yield
        finally:
            self._inside.yes = False
            c._cuda_endAllocateToPool(index, pool.id)
            c._cuda_releasePool(index, pool.id)

    def _codec(self, op: DeviceOp) -> Any:
        codec = self._nb.codec_for(op, device=self.device, stream=self.stream)
        codec.timing = self.timing
        return codec

    # -- both directions --
    def memory_total(self) -> int | None:
        return int(torch.cuda.get_device_properties(self.device).total_memory)

    def host_buffer(self, size: int) -> torch.Tensor:
        return aligned_host_buffer(size, pin=True)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, stream: Any) -> Any:
        with torch.cuda.stream(stream):
            dst[: src.numel()].copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    def side_stream(self, after: Any) -> Any:
        s = torch.cuda.Stream(self.device)
        s.wait_stream(self.stream)
        if after is not None:
            s.wait_event(after)
        return s

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_contiguous():  # a view, no copy: no stream to allocate on (entering one costs ~40 us)
            return flat_bytes(tensor)
        with self._allocating(), torch.cuda.stream(self.stream):
            return flat_bytes(tensor)

    def source(self, tensor: torch.Tensor) -> torch.Tensor:
        """What encode reads a tensor's chunks from: its flat bytes (a view) where it is contiguous, else the
        tensor itself, whose chunks each batch stages (a contiguous copy of the whole tensor could be larger
        than the memory budget)."""
        return flat_bytes(tensor) if tensor.is_contiguous() else tensor

    def mark(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def caller_mark(self) -> Any:
        """An event after the caller's work so far, on the caller's current stream."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def wait(self, event: Any) -> None:
        event.synchronize()

    def ready(self, event: Any) -> bool:
        return bool(event.query())

    def finish(self) -> None:
        self.stream.synchronize()
        self.gather_stream.synchronize()
        self.copy_stream.synchronize()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._packing.clear()

    def _timed(self) -> Any:
        if not self.timing:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.stream)
        return ev

    def timing_report(self) -> dict[str, Any]:
        from .stats import timing_report

        return timing_report(self.timings) if self.timings else {}

    # -- encode --
    def wait_for_caller(self, event: Any) -> None:
        """Order the engine's streams after the caller's pending work: after ``event`` where the caller
        recorded one (an async_save's call, a snapshot's copies), else after this thread's current stream.
        Only the event: a lazy save's caller goes on queueing its next forward and backward on the default
        stream, which this thread shares, and the reads must not wait for those."""
        caller = torch.cuda.current_stream(self.device)
        for s in (self.stream, self.copy_stream):
            if event is not None:
                s.wait_event(event)
            else:
                s.wait_stream(caller)

    def ordered(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` with its device work on the engine's stream: after the caller's work (wait_for_caller)."""
        with torch.cuda.stream(self.stream):
            return fn()

    def capacity(self, pipeline: Pipeline, length: int) -> int:
        # Memoized by its one caller, the engine's planning (encode._pipeline), and nvCOMP's bound per process.
        op = pipeline.device_op()
        if op is None:
            raise ValueError(f"pipeline {pipeline.describe()} does not encode on the GPU")
        c = self._codec(op)
        with self._allocating():  # nvCOMP's bound is asked with a probe buffer (once per process)
            return align_up(c.max_compressed_size(length), c.comp_alignment)

    def encode(self, batch: Batch, sources: dict[int, torch.Tensor]) -> Encoded:
        codec = self._codec(batch.key.device_op())
        with self._allocating():
            parts = self._parts(batch, sources)
            with torch.cuda.stream(self.stream):
                start = self._timed()
                result = codec.encode_parts(parts)
                end = self._timed()
        if result.capacity != batch.capacity:
            raise RuntimeError(f"planned capacity {batch.capacity} != nvCOMP's {result.capacity}")
        if self.timing:
            self.timings.append((start, end, *(result.codec_events or (None, None)), batch.key.describe(), batch.raw_bytes))
        return Encoded(batch, parts, result.capacity, result.buffer, result)

    def _parts(self, batch: Batch, sources: dict[int, torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
        """(tensor, start, length) of each chunk of ``batch`` on this device: chunks of tensors elsewhere (an
        optimizer's step counts on the CPU, another GPU) or not contiguous are staged on the engine's stream."""
        with self._allocating(), torch.cuda.stream(self.stream):
            return _batch_parts(batch, sources, self.device,
                                lambda x: x.device != self.device or not x.is_contiguous())

    def copy_out(self, enc: Encoded, run: SlotRun, raw: list[int], slot: torch.Tensor, gather: bool = False) -> Any:
        """Issue the copies of ``run``'s chunks into ``slot``; returns an event to wait for.

        With ``gather`` the pieces are packed on the gather stream into one of two device buffers of a
        slot each (GATHER_BUFFERS, counted in the memory budget), then moved by one copy on the copy
        stream: the next run is packed while this one crosses the link.  A buffer is packed again only
        after the copy that read it."""
        pieces = _pieces(run, raw)
        copy = self.copy_stream
        if not (gather and _packable(pieces)):
            with torch.cuda.stream(copy):
                copy.wait_event(enc.event)
                _copy_run(enc, run, raw, slot, non_blocking=True, gather=False)
                done = torch.cuda.Event()
                done.record(copy)
            return done
        if len(self._packing) < GATHER_BUFFERS:  # a new buffer while there are fewer than two
            with self._allocating(), torch.cuda.stream(self.gather_stream):
                entry = [torch.empty(slot.numel(), dtype=torch.uint8, device=self.device), None]
        else:  # else the one packed longest ago
            entry = self._packing.pop(0)
        self._packing.append(entry)
        buf, last = entry
        n = sum(p[4] for p in pieces)
        with torch.cuda.stream(self.gather_stream):
            self.gather_stream.wait_event(enc.event)
            if last is not None:
                self.gather_stream.wait_event(last)
            torch.cat([enc.buffer[d: d + m] for _, _, d, _, m in pieces], out=buf[:n])
            packed = torch.cuda.Event()
            packed.record(self.gather_stream)
        with torch.cuda.stream(copy):
            copy.wait_event(packed)
            copy.wait_event(enc.event)
            at = pieces[0][3]
            slot[at: at + n].copy_(buf[:n], non_blocking=True)
            _copy_raw(enc, run, raw, slot, non_blocking=True)
            done = torch.cuda.Event()
            done.record(copy)
        entry[1] = done
        return done

    # -- decode --
    def route(self, pipeline: Pipeline) -> Any:
        """``Pipeline.device_route``: "raw", "cpu", ("planes", k) (the coder on the host, the byte planes put back
        here), or a DeviceOp, whose chunks this nvCOMP must be able to read (UnsupportedCodecError before any read)."""
        route = pipeline.device_route(self.gpu_zstd)
        if isinstance(route, DeviceOp):
            self._nb.check_readable(route)
        return route

    def alloc(self, nbytes: int) -> torch.Tensor:
        """Scratch memory of the engine's stream (the arena)."""
        with self._allocating(), torch.cuda.stream(self.stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def dest(self, nbytes: int) -> torch.Tensor:
        """Memory for a tensor handed to the caller: allocated on the caller's stream, which waits
        for the engine's stream before the load returns (finish)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Host -> device on the engine's stream; returns once ``src`` may be reused."""
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        ev.synchronize()

    def upload_async(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Host (pinned) or device -> device on the engine's stream; returns an event after which ``src``
        may be reused: the loader reads the next span meanwhile."""
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Device -> host (pinned) on this thread's own stream, waited for: the bytes a device read
        brought, for their checksums on the host (called by the loader's checker threads)."""
        stream = getattr(self._fetch_streams, "stream", None)
        if stream is None:
            stream = self._fetch_streams.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()

    def device_reads(self, source: Any, required: bool) -> Any:
        """RangeReads of ``source`` into this device's memory (KvikIO: nvckpt.io.gds), or None where there
        are none (not a local file, KvikIO not installed; an error instead if ``required``)."""
        from ...io.gds import open_kvikio_reads

        with torch.cuda.device(self.device):
            return open_kvikio_reads(source, required=required)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def unshuffle(self, dst: torch.Tensor, planes: torch.Tensor, k: int) -> None:
        """Byte planes (host) -> elements (device): upload, then the transpose on the engine's stream."""
        with self._allocating(), torch.cuda.stream(self.stream):
            tmp = torch.empty(planes.numel(), dtype=torch.uint8, device=self.device)
            tmp.copy_(planes, non_blocking=True)
            self._nb.unshuffle_into(dst, tmp, k)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        ev.synchronize()

    def decode(self, key: Hashable, payloads: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        codec = self._codec(key)
        start = self._timed()
        with self._allocating():  # the decode's scratch
            codec.decode(payloads, outs)
        end = self._timed()
        if self.timing:
            self.timings.append((start, end, *(codec.last_codec_events or (None, None)), key.describe(),
                                 sum(o.numel() for o in outs)))


__all__ = ["Backend", "CudaBackend", "Encoded", "Lease", "cuda_device", "device_streams"]
