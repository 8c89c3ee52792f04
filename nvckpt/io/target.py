"""Targets: where one save writes its checkpoint (``open_target`` picks one for what the caller gave).

A ``Target`` is one save's write: ``open_sink`` gives the stream the frame
writer writes to, front to back (it never seeks); ``commit`` makes the file
appear, ``abort`` leaves the target as it was.  An *atomic* target (a local
path written through a temporary file and a rename, an object-store upload
completed at the end) shows the new file only complete, so a cancel is honoured
until the commit; a stream or a special file (``/dev/null``, a FIFO) is written
through, and a cancel must come before the index is written.
``nvckpt.testing.io.TargetTests`` is the contract every target passes.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from .atomic import AtomicReplace, check_target, is_special_file, leftover_temporaries
from .sink import DEFAULT_BLOCK, DEFAULT_BLOCKS, FileSink
from .source import forget_position


@dataclass(frozen=True)
class SinkOptions:
    """What the engine asks of a local file's sink: O_DIRECT, and its staging blocks; ``expected_bytes``: at
    most what the save will write, where known (an object store sizes its upload's parts by it)."""

    direct: bool = True
    block_size: int = DEFAULT_BLOCK
    blocks: int = DEFAULT_BLOCKS
    expected_bytes: int | None = None


class Sink(Protocol):
    """A write-only binary stream: ``write(data) -> int``; ``write_many(pieces)`` where it has one."""

    def write(self, data: Any) -> int:
        """Append ``data`` (bytes-like); returns its length."""
        ...


@runtime_checkable
class Target(Protocol):
    """One save's write of one checkpoint (see the module docstring).

    ``name``: the target as the caller gave it (errors name it); ``path``: what ``SaveResult.path`` says
    (None for a stream); ``order_key``: saves to the same key publish in the order they started (None: no
    order to keep)."""

    name: str
    path: str | None
    atomic: bool
    order_key: str | None

    def check(self) -> None:
        """Raise now what would make the save fail at its end (a missing folder, a read-only file)."""
        ...

    def leftovers(self) -> list[str]:
        """Temporaries of earlier saves to this target that did not finish (a crash), to report."""
        ...

    def open_sink(self, options: SinkOptions) -> Sink:
        """Start the write: the stream the frames go to, front to back (``options``: what the engine asks of a local file)."""
        ...

    def commit(self, before_publish: Callable[[], None] | None = None) -> None:
        """The written file becomes the target.  ``before_publish`` is called last before that (it may raise,
        and the target is then left as it was); a non-atomic target calls nothing."""
        ...

    def abort(self) -> None:
        """Stop writing; an atomic target is left as it was.  Safe to call twice, or after a failed commit."""
        ...

    def restate(self, exc: BaseException) -> BaseException:
        """An error about the write (a temporary file, a part) restated for the target the caller named."""
        ...


class AtomicFile:
    """A local path written atomically: a temporary file beside it, fsync, rename (nvckpt.io.atomic)."""

    atomic = True

    def __init__(self, path: str) -> None:
        self.name = path
        self.path: str | None = None  # set at open_sink: the file a symlink names, which the rename replaces
        self.order_key = os.path.realpath(os.path.abspath(path))
        # Free the replaced file's blocks before commit() returns (set by an async save, whose own thread
        # pays for it; a plain save leaves that to a thread of its own, off the caller's path).
        self.free_replaced_now = False
        self._out: AtomicReplace | None = None

    def check(self) -> None:
        check_target(self.name)

    def leftovers(self) -> list[str]:
        return leftover_temporaries(self.name)

    def open_sink(self, options: SinkOptions) -> FileSink:
        self._out = AtomicReplace(self.name, lambda tmp: FileSink(tmp, direct=options.direct,
                                                                   block_size=options.block_size,
                                                                   blocks=options.blocks),
                                  free_now=self.free_replaced_now)
        self.path = self._out.path
        return self._out.writer

    def commit(self, before_publish: Callable[[], None] | None = None) -> None:
        assert self._out is not None, "commit before open_sink"
        self._out.commit(before_publish)

    def abort(self) -> None:
        if self._out is not None:
            self._out.abort()

    def restate(self, exc: BaseException) -> BaseException:
        return exc if self._out is None else self._out.as_target(exc)


class StreamTarget:
    """A caller's binary stream, written front to back and left open (torch.save's file-object form)."""

    atomic = False
    path = None
    order_key = None

    def __init__(self, stream: Any) -> None:
        if isinstance(stream, io.TextIOBase):
            raise TypeError(f"{getattr(stream, 'name', 'the file')!r} is open in text mode: a checkpoint is "
                            "written to a binary file object (open(path, 'wb')) or to a path")
        self.stream = stream
        self.name = str(getattr(stream, "name", "<stream>"))

    def check(self) -> None:
        pass

    def leftovers(self) -> list[str]:
        return []

    def open_sink(self, options: SinkOptions) -> Any:
        forget_position(self.stream)  # a load at the stream's end now reads what was written (from the start)
        return self.stream

    def commit(self, before_publish: Callable[[], None] | None = None) -> None:
        pass

    def abort(self) -> None:
        pass

    def restate(self, exc: BaseException) -> BaseException:
        return exc


class SpecialFile:
    """A device or FIFO (``/dev/null``, a pipe): written through, as torch.save does, never replaced."""

    atomic = False
    order_key = None

    def __init__(self, path: str) -> None:
        self.name = self.path = path
        self._file: Any = None

    def check(self) -> None:
        pass

    def leftovers(self) -> list[str]:
        return []

    def open_sink(self, options: SinkOptions) -> Any:
        self._file = open(self.path, "wb")
        return self._file

    def commit(self, before_publish: Callable[[], None] | None = None) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()

    def abort(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass  # the error that ended the save is the one to report

    def restate(self, exc: BaseException) -> BaseException:
        if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
            return type(exc)(exc.errno, exc.strerror, self.path)  # ENOSPC from /dev/full names no file
        return exc


def target_path(target: Any, *, absolute: bool = False) -> str:
    """A str path from what a caller gave (TypeError naming the type otherwise); ``absolute``: made absolute
    (an async_save's path means the folder of the call, whatever the working folder is when its thread opens
    it), keeping a trailing separator, which says the path names a folder (refused by ``check``)."""
    try:
        path = os.fspath(target)
    except TypeError:
        raise TypeError(f"a checkpoint is saved to a path (str or os.PathLike) or a binary file object with "
                        f"write(), not {type(target).__qualname__}") from None
    if isinstance(path, bytes):
        raise TypeError("a checkpoint is saved to a path (str or os.PathLike) or a binary file object, not "
                        "bytes: use os.fsdecode(path) for a bytes path")
    if not absolute:
        return path
    absolute_path = os.path.abspath(path)
    return absolute_path + os.sep if path.endswith(("/", os.sep)) and not absolute_path.endswith(os.sep) else absolute_path


def open_target(target: Any, *, absolute: bool = False, storage_options: dict[str, Any] | None = None) -> Target:
    """The Target a save writes to, for what the caller gave: a binary stream (it has ``write``), a URL
    (its storage backend), a device or FIFO, or a local path."""
    if isinstance(target, Target):
        return target
    if hasattr(target, "write"):
        return StreamTarget(target)
    from .._fork import importing

    with importing():  # maybe in a thread of the caller's: a fork waits for the import (nvckpt._fork)
        from .schemes import backend_for, local_path

    path = target_path(target)
    backend = backend_for(path)
    if backend is not None:
        return backend.open_target(path, storage_options)
    path = target_path(local_path(path), absolute=absolute)
    if is_special_file(path):
        return SpecialFile(path)
    return AtomicFile(path)


__all__ = ["Target", "Sink", "SinkOptions", "AtomicFile", "StreamTarget", "SpecialFile", "open_target", "target_path"]
