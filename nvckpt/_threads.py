"""The host's worker threads: one pool per worker count, shared by every CPU save and load of the process.

Why shared: the codecs keep per-thread state (a zstd context, scratch buffers for byte planes and stored
chunks, ``nvckpt.codecs.planes`` and ``nvckpt.read.reader``).  A pool of fresh threads per save or per
open file made every call start cold: new contexts, and scratch memory the kernel first had to fault in
and zero, which on a 2-core VM cost a portable load of MiniLM bf16 (45 MB) 10-20 % of its time and the
same again in CPU time.  Kept threads keep their state warm: a few MiB per thread (the largest chunk
seen, twice) for the life of the process.

Work given to these threads never waits for other work given to them (a task that did could wait for a
worker that is itself waiting), so callers submit from their own thread and wait there.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ._signals import leave_to_main_thread

#: Small pieces of work (chunks of a few KiB, an optimizer's step counters) go to the threads in tasks of about
#: this many bytes and at most this many pieces: a task per piece (submit, wake a thread, hand the result back)
#: costs more than a small chunk's coding.
TASK_BYTES = 256 << 10
TASK_PIECES = 256

_pools: dict[int, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def host_pool(workers: int) -> ThreadPoolExecutor:
    """The process's pool of ``workers`` threads, started at first use."""
    with _lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix=f"nvckpt-host{workers}",
                                                          initializer=leave_to_main_thread)
        return pool


def _after_fork_in_child() -> None:
    # A forked child has none of its parent's threads: work queued on the parent's pools would never run.
    global _lock
    _lock = threading.Lock()
    _pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["host_pool", "TASK_BYTES", "TASK_PIECES"]
