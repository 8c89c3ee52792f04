"""Chunk checksums (XXH3-64, SPEC 5) computed in a helper process, over host memory both processes map.

Why a process: while an async_save's writer runs beside a training loop, hashing its thousands of compressed
chunks in threads of the training process takes the GIL back after every chunk, each time a hand-off that the
loop's thread pays for.  On the H200 host that alone slowed a training step by +4.3 % (median of 8 rounds),
the same hashing in a child process by +0.8 %, about the method's noise (benchmarks/results/
probe_slowdown_h200.md).  Here the process that saves sends one message per run of chunks and reads one back.

``SharedBuffer``: anonymous shared memory (Linux memfd) mapped here and in the helper.  ``HashProcess``: the
helper, started on first use, one per process; it maps each buffer once (its descriptor passed over a Unix
socket), hashes runs of (buffer, offset, length) on a few threads and answers in order.  It ignores SIGINT and
SIGTERM (the saving process decides what a signal means for a save in progress, nvckpt.session.lifecycle) and
exits when the socket closes, so it never outlives its parent.  Anything it cannot do (no memfd, the helper
died or could not start) leaves the caller to hash in its own threads: ``usable`` says whether to try.

Run as ``python -m nvckpt.io.digests FD``: the helper (imports xxhash and nvckpt's zstd window check, not torch).
"""

from __future__ import annotations

import mmap
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import weakref
from typing import Any

_HEAD = struct.Struct("<BIQ")  # kind, request or buffer id, count or size
_RECORD = struct.Struct("<IQQB")  # buffer id, offset, length, check the zstd window first
_REPLY = struct.Struct("<IIB")  # request id, count, status (0: digests follow; 1: a message follows)
_MAP, _UNMAP, _HASH = 1, 2, 3
_ZSTD = 1


class HasherUnavailable(RuntimeError):
    """The helper process is not there (could not start, or died): hash in this process instead."""


def shared_memory_supported() -> bool:
    return hasattr(os, "memfd_create") and sys.platform.startswith("linux") and not os.environ.get("NVCKPT_NO_HASH_PROCESS")


class SharedBuffer:
    """``size`` bytes of memfd-backed shared memory, mapped read-write here (``memory``), known to the helper
    under ``buffer_id`` (it maps them read-only); unmapped there when this object is collected."""

    def __init__(self, size: int) -> None:
        fd = os.memfd_create("nvckpt-chunks", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(fd, size)
            self.memory = mmap.mmap(fd, size)  # page-aligned, as O_DIRECT and pinning need
            self.size = size
            self.buffer_id = HASHER.map(fd, size)
        finally:
            os.close(fd)  # the mapping (and the helper's) keeps the memory
        weakref.finalize(self, HASHER.unmap, self.buffer_id)


class _Request:
    __slots__ = ("done", "digests", "error")

    def __init__(self) -> None:
        self.done = False
        self.digests: list[int] = []
        self.error: str | None = None


class HashProcess:
    """The client side of the helper (thread-safe): ``map``/``unmap`` buffers, ``submit`` runs, ``result``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None
        self._broken = False
        self._next_buffer = 0
        self._next_request = 0
        self._pending: dict[int, _Request] = {}
        self._order: list[int] = []  # requests sent and not yet answered, in order

    @property
    def usable(self) -> bool:
        return not self._broken and shared_memory_supported()

    def _start(self) -> socket.socket:
        if self._broken:
            raise HasherUnavailable("the chunk-hashing helper process is not available")
        if self._sock is not None:
            return self._sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "nvckpt.io.digests", str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                          env={**os.environ, "PYTHONPATH": _package_path()})
        except OSError as exc:
            ours.close()
            self._broken = True
            raise HasherUnavailable(f"could not start the chunk-hashing helper process: {exc}") from None
        finally:
            theirs.close()
        self._sock = ours
        return ours

    def _fail(self, why: str) -> HasherUnavailable:
        """The helper is gone: every request still out fails over to hashing here."""
        self._broken = True
        for rid in self._order:
            req = self._pending.pop(rid, None)
            if req is not None:
                req.done, req.error = True, None
        self._order.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        return HasherUnavailable(f"the chunk-hashing helper process stopped ({why})")

    def map(self, fd: int, size: int) -> int:
        with self._lock:
            sock = self._start()
            self._next_buffer += 1
            try:
                socket.send_fds(sock, [_HEAD.pack(_MAP, self._next_buffer, size)], [fd])
            except OSError as exc:
                raise self._fail(str(exc)) from None
            return self._next_buffer

    def unmap(self, buffer_id: int) -> None:
        with self._lock:
            if self._sock is None or self._broken:
                return
            try:
                self._sock.sendall(_HEAD.pack(_UNMAP, buffer_id, 0))
            except OSError:
                self._fail("unmap")

    def submit(self, records: list[tuple[int, int, int, bool]]) -> int:
        """Hash (buffer id, offset, length, zstd window check) of each record; returns the request's id."""
        with self._lock:
            sock = self._start()
            self._next_request += 1
            rid = self._next_request
            body = b"".join(_RECORD.pack(b, o, n, _ZSTD if z else 0) for b, o, n, z in records)
            try:
                sock.sendall(_HEAD.pack(_HASH, rid, len(records)) + body)
            except OSError as exc:
                raise self._fail(str(exc)) from None
            self._pending[rid] = _Request()
            self._order.append(rid)
            return rid

    def result(self, rid: int) -> list[int]:
        """The digests of request ``rid`` (in record order); HasherUnavailable if the helper went away
        (hash them here), RuntimeError with the helper's message if a chunk failed its check."""
        with self._lock:
            req = self._pending.get(rid)
            while req is not None and not req.done:
                self._read_one()
            self._pending.pop(rid, None)
        if req is None or (req.error is None and not req.digests and self._broken):
            raise HasherUnavailable("the chunk-hashing helper process stopped")
        if req.error is not None:
            raise RuntimeError(req.error)
        return req.digests

    def _read_one(self) -> None:  # under the lock: the next answer, which belongs to the oldest request
        assert self._sock is not None
        try:
            rid, count, status = _REPLY.unpack(_recv_exactly(self._sock, _REPLY.size))
            if status == 0:
                digests = list(struct.unpack(f"<{count}Q", _recv_exactly(self._sock, 8 * count)))
                error = None
            else:
                digests, error = [], _recv_exactly(self._sock, count).decode("utf-8", "replace")
        except (OSError, EOFError) as exc:
            raise self._fail(str(exc) or "end of stream") from None
        if not self._order or self._order[0] != rid:
            raise self._fail(f"answer {rid} out of order")
        self._order.pop(0)
        req = self._pending.get(rid)
        if req is not None:
            req.done, req.digests, req.error = True, digests, error

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._proc is not None:
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                self._proc = None

    def _forked(self) -> None:
        """In a forked child (a DataLoader worker): the parent's helper is not ours to talk to."""
        if self._sock is not None:
            self._sock.close()
        self.__init__()  # type: ignore[misc]
        self._broken = True


def _package_path() -> str:
    """The directory nvckpt is imported from, first on the helper's path (an uninstalled checkout too)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = os.environ.get("PYTHONPATH")
    return here if not rest else here + os.pathsep + rest


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the helper closed its socket")
        got += k
    return bytes(buf)


HASHER = HashProcess()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: HASHER._forked())


# -- the helper -----------------------------------------------------------------------------
def _serve(fd: int) -> int:
    import signal
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    from ..codecs.builtin import check_zstd_window

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides (its lifecycle's grace on SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    maps: dict[int, memoryview] = {}
    pool = ThreadPoolExecutor(4, thread_name_prefix="nvckpt-hasher")

    def digest(rec: tuple[int, int, int, int]) -> int:
        b, o, n, flags = rec
        payload = maps[b][o: o + n]
        if flags & _ZSTD:
            try:
                check_zstd_window(payload)
            except ValueError as exc:
                raise ValueError(f"nvCOMP wrote a zstd chunk that SPEC 11.4 does not allow: {exc}") from None
        return xxhash.xxh3_64_intdigest(payload)

    def run(records: list[tuple[int, int, int, int]]) -> list[int]:
        return [digest(r) for r in records]

    def answer(ident: int, records: list[tuple[int, int, int, int]]) -> bytes:
        count = len(records)
        try:
            parts = [records[i::4] for i in range(4)] if count >= 8 else [records]
            out = [0] * count
            for i, part in enumerate(pool.map(run, parts)):
                out[i::len(parts)] = part
            return _REPLY.pack(ident, count, 0) + struct.pack(f"<{count}Q", *out)
        except Exception as exc:  # a chunk that failed its check, an unknown buffer: the caller raises it
            text = str(exc).encode("utf-8")
            return _REPLY.pack(ident, len(text), 1) + text

    # This thread reads every message at once (so the parent's writes never wait on a full socket), the
    # worker answers them in order; unmaps go through the worker too, after the hashes sent before them.
    work: queue.SimpleQueue = queue.SimpleQueue()

    def worker() -> None:
        while (item := work.get()) is not None:
            kind, ident, records = item
            if kind == _UNMAP:
                view = maps.pop(ident, None)
                if view is not None:
                    obj = view.obj
                    view.release()
                    obj.close()
                continue
            try:
                sock.sendall(answer(ident, records))
            except OSError:
                return

    thread = threading.Thread(target=worker, name="nvckpt-hasher-answers", daemon=True)
    thread.start()
    try:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(sock, _HEAD.size, 1)
                if not msg:
                    return 0  # the parent closed the socket (or exited)
                if len(msg) < _HEAD.size:
                    msg += _recv_exactly(sock, _HEAD.size - len(msg))
                kind, ident, count = _HEAD.unpack(msg)
                if kind == _HASH:
                    body = _recv_exactly(sock, _RECORD.size * count)
            except (OSError, EOFError):
                return 0
            if kind == _MAP:
                m = mmap.mmap(fds[0], count, prot=mmap.PROT_READ)
                os.close(fds[0])
                maps[ident] = memoryview(m)
            elif kind == _UNMAP:
                work.put((kind, ident, None))
            elif kind == _HASH:
                work.put((kind, ident, [_RECORD.unpack_from(body, i * _RECORD.size) for i in range(count)]))
            else:
                return 2
    finally:
        work.put(None)


if __name__ == "__main__":
    sys.exit(_serve(int(sys.argv[1])))
