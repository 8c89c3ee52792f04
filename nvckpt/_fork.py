"""What nvckpt holds across ``os.fork``: nothing a forked child would wait for forever.

A forked child (a DataLoader worker, a ``multiprocessing`` process started by fork) has only the thread
that forked.  A lock another thread held at the fork stays held in the child for good, and so does a module
another thread was importing (Python's per-module import lock): the child's first save or load then hangs.

- Process-wide locks are ``Lock``: a child gets each of them anew, unlocked.  (Objects a child may go on
  using, such as a checkpoint its parent opened, reset their own state: ``nvckpt.session.file``.)
- The imports nvckpt makes once it runs (its lazy attributes, the CPU engine, libzstd's CFFI backend) are
  made inside ``importing()``, which a fork waits for (a before-fork hook takes it), so no child gets a
  module half imported by another thread; ``module(name)`` is such an import, kept for the next call.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import weakref
from types import ModuleType
from typing import Any, Iterator


class Lock:
    """A ``threading.Lock`` that a forked child gets unlocked (the thread that held it is not in the child)."""

    __slots__ = ("_lock", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _LOCKS.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()


_LOCKS: "weakref.WeakSet[Lock]" = weakref.WeakSet()
_imports = threading.RLock()
_here = threading.local()  # depth of importing() blocks in this thread
_modules: dict[str, ModuleType] = {}


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """A block that imports (or loads a library once for the process): a fork waits until it has ended."""
    with _imports:
        _here.depth = getattr(_here, "depth", 0) + 1
        try:
            yield
        finally:
            _here.depth -= 1


def importing_here() -> bool:
    """Whether the calling thread is inside ``importing()`` (the tests' audit of imports in threads)."""
    return getattr(_here, "depth", 0) > 0


def module(name: str) -> ModuleType:
    """``import name`` inside ``importing()`` on first use; the module object after."""
    found = _modules.get(name)
    if found is None:
        with importing():
            found = _modules[name] = importlib.import_module(name)
    return found


def _before_fork() -> None:
    _imports.acquire()  # waits for an import in progress in another thread


def _after_fork_in_parent() -> None:
    _imports.release()


def _after_fork_in_child() -> None:
    global _imports
    _imports = threading.RLock()  # the forking thread held the parent's through the fork: a fresh one
    for lock in list(_LOCKS):
        lock._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


__all__ = ["Lock", "importing", "importing_here", "module"]
