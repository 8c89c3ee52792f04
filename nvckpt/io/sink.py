"""FileSink: the last stage of a save, aligned block writes overlapped with encoding.

Frames are copied into fixed-size staging blocks; a full block goes to one of
``io_threads`` I/O threads that writes it at its own offset with ``pwrite``
(with O_DIRECT where the filesystem allows: the page cache then costs neither
copies nor a long fsync), while the caller fills the next block.  Several
writes in flight keep a virtual disk's queue busy.  The pool of blocks is
bounded, so a slow disk slows the encoder (backpressure) instead of growing
memory.  An I/O error is raised to the caller at its next write or at close.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import queue
import threading
from typing import Any, Callable

import numpy as np

from .._signals import leave_to_main_thread
from ..errors import NvckptError

DEFAULT_BLOCK = 16 << 20
DEFAULT_BLOCKS = 6
# Two writes in flight: on the H200 machine's virtio disk 1, 2 or 4 O_DIRECT writers run about
# the same speed (1.8-2.3 GB/s, benchmarks/results/bench_h200.md), but in a save the thread that
# finished a write may wait for the GIL before it issues the next one; the second keeps the disk busy.
DEFAULT_IO_THREADS = 2
_DIRECT_ALIGN = 4096
_NUMPY_COPY = 64 << 10  # payloads from this size on are staged by numpy


def _mmap_block(size: int) -> Any:
    # Anonymous mmap is page-aligned, as O_DIRECT needs.
    return mmap.mmap(-1, size)


class _BlockPool:
    """Staging blocks kept for the next save of this process: fresh anonymous memory costs a page fault
    per 4 KiB on first touch (~50 ms for the 96 MiB of one save), more than copying a small state."""

    def __init__(self) -> None:
        self._free: dict[int, list[Any]] = {}
        self._lock = threading.Lock()

    def take(self, size: int) -> Any:
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
        return _mmap_block(size)

    def give(self, size: int, block: Any, keep: int) -> None:
        """Keep ``block`` for the next save unless ``keep`` blocks of its size are kept already."""
        with self._lock:
            free = self._free.setdefault(size, [])
            if len(free) < keep:
                free.append(block)

    def _after_fork_in_child(self) -> None:
        # A fork while a parent's thread held the lock leaves it held in the child: a new one, and no blocks.
        self._lock = threading.Lock()
        self._free = {}


_POOL = _BlockPool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL._after_fork_in_child)


class FileSink:
    """A write-only binary sink over a file descriptor it owns."""

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
                self._free.put((block, np.frombuffer(block, dtype=np.uint8)))
            self._full: queue.Queue = queue.Queue()
            self._error: BaseException | None = None
            self._current = self._free.get()
            self._used = 0
            self._block_offset = 0  # file offset of the block being filled
            self.position = 0  # bytes accepted so far
            self.written = 0  # bytes on disk so far
            self._written_lock = threading.Lock()
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
        leave_to_main_thread()
        while True:
            item = self._full.get()
            if item is None:
                return
            block, length, offset = item
            try:
                if self._error is None:
                    self._write_all(block[0], length, offset)
            except BaseException as exc:  # reported to the producer
                self._error = exc
            finally:
                self._free.put(block)

    def _write_all(self, block: memoryview, length: int, offset: int) -> None:
        # O_DIRECT needs an aligned length: the last block is padded, then truncated at close.
        padded = -(-length // _DIRECT_ALIGN) * _DIRECT_ALIGN if self.direct else length
        view = block[:padded]
        done = 0
        while done < padded:
            try:
                n = os.pwrite(self.fd, view[done:], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self._without_direct():
                    continue  # the same bytes through the page cache: its write says what is wrong
                raise
            if n <= 0:
                raise OSError(errno.EIO, "write returned 0 bytes")
            done += n
            if done < padded and done % _DIRECT_ALIGN:
                self._without_direct()  # a short write left the rest unaligned for O_DIRECT
        with self._written_lock:
            self.written += length

    def _without_direct(self) -> bool:
        """Write through the page cache from now on; False if this file already did.  A write that the kernel
        cuts short (a disk filling up, a file size limit: ``ulimit -f``) is, or leaves a rest, no longer aligned,
        which O_DIRECT refuses with EINVAL, hiding what stopped the write (ENOSPC, EFBIG); the cached write
        reports it.  The padding of the last block is still truncated at close."""
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        if not self.direct or not flags & os.O_DIRECT:
            return False
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        return True

    def _check(self) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, OSError):
                raise type(err)(err.errno, err.strerror, self.path) from err  # the caller may name its target instead
            raise NvckptError(f"writing failed: {err}", path=self.path) from err

    def _submit(self) -> None:
        # Every block but the last is full, so blocks land at multiples of block_size.
        self._full.put((self._current, self._used, self._block_offset))
        self._block_offset += self._used
        self._current = None
        self._used = 0

    # -- producer side -----------------------------------------------------
    def write(self, data: Any) -> int:
        self._check()
        src = memoryview(data).cast("B")
        n = src.nbytes
        # numpy copies without holding the GIL (a memoryview copy holds it), so the I/O
        # threads and the encoders' threads run on while a large payload is staged.
        src_np = np.frombuffer(src, dtype=np.uint8) if n >= _NUMPY_COPY else None
        pos = 0
        while pos < n:
            block, room = self._room()
            take = min(n - pos, room)
            if src_np is not None:
                block[1][self._used : self._used + take] = src_np[pos : pos + take]
            else:
                block[0][self._used : self._used + take] = src[pos : pos + take]
            self._staged(take)
            pos += take
        self.position += n
        return n

    def _room(self) -> tuple[Any, int]:
        """The block being filled (taken from the free ones, waiting while the disk is behind) and its room."""
        if self._current is None:
            self._current = self._free.get()
            self._check()
        return self._current, self.block_size - self._used

    def _staged(self, n: int) -> None:
        """``n`` more bytes are in the current block; a full block goes to the I/O threads."""
        self._used += n
        if self._used == self.block_size:
            self._submit()

    def write_many(self, pieces: list[Any]) -> int:
        """``write`` of each piece, in order, with the copies into a block made by one numpy call per block:
        the GIL is let go of for each large piece and taken back between them without running Python, so
        a thread that waits for it (a training loop) is not held up by this one between pieces."""
        self._check()
        arrays = [np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in pieces]
        total = sum(a.size for a in arrays)
        i = at = 0  # the piece being staged, and how much of it is staged
        while i < len(arrays):
            block, room = self._room()
            parts, taken = [], 0
            while i < len(arrays) and taken < room:
                a = arrays[i]
                n = min(a.size - at, room - taken)
                parts.append(a[at: at + n])
                taken += n
                at += n
                if at == a.size:
                    i, at = i + 1, 0
            dst = block[1][self._used: self._used + taken]
            if len(parts) == 1:
                dst[:] = parts[0]
            else:
                np.concatenate(parts, out=dst)
            self._staged(taken)
        self.position += total
        return total

    def close(self, *, sync: bool = True) -> None:
        """Write what is left, wait for the I/O thread, fsync, close."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._current is not None and self._used:
                self._submit()
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
            _POOL.give(self.block_size, raw, keep=len(owned))

    def abort(self) -> None:
        """Stop without flushing (the caller removes the file)."""
        if self._closed:
            return
        self._closed = True
        self._error = self._error or NvckptError("aborted", path=self.path)
        try:
            self._stop_threads()
        finally:
            os.close(self.fd)
            self._give_back()

    def _stop_threads(self) -> None:
        for _ in self._threads:
            self._full.put(None)
        for t in self._threads:
            t.join()
