"""The host's worker threads: nvckpt's own thread pool, and one pool per worker count shared by every CPU save
and load of the process.

Why its own pool: a pending ``async_save`` is finished at interpreter exit, in an ``atexit`` handler
(``nvckpt.session.lifecycle``).  concurrent.futures' ThreadPoolExecutor refuses new work from the moment
threading's shutdown begins, which is before any ``atexit`` handler runs ("cannot schedule new futures after
interpreter shutdown"), so a save's engine could not go on there.  ``WorkerPool`` is a
``concurrent.futures.Executor`` (its futures are plain ``concurrent.futures.Future`` objects, for ``wait``
and ``as_completed``) whose daemon threads take work until the process ends.

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
import queue
import threading
import weakref
from concurrent.futures import Executor, Future
from typing import Any, Callable

from ._signals import leave_to_main_thread

#: Small pieces of work (chunks of a few KiB, an optimizer's step counters) go to the threads in tasks of about
#: this many bytes and at most this many pieces: a task per piece (submit, wake a thread, hand the result back)
#: costs more than a small chunk's coding.
TASK_BYTES = 256 << 10
TASK_PIECES = 256


class WorkerPool(Executor):
    """Up to ``workers`` daemon threads named ``name_0``, ``name_1``, ... (started as work comes and no thread
    is idle), which leave SIGTERM and SIGINT to the main thread (``nvckpt._signals``) and keep taking work
    through the interpreter's exit.  ``shutdown()`` (or leaving a ``with`` block) ends them; so does dropping
    the last reference to the pool, once they are idle."""

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"a worker pool needs at least 1 thread, got {workers}")
        self._workers = workers
        self._name = name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        # The threads hold the queue, never the pool: an unreferenced pool's threads are told to end.
        self._release = weakref.finalize(self, _end_threads, self._tasks, self._threads)
        self._release.atexit = False  # at exit they stay: a pending async save may still need them

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self._name} worker pool was shut down: it takes no new work")
            future: Future = Future()
            self._tasks.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._workers:
                thread = threading.Thread(target=_work, args=(self._tasks, self._idle), daemon=True,
                                          name=f"{self._name}_{len(self._threads)}")
                thread.start()
                self._threads.append(thread)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if cancel_futures:
                while True:
                    try:
                        task = self._tasks.get_nowait()
                    except queue.Empty:
                        break
                    if task is not None:
                        task[0].cancel()
            if not self._closed:
                self._closed = True
                self._release()  # one end-of-work mark per thread, after the work queued before it
            threads = list(self._threads)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()


def _work(tasks: queue.SimpleQueue, idle: threading.Semaphore) -> None:
    leave_to_main_thread()
    while True:
        task = tasks.get()
        if task is None:
            return
        future, fn, args, kwargs = task
        del task
        if future.set_running_or_notify_cancel():  # False: cancelled while it waited in the queue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - the future carries it to whoever asks, as an executor's does
                future.set_exception(exc)
            else:
                future.set_result(result)
                del result
        del future, fn, args, kwargs  # an idle thread keeps no task's objects alive
        idle.release()


def _end_threads(tasks: queue.SimpleQueue, threads: list[threading.Thread]) -> None:
    for _ in threads:
        tasks.put(None)


_pools: dict[tuple[str, int], WorkerPool] = {}
_lock = threading.Lock()


def host_pool(workers: int) -> WorkerPool:
    """The process's pool of ``workers`` threads, started at first use."""
    return shared_pool("nvckpt-host", workers)


def shared_pool(name: str, workers: int) -> WorkerPool:
    """The process's pool ``name`` of ``workers`` threads (named ``{name}{workers}_0``, ...), started at first
    use; a forked child gets new ones.  Work that waits on other work goes to another pool (an object store's
    requests wait on the network: ``nvckpt-s3``, not the decode threads)."""
    with _lock:
        pool = _pools.get((name, workers))
        if pool is None:
            pool = _pools[(name, workers)] = WorkerPool(workers, f"{name}{workers}")
        return pool


def _after_fork_in_child() -> None:
    # A forked child has none of its parent's threads: work queued on the parent's pools would never run.
    global _lock
    _lock = threading.Lock()
    _pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["WorkerPool", "host_pool", "shared_pool", "TASK_BYTES", "TASK_PIECES"]
