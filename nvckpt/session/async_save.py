"""async_save: the call (take the state, or arrange to read it ahead), the save's thread, and its future.

The future (``SaveFuture``) uses concurrent.futures' public API only: it stays
pending while the save runs, so ``cancel()`` stops it as it would a queued
call; the save's commit makes it running (``set_running_or_notify_cancel``),
past which no cancel can go.  A lazy save (``fence=``) plans and reads in its
thread, and the fenced optimizers' next ``step()`` waits for its reads.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
import traceback
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any, Callable

import torch

from .._fork import Lock
from .._gc import paused as gc_paused
from .._signals import leave_to_main_thread
from ..io.target import open_target
from ..options import SaveOptions, default_memory_budget
from . import lifecycle
from .fence import copy_unfenced
from .save import SaveSession, register


class SaveFuture(Future):
    """The result of ``async_save``: a concurrent.futures.Future of a SaveResult.

    ``blocked_seconds`` is how long ``async_save`` held the caller, and ``fence_wait_seconds`` how long the
    fenced optimizers' steps then waited for a lazy save's reads (0 when they were done in time); ``snapshot``
    says per device how the state was taken: "device" (a copy on the GPU), "host" (a copy in host memory)
    or "read-ahead" (read by the GPU engine before the call returned, or in a lazy save before the step).

    ``cancel()`` stops the save unless it has reached its commit (the final rename): the future stays
    pending while the save runs, and only its commit makes it *running* (``running()``), which no cancel
    can stop; a cancelled save leaves the target with whatever file it had before."""

    def __init__(self) -> None:
        super().__init__()
        self.blocked_seconds = 0.0
        self.fence_wait_seconds = 0.0
        self.snapshot: dict[str, str] = {}
        self._stop = threading.Event()
        self._read: threading.Event | None = None
        self._publish_lock = threading.Lock()
        self._published = False
        self._notified = False  # the waiters of concurrent.futures.wait / as_completed were told of a cancel
        self._ended: threading.Event | None = None  # set when the save's thread has ended (cleaned up)
        self._failure: lifecycle.Failure | None = None  # set when it fails: exit reports it unless it was seen

    def result(self, timeout: float | None = None) -> Any:
        """The save's ``SaveResult`` once the file is complete; raises the save's error, or CancelledError after ``cancel()``."""
        try:
            self._wait_cleanup(timeout)
            return super().result(timeout)
        except CancelledError as exc:
            raise _cancelled(exc) from None
        finally:
            self._seen()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error once it ended (None if it succeeded), as ``concurrent.futures.Future.exception``."""
        try:
            self._wait_cleanup(timeout)
            return super().exception(timeout)
        except CancelledError as exc:
            raise _cancelled(exc) from None
        finally:
            self._seen()

    def _wait_cleanup(self, timeout: float | None) -> None:
        """A cancelled save is cancelled at once (cancel() returned True), but its thread may still be removing
        its temporary file: result() and exception() wait for that (within ``timeout``), so that once they
        raise CancelledError the folder holds only what it held before."""
        if self.cancelled() and self._ended is not None:
            self._ended.wait(timeout)

    def _seen(self) -> None:
        if self.done() and self._failure is not None:
            self._failure.seen = True  # the caller has the error: exit need not report it

    def wait_read(self, timeout: float | None = None) -> bool:
        """Block until the save reads the caller's tensors no more (they may then be changed); True if so.

        A lazy async_save (``fence=``) calls this from the optimizer's step pre-hook; call it yourself
        before changing the saved tensors in any other way."""
        if self._read is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._read.wait(0.05):
            if self.done():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    def cancel(self) -> bool:
        """Stop the save unless it has reached its commit (then False): as for any Future, a True means that
        ``cancelled()`` is True from now on and ``result()`` raises CancelledError (once the save's thread has
        removed its temporary file)."""
        with self._publish_lock:
            if self._published:
                return False  # at its commit: the new file is (being) published
            self._stop.set()  # the save stops at its next chunk, or at its commit at the latest
        # Outside the lock: the done-callbacks run here, and one that asks for the outcome waits for the save's
        # thread, which takes the lock on its way out (_publish).
        return self._cancel_now()

    def _cancel_now(self) -> bool:
        """Future.cancel, then what an executor does with a cancelled call it was about to run
        (set_running_or_notify_cancel): concurrent.futures.wait and as_completed see it at once."""
        if not Future.cancel(self):
            return False
        with self._publish_lock:
            first, self._notified = not self._notified, True
        if first:
            self.set_running_or_notify_cancel()  # returns False: cancelled, and its waiters are told
        return True

    def _publish(self) -> None:
        """The save's last step before its commit: honour a cancel that came in time, refuse later ones."""
        with self._publish_lock:
            if self._stop.is_set():
                raise CancelledError("the save was cancelled; the file at the target path was not changed")
            self._published = True
            self.set_running_or_notify_cancel()  # pending -> running: cancel() returns False from now on

    def _finish(self, result: Any = None, exc: BaseException | None = None) -> None:
        """The save's thread's outcome, unless a cancel already decided it."""
        if exc is not None:
            _detach_traceback(exc)
        try:
            if exc is not None:
                self.set_exception(exc)
            else:
                self.set_result(result)
        except InvalidStateError:
            pass  # cancelled meanwhile: a cancelled save's later outcome is not reported


def _cancelled(exc: CancelledError) -> CancelledError:
    """concurrent.futures raises a bare CancelledError for a cancelled future: say what it means here."""
    if exc.args:
        return exc
    return CancelledError("the async save was cancelled; the file at the target path was not changed")


def _detach_traceback(exc: BaseException) -> None:
    """The future keeps the exception for as long as the caller keeps the future, and a traceback keeps every
    frame of the save's thread alive (their functions' closures too, which frame.clear() leaves): the session
    and its snapshot of the state.  So the tracebacks go, and the thread's stack stays as text in a note of
    the exception (as ProcessPoolExecutor gives a worker's), printed with it."""
    text = "".join(traceback.format_exception(exc))
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # their locals, for whoever still holds a frame
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note("in nvckpt's async save thread:\n" + text.rstrip())


def _gpu_budget(options: SaveOptions) -> Callable[[torch.device], int]:
    """The GPU memory a lazy call may take on a device (its gather of small copies): the save's budget."""
    return lambda device: (options.gpu.memory_budget
                           or default_memory_budget(torch.cuda.get_device_properties(device).total_memory))


_hooks: list[tuple[Any, SaveFuture]] = []  # step pre-hooks of lazy saves, with their futures
_hooks_lock = Lock()  # a forked child gets it unlocked (nvckpt._fork)


def _remove_spent_hooks() -> None:
    with _hooks_lock:
        spent = [(h, f) for h, f in _hooks if f.wait_read(0)]
        for h, f in spent:
            h.remove()
            _hooks.remove((h, f))


def _fences(fence: Any) -> list[Any]:
    fences = list(fence) if isinstance(fence, (list, tuple)) else [fence]
    if not fences:
        raise TypeError("fence= is an empty list: give the optimizer(s) whose next step may change the tensors "
                        "(or leave fence out for a save that reads them before it returns)")
    for f in fences:
        if not callable(getattr(f, "register_step_pre_hook", None)):
            raise TypeError(f"fence must be a torch.optim.Optimizer (or a list of them), got {type(f).__qualname__}: "
                            "its step pre-hook waits until the save has read the tensors")
    return fences


def start_async(obj: Any, target: Any, options: SaveOptions, fence: Any = None) -> SaveFuture:
    """Plan (and copy, or arrange to read ahead) in the caller's thread, then save in a thread of its own.

    With a fence (lazy) the call only copies the object's containers and the metadata and records an event
    on the caller's CUDA stream; planning, reading and writing all happen in the save's thread."""
    start = time.perf_counter()
    target = open_target(target, absolute=True, storage_options=options.storage_options)
    target.check()  # a missing folder or a write-protected file: at the call, as save says it
    fences = _fences(fence) if fence is not None else []
    lifecycle.prepare(async_save=True)
    future = SaveFuture()  # pending until the save's commit (SaveFuture.cancel)
    future._ended = threading.Event()
    returned = threading.Event()  # set as the call returns (or fails): a lazy save's thread starts planning then
    try:
        # No garbage-collection pass while the caller waits (the lazy call's copy of the containers, planning,
        # verifying candidates, the engine's read in the save's thread): in a large process (torch, a model,
        # its optimizer) one full pass can take longer than the whole read, and it holds the GIL both need.
        with gc_paused():
            return _start_async(obj, target, options, fences, future, returned, start)
    finally:
        returned.set()


def _start_async(obj: Any, target: Any, options: SaveOptions, fences: list[Any], future: SaveFuture,
                 returned: threading.Event, start: float) -> SaveFuture:
    if fences:
        # The containers copied, and the small tensors no fence owns (queued on the caller's stream).
        skeleton, copied = copy_unfenced(obj, fences, _gpu_budget(options))
        options = dataclasses.replace(options, metadata=copy.deepcopy(options.metadata))
        ready = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        future._read = threading.Event()
        future.snapshot = {"lazy": "planned and read in the save's thread"}

        def begin() -> SaveSession:
            nonlocal skeleton
            if copied is not None:  # the small copies in place, once in host memory
                skeleton = copied.finish(skeleton)
            # As in a plain async_save's call: no collection pass while planning (it would hold the GIL
            # that the caller's forward and backward need, for longer than the whole plan takes).
            with gc_paused():
                session = SaveSession(skeleton, target, options)
                session.prepare_lazy(ready, future._read)
            future.snapshot = dict(session.prepared.snapshot)
            return session
    else:
        prepared = SaveSession(obj, target, options)
        t0 = time.perf_counter()
        prepared.prepare_async()
        prepared.phases["prepare"] = time.perf_counter() - t0
        future.snapshot = dict(prepared.prepared.snapshot)
        future._read = prepared.prepared.tensors_read

        def begin() -> SaveSession:
            return prepared

    def work() -> None:
        started_after = time.perf_counter() - launched
        leave_to_main_thread()  # and so do the engine threads it starts: SIGTERM goes to the main thread
        if fences:
            # Plan only once the call has returned: planning holds the GIL for milliseconds at a time,
            # and the caller's last few lines would each wait for it (up to sys.getswitchinterval()).
            returned.wait()
        try:
            session = begin()
            session.publishing = future._publish
            session.phases["thread_start"] = started_after
            result = session.run(future._stop, running)
        except CancelledError as exc:
            if running.killed:
                pass  # SIGTERM past its grace: the process exits 143 next; waking result() would run user code
            elif future._stop.is_set():
                future._cancel_now()  # stopped by a cancel, or by a second Ctrl-C at exit: cancelled, waiters woken
            else:
                future._finish(exc=exc)
        except BaseException as exc:
            if not future.cancelled():  # a cancelled save's later error is not a lost checkpoint
                future._failure = lifecycle.failed(running, exc)
            future._finish(exc=exc)
        else:
            future._finish(result)
        finally:
            if fences and copied is not None:
                copied.release()  # a save that failed before taking its small copies gives their memory back
            lifecycle.end(running)
            if future._read is not None:
                future._read.set()  # also when it failed before reading: whoever waits sees the outcome
            future._ended.set()

    try:
        running = register(target, options, future._stop, future)  # before the thread starts: an exit now waits for it
    except BaseException:
        if not fences:
            prepared.release()  # no save: its snapshot's device memory goes back
        raise
    launched = time.perf_counter()
    try:
        # A daemon thread: at exit, lifecycle's atexit handler waits for it (and says so; Ctrl-C there cancels
        # it), which it could not do for a thread that the interpreter's thread shutdown joins before.
        thread = threading.Thread(target=work, name="nvckpt-async-save", daemon=True)
        lifecycle.started(thread)
        thread.start()
    except BaseException:
        lifecycle.end(running)  # no thread: its turn at the path must not hold up later saves
        if not fences:
            prepared.release()
        raise
    if not fences and prepared.prepared.caller_decides:
        try:  # verify the derived-tensor candidates here while the save's thread reads every other tensor
            prepared.plan.decide()
        except Exception:
            pass  # the engine raises the same error in the save's thread: the future reports it below
    if not fences and future._read is not None:
        future.wait_read()
    if fences:  # lazy: the next optimizer.step() waits for the reads, the forward and backward do not
        _remove_spent_hooks()

        pid = os.getpid()

        def before_step(*_: Any) -> None:
            if os.getpid() != pid:
                return  # a forked child has none of its parent's saves, and no thread that would end this one
            if future._read.is_set():
                return  # read: a no-op; the hook is removed at the next lazy save (not while torch iterates
                # over the hooks, which a removal from inside one would break)
            t0 = time.perf_counter()
            future.wait_read()
            future.fence_wait_seconds += time.perf_counter() - t0

        with _hooks_lock:
            _hooks.extend((f.register_step_pre_hook(before_step), future) for f in fences)
    elif future._read is not None:
        if future.done() and future.exception() is not None:
            raise future.exception()  # failed before it had read the tensors: nothing was written
    future.blocked_seconds = time.perf_counter() - start
    return future


__all__ = ["SaveFuture", "start_async"]
