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


def _name_max(folder: str) -> int:
    try:
        return os.pathconf(folder or ".", "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


def temporary_name(final: str) -> str:
    """A fresh hidden name beside ``final`` (the caller creates it with O_EXCL).

    ``.NAME.XXXXXXXX.nvckpt-tmp``, with NAME shortened (whole UTF-8 characters)
    where the whole would exceed the folder's NAME_MAX: a legal target name of
    235-255 bytes must not fail for its temporary's sake."""
    folder, base = os.path.split(final)
    token = secrets.token_hex(4)
    extra = len(f"..{token}{TMP_SUFFIX}")
    raw = os.fsencode(base)
    room = _name_max(folder) - extra
    if len(raw) > room:
        cut = raw[:max(room, 1)]
        lead = len(cut)
        while lead > 0 and cut[lead - 1] & 0xC0 == 0x80:  # back to the start of the last character
            lead -= 1
        if lead > 0 and cut[lead - 1] >= 0xC0:
            need = 2 if cut[lead - 1] < 0xE0 else 3 if cut[lead - 1] < 0xF0 else 4
            if len(cut) - (lead - 1) < need:  # cut inside a character: leave it out
                cut = cut[: lead - 1]
        base = os.fsdecode(cut)
    return os.path.join(folder, f".{base}.{token}{TMP_SUFFIX}")


def _as_target(exc: OSError, path: str, tmp: str) -> OSError:
    """The same OSError, naming the path the caller gave instead of our temporary name."""
    if exc.filename in (tmp, os.fsencode(tmp)) or (isinstance(exc.filename, str) and exc.filename.startswith(tmp)):
        new = type(exc)(exc.errno, f"{exc.strerror} (while writing a temporary file beside it)", path)
        new.__traceback__ = exc.__traceback__
        return new
    return exc


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
        self.given = os.fspath(path)
        self.path = os.path.abspath(self.given)
        if os.path.isdir(self.path):
            raise IsADirectoryError(21, "Is a directory", self.given)
        for _ in range(100):
            self.tmp = temporary_name(self.path)
            try:
                self.writer = create(self.tmp)
                break
            except FileExistsError:
                continue
            except OSError as exc:
                with contextlib.suppress(FileNotFoundError):  # created, then the writer failed to start
                    os.unlink(self.tmp)
                raise _as_target(exc, self.given, self.tmp) from None
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
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
        except OSError as exc:
            self.abort()  # the old file stays; nothing half-written stays beside it
            raise _as_target(exc, self.given, self.tmp) from None
        except BaseException:
            self.abort()
            raise
        _fsync(os.path.dirname(self.path))

    def as_target(self, exc: BaseException) -> BaseException:
        """An OSError about the temporary file, restated for the path the caller gave (others as they are)."""
        return _as_target(exc, self.given, self.tmp) if isinstance(exc, OSError) else exc

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

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
            return
        self.abort()
        mapped = self.as_target(exc)
        if mapped is not exc:
            raise mapped from None


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path beside ``path`` for a writer that wants a path; publish it on success."""
    with AtomicReplace(path) as out:
        yield out.tmp


__all__ = ["AtomicReplace", "atomic_output", "temporary_name", "TMP_SUFFIX"]
