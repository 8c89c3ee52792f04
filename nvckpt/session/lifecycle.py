"""What happens to saves in progress when the process ends: no checkpoint is lost silently.

- Interpreter exit (end of script, ``sys.exit``, an uncaught exception): a
  pending ``async_save`` is finished in an ``atexit`` handler that runs before
  the program's own.  Its thread is a daemon thread (the interpreter's thread
  shutdown, which joins the others before any atexit handler runs, leaves it
  be, so that the wait happens in code of nvckpt's that can say what it waits
  for and be interrupted), and its engine's worker threads are nvckpt's own
  (``nvckpt._threads.WorkerPool``: concurrent.futures' pools take no new work
  from the start of the thread shutdown on).  If one fails, its path and reason
  are printed in one line and the process exits with status 1.
- SIGTERM (SLURM, Kubernetes preemption): while any save runs, nvckpt's handler
  (installed only where SIGTERM still has its default action, from the main
  thread) gives the saves up to ``SaveOptions.preemption_grace`` seconds to
  finish; saves still running then are cancelled (their temporary files are
  removed, the old files stay).  Then the signal takes its default action
  (exit status 143), as if nvckpt had not been there.  With no save running
  the handler does just that at once.
  Inside ``saves_are_the_job()`` (the CLI's convert, merge and split, whose
  job is the file they write) a save that finishes within its grace does not
  end the process: the command completes and exits as it would have (0 for a
  complete file), since a wrapper would otherwise see a failure for a file
  that was written.
- SIGINT raises KeyboardInterrupt as usual: a synchronous save aborts (its
  temporary file is removed); an async_save runs on and is finished at exit.
  Ctrl-C while the exit waits for it cancels it (the old file stays, its
  temporary file is removed), says so, runs the program's atexit handlers and
  ends the process as killed by SIGINT (130 in a shell), as an uncaught
  KeyboardInterrupt does.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from .._signals import leave_to_main_thread

_lock = threading.Lock()
_active: dict[int, "Running"] = {}
_installed: dict[str, Any] = {"exit": None, "sigterm": False}  # exit: the process that registered its handler
_terminating = threading.Event()
_force = threading.Event()  # the grace is over: take the default action whatever still runs
_job = threading.Event()  # saves_are_the_job(): saves finished within the grace leave the process running
_watchdogs: list[threading.Thread] = []  # the SIGTERM watchdog while one runs
_save_threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()  # async saves' (threading holds the live)


@dataclass
class Running:
    """One save in progress."""

    path: str
    cancel: threading.Event
    grace: float
    future: Any = None  # the SaveFuture of an async_save
    done: threading.Event = field(default_factory=threading.Event)
    turn: Any = None  # its place among the saves to its path (nvckpt.io.atomic.TURNS), left when it ends
    killed: bool = False  # cancelled by SIGTERM's watchdog: the process ends next, its waiters are not woken


def prepare(async_save: bool) -> None:
    """Install the exit hook (async saves) and the SIGTERM handler; call from the caller's thread
    (signal handlers can be set only from the main thread, where an async_save is started)."""
    _install(async_save)


def started(thread: threading.Thread) -> None:
    """An async_save's own (daemon) thread: the exit waits until it has ended."""
    with _lock:
        _save_threads.add(thread)


def begin(path: str, cancel: threading.Event, grace: float, future: Any = None, turn: Any = None) -> Running:
    run = Running(path, cancel, grace, future, turn=turn)
    with _lock:
        _active[id(run)] = run
    return run


def end(run: Running) -> None:
    with _lock:
        _active.pop(id(run), None)
    if run.turn is not None:
        run.turn.leave()
    run.done.set()


def _install(async_save: bool) -> None:
    with _lock:
        if async_save and _installed["exit"] != os.getpid():  # once per process (a forked child has no thread)
            atexit.unregister(_finish_at_exit)  # a forked child inherits the registration: once, not twice
            atexit.register(_finish_at_exit)
            threading.Thread(target=_first_at_exit, name="nvckpt-exit", daemon=False).start()
            _installed["exit"] = os.getpid()
        if not _installed["sigterm"] and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                    signal.signal(signal.SIGTERM, _on_sigterm)
                    _installed["sigterm"] = True
            except (ValueError, OSError):  # pragma: no cover - no signals here (embedded interpreters)
                pass


def cancelled_by_sigterm(run: Running) -> None:
    """A save that SIGTERM's watchdog cancelled has cleaned up: the signal now takes its default action
    (for a save in the main thread, before its CancelledError could end the process another way)."""
    if _force.is_set() or (_terminating.is_set() and run.cancel.is_set()):
        _force.set()
        if threading.current_thread() is threading.main_thread():
            _die(signal.SIGTERM)


@dataclass
class Failure:
    """An async save that failed: reported at exit unless its future's result (or error) was asked for.
    Not the future itself: its traceback would keep the failed save's frames and engine threads alive."""

    path: str
    line: str
    seen: bool = False


_failed: list[Failure] = []


def failed(run: Running, exc: BaseException) -> Failure:
    """An async save ended with ``exc``; its future sets ``seen`` when asked for its result."""
    failure = Failure(run.path, " ".join(str(exc).split()) or type(exc).__name__)
    with _lock:
        _failed.append(failure)
    return failure


def pending_async() -> list[Running]:
    with _lock:
        return [r for r in _active.values() if r.future is not None]


def _first_at_exit() -> None:
    """Wait for the interpreter's exit, then make ``_finish_at_exit`` the last registered atexit handler, which
    the interpreter runs first: the program's own handlers (one may upload the checkpoint) run once the saves
    are done, and an exit that ends the process itself (``_exit_now``) runs each of them exactly once.

    The main thread counts as ended once the interpreter's thread shutdown begins; that shutdown then waits
    for this thread (it is no daemon), and only after it runs the atexit handlers."""
    leave_to_main_thread()
    threading.main_thread().join()
    atexit.unregister(_finish_at_exit)
    atexit.register(_finish_at_exit)


def _finish_at_exit() -> None:
    try:  # from its first line: a Ctrl-C may come as soon as the message below is out, before print returns
        waiting = pending_async()
        with _lock:
            threads = list(_save_threads)  # also those whose save is done: one still ending is waited for below
        saving = [r for r in waiting if not r.future.cancelled()]  # cancelled ones only remove their temporary file
        if saving and not _terminating.is_set():
            paths = ", ".join(r.path for r in saving)
            print(f"nvckpt: finishing {len(saving)} async save(s) before exit: {paths}", file=sys.stderr, flush=True)
        for run in waiting:
            run.done.wait()
        for thread in threads:
            # A daemon thread that runs on as the interpreter finalizes is ended at its next take of the GIL,
            # by an unwinding that aborts the process if it passes through C++ (torch's) frames.
            thread.join()
    except KeyboardInterrupt:  # Ctrl-C while the exit waits: the saves not finished are cancelled, and said so
        _cancel_at_exit(pending_async())
        # Raised from here, the interpreter would print "Exception ignored in atexit callback" and exit 0 while
        # the save's thread still wrote (cut off mid-write as the interpreter ends, its temporary file left).
        _exit_now(signum=signal.SIGINT)
    with _lock:  # failed now, or before the exit and nobody asked: lost either way
        failed = [(f.path, f.line) for f in _failed if not f.seen]
    for path, line in failed:
        print(f"nvckpt: error: the async save to {path} failed: {line}", file=sys.stderr, flush=True)
    if failed:
        _exit_now(status=1)  # the checkpoint the script believed it wrote does not exist: never exit 0


def _cancel_at_exit(late: list[Running]) -> None:
    """Cancel ``late`` and wait (up to 30 s) for each to remove its temporary file; a further Ctrl-C stops the
    waiting (a temporary file may then stay, which the next save to that path reports)."""
    for run in late:
        run.cancel.set()
    try:
        for run in late:
            run.done.wait(30.0)  # the writer stops at its next chunk and removes its temporary file
            print(f"nvckpt: interrupted: the async save to {run.path} was cancelled (the file there is unchanged)",
                  file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("nvckpt: interrupted again: exiting without waiting for the cancelled saves to clean up",
              file=sys.stderr, flush=True)


def _exit_now(status: int = 1, signum: int | None = None) -> None:
    """End the process although the script's main code has ended (its status is decided by then): what the
    interpreter would still do -- the program's atexit handlers (this runs in the first of them,
    ``_finish_at_exit``), flushing files it left open -- then exit with ``status``, or as killed by ``signum``
    (SIGINT: as the interpreter ends on an uncaught KeyboardInterrupt, 130 in a shell)."""
    import gc
    import io

    if signum is not None:
        signal.signal(signum, signal.SIG_IGN)  # a further Ctrl-C while the handlers run does not cut them short
    atexit.unregister(_finish_at_exit)  # running now: the run below must not start it again
    try:
        atexit._run_exitfuncs()  # each other handler once, in their order (the interpreter then finds none left)
    except BaseException:  # noqa: BLE001 - the interpreter prints a handler's error and goes on
        pass
    files = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)
    for obj in gc.get_objects():  # files a script leaves open are flushed when the interpreter ends
        if issubclass(type(obj), files):  # (not isinstance: it asks every object for its __class__)
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001 - a broken file must not keep the others from being flushed
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    if signum is not None:
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
        status = 128 + signum  # where the signal did not end the process (it is delivered at once otherwise)
    os._exit(status)


def _on_sigterm(signum: int, frame: Any) -> None:
    with _lock:
        running = list(_active.values())
    if not running or _force.is_set():
        _die(signum)
        return
    if _terminating.is_set():
        return  # a watchdog is already on it
    _terminating.set()
    grace = max(r.grace for r in running)
    print(f"nvckpt: SIGTERM: letting {len(running)} save(s) finish (up to {grace:g} s): "
          f"{', '.join(r.path for r in running)}", file=sys.stderr, flush=True)
    # Whether the saves are the job is decided now: the command may leave saves_are_the_job() as soon as its
    # save ends, before the watchdog wakes to see it.
    watchdog = threading.Thread(target=_watchdog, args=(running, grace, signum, _job.is_set()),
                                name="nvckpt-sigterm", daemon=True)
    _watchdogs[:] = [watchdog]
    watchdog.start()


@contextlib.contextmanager
def saves_are_the_job() -> Any:
    """Within it, SIGTERM during a save lets the save finish (within its grace) and then lets the process go
    on instead of ending it: for a command whose whole job is the file it writes.  SIGTERM with no save
    running, or a save past its grace, still ends the process (143)."""
    _install(async_save=False)
    _job.set()
    try:
        yield
    finally:
        # A SIGTERM watchdog decides (and says) how the command ends before the command goes on or exits: the
        # daemon thread would otherwise be cut off by the exit, or see the job over and end the process (143).
        for watchdog in list(_watchdogs):
            if watchdog is not threading.current_thread():
                watchdog.join()
        _job.clear()


def _watchdog(running: list[Running], grace: float, signum: int, job: bool) -> None:
    leave_to_main_thread()  # its os.kill below must reach the main thread's handler
    deadline = time.monotonic() + grace
    for run in running:
        run.done.wait(max(0.0, deadline - time.monotonic()))
    late = [r for r in running if not r.done.is_set()]
    if not late and job:
        print(f"nvckpt: SIGTERM: {', '.join(r.path for r in running)} written in full; the command completes",
              file=sys.stderr, flush=True)
        _terminating.clear()  # a later SIGTERM is answered anew
        return
    for run in late:
        print(f"nvckpt: SIGTERM: cancelling the save to {run.path} (the file there is unchanged)", file=sys.stderr,
              flush=True)
        run.killed = True  # before the cancel: no CancelledError reaches the caller's code before the exit
        run.cancel.set()
    for run in late:
        run.done.wait(30.0)  # the writer stops at its next chunk and removes its temporary file
    _force.set()
    os.kill(os.getpid(), signum)  # back in the main thread's handler, which now takes the default action


def _die(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, a multiprocessing.Process) has none of its parent's saves: their
    threads stayed in the parent, so the child must neither wait for them at its exit nor report them."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork: it would stay locked here
    _active.clear()
    _save_threads.clear()
    _failed.clear()
    _terminating.clear()
    _force.clear()
    _job.clear()
    _watchdogs.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["prepare", "begin", "end", "pending_async", "Running", "saves_are_the_job"]
