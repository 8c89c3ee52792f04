"""The GPU loader: chunks read into pinned memory (or device memory), verified, decoded by nvCOMP into the destination.

Stages, all overlapping, so that the disk is busy from the first byte to the last:

1. read: chunks are taken in file order and grouped into aligned reads of up
   to ``read_span_bytes`` (``read_schedule``, over ``nvckpt.io.ranges.coalesce``);
   ``read_threads`` threads read them (O_DIRECT where the filesystem allows: a
   load then costs the page cache nothing, and the bytes land in pinned memory
   directly) into a pool of ``read_buffers`` pinned buffers, pinned by the
   reader that first needs one.  With ``read_path`` "kvikio" (or "auto" where
   KvikIO runs GPUDirect Storage) the reads go straight to device buffers
   through KvikIO (``nvckpt.io.gds``) instead;
2. check: as many checker threads verify every chunk's XXH3-64 on the host
   (device reads are copied back for it first), BEFORE its bytes reach nvCOMP
   (which does not detect corrupt input: MEASURED.md), while the readers go on
   with the next reads; zstd chunks (and any codec without a GPU decoder) are
   decoded here with libzstd (``GpuLoadOptions.gpu_zstd``: why not nvCOMP's Zstd);
3. stage: the caller's thread queues each checked read's copy to a device arena
   of ``decode_batch_bytes`` and does not wait for it: the buffer goes back to
   the readers once the copy's event has fired;
4. decode: once the arena is full (or the reads are done), its ANS chunks are
   decoded by one batched nvCOMP call per data type, straight into the
   destination tensors' memory; raw chunks are copied there;
5. verify: a tensor whose chunks are all decoded is checked against its
   XXH3-64 by ``verify_workers`` threads (device-to-host in pieces), while
   reading goes on (``verify_tensors=False`` skips this).

The load's stats (``Checkpoint.stats()["last_gpu_load"]``) say which read path ran ("gds",
"kvikio-compat", "o_direct", "buffered", "source"), the bytes read, the reads' wall time and rate, reads in
flight at most, and the time spent checking, decoding and waiting for reads.

Memory beyond the tensors loaded: see ``nvckpt.GpuLoadOptions``.  ANS chunks
decode only here (nvCOMP on a CUDA GPU); every other codec also decodes on
the host (nvckpt.read.reader).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..._threads import WorkerPool
from ...codecs.base import DecodeRejected, DeviceOp
from ...errors import ChecksumError, FormatError, LimitError, NvckptError
from ...format.entry import Chunk, TensorEntry
from ...io.ranges import Read, coalesce
from ...io.gds import GDS
from ...io.source import DirectReads
from ...options import GpuLoadOptions, default_memory_budget
from ...read.reader import ChunkReader
from .backend import Backend
from .hashing import device_digest
from .pinned import PINNED

_ALIGN = 4096


# -- what to decode where -------------------------------------------------------------------
@dataclass
class _Target:
    """Chunks ``indices`` of ``entry`` decoded into ``dest`` (raw bytes [base, base + dest.numel()))."""

    entry: TensorEntry
    dest: torch.Tensor
    base: int
    indices: list[int]
    verify: bool
    left: int = 0


@dataclass
class _Item:
    target: _Target
    index: int
    chunk: Chunk

    @property
    def offset(self) -> int:
        return self.chunk.offset

    @property
    def stored_length(self) -> int:
        return self.chunk.stored_length

    def out(self) -> torch.Tensor:
        at = self.chunk.raw_start - self.target.base
        return self.target.dest[at: at + self.chunk.raw_length]


@dataclass
class _Span:
    """One read of the file and the chunks it covers (in file order)."""

    read: Read
    items: list[_Item]

    @property
    def start(self) -> int:
        return self.read.start

    @property
    def length(self) -> int:
        return self.read.length


def read_schedule(items: list[_Item], options: GpuLoadOptions, policy: Any) -> list[_Span]:
    """The loader's reads, in file order: the source's coalescing policy, widened to the loader's spans and
    aligned for O_DIRECT; every chunk is read into a pinned buffer, so none is read alone.  Each wanted
    chunk lies whole in exactly one read; reads share no byte where chunks start on pages (the GPU
    engine's files), else at most the one page where one read ends and the next begins."""
    policy = policy.with_(max_gap=max(policy.max_gap, options.max_gap), max_span=options.read_span_bytes,
                          align=_ALIGN, alone_from=1 << 62, max_ranges=1 << 62)
    reads = coalesce([it.offset for it in items], [it.stored_length for it in items], policy)
    return [_Span(r, items[r.first: r.stop]) for r in reads]


# -- reading ----------------------------------------------------------------------------------
def _on_host(route: Any) -> bool:
    return route == "cpu" or isinstance(route, tuple) and route[0] == "planes"


def _verify_and_decode(file: ChunkReader, span: "_Span", mv: memoryview, routes: list[Any]) -> dict[int, torch.Tensor]:
    """Check every chunk of a span that was read (its XXH3-64: ChunkReader.verify), what a device decoder's
    codec checks in stored bytes first (SPEC 11.4), and decode its host-routed chunks here (libzstd releases
    the GIL, so the checker threads decode in parallel): {item number: raw bytes}."""
    decoded = {}
    for k, (it, r) in enumerate(zip(span.items, routes)):
        at = it.offset - span.start
        data = mv[at: at + it.stored_length]
        file.verify(it.target.entry, it.index, data)
        if isinstance(r, DeviceOp):
            try:
                file.pipelines[it.chunk.codec_id].check_stored(data)
            except ValueError as exc:
                raise FormatError(str(exc), path=file.path, tensor=it.target.entry.name, chunk=it.index,
                                  offset=it.offset) from None
        if _on_host(r):
            if r == "cpu":
                raw = file.decode_payload(it.target.entry, it.index, data)
            else:  # the coder only (libzstd checks the frame); the planes are put back on the device
                if it.chunk.raw_length % r[1]:
                    raise FormatError(f"raw_length {it.chunk.raw_length} is not a multiple of the element size {r[1]}",
                                      path=file.path, tensor=it.target.entry.name, chunk=it.index, offset=it.offset)
                raw = file.decode_coder(it.target.entry, it.index, data)
            out = torch.empty(it.chunk.raw_length, dtype=torch.uint8)
            out.numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
            decoded[k] = out
    return decoded


class _ReadStage:
    """Spans read by ``read_threads`` threads into ``count`` buffers of ``size`` bytes, then checked by as
    many checker threads, so that a thread that finished a read starts the next one at once: the disk
    always has ``read_threads`` reads queued while buffers are free.

    ``device_reads`` (KvikIO) reads into device buffers; a checker then copies the span to a pinned buffer
    of its own to check it on the host, before any of its bytes reaches a device decoder.  Otherwise the
    buffers are pinned host memory, allocated (pinned: ~0.4 s per GB) by the reader thread that first
    needs one, not on the loader's thread.

    Counts, for the load's stats: wall time from the first read's start to the last read's end, time
    inside reads (summed over threads), reads in flight at most, checking time."""

    def __init__(self, file: ChunkReader, dev: Backend, reads: Any, device_reads: Any, count: int, size: int,
                 threads: int) -> None:
        self.file = file
        self.dev = dev
        self.reads = reads
        self.device_reads = device_reads
        self.size = size
        self.buffers: list[torch.Tensor | None] = [None] * count
        self._free = list(range(count - 1, -1, -1))
        self._lock = threading.Lock()
        self._local = threading.local()
        self._scratch: list[torch.Tensor] = []  # the checkers' pinned buffers (device reads)
        self.readers = WorkerPool(threads, "nvckpt-read")
        self.checkers = WorkerPool(threads, "nvckpt-check")
        self.in_flight = 0
        self.in_flight_max = 0
        self.first_start: float | None = None
        self.last_end = 0.0
        self.read_seconds = 0.0
        self.check_seconds = 0.0
        self.reads_done = 0

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def give(self, slot: int) -> None:
        if slot in self._free:
            raise RuntimeError(f"read buffer {slot} returned twice")
        self._free.append(slot)

    def buffer(self, slot: int) -> torch.Tensor:
        buf = self.buffers[slot]
        if buf is None:  # only the task that holds the slot gets here
            if self.device_reads is not None:
                buf = self.dev.alloc(self.size)
            else:
                buf = PINNED.take(self.size, self.dev.host_buffer)
            self.buffers[slot] = buf
        return buf

    def submit(self, span: _Span, slot: int, routes: list[Any]) -> Future:
        """A future of a future: the read, then its check (``result().result()``: {item: host-decoded bytes})."""
        return self.readers.submit(self._read, span, slot, routes)

    def _read(self, span: _Span, slot: int, routes: list[Any]) -> Future:
        buf = self.buffer(slot)
        need = max(it.offset + it.stored_length for it in span.items) - span.start
        t0 = time.perf_counter()
        with self._lock:
            self.in_flight += 1
            self.in_flight_max = max(self.in_flight_max, self.in_flight)
            if self.first_start is None:
                self.first_start = t0
        try:
            if self.device_reads is not None:
                self.device_reads.read(span.start, span.length, need, buf)
            else:
                self.reads.read(span.start, span.length, need, memoryview(buf.numpy()))
        finally:
            t1 = time.perf_counter()
            with self._lock:
                self.in_flight -= 1
                self.read_seconds += t1 - t0
                self.last_end = max(self.last_end, t1)
                self.reads_done += 1
        return self.checkers.submit(self._check, span, buf, need, routes)

    def _check(self, span: _Span, buf: torch.Tensor, need: int, routes: list[Any]) -> dict[int, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            if self.device_reads is not None:  # the bytes on the host, for their checksums
                host = getattr(self._local, "host", None)
                if host is None:
                    host = self._local.host = PINNED.take(self.size, self.dev.host_buffer)
                    with self._lock:
                        self._scratch.append(host)
                self.dev.fetch(host[:need], buf[:need])
                buf = host
            return _verify_and_decode(self.file, span, memoryview(buf.numpy())[:need], routes)
        finally:
            with self._lock:
                self.check_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Stop the threads (reads not started are cancelled) and give the pinned buffers back."""
        self.readers.shutdown(wait=True, cancel_futures=True)
        self.checkers.shutdown(wait=True, cancel_futures=True)
        if self.device_reads is None:
            PINNED.give([b for b in self.buffers if b is not None])
        PINNED.give(self._scratch)
        self.buffers = [None] * len(self.buffers)
        self._scratch = []

    def report(self) -> dict[str, Any]:
        wall = self.last_end - self.first_start if self.first_start is not None else 0.0
        return {"read_seconds": wall, "read_busy_seconds": self.read_seconds, "reads": self.reads_done,
                "reads_in_flight_max": self.in_flight_max, "check_seconds": self.check_seconds}


# -- verification of whole tensors ----------------------------------------------------------
class _Verifier:
    def __init__(self, dev: Backend, path: str, workers: int, piece_bytes: int) -> None:
        self.dev = dev
        self.path = path
        self.piece_bytes = piece_bytes
        self.pool = WorkerPool(workers, "nvckpt-verify")
        self.futures: list[Future] = []
        self._local = threading.local()

    def submit(self, target: _Target) -> None:
        after = self.dev.mark()
        self.futures.append(self.pool.submit(self._check, target, after))

    def _check(self, target: _Target, after: Any) -> None:
        stream = self.dev.side_stream(after) if target.dest.device.type != "cpu" else None
        pieces = getattr(self._local, "pieces", None)
        if pieces is None:
            pieces = self._local.pieces = []
        if device_digest(self.dev, target.dest, stream, pieces, self.piece_bytes) != target.entry.checksum:
            raise ChecksumError("tensor checksum does not match its decoded bytes", path=self.path, tensor=target.entry.name)

    def close(self, wait_results: bool) -> None:
        try:
            if wait_results:
                for f in self.futures:
                    f.result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


# -- the loader -------------------------------------------------------------------------------
def _dest(dev: Backend, nbytes: int, file: ChunkReader, entry: TensorEntry) -> torch.Tensor:
    """The destination of a tensor's bytes; a failed allocation is a LimitError naming the tensor."""
    try:
        return dev.dest(nbytes)
    except (RuntimeError, MemoryError) as exc:
        if isinstance(exc, RuntimeError) and "memory" not in str(exc).lower() and "alloc" not in str(exc).lower():
            raise
        raise LimitError(f"cannot allocate {nbytes} bytes for it ({str(exc).splitlines()[0][:160]}); "
                         "open the file with max_tensor_bytes=N to refuse such tensors before allocating",
                         path=file.path, tensor=entry.name) from None



def decode_entries(file: ChunkReader, entries: Sequence[TensorEntry], dev: Backend, options: GpuLoadOptions,
                   stats: dict[str, Any] | None = None) -> dict[int, torch.Tensor]:
    """The raw bytes (1-D uint8 on ``dev``) of stored tensors: {tensor_id: bytes}."""
    targets = []
    for e in entries:
        if e.chunks is None:
            raise ValueError(f"decode_entries takes stored tensors only, not {e.name!r}")
        targets.append(_Target(e, _dest(dev, e.nbytes, file, e), 0, list(range(len(e.chunks))),
                               options.verify_tensors and e.checksum is not None))
    _decode(file, targets, dev, options, {} if stats is None else stats)
    return {t.entry.tensor_id: t.dest for t in targets}


def decode_range(file: ChunkReader, entry: TensorEntry, lo: int, hi: int, dev: Backend, options: GpuLoadOptions,
                 stats: dict[str, Any] | None = None) -> torch.Tensor:
    """Raw bytes [lo, hi) of a stored tensor (1-D uint8 on ``dev``), decoding only the chunks that hold them."""
    if entry.chunks is None:
        raise ValueError(f"decode_range reads stored tensors only, not {entry.name!r}")
    idx = list(entry.chunks.covering(lo, hi))
    if not idx:
        return dev.dest(0)
    base = entry.chunks[idx[0]].raw_start
    end = entry.chunks[idx[-1]].raw_start + entry.chunks[idx[-1]].raw_length
    target = _Target(entry, _dest(dev, end - base, file, entry), base, idx, False)
    _decode(file, [target], dev, options, {} if stats is None else stats)
    return target.dest[lo - base: hi - base]


def _open_reads(file: ChunkReader, dev: Backend, options: GpuLoadOptions,
                stats: dict[str, Any]) -> tuple[Any, Any, str]:
    """(host RangeReads, device RangeReads or None, read path): ``GpuLoadOptions.read_path`` decided here.
    "auto" takes the device's own reads (KvikIO) only where they run GPUDirect Storage: KvikIO's
    compatibility mode bounces through pinned buffers as the loader's O_DIRECT reads do.  A KvikIO that
    fails to open the file under "auto" leaves the load to the pinned path (its error in the stats)."""
    device_reads = None
    if options.read_path == "kvikio":
        device_reads = dev.device_reads(file.source, True)
    elif options.read_path == "auto":
        try:
            device_reads = dev.device_reads(file.source, False)
        except Exception as exc:  # noqa: BLE001 - cuFile or the driver refusing this file: the pinned path
            stats["device_reads_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if device_reads is not None and device_reads.mode != GDS:
            device_reads.close()
            device_reads = None
    if device_reads is not None:
        return None, device_reads, device_reads.mode
    reads = file.source.range_reads(options.direct_io)
    if isinstance(reads, DirectReads):
        return reads, None, "o_direct" if options.direct_io and reads.direct is not None else "buffered"
    return reads, None, "source"


def _decode(file: ChunkReader, targets: list[_Target], dev: Backend, options: GpuLoadOptions,
            stats: dict[str, Any]) -> None:
    started = time.perf_counter()
    items = []
    for t in targets:
        t.left = len(t.indices)
        items.extend(_Item(t, i, t.entry.chunks[i]) for i in t.indices)
    items.sort(key=lambda it: it.offset)
    spans = deque(read_schedule(items, options, file.source.coalescing))
    stats.update(spans=len(spans), chunks=len(items), stored_bytes=sum(it.stored_length for it in items))
    verifier = _Verifier(dev, file.path, options.verify_workers, options.piece_bytes)
    for t in targets:
        if t.verify and not t.indices:
            verifier.submit(t)
    if not spans:
        verifier.close(True)
        return
    routes: dict[int, Any] = {}
    pipelines = file.pipelines

    def route(it: _Item) -> Any:
        cid = it.chunk.codec_id
        if cid not in routes:
            try:
                routes[cid] = dev.route(pipelines[cid])
            except NvckptError as exc:
                raise exc.located(path=file.path, tensor=it.target.entry.name, chunk=it.index, offset=it.offset)
        return routes[cid]

    for it in items:  # UnsupportedCodecError before any read
        route(it)
    buf_size = max(max(s.length for s in spans), options.read_span_bytes)
    budget = options.memory_budget or default_memory_budget(dev.memory_total())
    # The arena is the loader's device memory (besides a chunk's staging and nvCOMP's scratch): half the budget.
    arena_bytes = max(min(options.decode_batch_bytes, budget // 2), buf_size)
    reads, device_reads, read_path = _open_reads(file, dev, options, stats)
    count = min(options.read_buffers, len(spans))
    if device_reads is not None:  # the read buffers are device memory too: what the budget leaves them
        count = max(2, min(count, (budget - arena_bytes) // buf_size))
    stats.update(memory_budget=budget, arena_bytes=arena_bytes, read_path=read_path, read_buffers=count,
                 read_buffer_bytes=buf_size)
    stage = _ReadStage(file, dev, reads, device_reads, count, buf_size, options.read_threads)
    arena = dev.alloc(arena_bytes)
    inflight: deque = deque()  # (span, slot, routes, future of its read), in file order
    uploading: deque = deque()  # (slot, event after which its buffer may be read into again)
    staged: dict[Any, list[tuple[_Item, torch.Tensor]]] = {}
    arena_used = 0
    cpu_chunks = 0
    wait_reads = 0.0
    ok = False

    def done(it: _Item) -> None:
        t = it.target
        t.left -= 1
        if t.left == 0 and t.verify:
            verifier.submit(t)

    phases = {"decode_rounds": 0.0, "uploads": 0.0, "verify_tail": 0.0}

    def decode_round() -> None:
        t0 = time.perf_counter()
        try:
            _decode_round()
        finally:
            phases["decode_rounds"] += time.perf_counter() - t0

    def _decode_round() -> None:
        for key, group in staged.items():
            try:
                dev.decode(key, [p for _, p in group], [it.out() for it, _ in group])
            except torch.cuda.OutOfMemoryError:
                raise  # the device is full: not the file's fault
            except (DecodeRejected, RuntimeError, ValueError) as exc:
                first = group[0][0]
                if isinstance(key, DeviceOp) and not pipelines[first.chunk.codec_id].needs_gpu:
                    # A valid frame the device decoder refuses (a feature it lacks): the host decodes it.
                    for it, payload in group:
                        raw = file.decode_payload(it.target.entry, it.index, payload.cpu().numpy().tobytes())
                        dev.upload(it.out(), torch.frombuffer(bytearray(raw), dtype=torch.uint8))
                    stats["cpu_fallback_chunks"] = stats.get("cpu_fallback_chunks", 0) + len(group)
                elif isinstance(exc, (DecodeRejected, ValueError)):  # the decoder refused its input
                    raise FormatError(f"{pipelines[first.chunk.codec_id].describe()} could not decode a batch of "
                                      f"{len(group)} chunks: {exc}", path=file.path, tensor=first.target.entry.name,
                                      chunk=first.index, offset=first.offset) from None
                else:
                    raise
            for it, _ in group:
                done(it)
        staged.clear()

    def reclaim(block: bool) -> None:
        """Buffers whose upload is done go back to the readers (the oldest waited for, if ``block``)."""
        while uploading and (block or dev.ready(uploading[0][1])):
            slot, event = uploading.popleft()
            dev.wait(event)
            stage.give(slot)
            block = False

    try:
        while spans or inflight:
            reclaim(False)
            while spans and stage.free:
                span = spans.popleft()
                slot = stage.take()
                routes_of = [routes[it.chunk.codec_id] for it in span.items]
                inflight.append((span, slot, routes_of, stage.submit(span, slot, routes_of)))
            if not inflight:  # every buffer still being uploaded
                reclaim(True)
                continue
            span, slot, routes_of, fut = inflight.popleft()
            t0 = time.perf_counter()
            decoded = fut.result().result()  # ChecksumError, TruncatedError, OSError, a CPU decoder's FormatError
            wait_reads += time.perf_counter() - t0
            buf = stage.buffers[slot]
            if arena_used + span.length > arena.numel():
                decode_round()
                arena_used = 0
            dev_span = arena[arena_used: arena_used + span.length]
            to_stage = []
            for k, (it, r) in enumerate(zip(span.items, routes_of)):
                if r == "cpu":  # decoded on the host by a checker thread
                    dev.upload(it.out(), decoded[k])
                    cpu_chunks += 1
                    done(it)
                elif isinstance(r, tuple) and r[0] == "planes":  # zstd decoded by a checker thread
                    if r[1] > 1:
                        dev.unshuffle(it.out(), decoded[k], r[1])
                    else:
                        dev.upload(it.out(), decoded[k])
                    cpu_chunks += 1
                    done(it)
                else:
                    to_stage.append((it, r, it.offset - span.start))
            if not to_stage:
                stage.give(slot)
                continue
            t0 = time.perf_counter()
            # Not waited for here: the buffer goes back to the readers once the copy is done (reclaim).
            uploading.append((slot, dev.upload_async(dev_span, buf[: span.length])))
            phases["uploads"] += time.perf_counter() - t0
            arena_used += -(-span.length // _ALIGN) * _ALIGN
            for it, r, at in to_stage:
                payload = dev_span[at: at + it.stored_length]
                if r == "raw":
                    if it.stored_length != it.chunk.raw_length:
                        raise FormatError(f"raw chunk stores {it.stored_length} bytes for a raw length of {it.chunk.raw_length}",
                                          path=file.path, tensor=it.target.entry.name, chunk=it.index, offset=it.offset)
                    dev.copy(it.out(), payload)
                    done(it)
                else:
                    staged.setdefault(r, []).append((it, payload))
        decode_round()
        dev.finish()
        ok = True
    except BaseException as exc:
        # The frames of the error's traceback (a decode round, the decoder) hold views of the arena and of
        # the read buffers; the caller may keep the error: let them go, so the lease's pool goes back whole.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        for *_, fut in inflight:
            fut.cancel()
        if not ok:
            try:
                dev.finish()  # no copy may still read a buffer given back below
            except Exception:  # noqa: BLE001 - the load's own error is the one to raise
                pass
        stage.close()
        # The device buffers go now, not with this frame (an error's traceback keeps it): the caller's lease
        # hands the memory of all of them back to the device when it ends.
        staged.clear()
        inflight.clear()
        uploading.clear()
        arena = dev_span = payload = buf = None
        used = device_reads if device_reads is not None else reads
        bytes_read, direct_reads = used.bytes_read, used.direct_reads
        used.close()
        t0 = time.perf_counter()
        try:
            verifier.close(ok)
        finally:
            dev.finish()
            phases["verify_tail"] = time.perf_counter() - t0
    if read_path == "o_direct" and not direct_reads:  # the filesystem refused O_DIRECT reads after all
        read_path = "buffered"
    seconds = time.perf_counter() - started
    report = stage.report()
    stats.update(read_path=read_path, seconds=seconds, waiting_for_reads_seconds=wait_reads, bytes_read=bytes_read,
                 direct_reads=direct_reads, phases=phases, cpu_decoded_chunks=cpu_chunks,
                 decode_seconds=phases["decode_rounds"], **report,
                 read_GBps=bytes_read / report["read_seconds"] / 1e9 if report["read_seconds"] else None)
    stats.update(dev.timing_report())


__all__ = ["decode_entries", "decode_range", "read_schedule"]
