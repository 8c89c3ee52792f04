"""An open checkpoint: its index, its pipelines, and verified reads of its chunks (SPEC 15.1).

``ChunkReader`` locates and parses the index, builds the codec table's
pipelines, and reads chunks through a ``ByteSource`` (positional reads, so one
serves many threads at once), verifying every chunk's checksum (``verify``,
``verify_run``: the one place) before its bytes reach a decoder.  It decodes
on the host; the GPU loader (nvckpt.engines.gpu.decode) reads its own spans,
verifies them through ``verify`` and decodes host-routed chunks here.  Materializing tensors
(torch) is nvckpt.session.load.
"""

from __future__ import annotations

import os
import threading
import weakref
from operator import add, eq
from concurrent.futures import Future, wait
from typing import Any, Callable

import numpy as np

from ..codecs.base import Pipeline
from ..codecs.registry import pipeline_from_json
from .._threads import host_pool
from ..errors import (ChecksumError, FormatError, LimitError, NvckptError, TensorNotFoundError, TruncatedError,
                      UnsupportedCodecError, UnsupportedFeatureError)
from ..format.entry import TensorEntry
from ..format.constants import FOOTER_SIZE, FRAME_INDEX
from ..format.frames import iter_frames, locate_index
from ..format.paths import by_dotted_name, did_you_mean
from ..format.sniff import foreign_format_hint
from ..format.structs import xxh3
from ..io.ranges import coalesce
from ..io.source import ByteSource, open_source


def _locate(source: ByteSource, max_index_memory: int | None) -> tuple[Any, Any]:
    """The preamble and index; in a caller's stream that holds more after the checkpoint (two saved back to
    back), its end is found by walking its frames to the INDEX frame: the footer is not the stream's last bytes."""
    try:
        return locate_index(source, max_index_memory=max_index_memory)
    except (FormatError, TruncatedError, ChecksumError) as exc:
        if source.exact_size:
            raise
        try:
            end = None
            for offset, header in iter_frames(source):
                if header.frame_type == FRAME_INDEX:
                    end = offset + header.payload_skip + header.stored_length + FOOTER_SIZE
            if end is None or end >= source.size:
                raise exc
        except NvckptError:
            raise exc from None
        source.size = end
        return locate_index(source, max_index_memory=max_index_memory)


def check_supported(entry: TensorEntry, path: str) -> None:
    """Raise for a tensor this reader cannot build (unknown dtype or derived function, SPEC 10 and 8.5)."""
    if entry.unsupported is not None:
        raise UnsupportedFeatureError(entry.unsupported, path=path, tensor=entry.name)


class ChunkReader:
    def __init__(self, target: Any, *, workers: int | None = None, max_tensor_bytes: int | None = None,
                 max_index_memory: int | None = None, storage_options: dict[str, Any] | None = None) -> None:
        if max_tensor_bytes is not None and (type(max_tensor_bytes) is not int or max_tensor_bytes < 0):
            raise ValueError(f"max_tensor_bytes must be a non-negative integer or None, got {max_tensor_bytes!r}")
        self.max_tensor_bytes = max_tensor_bytes
        self.source = open_source(target, storage_options)
        self.path = self.source.name
        try:
            self.preamble, self.index = _locate(self.source, max_index_memory)
            self.pipelines: list[Pipeline] = [pipeline_from_json(c) for c in self.index.codecs]
        except NvckptError as exc:
            self.source.close()
            if isinstance(exc, FormatError) and exc.offset == 0 and exc.reason.startswith("not an nvckpt file") \
                    and isinstance(target, (str, os.PathLike)):
                exc.reason += foreign_format_hint(target)  # a torch.save or safetensors file: what reads it
            raise exc.located(path=self.path)
        except BaseException:
            self.source.close()
            raise
        self._workers = workers or os.cpu_count() or 1
        self._pool_lock = threading.Lock()
        self._inflight: set[Future] = set()  # this file's work on the shared threads (close waits for it)
        self._closed = False
        _OPEN.add(self)

    def _after_fork_in_child(self) -> None:
        # A forked child (a DataLoader worker reading through its dataset's open checkpoint) has none of the
        # parent's decode threads (the shared pools start anew there, nvckpt._threads), nor their
        # work, nor the parent's reads in flight (nvckpt.io.source; a source of another kind keeps its own).
        self._pool_lock = threading.Lock()
        self._inflight = set()
        after_fork = getattr(self.source, "after_fork_in_child", None)
        if after_fork is not None:
            after_fork()

    # -- lifecycle ---------------------------------------------------------
    def close(self) -> None:
        """Close the source once this file's work on the shared decode threads has ended."""
        with self._pool_lock:
            self._closed = True
            inflight = list(self._inflight)
        wait(inflight)  # the threads are shared: wait for this file's own work only
        self.source.close()

    def map(self, fn: Callable, items: list) -> list:
        """``[fn(x) for x in items]`` on ``workers`` threads: the caller's and ``workers - 1`` of the shared
        decode threads, each taking the next item in order until none is left.  The first exception stops
        the others after their current item and is raised once all have stopped.

        Not a task per item: on 2 cores a task per chunk (submit, wake a thread, hand the result back) cost
        more than it gained, a MiniLM bf16 load's 138 chunks taking 23 ms against 19 ms on one thread; two
        threads taking chunks in turn, 15 ms."""
        if len(items) <= 1 or self._workers == 1:
            return [fn(x) for x in items]
        results: list[Any] = [None] * len(items)
        order = iter(range(len(items)))
        take = threading.Lock()
        failed: list[BaseException] = []

        def drain() -> None:
            while not failed:
                with take:
                    i = next(order, None)
                if i is None:
                    return
                try:
                    results[i] = fn(items[i])
                except BaseException as exc:  # noqa: BLE001  (raised in the caller below)
                    failed.append(exc)
                    return

        helpers = [self.submit(drain) for _ in range(min(self._workers, len(items)) - 1)]
        try:
            drain()
        finally:
            for h in helpers:  # they write into the caller's memory: never return before they stop
                h.exception()
        if failed:
            raise failed[0]
        return results

    # -- names -------------------------------------------------------------
    def entry(self, name: str) -> TensorEntry:
        """The entry of the tensor named ``name``: one of the index's paths, an internal base's name (SPEC
        14.3), or DCP's dotted name of one of those paths; TensorNotFoundError (near names in its message)."""
        tid = self.index.paths.get(name)
        if tid is None:
            others = self.__dict__.get("_unpathed")
            if others is None:  # internal bases are reachable by name too (made once: a miss is not a scan)
                others = self.__dict__["_unpathed"] = {e.name: e for e in self.index.tensors
                                                       if e.name not in self.index.paths}
            e = others.get(name)
            if e is not None:
                return e
            tid = self._dotted_names().get(name) if "." in name else None
            if tid is None:
                raise TensorNotFoundError(f"no tensor named {name!r}{did_you_mean(name, self.index.paths)}",
                                          path=self.path)
        return self.index.tensors[tid]

    def _dotted_names(self) -> dict[str, int]:
        """DCP's dotted name of each tensor path -> its tensor id (made on the first miss, then kept)."""
        found = self.__dict__.get("_dotted")
        if found is None:
            found = self.__dict__["_dotted"] = {k: self.index.paths[p] for k, p in
                                                by_dotted_name(self.index.paths).items() if p is not None}
        return found

    # -- chunks: reads and the one checksum check --------------------------
    def verify(self, entry: TensorEntry, i: int, stored: Any) -> None:
        """Chunk ``i``'s stored bytes against its checksum (SPEC 13), before any decoder sees them."""
        c = entry.chunks[i]
        if xxh3(stored) != c.checksum:
            raise ChecksumError("chunk checksum does not match its stored bytes", path=self.path, tensor=entry.name,
                                chunk=i, offset=c.offset)

    def verify_run(self, entry: TensorEntry, first: int, view: memoryview, at: list[int], stored: list[int],
                   checks: list[int]) -> None:
        """``verify`` of chunks ``first, first + 1, ...`` of ``entry``, whose stored bytes are ``view[at[k]:
        at[k] + stored[k]]`` (a table's columns: no Chunk made per chunk of a run of thousands)."""
        sums = map(xxh3, map(view.__getitem__, map(slice, at, map(add, at, stored))))
        if not all(map(eq, sums, checks)):
            bad = next(k for k, (a, n, c) in enumerate(zip(at, stored, checks)) if xxh3(view[a: a + n]) != c)
            self.verify(entry, first + bad, view[at[bad]: at[bad] + stored[bad]])

    def read_payload(self, entry: TensorEntry, i: int) -> bytes:
        """The stored bytes of chunk ``i``, checksum verified."""
        c = entry.chunks[i]
        try:
            data = self.source.read(c.offset, c.stored_length)
        except NvckptError as exc:
            raise exc.located(tensor=entry.name, chunk=i)
        self.verify(entry, i, data)
        return data

    def _read_checked(self, entry: TensorEntry, i: int, buf: np.ndarray) -> None:
        """Chunk ``i``'s stored bytes read into ``buf`` (its stored length), checksum verified."""
        try:
            self.source.read_into(entry.chunks[i].offset, buf)
        except NvckptError as exc:
            raise exc.located(tensor=entry.name, chunk=i)
        self.verify(entry, i, buf)

    def decode_payload(self, entry: TensorEntry, i: int, data: Any) -> memoryview:
        c = entry.chunks[i]
        pipeline = self.pipelines[c.codec_id]
        if pipeline.planar_form() is not None:
            out = np.empty(c.raw_length, dtype=np.uint8)
            self.decode_into(entry, i, data, out)
            return memoryview(out)
        return self._decoded(entry, i, lambda: pipeline.decode(memoryview(data), c.raw_length), pipeline)

    def decode_into(self, entry: TensorEntry, i: int, data: Any, out: np.ndarray) -> None:
        """Decode chunk ``i`` (stored bytes ``data``, checksum verified) into ``out`` (its raw length, uint8)."""
        c = entry.chunks[i]
        pipeline = self.pipelines[c.codec_id]
        if pipeline.is_raw:
            if memoryview(data).nbytes != c.raw_length:
                raise FormatError(f"raw chunk stores {memoryview(data).nbytes} bytes, raw_length is {c.raw_length}",
                                  path=self.path, tensor=entry.name, chunk=i, offset=c.offset)
            out[:] = np.frombuffer(data, dtype=np.uint8)
            return
        if pipeline.planar_form() is None:
            out[:] = np.frombuffer(self.decode_payload(entry, i, data), dtype=np.uint8)
            return
        try:
            pipeline.decode_into(data, out)
        except MemoryError:
            raise
        except Exception as exc:  # a frame libzstd rejects, or one that decodes to another length
            raise FormatError(f"{pipeline.describe()} could not decode the chunk: {exc}", path=self.path,
                              tensor=entry.name, chunk=i, offset=c.offset) from None

    def decode_coder(self, entry: TensorEntry, i: int, data: Any) -> memoryview:
        """Only the coder (last step) of chunk ``i``'s pipeline: the GPU loader undoes the filters on the device."""
        c = entry.chunks[i]
        pipeline = self.pipelines[c.codec_id]
        def coder() -> Any:
            pipeline.check_known()
            return pipeline.coder.decode(memoryview(data), c.raw_length)

        return self._decoded(entry, i, coder, pipeline)

    def _decoded(self, entry: TensorEntry, i: int, decode: Callable[[], Any], pipeline: Pipeline) -> memoryview:
        c = entry.chunks[i]
        try:
            out = memoryview(decode()).cast("B")
        except UnsupportedCodecError as exc:
            w = self.index.writer
            exc.reason += f" [codec id {c.codec_id}; file written by {w.get('name', '?')} {w.get('version', '?')}]"
            raise exc.located(path=self.path, tensor=entry.name, chunk=i, offset=c.offset)
        except NvckptError as exc:
            raise exc.located(path=self.path, tensor=entry.name, chunk=i, offset=c.offset)
        except MemoryError:
            raise
        except Exception as exc:  # a host decoder rejecting its input (zstd raises ZstdError, numpy ValueError)
            raise FormatError(f"{pipeline.describe()} could not decode the chunk: {exc}", path=self.path, tensor=entry.name, chunk=i, offset=c.offset) from None
        if out.nbytes != c.raw_length:
            raise FormatError(f"chunk decoded to {out.nbytes} bytes, raw_length is {c.raw_length}", path=self.path, tensor=entry.name, chunk=i, offset=c.offset)
        return out

    def check_size(self, entry: TensorEntry, nbytes: int) -> None:
        """The caller's limit on the bytes one read materializes (SPEC.md 16), checked before allocating."""
        if self.max_tensor_bytes is not None and nbytes > self.max_tensor_bytes:
            raise LimitError(f"reading it would materialize {nbytes} bytes, more than max_tensor_bytes="
                             f"{self.max_tensor_bytes}", path=self.path, tensor=entry.name)

    def fill(self, entry: TensorEntry, i: int, start: int, out: np.ndarray) -> None:
        """Chunk ``i`` of ``entry``, read, verified and decoded into ``out``, which holds the tensor's raw
        bytes from ``start`` on: straight into ``out`` where the chunk lies inside it (a raw chunk is read
        there by the OS, a zstd one decoded there), through a scratch buffer at a slice's edges."""
        c = entry.chunks[i]
        lo, hi = max(start, c.raw_start), min(start + out.nbytes, c.raw_start + c.raw_length)
        whole = lo == c.raw_start and hi == c.raw_start + c.raw_length
        pipeline = self.pipelines[c.codec_id]
        if pipeline.is_raw and c.stored_length == c.raw_length and whole:
            self._read_checked(entry, i, out[lo - start: hi - start])
            return
        stored = _scratch("stored", c.stored_length)
        self._read_checked(entry, i, stored)
        if whole:
            self.decode_into(entry, i, stored, out[lo - start: hi - start])
            return
        raw = _scratch("raw", c.raw_length)
        self.decode_into(entry, i, stored, raw)
        out[lo - start: hi - start] = raw[lo - c.raw_start: hi - c.raw_start]

    def read_into(self, entry: TensorEntry, start: int, stop: int, out: memoryview) -> None:
        """Raw bytes [start, stop) of a stored tensor into ``out`` (writable, stop - start bytes),
        reading and decoding only the chunks that hold them, on the decode threads.
        Neighbouring small chunks are read with one read and handed to a thread together, so a
        tensor of a million small chunks costs a few thousand tasks, not a million; a chunk on its
        own is read (and decoded) straight into ``out`` where it lies inside it (``fill``)."""
        self.map(lambda task: self._fill(*task), self.fill_tasks(entry, start, stop, out))

    def fill_tasks(self, entry: TensorEntry, start: int, stop: int, out: Any) -> list[tuple[Any, ...]]:
        """``read_into``'s work as tasks (``fill_task(*task)`` each, on any thread): a caller reading many
        ranges of many tensors runs all of their tasks in one ``map``."""
        assert entry.chunks is not None
        dest = np.frombuffer(out, dtype=np.uint8)
        return [(entry, g, start, dest) for g in _groups(entry, entry.chunks.covering(start, stop),
                                                         self.source.coalescing)]

    def fill_task(self, entry: TensorEntry, group: range, start: int, out: np.ndarray) -> None:
        """One of ``fill_tasks``, on the calling thread."""
        self._fill(entry, group, start, out)

    def read_run(self, entry: TensorEntry, group: range, out: np.ndarray, data: Any = None) -> None:
        """Chunks ``group`` of ``entry`` (neighbours, as ``coalesce`` grouped them) read with one read, verified
        and decoded into ``out``, the whole tensor's raw bytes; ``data``: their stored bytes, fetched
        already (``run_range``'s, by a read-ahead)."""
        self._fill(entry, group, 0, out, data)

    def run_range(self, entry: TensorEntry, group: range) -> tuple[int, int]:
        """(offset, length) of the stored bytes that chunks ``group`` of ``entry`` span."""
        assert entry.chunks is not None
        offs, stored = entry.chunks.columns(group.start, group.stop)[:2]
        return offs[0], offs[-1] + stored[-1] - offs[0]

    def _fill(self, entry: TensorEntry, group: range, start: int, out: np.ndarray, data: Any = None) -> None:
        if len(group) == 1 and data is None:
            self.fill(entry, group.start, start, out)
            return
        table = entry.chunks
        assert table is not None
        stop = start + out.nbytes
        offs, stored, raws, codecs, checks, starts = table.columns(group.start, group.stop)
        base = offs[0]
        if data is None:
            try:
                data = self.source.read(base, offs[-1] + stored[-1] - base)
            except NvckptError as exc:
                raise exc.located(tensor=entry.name, chunk=group.start)
        view = memoryview(data)
        at = [o - base for o in offs]
        self.verify_run(entry, group.start, view, at, stored, checks)
        if (offs[-1] - base == starts[-1] - starts[0] and stored == raws
                and all(self.pipelines[c].is_raw for c in set(codecs))):
            # Raw chunks stored back to back: their bytes are the tensor's bytes, one copy.
            lo, hi = max(start, starts[0]), min(stop, starts[-1] + raws[-1])
            out[lo - start: hi - start] = np.frombuffer(view[lo - starts[0]: hi - starts[0]], dtype=np.uint8)
            return
        for k, i in enumerate(group):
            chunk = view[at[k]: at[k] + stored[k]]
            lo, hi = max(start, starts[k]), min(stop, starts[k] + raws[k])
            if lo == starts[k] and hi == starts[k] + raws[k]:
                self.decode_into(entry, i, chunk, out[lo - start: hi - start])
            else:
                raw = _scratch("raw", raws[k])
                self.decode_into(entry, i, chunk, raw)
                out[lo - start: hi - start] = raw[lo - starts[k]: hi - starts[k]]

    def submit(self, fn: Callable, *args: Any) -> Future:
        """``fn(*args)`` on the decode threads (the process's shared pool of ``workers`` threads); returns
        its Future.  ``fn`` must not wait for other work on those threads."""
        with self._pool_lock:
            if self._closed:
                raise NvckptError("read from a closed checkpoint", path=self.path)
            future = host_pool(self._workers).submit(fn, *args)
            self._inflight.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future) -> None:
        with self._pool_lock:
            self._inflight.discard(future)


_tls = threading.local()
_OPEN: "weakref.WeakSet[ChunkReader]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for f in list(_OPEN):
        f._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _groups(entry: TensorEntry, indices: range, policy: Any) -> list[range]:
    """``indices`` cut into runs of chunks that one read covers (io.ranges: the source's coalescing policy;
    a local file's reads small neighbouring chunks together and a large chunk alone, into its destination)."""
    if len(indices) <= 1:
        return [indices] if indices else []
    assert entry.chunks is not None
    offs, stored = entry.chunks.columns(indices.start, indices.stop)[:2]
    return [range(indices.start + r.first, indices.start + r.stop) for r in coalesce(offs, stored, policy)]


def _scratch(name: str, n: int) -> np.ndarray:
    """This thread's reusable buffer ``name`` of at least ``n`` bytes (first ``n`` returned)."""
    buf = getattr(_tls, name, None)
    if buf is None or buf.nbytes < n:
        buf = np.empty(max(n, 1 << 20), dtype=np.uint8)
        setattr(_tls, name, buf)
    return buf[:n]


__all__ = ["ChunkReader", "check_supported"]
