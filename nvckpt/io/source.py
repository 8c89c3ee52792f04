"""Byte sources: positional reads of a stored checkpoint, counted.

Every reader reaches storage through a ``ByteSource`` (``open_source`` picks
one for what the caller gave): ``LocalFile`` reads a path through ``pread``
(no shared file position, so one serves many threads at once),
``FileObjectSource`` a caller's seekable binary file object, and an object
store or fsspec URL its own backend (``nvckpt.io.schemes``).  ``range_reads``
gives the GPU loader large reads into its (pinned) buffers; a local file does
them with O_DIRECT where the filesystem allows, so a load costs the page cache
nothing.  ``nvckpt.testing.io.ByteSourceTests`` is the contract every source passes.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import threading
import weakref
from typing import Any, Protocol, runtime_checkable

from .._fork import Lock, importing
from ..errors import EndOfStreamError, NvckptError, TruncatedError
from .ranges import LOCAL, Coalescing

_DIRECT_ALIGN = 4096


class RangeReads(Protocol):
    """Large reads of a source into a caller's buffers (the GPU loader's spans); ``close()`` counts them."""

    bytes_read: int
    direct_reads: int

    def read(self, start: int, length: int, need: int, buf: memoryview) -> memoryview:
        """At least ``need`` bytes from ``start`` into ``buf`` (``length`` asked, aligned for O_DIRECT)."""
        ...

    def close(self) -> None:
        """Release what the reads hold (descriptors) and add the bytes they read to the source's ``bytes_read``."""
        ...


@runtime_checkable
class ByteSource(Protocol):
    """The stored bytes of one checkpoint, read by position (thread-safe).

    ``size`` is the checkpoint's length (a reader may lower it for a stream that holds more after the
    checkpoint, ``exact_size`` False); ``bytes_read`` counts what was read; ``coalescing`` says which
    ranges one read should cover on this medium.  Reads past ``size`` raise TruncatedError, reads after
    ``close()`` NvckptError; OSErrors name the source."""

    name: str
    size: int
    bytes_read: int
    exact_size: bool
    coalescing: Coalescing

    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset`` (TruncatedError past ``size``)."""
        ...

    def read_into(self, offset: int, buf: Any) -> None:
        """Fill the writable buffer ``buf`` with the bytes from ``offset`` (TruncatedError past ``size``)."""
        ...

    def range_reads(self, direct: bool) -> RangeReads:
        """Large reads into caller buffers; ``direct`` asks for O_DIRECT where the medium has it (a local file)."""
        ...

    def count(self, n: int) -> None:
        """Add ``n`` bytes read past this source (by its RangeReads) to ``bytes_read``."""
        ...

    def close(self) -> None:
        """Close the source, after the reads in flight; later reads raise NvckptError.  Safe to call twice."""
        ...

    @property
    def closed(self) -> bool:
        """``close()`` was called."""
        ...


class _Counted:
    """Reads in flight (``close`` waits for them) and the count of bytes read: what every source shares."""

    name: str
    size: int

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Reads in flight: close() waits for them, so a descriptor is never closed (and its number
        # reused by another open file) under a read on another thread.
        self._state = threading.Condition(threading.Lock())
        self._active = 0
        self._closing = False
        self.bytes_read = 0

    def after_fork_in_child(self) -> None:
        """In a forked child (a DataLoader worker reading its parent's open checkpoint): the parent's reads in
        flight and its threads' holds on the locks stayed behind with their threads; close() must not wait
        for them.  The descriptor is the child's own copy."""
        self._lock = threading.Lock()
        self._state = threading.Condition(threading.Lock())
        self._active = 0

    def count(self, n: int) -> None:
        """Count ``n`` bytes read past this source (by its RangeReads) in ``bytes_read``."""
        with self._lock:
            self.bytes_read += n

    @contextlib.contextmanager
    def _reading(self) -> Any:
        with self._state:
            if self._closing or self.closed:
                raise NvckptError("read from a closed checkpoint", path=self.name)
            self._active += 1
        try:
            yield
        finally:
            with self._state:
                self._active -= 1
                if not self._active:
                    self._state.notify_all()

    def _drain(self) -> None:
        """Refuse new reads and wait for those in flight (under ``_state``)."""
        self._closing = True
        while self._active:
            self._state.wait()

    def _check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise TruncatedError(f"read of {length} bytes at {offset} runs past the end of the file ({self.size} bytes)",
                                 path=self.name, offset=offset)

    @property
    def closed(self) -> bool:  # pragma: no cover - every source defines it
        raise NotImplementedError

    def read_into(self, offset: int, buf: Any) -> None:
        """``read`` copied into ``buf`` (a source that cannot read into a caller's buffer)."""
        view = memoryview(buf).cast("B")
        view[:] = self.read(offset, view.nbytes)  # type: ignore[attr-defined]

    def range_reads(self, direct: bool) -> RangeReads:
        """Reads into caller buffers through ``read_into`` (a source without a faster way)."""
        return BufferedReads(self)  # type: ignore[arg-type]


def open_source(target: Any, storage_options: dict[str, Any] | None = None) -> ByteSource:
    """The ByteSource for what a caller gave ``open``/``load``: a path, a URL (its storage backend, with
    ``storage_options``), or a binary file object (a ByteSource is returned as it is)."""
    if isinstance(target, ByteSource):
        return target
    if isinstance(target, (str, os.PathLike)):
        with importing():  # maybe in a thread of the caller's: a fork waits for the import (nvckpt._fork)
            from .schemes import backend_for, local_path

        path = os.fspath(target)
        if isinstance(path, str):
            backend = backend_for(path)
            if backend is not None:
                return backend.open_source(path, storage_options)
            path = local_path(path)
        return LocalFile(path)
    if isinstance(target, (bytes, bytearray, memoryview)):
        raise TypeError("a checkpoint is opened from a path (str or os.PathLike) or a binary file object, "
                        f"not {type(target).__name__}: wrap a checkpoint's bytes in io.BytesIO(data); "
                        "decode a bytes path with os.fsdecode(path)")
    return FileObjectSource(target)


class LocalFile(_Counted):
    """A checkpoint file on a local filesystem, read with ``pread`` / ``preadv``."""

    exact_size = True
    coalescing = LOCAL

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.name = os.fspath(path)
        self._fd: int | None = os.open(self.name, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        st = os.fstat(self._fd)
        if stat.S_ISDIR(st.st_mode):  # Linux opens a folder read-only; its reads then fail naming no file
            os.close(self._fd)
            self._fd = None
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), self.name)
        self.size = st.st_size
        if not stat.S_ISREG(st.st_mode):  # a block device has a size only lseek tells; a pipe has none
            try:
                self.size = os.lseek(self._fd, 0, os.SEEK_END)
            except OSError:
                os.close(self._fd)
                self._fd = None
                raise OSError(errno.ESPIPE, "a pipe or socket, which does not seek: the index is at the end of the "
                              "file, so a checkpoint is read from a file (save the stream to one first)",
                              self.name) from None

    @property
    def fd(self) -> int | None:
        """The open descriptor (None once closed)."""
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd is None

    def _named(self, exc: OSError) -> OSError:
        if exc.filename is None and exc.errno is not None:
            return type(exc)(exc.errno, exc.strerror, self.name)  # name the file (EIO)
        return exc

    def read(self, offset: int, length: int) -> bytes:
        with self._reading():
            self._check_range(offset, length)
            fd = self._fd
            assert fd is not None
            parts, got = [], 0
            while got < length:  # pread may return short reads
                try:
                    part = os.pread(fd, length - got, offset + got)
                except OSError as exc:
                    raise self._named(exc) from None
                if not part:
                    raise TruncatedError(f"file ended while reading {length} bytes", path=self.name, offset=offset)
                parts.append(part)
                got += len(part)
            self.count(length)
            return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_into(self, offset: int, buf: Any) -> None:
        """Exactly ``len(buf)`` bytes from ``offset`` into the writable buffer ``buf`` (no copy through bytes)."""
        view = memoryview(buf).cast("B")
        length = view.nbytes
        with self._reading():
            self._check_range(offset, length)
            fd = self._fd
            assert fd is not None
            got = 0
            while got < length:
                try:
                    n = os.preadv(fd, [view[got:]], offset + got)
                except OSError as exc:
                    raise self._named(exc) from None
                if n <= 0:
                    raise TruncatedError(f"file ended while reading {length} bytes", path=self.name, offset=offset)
                got += n
            self.count(length)

    def range_reads(self, direct: bool) -> RangeReads:
        return DirectReads(self, direct)

    def close(self) -> None:
        """Close the file, once the reads in flight are done; reads after this raise NvckptError."""
        with self._state:
            self._drain()
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        # A checkpoint dropped without close() (``nvckpt.open(p)["w"]``) must not keep its descriptor open,
        # as a Python file object does not; nothing reads through a source that is being collected.
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


class FileObjectSource(_Counted):
    """A checkpoint in a caller's seekable binary file object, read from where the stream stands (as save
    wrote it there, after a header of the caller's), one read at a time; ``close`` leaves the stream just
    after the checkpoint, as torch.load leaves it (a second checkpoint written after it then loads next)."""

    exact_size = False  # the stream may hold more after the checkpoint (two saved back to back)
    coalescing = LOCAL

    def __init__(self, target: Any) -> None:
        super().__init__()
        if isinstance(target, io.TextIOBase):
            raise TypeError(f"{getattr(target, 'name', 'the file')!r} is open in text mode: a checkpoint is "
                            "read from a binary file object (open(path, 'rb')) or from the path itself")
        if not all(hasattr(target, a) for a in ("seek", "read")):
            raise TypeError("a checkpoint is opened from a path (str or os.PathLike) or a binary file object "
                            f"(with read and seek), not {type(target).__qualname__}")
        seekable = getattr(target, "seekable", None)
        if callable(seekable) and not seekable():
            raise TypeError(f"cannot read a checkpoint from a {type(target).__qualname__} that does not seek "
                            "(a pipe, a socket): the index is at the end of the file; give a path or a "
                            "seekable binary file object (read a pipe into io.BytesIO first)")
        self.name = getattr(target, "name", "<stream>")
        if not isinstance(self.name, str):
            self.name = str(self.name)
        self._file: Any = target
        # Offsets are the checkpoint's own, from its preamble.  A stream left at its end (written, not rewound)
        # is read from its start, as before -- unless nvckpt's own reader left it there after its last
        # checkpoint: then there is nothing more to read (a loop reading checkpoints one after another until
        # the end must not start over).
        try:
            self._base = target.tell()
        except (OSError, AttributeError, ValueError):
            self._base = 0
        end = target.seek(0, os.SEEK_END)
        if self._base >= end:
            if end and _left_at_end(target) == end:
                target.seek(end)
                raise EndOfStreamError(f"the stream is at its end ({end} bytes), just after the last checkpoint "
                                       "read from it: no checkpoint follows (seek(0) to read from the start)",
                                       path=self.name)
            self._base = 0
        self.size = end - self._base

    @property
    def closed(self) -> bool:
        return self._file is None

    def read(self, offset: int, length: int) -> bytes:
        with self._reading():
            self._check_range(offset, length)
            with self._lock:
                if self._file is None:
                    raise NvckptError("read from a closed checkpoint", path=self.name)
                self._file.seek(self._base + offset)
                data = self._file.read(length)
                if data is not None and 0 < len(data) < length:  # a raw stream may return less than asked
                    parts = [data]
                    got = len(data)
                    while got < length:
                        part = self._file.read(length - got)
                        if not part:
                            break
                        parts.append(part)
                        got += len(part)
                    data = b"".join(parts)
            if data is None:
                raise NvckptError(f"the stream returned no data for a read of {length} bytes (a non-blocking "
                                  "stream?)", path=self.name, offset=offset)
            if len(data) != length:
                raise TruncatedError(f"file ended while reading {length} bytes", path=self.name, offset=offset)
            self.count(length)
            return data

    def close(self) -> None:
        with self._state:
            self._drain()
            stream, self._file = self._file, None
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):  # a stream closed by its owner meanwhile
                stream.seek(self._base + self.size)
                _note_left(stream, self._base + self.size)


# Streams this process's readers left just after a checkpoint, with that position: a stream at its end
# is read from its start (a save wrote it and did not rewind) unless nvckpt's reader put it there.
_LEFT: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_LEFT_LOCK = Lock()  # a forked child gets it unlocked (nvckpt._fork)


def _note_left(stream: Any, position: int) -> None:
    with _LEFT_LOCK, contextlib.suppress(TypeError):  # a stream type without weak references: not noted
        _LEFT[stream] = position


def _left_at_end(stream: Any) -> int | None:
    with _LEFT_LOCK:
        try:
            return _LEFT.get(stream)
        except TypeError:
            return None


def forget_position(stream: Any) -> None:
    """A save wrote to ``stream``: a reader at its end reads from its start again."""
    with _LEFT_LOCK, contextlib.suppress(TypeError, KeyError):
        del _LEFT[stream]


class DirectReads:
    """Reads of a LocalFile into caller buffers, O_DIRECT where the filesystem allows.

    The file is reopened through ``/proc/self/fd``: the same file the source
    has open, not whatever its path names now (an atomic save may have
    replaced it since)."""

    def __init__(self, source: LocalFile, direct: bool) -> None:
        self.source = source
        self.plain: int | None = None
        self.direct: int | None = None
        self.bytes_read = 0
        self.direct_reads = 0
        self._use_direct = direct
        self._lock = threading.Lock()
        fd = source.fd
        path = f"/proc/self/fd/{fd}" if fd is not None and os.path.exists(f"/proc/self/fd/{fd}") else source.name
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
        self.source.count(self.bytes_read)  # a Checkpoint's bytes_read counts these reads too
        self.bytes_read = 0

    def read(self, start: int, length: int, need: int, buf: memoryview) -> memoryview:
        """At least ``need`` bytes from ``start`` into ``buf`` (asks for ``length``, aligned for O_DIRECT)."""
        size = self.source.size
        if self.plain is None:  # a device or a file this process cannot reopen: the source's own reads
            n = min(length, size - start)
            self.source.read_into(start, buf[:n])
            return buf
        got = 0
        while got < need:
            fd = self.direct if self._use_direct and self.direct is not None and got % _DIRECT_ALIGN == 0 else self.plain
            want = length - got if fd == self.direct else min(length, size - start) - got
            try:
                n = os.preadv(fd, [buf[got: got + want]], start + got)
            except OSError as exc:
                if fd == self.direct and exc.errno == errno.EINVAL:
                    self._use_direct = False  # this filesystem refuses O_DIRECT reads after all (closed at close())
                    continue
                raise OSError(exc.errno, f"{exc.strerror} (read of {want} bytes at {start + got})",
                              self.source.name) from None
            if n <= 0:
                raise TruncatedError(f"file ended while reading {need} bytes", path=self.source.name, offset=start + got)
            if fd == self.direct:
                self.direct_reads += 1
            got += n
        with self._lock:
            self.bytes_read += got
        return buf


class BufferedReads:
    """RangeReads through a source's own ``read_into`` (a file object, a store without a faster way):
    the source counts the bytes itself."""

    def __init__(self, source: ByteSource) -> None:
        self.source = source
        self.bytes_read = 0
        self.direct_reads = 0

    def read(self, start: int, length: int, need: int, buf: memoryview) -> memoryview:
        n = min(length, self.source.size - start)
        self.source.read_into(start, buf[:n])
        return buf

    def close(self) -> None:
        pass


__all__ = ["ByteSource", "RangeReads", "LocalFile", "FileObjectSource", "DirectReads", "BufferedReads", "open_source",
           "forget_position"]
