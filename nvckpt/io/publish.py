"""Publishing a directory atomically: the checkpoint directory of a distributed save (nvckpt.dcp).

Every rank writes its file into one hidden staging directory beside the
target (each file itself through ``AtomicReplace``: fsynced, renamed); the
coordinator then writes the metadata there, fsyncs the staging directory and
publishes it over the target in one step:

- no target yet: ``rename(staging, target)``;
- a previous checkpoint at the target: the two are swapped with
  ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+), so at every instant the target
  is the complete old checkpoint or the complete new one; the old one, now
  under the staging name, is then removed.  Where the exchange is not
  available (another OS, a filesystem without it), the old directory is
  renamed aside first: a crash between the two renames leaves no target, but
  the old checkpoint whole under ``.NAME.XXXXXXXX.nvckpt-old``.

A save that fails removes its staging directory (nvckpt.dcp.Writer.abandon);
one that is killed leaves only a hidden ``.NAME.XXXXXXXX.nvckpt-tmpdir``
beside the target, never a half-visible directory; ``remove_stale`` (the next
save's coordinator) deletes those, but not the staging directory of a save this
process is still writing.  Saves to one directory from one process: the newest
started wins (``Sequence``); an older one that finishes after a newer one has
published is refused instead of replacing it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import itertools
import os
import secrets
import shutil
import threading
from typing import Callable

from .._fork import Lock
from .atomic import fsync_path

TMPDIR_SUFFIX = ".nvckpt-tmpdir"
OLD_SUFFIX = ".nvckpt-old"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def staging_name(final: str | os.PathLike) -> str:
    """A fresh hidden directory name beside ``final``."""
    folder, base = os.path.split(os.path.abspath(os.fspath(final)))
    return os.path.join(folder, f".{base}.{secrets.token_hex(4)}{TMPDIR_SUFFIX}")


def stale_names(final: str | os.PathLike) -> list[str]:
    """Staging and set-aside directories of earlier saves to ``final`` that did not finish."""
    folder, base = os.path.split(os.path.abspath(os.fspath(final)))
    pattern = os.path.join(glob.escape(folder), f".{glob.escape(base)}.????????")
    return sorted(glob.glob(pattern + TMPDIR_SUFFIX) + glob.glob(pattern + OLD_SUFFIX))


_LIVE: set[str] = set()  # staging directories of saves in progress in this process
_LIVE_LOCK = Lock()  # a forked child gets it unlocked (nvckpt._fork)


def live_staging(staging: str, alive: bool) -> None:
    """Mark a staging directory as one this process is writing (``remove_stale`` leaves it), or no more."""
    with _LIVE_LOCK:
        (_LIVE.add if alive else _LIVE.discard)(os.path.abspath(staging))


def remove_stale(final: str | os.PathLike, keep: str | None = None) -> list[str]:
    """Remove what ``stale_names`` lists (except ``keep`` and the saves in progress here); returns what was removed."""
    removed = []
    for path in stale_names(final):
        if keep is not None and os.path.abspath(path) == os.path.abspath(keep):
            continue
        with _LIVE_LOCK:
            if os.path.abspath(path) in _LIVE:
                continue  # another save of this process is writing it
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically; False where the OS or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


class Sequence:
    """The order saves to a directory were started in this process: ``number()`` at the start; ``publish``
    refuses a number older than the one last published there."""

    def __init__(self) -> None:
        self._count = itertools.count()
        self._published: dict[str, int] = {}
        self.lock = threading.Lock()

    def number(self) -> int:
        return next(self._count)

    def publish(self, staging: str, final: str, number: int, carry: Callable[[str], bool] | None = None) -> None:
        """``_publish`` for save ``number``, unless a newer save to ``final`` has published (FileExistsError);
        the number counts as published only once the directory is."""
        key = os.path.realpath(os.path.abspath(final))
        with self.lock:
            if self._published.get(key, -1) > number:
                raise FileExistsError(errno.EEXIST, "a checkpoint saved after this one was published there first; "
                                      "this older one is not published over it", final)
            _publish(staging, final, carry)
            self._published[key] = number


    def _after_fork_in_child(self) -> None:
        self.lock = threading.Lock()  # it may have been held by a thread of the parent, which the child lacks


SAVES = Sequence()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=SAVES._after_fork_in_child)


def publish_directory(staging: str, final: str | os.PathLike, number: int | None = None,
                      carry: Callable[[str], bool] | None = None) -> None:
    """Make the complete ``staging`` directory the one at ``final`` (see the module docstring); ``number``:
    the save's ``SAVES.number()``, refused if a newer save to ``final`` has published.  ``carry(name)``: the
    entries of the directory being replaced that are not the checkpoint's own (a user's config, an export
    beside it) and go on in the new one, as a writer of files in place would leave them."""
    if number is None:
        _publish(staging, final, carry)
    else:
        SAVES.publish(staging, os.path.abspath(os.fspath(final)), number, carry)


def _carry_over(old: str, staging: str, carry: Callable[[str], bool]) -> None:
    """Hard links (copies where links are not possible) in ``staging`` of ``old``'s entries that ``carry``."""
    for name in os.listdir(old):
        if not carry(name) or os.path.lexists(os.path.join(staging, name)):
            continue
        src, dst = os.path.join(old, name), os.path.join(staging, name)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _publish(staging: str, final: str | os.PathLike, carry: Callable[[str], bool] | None = None) -> None:
    final = os.path.abspath(os.fspath(final))
    parent = os.path.dirname(final)
    if carry is not None and os.path.isdir(final) and not os.path.islink(final):
        _carry_over(final, staging, carry)
    fsync_path(staging)
    if not os.path.lexists(final):
        os.rename(staging, final)
    elif not os.path.isdir(final) or os.path.islink(final):
        raise NotADirectoryError(20, "not a directory: a checkpoint directory cannot replace it", final)
    elif _exchange(staging, final):
        fsync_path(parent)
        shutil.rmtree(staging, ignore_errors=True)  # the old checkpoint, now under the staging name
    else:
        aside = staging[: -len(TMPDIR_SUFFIX)] + OLD_SUFFIX
        os.rename(final, aside)
        try:
            os.rename(staging, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rename(aside, final)  # put the old one back
            raise
        fsync_path(parent)
        shutil.rmtree(aside, ignore_errors=True)
    fsync_path(parent)


__all__ = ["publish_directory", "remove_stale", "stale_names", "staging_name", "TMPDIR_SUFFIX", "OLD_SUFFIX"]
