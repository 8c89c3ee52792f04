"""Replacing a file atomically, the one way nvckpt does it (save, convert, recover).

Write beside the target, fsync, rename over it, fsync the folder.  A crash at
any point leaves the final path with the complete old file or the complete new
one; what it leaves beside it is a ``.NAME.XXXXXXXX.nvckpt-tmp`` file that
``nvckpt recover`` can salvage.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Any, Callable, Iterator

TMP_SUFFIX = ".nvckpt-tmp"


def temporary_name(final: str) -> str:
    """A fresh hidden name beside ``final`` (the caller creates it with O_EXCL)."""
    folder, base = os.path.split(final)
    return os.path.join(folder, f".{base}.{secrets.token_hex(4)}{TMP_SUFFIX}")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create(tmp: str) -> None:
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))


class AtomicReplace:
    """A temporary file beside ``path``, published over it by ``commit()``, removed by ``abort()``.

    ``create(tmp)`` creates the temporary file exclusively (O_EXCL) and returns
    what writes it (a FileSink, say); by default an empty file is created and
    the writer opens ``tmp`` itself.  Use as a context manager to commit on
    success and abort on any exception."""

    def __init__(self, path: str | os.PathLike, create: Callable[[str], Any] = _create) -> None:
        self.path = os.path.abspath(os.fspath(path))
        if os.path.isdir(self.path):
            raise IsADirectoryError(21, "Is a directory", os.fspath(path))
        for _ in range(100):
            self.tmp = temporary_name(self.path)
            try:
                self.writer = create(self.tmp)
                break
            except FileExistsError:
                continue
            except BaseException:
                with contextlib.suppress(FileNotFoundError):  # created, then the writer failed to start
                    os.unlink(self.tmp)
                raise
        else:
            raise FileExistsError(17, "could not create a temporary file beside it", os.fspath(path))

    def commit(self) -> None:
        """The complete temporary file (fsynced, closed by its writer) becomes the target."""
        try:
            close = getattr(self.writer, "close", None)
            if close is not None:
                close(sync=True)
            else:
                _fsync(self.tmp)
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()  # the old file stays; nothing half-written stays beside it
            raise
        _fsync(os.path.dirname(self.path))

    def abort(self) -> None:
        try:
            stop = getattr(self.writer, "abort", None)
            if stop is not None:
                stop()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)

    def __enter__(self) -> "AtomicReplace":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path beside ``path`` for a writer that wants a path; publish it on success."""
    with AtomicReplace(path) as out:
        yield out.tmp


__all__ = ["AtomicReplace", "atomic_output", "temporary_name", "TMP_SUFFIX"]
