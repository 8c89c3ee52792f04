"""Directories: where a sharded checkpoint lives (one file per rank, its metadata), read and published whole.

A ``Directory`` is a local folder or a prefix in an object store.  Readers ask
it for an entry's bytes, size or a ``ByteSource``.  A save *stages* the new
checkpoint where no reader sees it (``stage()`` in the coordinator; every rank
reaches the same staging through its ``token``), writes each file through a
``Target`` of the staging, then ``publish`` makes it the directory's checkpoint
in one step, so that a reader sees the complete old checkpoint or the complete
new one and never a mix; a save that fails ``discard``s what it staged.  On a
local filesystem this is a hidden staging folder renamed (exchanged) into place
(nvckpt.io.publish); an object store writes one object last as the commit point.
``nvckpt.testing.io.DirectoryTests`` is the contract every implementation passes.
"""

from __future__ import annotations

import errno
import os
import shutil
import weakref
from typing import Any, Callable, Protocol, runtime_checkable

from .atomic import atomic_output
from .publish import SAVES, live_staging, publish_directory, remove_stale, staging_name
from .source import ByteSource, LocalFile
from .target import AtomicFile, Target


class Staging(Protocol):
    """A checkpoint being written into a Directory, invisible to readers until ``publish``."""

    token: str  # picklable: the other ranks reach this staging with Directory.staging(token)

    def target(self, name: str) -> Target:
        """The Target of the staged file ``name`` (a plain file name)."""
        ...

    def alive(self) -> bool:
        """The staging is still there to write into (not discarded by a failed save, not published)."""
        ...

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write the whole staged file ``name`` (complete or not at all)."""
        ...

    def size(self, name: str) -> int:
        """The size of the staged file ``name`` (FileNotFoundError if it is not there)."""
        ...

    def publish(self, number: int | None = None, carry: Callable[[str], bool] | None = None) -> None:
        """Make the staged checkpoint the directory's (see nvckpt.io.publish for ``number`` and ``carry``)."""
        ...

    def discard(self) -> None:
        """Remove what this staging holds (a failed save); safe to call twice."""
        ...


@runtime_checkable
class Directory(Protocol):
    """A sharded checkpoint's directory (see the module docstring)."""

    name: str

    def exists(self) -> bool:
        """The directory (or prefix) holds anything."""
        ...

    def is_file(self) -> bool:
        """The name is a plain file, not a directory (a rank file given where a directory belongs)."""
        ...

    def entries(self) -> list[str]:
        """The names in the directory (empty if it does not exist)."""
        ...

    def read_bytes(self, name: str) -> bytes:
        """The whole entry ``name`` (FileNotFoundError if missing, OSError if unreadable)."""
        ...

    def size(self, name: str) -> int | None:
        """The size of entry ``name``, or None if there is no such file."""
        ...

    def one_save(self) -> bool:
        """Every entry this object reads is one that a single publish wrote (an object store's commit object
        names them all, each pinned), so they cannot be parts of two saves; False where files may have been
        copied in one by one (a local folder copied while a save was published over it)."""
        ...

    def open_source(self, name: str) -> ByteSource:
        """A ByteSource of entry ``name`` (a rank file), for a ChunkReader."""
        ...

    def join(self, name: str) -> str:
        """How errors and reports name entry ``name``."""
        ...

    def check_replaceable(self, own: Callable[[str], bool], overwrite: bool) -> None:
        """Raise (FileExistsError naming the directory) unless a new checkpoint may be published here:
        nothing there, or a checkpoint (an entry ``own`` recognises) and ``overwrite``."""
        ...

    def remove_stale(self) -> list[str]:
        """Remove what saves that did not finish left (not a staging this process is still writing)."""
        ...

    def stage(self) -> Staging:
        """Begin a new checkpoint here, invisible to readers (the coordinator calls it once per save)."""
        ...

    def staging(self, token: str) -> Staging:
        """The staging another process began, from its ``token`` (every rank writes into the same one)."""
        ...


class LocalStaging:
    """A hidden folder beside the target directory, renamed (exchanged) into place by ``publish``."""

    def __init__(self, directory: "LocalDirectory", token: str, *, create: bool) -> None:
        self.directory = directory
        self.token = token
        if create:
            try:
                os.mkdir(token)
            except OSError as exc:  # errors name the user's directory, never the hidden staging one
                raise _named(exc, directory.name) from None
            live_staging(token, True)
            # A save that failed and is never discarded: its staging is stale once this object is freed.
            weakref.finalize(self, live_staging, token, False)

    def target(self, name: str) -> Target:
        _plain_name(name)
        return _StagedFile(os.path.join(self.token, name), os.path.join(self.directory.name, name))

    def alive(self) -> bool:
        return os.path.isdir(self.token)

    def write_bytes(self, name: str, data: bytes) -> None:
        _plain_name(name)
        with atomic_output(os.path.join(self.token, name)) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)

    def size(self, name: str) -> int:
        return os.stat(os.path.join(self.token, name)).st_size

    def publish(self, number: int | None = None, carry: Callable[[str], bool] | None = None) -> None:
        try:
            publish_directory(self.token, self.directory.name, number, carry)
        except FileExistsError:
            shutil.rmtree(self.token, ignore_errors=True)  # older than what is there: nothing of it stays
            raise
        finally:
            live_staging(self.token, False)

    def discard(self) -> None:
        live_staging(self.token, False)
        shutil.rmtree(self.token, ignore_errors=True)

    def release(self) -> None:
        """This save will not publish: its staging is stale for the next save's ``remove_stale``."""
        live_staging(self.token, False)


class _StagedFile(AtomicFile):
    """A file in a staging folder, whose errors name the file as it will be once published."""

    def __init__(self, path: str, published: str) -> None:
        super().__init__(path)
        self._published = published

    def restate(self, exc: BaseException) -> BaseException:
        from .atomic import about_target

        return about_target(super().restate(exc), self._published, self.name)


class LocalDirectory:
    """A folder on a local filesystem."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.name = os.path.abspath(os.fspath(path))

    def exists(self) -> bool:
        return os.path.isdir(self.name)

    def is_file(self) -> bool:
        return os.path.isfile(self.name)

    def entries(self) -> list[str]:
        try:
            return sorted(os.listdir(self.name))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def join(self, name: str) -> str:
        return os.path.join(self.name, name)

    def read_bytes(self, name: str) -> bytes:
        with open(self.join(name), "rb") as f:
            return f.read()

    def size(self, name: str) -> int | None:
        path = self.join(name)
        return os.path.getsize(path) if os.path.isfile(path) else None

    def one_save(self) -> bool:
        return False  # a folder's files may have been copied in one by one

    def open_source(self, name: str) -> ByteSource:
        return LocalFile(self.join(name))

    def check_replaceable(self, own: Callable[[str], bool], overwrite: bool) -> None:
        p = self.name
        if not os.path.lexists(p):
            return
        if os.path.islink(p):  # publishing renames over the path: it would replace the link, not what it names
            raise FileExistsError(errno.EEXIST, "is a symlink; a checkpoint directory is published by renaming it "
                                  f"into place, which would replace the link: give the directory it names "
                                  f"({os.path.realpath(p)})", p)
        if not os.path.isdir(p):
            raise FileExistsError(errno.EEXIST, "exists and is not a directory; a checkpoint directory is written "
                                  "there", p)
        entries = os.listdir(p)
        if any(own(e) for e in entries):
            if not overwrite:
                raise FileExistsError(errno.EEXIST, "a checkpoint exists there and overwrite=False", p)
        elif entries:
            raise FileExistsError(errno.EEXIST, "is a directory holding other files, not a checkpoint; a checkpoint "
                                  "directory replaces a whole directory and will not replace this one", p)

    def remove_stale(self) -> list[str]:
        return remove_stale(self.name)

    def stage(self) -> LocalStaging:
        os.makedirs(os.path.dirname(self.name), exist_ok=True)
        return LocalStaging(self, staging_name(self.name), create=True)

    def staging(self, token: str) -> LocalStaging:
        return LocalStaging(self, token, create=False)


def _plain_name(name: str) -> None:
    if os.path.basename(name) != name or name in ("", ".", ".."):
        raise ValueError(f"{name!r} is not a plain file name")


def _named(exc: OSError, name: str) -> OSError:
    if exc.errno is None or exc.strerror is None:
        return exc
    return OSError(exc.errno, exc.strerror, name)


def location(target: str | os.PathLike) -> str:
    """A directory's path made absolute (a URL as it is), as a front-end names it."""
    from .schemes import local_path, url_scheme

    path = os.fspath(target)
    return path if url_scheme(path) not in (None, "file") else os.path.abspath(local_path(path))


def is_directory(target: Any, storage_options: dict[str, Any] | None = None) -> bool:
    """``target`` names a directory (a local folder; under a URL, a prefix holding objects) and not a file."""
    from .schemes import backend_for, local_path

    path = os.fspath(target)
    if isinstance(path, str) and backend_for(path) is not None:
        d = open_directory(path, storage_options)
        try:
            return not d.is_file() and d.exists()
        except FileNotFoundError:  # no bucket: what opening it as a file says is the error to give
            return False
    return os.path.isdir(local_path(path) if isinstance(path, str) else path)


def open_directory(target: Any, storage_options: dict[str, Any] | None = None) -> Directory:
    """The Directory for a path or URL (a Directory is returned as it is)."""
    if isinstance(target, Directory):
        return target
    from .schemes import backend_for, local_path

    path = os.fspath(target)
    backend = backend_for(path)
    if backend is not None:
        return backend.open_directory(path, storage_options)
    return LocalDirectory(local_path(path))


__all__ = ["Directory", "Staging", "LocalDirectory", "LocalStaging", "location", "open_directory", "is_directory", "SAVES"]
