"""The GPU loader: chunks read into pinned memory, verified, decoded by nvCOMP into the destination.

Stages, all overlapping:

1. read: chunks are taken in file order and grouped into aligned reads of up
   to ``read_span_bytes`` (``nvckpt.io.ranges.coalesce``); ``read_threads``
   threads read them (O_DIRECT where the filesystem allows: a load then costs
   the page cache nothing, and the bytes land in pinned memory directly) into
   a fixed pool of ``read_buffers`` pinned buffers, and check every chunk's
   XXH3-64 there, BEFORE its bytes reach nvCOMP (which does not detect corrupt
   input: MEASURED.md);
2. stage: the caller's thread copies each verified read to a device arena of
   ``decode_batch_bytes`` and returns the pinned buffer to the readers;
3. decode: once the arena is full (or the reads are done), its ANS chunks are
   decoded by one batched nvCOMP call per data type, straight into the
   destination tensors' memory; raw chunks are copied there; zstd chunks
   (and any codec without a GPU decoder) are decoded with libzstd by the
   reader threads and copied up (``GpuLoadOptions.gpu_zstd``: why not nvCOMP's Zstd);
4. verify: a tensor whose chunks are all decoded is checked against its
   XXH3-64 by ``verify_workers`` threads (device-to-host in pieces), while
   reading goes on (``verify_tensors=False`` skips this).

Memory beyond the tensors loaded: see ``nvckpt.GpuLoadOptions``.  ANS chunks
decode only here (nvCOMP on a CUDA GPU); every other codec also decodes on
the host (nvckpt.read.reader).
"""

from __future__ import annotations

import threading
import time
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
from ...io.source import RangeReads
from ...options import GpuLoadOptions, default_memory_budget
from ...read.reader import ChunkReader
from .backend import Backend
from .batching import SlotPool
from .hashing import device_digest
from .pinned import PINNED, cached_allocator

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


def _spans(items: list[_Item], options: GpuLoadOptions, policy: Any) -> list[_Span]:
    """The loader's reads: the source's coalescing policy, widened to the loader's spans and aligned for
    O_DIRECT; every chunk is read into a pinned buffer, so none is read alone."""
    policy = policy.with_(max_gap=max(policy.max_gap, options.max_gap), max_span=options.read_span_bytes,
                          align=_ALIGN, alone_from=1 << 62, max_ranges=1 << 62)
    reads = coalesce([it.offset for it in items], [it.stored_length for it in items], policy)
    return [_Span(r, items[r.first: r.stop]) for r in reads]


# -- reading ----------------------------------------------------------------------------------
def _on_host(route: Any) -> bool:
    return route == "cpu" or isinstance(route, tuple) and route[0] == "planes"


def _read_and_verify(file: ChunkReader, reads: RangeReads, span: "_Span", buf: torch.Tensor,
                     routes: list[Any]) -> dict[int, torch.Tensor]:
    """Read a span, verified (ChunkReader.read_span), and decode its host-routed chunks here
    (libzstd releases the GIL, so the reader threads decode in parallel): {item number: raw bytes}."""
    need = max(it.offset + it.stored_length for it in span.items) - span.start
    mv = file.read_span(reads, span.read, need, [(it.target.entry, it.index) for it in span.items],
                        memoryview(buf.numpy()))
    decoded = {}
    for k, (it, r) in enumerate(zip(span.items, routes)):
        if isinstance(r, DeviceOp):  # to a device decoder: what its codec checks in stored bytes first (SPEC 11.4)
            at = it.offset - span.start
            try:
                file.pipelines[it.chunk.codec_id].check_stored(mv[at: at + it.stored_length])
            except ValueError as exc:
                raise FormatError(str(exc), path=file.path, tensor=it.target.entry.name, chunk=it.index,
                                  offset=it.offset) from None
        if _on_host(r):
            at = it.offset - span.start
            data = mv[at: at + it.stored_length]
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


def _decode(file: ChunkReader, targets: list[_Target], dev: Backend, options: GpuLoadOptions,
            stats: dict[str, Any]) -> None:
    started = time.perf_counter()
    items = []
    for t in targets:
        t.left = len(t.indices)
        items.extend(_Item(t, i, t.entry.chunks[i]) for i in t.indices)
    items.sort(key=lambda it: it.offset)
    spans = deque(_spans(items, options, file.source.coalescing))
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

    buf_size = max(max(s.length for s in spans), options.read_span_bytes)
    budget = options.memory_budget or default_memory_budget(dev.memory_total())
    # The arena is the loader's device memory (besides a chunk's staging and nvCOMP's scratch): half the budget.
    arena_bytes = max(min(options.decode_batch_bytes, budget // 2), buf_size)
    stats.update(memory_budget=budget, arena_bytes=arena_bytes)
    reads = file.source.range_reads(options.direct_io)
    pool = SlotPool(min(options.read_buffers, len(spans)), buf_size, cached_allocator(dev.host_buffer), lazy=True)
    arena = dev.alloc(arena_bytes)
    readers = WorkerPool(options.read_threads, "nvckpt-read")
    inflight: deque = deque()
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

    try:
        while spans or inflight:
            while spans and pool.free:
                slot = pool.take()
                span = spans.popleft()
                routes_of = [route(it) for it in span.items]  # UnsupportedCodecError before any read
                inflight.append((span, slot, routes_of,
                                 readers.submit(_read_and_verify, file, reads, span, pool.slots[slot], routes_of)))
            span, slot, routes_of, fut = inflight.popleft()
            t0 = time.perf_counter()
            decoded = fut.result()  # ChecksumError, TruncatedError, OSError, a CPU decoder's FormatError
            wait_reads += time.perf_counter() - t0
            host = pool.slots[slot]
            if arena_used + span.length > arena.numel():
                decode_round()
                arena_used = 0
            dev_span = arena[arena_used: arena_used + span.length]
            to_stage = []
            for k, (it, r) in enumerate(zip(span.items, routes_of)):
                if r == "cpu":  # decoded on the host by the reader thread
                    dev.upload(it.out(), decoded[k])
                    cpu_chunks += 1
                    done(it)
                elif isinstance(r, tuple) and r[0] == "planes":  # zstd decoded by the reader thread
                    if r[1] > 1:
                        dev.unshuffle(it.out(), decoded[k], r[1])
                    else:
                        dev.upload(it.out(), decoded[k])
                    cpu_chunks += 1
                    done(it)
                else:
                    to_stage.append((it, r, it.offset - span.start))
            if to_stage:
                t0 = time.perf_counter()
                dev.upload(dev_span, host[: span.length])
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
            pool.give(slot)
        decode_round()
        dev.finish()
        ok = True
    finally:
        for *_, fut in inflight:
            fut.cancel()
        readers.shutdown(wait=True, cancel_futures=True)
        PINNED.give(pool.slots)
        bytes_read, direct_reads = reads.bytes_read, reads.direct_reads
        reads.close()
        t0 = time.perf_counter()
        try:
            verifier.close(ok)
        finally:
            dev.finish()
            phases["verify_tail"] = time.perf_counter() - t0
    stats.update(seconds=time.perf_counter() - started, waiting_for_reads_seconds=wait_reads,
                 bytes_read=bytes_read, direct_reads=direct_reads, phases=phases, cpu_decoded_chunks=cpu_chunks)
    stats.update(dev.timing_report())


__all__ = ["decode_entries", "decode_range"]
