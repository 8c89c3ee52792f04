"""Replacing a file atomically: write beside it, fsync, rename over it, fsync the folder.

A crash at any point leaves the final path with the complete old file or the
complete new one; what it leaves beside it is a ``.NAME.XXXXXXXX.nvckpt-tmp``
file that ``nvckpt recover`` can salvage.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Iterator

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


def publish(tmp: str, final: str) -> None:
    """Rename the complete, fsynced ``tmp`` over ``final``, and make the rename durable."""
    os.replace(tmp, final)
    _fsync(os.path.dirname(final))


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path beside ``path`` for a writer that wants a path; publish it on success."""
    final = os.path.abspath(os.fspath(path))
    if os.path.isdir(final):
        raise IsADirectoryError(21, "Is a directory", os.fspath(path))
    while True:
        tmp = temporary_name(final)
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        _fsync(tmp)
        publish(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
