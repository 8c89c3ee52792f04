"""The GPU loader: chunks read into pinned memory, verified, decoded by nvCOMP into the destination.

Stages, all overlapping:

1. read: chunks are taken in file order and grouped into aligned reads of up
   to ``READ_SPAN_BYTES`` (``batching.plan_read_spans``); ``READ_THREADS``
   threads read them (O_DIRECT where the filesystem allows: a load then costs
   the page cache nothing, and the bytes land in pinned memory directly) into
   a fixed pool of ``READ_BUFFERS`` pinned buffers, and check every chunk's
   XXH3-64 there, BEFORE its bytes reach nvCOMP (which does not detect corrupt
   input: MEASURED.md);
2. stage: the caller's thread copies each verified read to a device arena of
   ``DECODE_BATCH_BYTES`` and returns the pinned buffer to the readers;
3. decode: once the arena is full (or the reads are done), its ANS chunks are
   decoded by one batched nvCOMP call per data type, straight into the
   destination tensors' memory; raw chunks are copied there; zstd chunks
   (and any codec without a GPU decoder) are decoded with libzstd by the
   reader threads and copied up (``GPU_ZSTD``: why not nvCOMP's Zstd);
4. verify: a tensor whose chunks are all decoded is checked against its
   XXH3-64 by ``VERIFY_WORKERS`` threads (device-to-host in pieces), while
   reading goes on.  (``VERIFY_TENSORS = False`` skips this.)

Memory beyond the tensors loaded: pinned READ_BUFFERS x READ_SPAN_BYTES (+
2 x PIECE_BYTES per verify worker); device DECODE_BATCH_BYTES + one read
span, plus nvCOMP's scratch.  ANS chunks decode only here (nvCOMP on a CUDA
GPU); every other codec also decodes on the CPU (nvckpt.pipeline.reader).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import xxhash

from .. import dtypes
from ..codecs import Pipeline
from ..errors import ChecksumError, FormatError, NvckptError, TruncatedError
from ..format.index import Chunk, TensorEntry
from ..format.structs import xxh3
from . import nvcomp_backend as nb
from .batching import SlotPool, aligned_host_buffer, plan_read_spans
from .reader import Reader, check_bools, check_supported

MiB = 1 << 20
READ_SPAN_BYTES = 32 * MiB
READ_THREADS = 4
READ_BUFFERS = 12  # allocated as needed; more than the reads in flight, so a busy consumer does not stall the disk
MAX_GAP = 1 * MiB  # bytes between two wanted chunks that one read may still cover
DECODE_BATCH_BYTES = 256 * MiB
DIRECT_IO = True
# zstd chunks decode with libzstd on the CPU, in the reader threads.  nvCOMP's Zstd decoder
# crashed the process (SIGABRT) on a garbage frame with a valid checksum and accepted
# trailing garbage after a frame (conformance suite, H200): a file must never crash its
# reader, and these loads are disk-bound anyway.  True sends them to nvCOMP instead.
GPU_ZSTD = False
VERIFY_TENSORS = True
VERIFY_WORKERS = 4  # one XXH3 stream runs ~6 GB/s on the H200 host
PIECE_BYTES = 16 * MiB
_ALIGN = 4096

last_stats: dict[str, Any] = {}  # figures of the last load through this loader (for benchmarks)


def available() -> bool:
    return nb.available()


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


# -- devices ----------------------------------------------------------------------------------
_streams: dict[Any, Any] = {}
_streams_lock = threading.Lock()


def engine_stream(device: torch.device) -> Any:
    """One long-lived decode stream per device: buffers cached by torch's allocator on it are reused by the next load."""
    with _streams_lock:
        s = _streams.get(device)
        if s is None:
            s = _streams[device] = torch.cuda.Stream(device)
        return s


class CudaDecoder:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = engine_stream(device)
        self._codecs: dict[tuple, nb.GpuCodec] = {}
        self.timings: list[tuple[Any, Any, int]] = []

    def route(self, pipeline: Pipeline) -> Any:
        """"raw", "cpu", or the key of a batched GPU decode."""
        if [s.name for s in pipeline.steps] == ["raw"]:
            return "raw"
        op = nb.gpu_op_for(pipeline)  # raises UnsupportedCodecError for ANS of another nvCOMP major
        if op is None:
            return "cpu"
        if op[0] == "zstd" and not GPU_ZSTD:
            return ("planes", op[2])  # libzstd on the CPU, byte planes put back on the GPU
        return op

    def unshuffle(self, dst: torch.Tensor, planes: torch.Tensor, k: int) -> None:
        """Byte planes (host) -> elements (device): upload, then the transpose on the decode stream."""
        with torch.cuda.stream(self.stream):
            tmp = torch.empty(planes.numel(), dtype=torch.uint8, device=self.device)
            tmp.copy_(planes, non_blocking=True)
            nb.unshuffle_into(dst, tmp, k)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        ev.synchronize()

    def alloc(self, nbytes: int) -> torch.Tensor:
        """Scratch memory of the decode stream (the arena)."""
        with torch.cuda.stream(self.stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def dest(self, nbytes: int) -> torch.Tensor:
        """Memory for a tensor handed to the caller: allocated on the caller's stream, which
        waits for the decode stream before the load returns."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host_buffer(self, size: int) -> torch.Tensor:
        return aligned_host_buffer(size, pin=True)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Host -> device on the decode stream; returns once ``src`` may be reused."""
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        ev.synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def decode(self, key: Any, payloads: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        codec = self._codecs.get(key)
        if codec is None:
            codec = self._codecs[key] = nb.codec_for(key[0], key[1], key[2], device=self.device, stream=self.stream)
            codec.timing = True
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        codec.decode(payloads, outs)
        end.record(self.stream)
        events = getattr(codec, "last_codec_events", None) or (None, None)
        label = f"{key[0]}({key[1]})" if key[0] == "ans" else f"zstd(shuffle={key[2]})"
        self.timings.append((start, end, *events, label, sum(o.numel() for o in outs)))

    def mark(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, stream: Any) -> Any:
        with torch.cuda.stream(stream):
            dst[: src.numel()].copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    def side_stream(self, after: Any) -> Any:
        s = torch.cuda.Stream(self.device)
        s.wait_event(after)
        return s

    def wait(self, event: Any) -> None:
        event.synchronize()

    def finish(self) -> None:
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def timing_report(self) -> dict[str, Any]:
        from .encode_gpu import timing_report
        return timing_report(self.timings)


class HostDecoder:
    """The same loader with the CPU codecs on the CPU: runs the scheduling in CI without a GPU."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def route(self, pipeline: Pipeline) -> Any:
        # byteshuffle+zstd takes the route it takes on a GPU (libzstd in the reader threads, planes
        # put back by the "device"); plain zstd stands in for a device codec, so CI runs both paths.
        names = [s.name for s in pipeline.steps]
        if names == ["raw"]:
            return "raw"
        if names == ["byteshuffle", "zstd"]:
            return ("planes", pipeline.steps[0].elementsize)
        return pipeline

    def unshuffle(self, dst: torch.Tensor, planes: torch.Tensor, k: int) -> None:
        nb.unshuffle_into(dst, planes, k)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    dest = alloc

    def host_buffer(self, size: int) -> torch.Tensor:
        return aligned_host_buffer(size, pin=False)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def decode(self, key: Pipeline, payloads: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        for i, (p, o) in enumerate(zip(payloads, outs)):
            data = memoryview(key.decode(memoryview(p.numpy()), o.numel())).cast("B")
            if data.nbytes != o.numel():
                raise NvckptError(f"chunk {i} of a batch decoded to {data.nbytes} bytes, expected {o.numel()}")
            o.numpy()[:] = np.frombuffer(data, dtype=np.uint8)

    def mark(self) -> Any:
        return None

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, stream: Any) -> Any:
        dst[: src.numel()].copy_(src)
        return None

    def side_stream(self, after: Any) -> Any:
        return None

    def wait(self, event: Any) -> None:
        pass

    def finish(self) -> None:
        pass

    def timing_report(self) -> dict[str, Any]:
        return {}


# -- reading ----------------------------------------------------------------------------------
class _Files:
    """Positional reads of the checkpoint into host buffers: O_DIRECT where the filesystem allows."""

    def __init__(self, reader: Reader, direct: bool) -> None:
        self.reader = reader
        self.source = reader.source
        self.plain = self.direct = None
        self.bytes_read = 0
        self.direct_reads = 0
        self._lock = threading.Lock()
        fd = getattr(self.source, "_fd", None)
        # Reopen the file the Reader has open, not whatever the path names now: an atomic
        # save may have replaced it since (on Linux, /proc/self/fd/N is that same file).
        path = f"/proc/self/fd/{fd}" if fd is not None and os.path.exists(f"/proc/self/fd/{fd}") else self.source.name
        if fd is not None and os.path.isfile(path):
            self.plain = os.open(path, os.O_RDONLY)
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    self.direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
                except OSError:
                    self.direct = None

    def close(self) -> None:
        for fd in (self.plain, self.direct):
            if fd is not None:
                os.close(fd)
        self.plain = self.direct = None

    def read(self, start: int, length: int, need: int, buf: torch.Tensor) -> memoryview:
        """At least ``need`` bytes from ``start`` into ``buf`` (asks for ``length``, aligned)."""
        mv = memoryview(buf.numpy())
        size = self.source.size
        if self.plain is None:  # a file object: go through the Reader's own lock
            n = min(length, size - start)
            mv[:n] = self.source.pread(start, n)
            return mv
        got = 0
        while got < need:
            fd = self.direct if self.direct is not None and got % _ALIGN == 0 else self.plain
            want = length - got if fd == self.direct else min(length, size - start) - got
            try:
                n = os.preadv(fd, [mv[got: got + want]], start + got)
            except OSError as exc:
                if fd == self.direct and exc.errno == errno.EINVAL:
                    self.direct = None  # this filesystem refuses O_DIRECT reads after all
                    continue
                raise
            if n <= 0:
                raise TruncatedError(f"file ended while reading {need} bytes", path=self.source.name, offset=start + got)
            if fd == self.direct:
                self.direct_reads += 1
            got += n
        with self._lock:
            self.bytes_read += got
        return mv


def _read_and_verify(files: _Files, span: Any, buf: torch.Tensor, routes: list[Any]) -> dict[int, torch.Tensor]:
    """Read a span, check every chunk's checksum, and decode its "cpu"-routed chunks here
    (libzstd releases the GIL, so the reader threads decode in parallel): {item number: raw bytes}."""
    need = max(it.offset + it.stored_length for it in span.items) - span.start
    mv = files.read(span.start, span.length, need, buf)
    for it in span.items:
        at = it.offset - span.start
        if xxh3(mv[at: at + it.stored_length]) != it.chunk.checksum:
            raise ChecksumError("chunk checksum does not match its stored bytes", path=files.source.name,
                                tensor=it.target.entry.name, chunk=it.index, offset=it.offset)
    decoded = {}
    for k, (it, r) in enumerate(zip(span.items, routes)):
        if r == "cpu" or isinstance(r, tuple) and r[0] == "planes":
            at = it.offset - span.start
            data = mv[at: at + it.stored_length]
            if r == "cpu":
                raw = files.reader.decode_payload(it.target.entry, it.index, data)
            else:  # the coder only (libzstd checks the frame); the planes are put back on the GPU
                raw = _decode_coder(files.reader, it, data, r[1])
            out = torch.empty(it.chunk.raw_length, dtype=torch.uint8)
            out.numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
            decoded[k] = out
    return decoded


def _decode_coder(reader: Reader, it: _Item, data: memoryview, k: int) -> Any:
    """The last step (zstd) of a [byteshuffle(k)+]zstd chunk on the CPU, checked as Reader.decode_payload checks."""
    entry, c = it.target.entry, it.chunk
    where = dict(path=reader.path, tensor=entry.name, chunk=it.index, offset=c.offset)
    if c.raw_length % k:
        raise FormatError(f"raw_length {c.raw_length} is not a multiple of the element size {k}", **where)
    coder = reader.index.codecs[c.codec_id].coder
    try:
        out = memoryview(coder.decode(data, c.raw_length)).cast("B")
    except NvckptError as exc:
        raise exc.located(**where)
    except Exception as exc:  # libzstd rejecting its input
        raise FormatError(f"zstd could not decode the chunk: {exc}", **where) from None
    if out.nbytes != c.raw_length:
        raise FormatError(f"chunk decoded to {out.nbytes} bytes, raw_length is {c.raw_length}", **where)
    return out


# -- verification of whole tensors ----------------------------------------------------------
class _Verifier:
    def __init__(self, dev: Any, path: str, workers: int, piece_bytes: int) -> None:
        self.dev = dev
        self.path = path
        self.piece_bytes = piece_bytes
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="nvckpt-verify")
        self.futures: list[Future] = []
        self._local = threading.local()

    def submit(self, target: _Target) -> None:
        after = self.dev.mark()
        self.futures.append(self.pool.submit(self._check, target, after))

    def _check(self, target: _Target, after: Any) -> None:
        dest = target.dest
        if dest.device.type == "cpu":
            digest = xxh3(memoryview(dest.numpy()))
        else:
            stream = self.dev.side_stream(after)
            pieces = getattr(self._local, "pieces", None)
            if pieces is None:
                pieces = self._local.pieces = [self.dev.host_buffer(self.piece_bytes) for _ in range(2)]
            h = xxhash.xxh3_64()
            pending: deque = deque()
            for k, lo in enumerate(range(0, dest.numel(), self.piece_bytes)):
                part = dest[lo: lo + self.piece_bytes]
                pending.append((self.dev.to_host(part, pieces[k % 2], stream), pieces[k % 2], part.numel()))
                if len(pending) == 2:
                    ev, buf, n = pending.popleft()
                    self.dev.wait(ev)
                    h.update(memoryview(buf[:n].numpy()))
            while pending:
                ev, buf, n = pending.popleft()
                self.dev.wait(ev)
                h.update(memoryview(buf[:n].numpy()))
            digest = h.intdigest()
        if digest != target.entry.checksum:
            raise ChecksumError("tensor checksum does not match its decoded bytes", path=self.path, tensor=target.entry.name)

    def close(self, wait_results: bool) -> None:
        try:
            if wait_results:
                for f in self.futures:
                    f.result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


# -- the loader -------------------------------------------------------------------------------
def load_entries(reader: Reader, entries: Sequence[TensorEntry], device: Any) -> dict[int, torch.Tensor]:
    """Stored (chunked) tensors decoded on ``device`` (CUDA): {tensor_id: tensor}."""
    dev = CudaDecoder(_cuda(device))
    return decode_entries(reader, entries, dev)


def load_rows(reader: Reader, entry: TensorEntry, first: int, stop: int, device: Any) -> torch.Tensor:
    """Rows [first, stop) of dim 0 of a stored tensor, decoding only the chunks that hold them."""
    return decode_rows(reader, entry, first, stop, CudaDecoder(_cuda(device)))


def _cuda(device: Any) -> torch.device:
    device = torch.device(device)
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def decode_entries(reader: Reader, entries: Sequence[TensorEntry], dev: Any, *,
                   verify: bool | None = None) -> dict[int, torch.Tensor]:
    verify = VERIFY_TENSORS if verify is None else verify
    targets = []
    for e in entries:
        if e.chunks is None:
            raise NvckptError("engine bug: load_entries takes stored tensors only", tensor=e.name)
        targets.append(_Target(e, dev.dest(e.nbytes), 0, list(range(len(e.chunks))),
                               verify and e.checksum is not None))
    _decode(reader, targets, dev)
    out = {}
    for t in targets:
        e = t.entry
        dtype = dtypes.to_torch(e.dtype.name)
        check_bools(e, t.dest, reader.path)
        out[e.tensor_id] = t.dest.view(dtype).reshape(e.shape) if e.nbytes else torch.empty(e.shape, dtype=dtype, device=dev.device)
    return out


def decode_rows(reader: Reader, entry: TensorEntry, first: int, stop: int, dev: Any) -> torch.Tensor:
    check_supported(entry, reader.path)
    dtype = dtypes.to_torch(entry.dtype.name)
    shape = (max(0, stop - first),) + tuple(entry.shape[1:])
    if entry.chunks is None or not entry.shape:
        raise NvckptError("engine bug: rows are read from stored tensors of rank >= 1 only", tensor=entry.name)
    row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
    if row_bytes == 0 or stop <= first:
        return torch.empty(shape, dtype=dtype, device=dev.device)
    lo, hi = first * row_bytes, stop * row_bytes
    idx = list(reader.chunks_for(entry, lo, hi))
    base = entry.chunks[idx[0]].raw_start
    end = entry.chunks[idx[-1]].raw_start + entry.chunks[idx[-1]].raw_length
    target = _Target(entry, dev.dest(end - base), base, idx, False)
    _decode(reader, [target], dev)
    return check_bools(entry, target.dest[lo - base: hi - base], reader.path).view(dtype).reshape(shape)


def _decode(reader: Reader, targets: list[_Target], dev: Any) -> None:
    started = time.perf_counter()
    items = []
    for t in targets:
        t.left = len(t.indices)
        items.extend(_Item(t, i, t.entry.chunks[i]) for i in t.indices)
    items.sort(key=lambda it: it.offset)
    spans = deque(plan_read_spans(items, span_bytes=READ_SPAN_BYTES, align=_ALIGN, max_gap=MAX_GAP))
    stats: dict[str, Any] = {"spans": len(spans), "chunks": len(items), "stored_bytes": sum(it.stored_length for it in items)}
    verifier = _Verifier(dev, reader.path, VERIFY_WORKERS, PIECE_BYTES)
    for t in targets:
        if t.verify and not t.indices:
            verifier.submit(t)
    if not spans:
        verifier.close(True)
        return
    routes: dict[int, Any] = {}
    codecs = reader.index.codecs

    def route(it: _Item) -> Any:
        cid = it.chunk.codec_id
        if cid not in routes:
            try:
                routes[cid] = dev.route(codecs[cid])
            except NvckptError as exc:
                raise exc.located(path=reader.path, tensor=it.target.entry.name, chunk=it.index, offset=it.offset)
        return routes[cid]

    buf_size = max(max(s.length for s in spans), READ_SPAN_BYTES)
    files = _Files(reader, DIRECT_IO)
    pool = SlotPool(min(READ_BUFFERS, len(spans)), buf_size, dev.host_buffer, lazy=True)
    arena = dev.alloc(max(DECODE_BATCH_BYTES, buf_size))
    readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="nvckpt-read")
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
            except (NvckptError, RuntimeError, ValueError) as exc:
                first = group[0][0]
                if isinstance(key, tuple) and key[0] == "zstd":
                    # A valid zstd frame nvCOMP refuses (a feature it lacks): libzstd on the CPU decodes it.
                    for it, payload in group:
                        raw = reader.decode_payload(it.target.entry, it.index, payload.cpu().numpy().tobytes())
                        dev.upload(it.out(), torch.frombuffer(bytearray(raw), dtype=torch.uint8))
                    stats["cpu_fallback_chunks"] = stats.get("cpu_fallback_chunks", 0) + len(group)
                else:
                    reason = exc.reason if isinstance(exc, NvckptError) else f"{type(exc).__name__}: {exc}"
                    raise FormatError(f"{codecs[first.chunk.codec_id].describe()} could not decode a batch of {len(group)} chunks: {reason}",
                                      path=reader.path, tensor=first.target.entry.name, chunk=first.index, offset=first.offset) from None
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
                                 readers.submit(_read_and_verify, files, span, pool.slots[slot], routes_of)))
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
                if r == "cpu":  # decoded on the CPU by the reader thread
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
                                              path=reader.path, tensor=it.target.entry.name, chunk=it.index, offset=it.offset)
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
        files.close()
        t0 = time.perf_counter()
        try:
            verifier.close(ok)
        finally:
            dev.finish()
            phases["verify_tail"] = time.perf_counter() - t0
    with reader.source._lock:  # Checkpoint.bytes_read counts these reads too
        reader.source.bytes_read += files.bytes_read
    stats.update(seconds=time.perf_counter() - started, waiting_for_reads_seconds=wait_reads,
                 bytes_read=files.bytes_read, direct_reads=files.direct_reads, phases=phases,
                 cpu_decoded_chunks=cpu_chunks)
    stats.update(dev.timing_report())
    stats["decoded_bytes_gpu"] = stats.get("gpu_bytes", 0)
    last_stats.clear()
    last_stats.update(stats)


__all__ = ["available", "load_entries", "load_rows", "decode_entries", "decode_rows", "CudaDecoder", "HostDecoder"]
