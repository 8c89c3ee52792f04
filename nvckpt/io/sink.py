"""FileSink: the last stage of a save, aligned writes overlapped with encoding.

Small frames are copied into fixed-size staging blocks; a save's compressed
chunks, already in pinned host memory, are borrowed (``write_borrowed``): not
copied, written from where they are.  One of ``io_threads`` I/O threads writes
each contiguous range of the file (pieces of staging blocks and borrowed
buffers) at its own offset with one ``pwritev`` (with O_DIRECT where the
filesystem allows: the page cache then costs neither copies nor a long fsync),
while the caller goes on.  Several writes in flight keep a virtual disk's queue
busy.  The staging blocks and the borrowed bytes not yet written are both
bounded, so a slow disk slows the encoder (backpressure) instead of growing
memory.  An I/O error is raised to the caller at its next write or at close.

Why borrow: a copy per chunk in the writer's thread let go of the GIL and took
it back thousands of times a save, each time taking it from the training
loop's thread of an async_save (benchmarks/results/probe_slowdown_h200.md).
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from typing import Any, Callable

import numpy as np

from ..errors import NvckptError

DEFAULT_BLOCK = 16 << 20
DEFAULT_BLOCKS = 6
# Two writes in flight: on the H200 machine's virtio disk 1, 2 or 4 O_DIRECT writers run about
# the same speed (1.8-2.3 GB/s, tools/bench_results/bench_h200.md), but in a save the thread that
# finished a write may wait for the GIL before it issues the next one; the second keeps the disk busy.
DEFAULT_IO_THREADS = 2
_DIRECT_ALIGN = 4096
_NUMPY_COPY = 64 << 10  # payloads from this size on are staged by numpy
_BORROW_MIN = 32 << 10  # borrowed payloads from this size on are written from where they are (smaller: copied)
_MAX_PARTS = 512  # parts of one pwritev (Linux allows 1024)


def _mmap_block(size: int) -> Any:
    # Anonymous mmap is page-aligned, as O_DIRECT needs.
    return mmap.mmap(-1, size)


class _BlockPool:
    """Staging blocks kept for the next save of this process: fresh anonymous memory costs a page fault
    per 4 KiB on first touch (~50 ms for the 96 MiB of one save), more than copying a small state."""

    def __init__(self, keep: int = DEFAULT_BLOCKS) -> None:
        self._free: dict[int, list[Any]] = {}
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, size: int) -> Any:
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
        return _mmap_block(size)

    def give(self, size: int, block: Any) -> None:
        with self._lock:
            free = self._free.setdefault(size, [])
            if len(free) < self._keep:
                free.append(block)


_POOL = _BlockPool()


class FileSink:
    """A write-only binary sink over a file descriptor it owns.

    ``write`` copies its bytes into the staging blocks.  ``write_borrowed`` (a
    save's compressed chunks, already in pinned host memory) hands the bytes to
    the I/O threads without a copy where it can: the caller keeps them valid
    until ``release()``, which the sink calls exactly once, after they are
    written (or, on an error, once nothing will read them).  Each I/O thread
    writes a *vector*: a contiguous range of the file from staging pieces and
    borrowed buffers in one ``pwritev``, so a run of chunks costs one system
    call and no copy per chunk in the writer's thread."""

    def __init__(
        self,
        path: str,
        *,
        direct: bool = True,
        block_size: int = DEFAULT_BLOCK,
        blocks: int = DEFAULT_BLOCKS,
        allocate: Callable[[int], Any] | None = None,
        flags: int = os.O_WRONLY | os.O_CREAT | os.O_EXCL,
        io_threads: int | None = None,
    ) -> None:
        if block_size % _DIRECT_ALIGN or block_size <= 0:
            raise ValueError(f"block_size must be a positive multiple of {_DIRECT_ALIGN}")
        if blocks < 2:
            raise ValueError("a FileSink needs at least 2 blocks to overlap copy and I/O")
        io_threads = DEFAULT_IO_THREADS if io_threads is None else io_threads
        if not 1 <= io_threads < blocks:
            raise ValueError(f"io_threads must be in 1..blocks-1, got {io_threads}")
        self.path = path
        self.direct = False
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o666)
                self.direct = True
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o666)
        try:
            self.block_size = block_size
            self._free: queue.Queue = queue.Queue()
            self._owned: list[Any] = []  # blocks from the process pool, given back at close
            for _ in range(blocks):
                raw = allocate(block_size) if allocate is not None else _POOL.take(block_size)
                if allocate is None:
                    self._owned.append(raw)
                block = memoryview(raw).cast("B")
                self._free.put(_Block(block, np.frombuffer(block, dtype=np.uint8)))
            self._full: queue.Queue = queue.Queue()
            self._error: BaseException | None = None
            self._lock = threading.Lock()  # block references, borrowed count, bytes written
            self._settled = threading.Condition(self._lock)
            self._borrowed = 0  # borrowed buffers not yet released
            self._borrowed_bytes = 0  # and their bytes
            self.borrowed_bytes = 0  # bytes written from borrowed buffers so far (not copied)
            self._blocks = blocks
            self._current: _Block | None = self._free.get()  # None after a full block, until the next write
            self._used = 0  # bytes staged in the current block
            self._piece = 0  # where the current block's bytes not yet in a vector start
            self._vec = _Vector(0)
            self.position = 0  # bytes accepted so far
            self.written = 0  # bytes on disk so far
            self._closed = False
            self._threads = [threading.Thread(target=self._io_loop, name=f"nvckpt-io-{i}", daemon=True)
                             for i in range(io_threads)]
            for t in self._threads:
                t.start()
        except BaseException:
            os.close(self.fd)  # nothing else holds it yet
            raise

    # -- I/O thread --------------------------------------------------------
    def _io_loop(self) -> None:
        while True:
            vec = self._full.get()
            if vec is None:
                return
            try:
                if self._error is None:
                    self._write_all(vec)
            except BaseException as exc:  # reported to the producer
                self._error = exc
            finally:
                self._done(vec)

    def _write_all(self, vec: "_Vector") -> None:
        parts = vec.parts
        if self.direct and vec.length % _DIRECT_ALIGN:
            # O_DIRECT needs an aligned length: the file's last piece is padded, then truncated at close.
            last = parts[-1]
            parts = parts[:-1] + [vec.pad_block.view[vec.pad_start: vec.pad_start + _align_up(last.nbytes)]]
        offset = vec.offset
        while parts:
            n = os.pwritev(self.fd, parts, offset)
            if n <= 0:
                raise OSError(errno.EIO, "write returned 0 bytes")
            offset += n
            while parts and n >= parts[0].nbytes:  # drop what was written, keep the rest of a partial write
                n -= parts[0].nbytes
                parts = parts[1:]
            if n:
                parts = [parts[0][n:]] + parts[1:]
        with self._lock:
            self.written += vec.length

    def _done(self, vec: "_Vector") -> None:
        """A vector is written (or will never be): its borrowed buffers are released, its blocks come back."""
        try:
            for release in vec.releases:
                release()
        except BaseException as exc:
            self._error = self._error or exc
        finally:
            with self._lock:
                for block in vec.blocks:
                    block.refs -= 1
                    if block.refs == 0 and block is not self._current:
                        self._free.put(block)
                self._borrowed -= len(vec.releases)
                self._borrowed_bytes -= vec.borrowed
                if vec.releases:
                    self._settled.notify_all()

    def _check(self) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, OSError):
                raise type(err)(err.errno, err.strerror, self.path) from err  # the caller may name its target instead
            raise NvckptError(f"writing failed: {err}", path=self.path) from err

    # -- producer side -----------------------------------------------------
    def _cut_piece(self, *, whole: bool = False) -> None:
        """The current block's staged bytes not yet in a vector go into the vector.  Under O_DIRECT only up
        to a multiple of 4 KiB unless ``whole`` (the file's end): every vector but the last then starts and
        ends aligned (a block's bytes sit at file offsets of the same remainder modulo 4 KiB)."""
        block = self._current
        if block is None:
            return
        end = self._used if whole or not self.direct else self._used - self._used % _DIRECT_ALIGN
        if end > self._piece:
            with self._lock:
                block.refs += 1
            self._vec.add(block.view[self._piece: end], block=block)
            self._vec.pad_block, self._vec.pad_start = block, self._piece
            self._piece = end

    def _submit(self) -> None:
        """The vector goes to an I/O thread; the next one starts where it ends."""
        vec, self._vec = self._vec, _Vector(self._vec.offset + self._vec.length)
        if vec.parts:
            self._full.put(vec)

    def _retire_block(self) -> None:
        """The current block is full: it goes back to the free blocks once its last vector is written."""
        with self._lock:
            old, self._current = self._current, None
            if old.refs == 0:
                self._free.put(old)

    def _take_block(self) -> None:
        self._current = self._free.get()  # blocks while the disk is behind
        self._used = self._piece = 0
        self._check()

    def write(self, data: Any) -> int:
        self._check()
        src = memoryview(data).cast("B")
        n = src.nbytes
        # numpy copies without holding the GIL (a memoryview copy holds it), so the I/O
        # threads and the encoders' threads run on while a large payload is staged.
        src_np = np.frombuffer(src, dtype=np.uint8) if n >= _NUMPY_COPY else None
        pos = 0
        while pos < n:
            if self._current is None:
                self._take_block()
            take = min(n - pos, self.block_size - self._used)
            if src_np is not None:
                self._current.array[self._used: self._used + take] = src_np[pos: pos + take]
            else:
                self._current.view[self._used: self._used + take] = src[pos: pos + take]
            self._used += take
            pos += take
            if self._used == self.block_size:  # full: to the disk now, the next block is taken when needed
                self._cut_piece()
                self._submit()
                self._retire_block()
        self.position += n
        return n

    def write_borrowed(self, data: Any, release: Callable[[], None], *, flush: bool = False) -> int:
        """Write ``data`` without copying it where possible; ``release()`` is called once the sink is done
        with it (exactly once, also on an error).  ``flush``: send what is pending to the disk now (the caller
        waits for its releases)."""
        try:
            self._check()
            src = memoryview(data).cast("B")
            n = src.nbytes
            take = self._borrowable(src)
        except BaseException:
            release()
            raise
        if not take:  # too small or misaligned for O_DIRECT: staged like any write
            try:
                self.write(src)
            finally:
                release()
            if flush:
                self._flush_vector()
            return n
        try:
            self._make_room(take)
        except BaseException:
            release()
            raise
        self._cut_piece()
        with self._lock:
            self._borrowed += 1
            self._borrowed_bytes += take
        self._vec.add(src[:take], release=release, borrowed=take)
        self.position += take
        self.borrowed_bytes += take
        if take < n:
            self.write(src[take:])  # O_DIRECT: the tail (< 4 KiB) shares a block with the next frame's header
        if flush or len(self._vec.parts) >= _MAX_PARTS or self._vec.borrowed >= self.block_size:
            self._flush_vector()
        return n

    def _make_room(self, take: int) -> None:
        """Wait until ``take`` more borrowed bytes keep the borrowed bytes not yet written within the staging
        blocks' size: a slow disk holds the caller back (backpressure), as when it waits for a free block."""
        limit = self._blocks * self.block_size
        with self._lock:
            if self._borrowed_bytes + take <= limit or not self._borrowed_bytes:
                return
        self._flush_vector()  # what is pending must go to the disk, or the wait would never end
        with self._settled:
            self._settled.wait_for(lambda: self._borrowed_bytes + take <= limit or not self._borrowed_bytes
                                   or self._error is not None)
        self._check()

    def _borrowable(self, src: memoryview) -> int:
        """How many of ``src``'s leading bytes can be written from where they are (0: none)."""
        n = src.nbytes
        if n < _BORROW_MIN:
            return 0
        if not self.direct:
            return n
        if self.position % _DIRECT_ALIGN or _address(src) % _DIRECT_ALIGN:
            return 0
        return n - n % _DIRECT_ALIGN

    def _flush_vector(self) -> None:
        self._cut_piece()
        self._submit()

    def settle(self) -> None:
        """Send what is pending to the disk and wait until every borrowed buffer is released."""
        if not self._closed:
            self._flush_vector()
        with self._settled:
            self._settled.wait_for(lambda: self._borrowed == 0)

    def close(self, *, sync: bool = True) -> None:
        """Write what is left, wait for the I/O thread, fsync, close."""
        if self._closed:
            return
        try:
            self._cut_piece(whole=True)
            self._submit()
        finally:
            self._closed = True
        try:
            self._stop_threads()
            self._check()
            if self.direct:
                os.ftruncate(self.fd, self.position)  # drop the padding of the last block
            if sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self._give_back()

    def _give_back(self) -> None:
        """Blocks back to the process pool, once no I/O thread can touch them."""
        owned, self._owned = self._owned, []
        if any(t.is_alive() for t in self._threads):
            return
        for raw in owned:
            _POOL.give(self.block_size, raw)

    def abort(self) -> None:
        """Stop without flushing (the caller removes the file).  Borrowed buffers are released."""
        if self._closed:
            return
        self._closed = True
        self._error = self._error or NvckptError("aborted", path=self.path)
        try:
            self._submit()  # not written (the error is set): its borrowed buffers are released
            self._stop_threads()
        finally:
            os.close(self.fd)
            self._give_back()

    def _stop_threads(self) -> None:
        for _ in self._threads:
            self._full.put(None)
        for t in self._threads:
            t.join()


class _Block:
    """A staging block: its bytes, a numpy view of them, and the vectors not yet written that hold pieces of it."""

    __slots__ = ("view", "array", "refs")

    def __init__(self, view: memoryview, array: Any) -> None:
        self.view, self.array, self.refs = view, array, 0


class _Vector:
    """A contiguous range of the file at ``offset``: staging pieces and borrowed buffers, in order."""

    __slots__ = ("offset", "length", "borrowed", "parts", "releases", "blocks", "pad_block", "pad_start")

    def __init__(self, offset: int) -> None:
        self.offset, self.length, self.borrowed = offset, 0, 0
        self.parts: list[memoryview] = []
        self.releases: list[Callable[[], None]] = []
        self.blocks: list[_Block] = []
        self.pad_block: _Block | None = None  # the block of the last piece (padded in place under O_DIRECT)
        self.pad_start = 0

    def add(self, part: memoryview, *, block: _Block | None = None, release: Callable[[], None] | None = None,
            borrowed: int = 0) -> None:
        self.parts.append(part)
        self.length += part.nbytes
        self.borrowed += borrowed
        if block is not None:
            self.blocks.append(block)
        if release is not None:
            self.releases.append(release)


def _align_up(n: int) -> int:
    return -(-n // _DIRECT_ALIGN) * _DIRECT_ALIGN


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else 0
