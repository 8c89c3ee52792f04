"""One save: plan -> engine -> frame writer -> sink -> publish.  Every way of writing a file goes through here
(``save``, ``async_save``, ``nvckpt convert``), so each gets the same engines, sink and atomic replace."""

from __future__ import annotations

import copy
import dataclasses
import os
import platform
import sys
import threading
import traceback
import time
import warnings
from collections import deque
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from .. import __version__
from .._gc import paused as gc_paused
from .._signals import leave_to_main_thread
from ..codecs.base import Pipeline
from ..codecs.presets import GPU_PRESETS, chooser
from ..errors import LeftoverTemporaryWarning, UnsupportedCodecError
from ..format.frames import FrameWriter, check_index_floor
from ..io.atomic import TURNS
from ..io.sink import CPU_BLOCK, CPU_BLOCKS
from ..io.target import SinkOptions, Target, open_target
from ..options import SaveOptions
from ..plan.chunking import CPU_CHUNK_SIZE, GPU_CHUNK_SIZE
from ..plan.walk import PlannedTensor, SavePlan, plan_save
from ..engines.items import EncodedChunk, TensorReady
from .fence import copy_unfenced
from . import lifecycle


@dataclass(frozen=True)
class SaveResult:
    """What a save wrote: sizes, time, and what the engine measured (``stats``).

    ``raw_bytes`` counts every tensor a load restores (views and derived tensors with their own
    bytes, not the internal bases), so ``ratio`` is what the file saves over holding the state."""

    path: str | None
    raw_bytes: int
    file_bytes: int
    seconds: float
    engine: str
    stats: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.file_bytes if self.file_bytes else 1.0


def writer_info(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The index's "writer" map (SPEC 8.2)."""
    info = {"name": "nvckpt", "version": __version__, "torch": torch.__version__.split("+")[0],
            "python": platform.python_version()}
    info.update(extra or {})
    return info


def write_items(stream: Any, items: Iterable[TensorReady | EncodedChunk], plan: SavePlan, *, alignment: int,
                info: dict[str, Any], progress: Callable[[int], None] | None = None) -> int:
    """Frame an engine's items onto ``stream``; returns the file's length.  ``progress(raw bytes)`` per chunk."""
    try:
        entries, chunk_lengths = plan.entries(), plan.chunk_lengths()  # once: a list per tensor, thousands
        packed_tree = check_index_floor(entries, chunk_lengths, plan.tree, plan.metadata, info)
        writer = FrameWriter(stream, entries, chunk_lengths, alignment=alignment,
                             required_features=plan.required_features)
        held: list[EncodedChunk] = []  # chunks whose frames the writer holds (EncodedChunk.flush False)
        undecided = plan.undecided  # derived-tensor candidates: their chunks are known when they are announced
        try:
            for item in items:
                if isinstance(item, TensorReady):
                    writer.tensor(item.tensor_id, item.checksum,
                                  [n for _, n in plan.tensors[item.tensor_id].chunks]
                                  if item.tensor_id in undecided else None)
                    continue
                if not item.flush:
                    writer.defer()
                held.append(item)
                writer.chunk(item.tensor_id, item.chunk_index, item.pipeline, item.payload, item.raw_length,
                             item.checksum)
                if item.flush:
                    writer.flush()  # one write of the run: no Python between its copies
                    _written(held, progress)
            writer.flush()
            _written(held, progress)
        finally:
            for item in held:  # on an error: the engine's buffers back all the same
                if item.release is not None:
                    item.release()
        return writer.finish(plan.tree, plan.metadata, info, packed_tree=packed_tree)
    finally:
        # Stop the engine now, also on an error: its threads and buffers must not live on in the traceback.
        close = getattr(items, "close", None)
        if close is not None:
            close()


def _written(chunks: list[EncodedChunk], progress: Callable[[int], None] | None) -> None:
    """``chunks`` are on the stream: their buffers go back to the engine (and progress hears of them)."""
    while chunks:
        item = chunks.pop(0)
        if item.release is not None:
            item.release()
        if progress is not None:
            progress(item.raw_length)


def _gpu_device(tensors: list[PlannedTensor], options: SaveOptions) -> torch.device | None:
    """The CUDA device whose GPU engine should run a save of ``tensors``, else None (the CPU engine)."""
    codec, engine = options.codec, options.engine
    if engine == "cpu" or isinstance(codec, Pipeline) or codec not in GPU_PRESETS:
        return None
    device = next((t.data.device for t in tensors if t.data is not None and t.data.is_cuda), None)
    if engine == "auto" and device is None:
        return None
    from ..codecs.nvcomp import backend as nb

    if not nb.available():
        if engine == "gpu" or codec == "ans":
            raise UnsupportedCodecError("the GPU engine needs CUDA and nvCOMP (pip install 'nvckpt[gpu]')")
        return None
    from ..engines.gpu.backend import cuda_device

    return cuda_device(device if device is not None else "cuda")


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _outside_nvckpt() -> int:
    """warnings.warn's stacklevel for the first frame outside nvckpt (the caller's line, whichever API it
    came through; in an async_save's thread, the thread's outermost frame)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


class SaveSession:
    """One save of ``obj`` to ``target`` (a path, written atomically, or a binary stream that never seeks)."""

    def __init__(self, obj: Any, target: Any, options: SaveOptions, *,
                 progress: Callable[[int], None] | None = None) -> None:
        self.start = time.perf_counter()
        self.options = options
        self.target = open_target(target, storage_options=options.storage_options)
        self.progress = progress
        bf16, copies = options.derives
        # Derived-tensor candidates are verified later (SavePlan.decide): before the engine runs, or, in
        # a read-ahead async_save, in the caller's thread while the engine reads every other tensor.
        self.device: torch.device | None = None

        def chunk_size(tensors: list[PlannedTensor]) -> int:
            # The engine follows from where the tensors live; the chunk size from the engine.
            self.device = _gpu_device(tensors, options)
            return options.chunk_size or (CPU_CHUNK_SIZE if self.device is None else GPU_CHUNK_SIZE)

        self.plan = plan_save(obj, metadata=options.metadata, derive=bf16, copies=copies, chunk_size=chunk_size,
                              defer=True)
        self.caller_decides = False
        # Where the time of a save goes, in seconds (SaveResult.stats["phases"], with the plan's own):
        # what runs before the engine reads the first tensor; async_save adds what held its caller.
        self.phases: dict[str, float] = {}
        self.ready: Any = None  # what the engine's streams wait for (the caller's work, a snapshot's copies)
        self.tensors_read: threading.Event | None = None  # set once the engine reads the caller's tensors no more
        self.publishing: Callable[[], None] | None = None  # an async_save's future: too late to cancel from now
        self.stats: dict[str, Any] = {}
        lifecycle.prepare(async_save=False)

    @property
    def tensor_checksums(self) -> bool:
        """Whole-tensor checksums: on unless turned off, or (when not asked for) in a read-ahead async_save,
        where hashing the raw bytes would keep the caller waiting for a device-to-host copy of the whole
        state; every stored byte still has its chunk checksum."""
        asked = self.options.tensor_checksums
        return asked if asked is not None else self.tensors_read is None

    @property
    def engine(self) -> str:
        return "cpu" if self.device is None else "gpu"

    def prepare_async(self, lazy: bool = False) -> None:
        """What async_save does at its call, so that the caller may change its tensors once it returns.

        CPU tensors are copied.  On the GPU engine a state that fits in half the memory budget is copied on
        the device (a few ms); a larger one -- or any, with ``lazy`` -- is not copied at all: the engine
        reads it ahead of the writer (compressed chunks into pinned host memory), and the caller is
        released once every tensor has been read (``tensors_read``)."""
        if self.device is None:
            self.plan.decide()
            with torch.no_grad():
                for t in self.plan.tensors:
                    if t.data is not None:
                        t.data = torch.empty(t.data.shape, dtype=t.data.dtype, device="cpu").copy_(t.data)
            self.stats["snapshot"] = {"cpu": "host"}
            return
        from ..engines.gpu.backend import CudaBackend
        from ..engines.gpu.snapshot import clone_host_tensors, snapshot
        from ..options import default_memory_budget

        budget = self.options.gpu.memory_budget or default_memory_budget(CudaBackend(self.device).memory_total())
        on_gpu = sum(t.nbytes for t in self.plan.tensors if t.data is not None and t.data.device.type == "cuda")
        if not lazy and on_gpu <= budget // 2:
            self.plan.decide()
            snap = snapshot(self.plan)
            self.ready = snap.events.get(self.device)
            self.stats["snapshot"] = snap.strategies
            return
        clone_host_tensors(self.plan)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # the caller's work so far, on the caller's stream
        self.ready = ready
        self.tensors_read = threading.Event()
        self.caller_decides = not lazy  # start_async verifies the candidates while the engine reads
        self.stats["snapshot"] = {str(self.device): "read-ahead"}

    def _items(self) -> tuple[Iterator[TensorReady | EncodedChunk], dict[str, Any]]:
        o = self.options
        if self.device is None:
            from ..engines.cpu import encode_cpu

            return encode_cpu(self.plan, chooser(o.codec, o.zstd_level), workers=o.workers,
                              tensor_checksums=o.tensor_checksums is not False), {}
        from ..codecs.nvcomp import backend as nb
        from ..engines.gpu.backend import CudaBackend
        from ..engines.gpu.encode import encode_batches

        version = nb.nvcomp_version()
        items = encode_batches(self.plan, chooser(o.codec, o.zstd_level, gpu=True, nvcomp_version=version),
                               CudaBackend(self.device, timing=o.gpu.timing), o.gpu,
                               tensor_checksums=self.tensor_checksums, ready=self.ready, stats=self.stats,
                               read_ahead=self.tensors_read)
        return items, {"nvcomp": version}

    def register(self, cancel: threading.Event, future: Any = None) -> lifecycle.Running:
        """This save as one in progress (finished at exit, given a grace on SIGTERM)."""
        return _register(self.target, self.options, cancel, future)

    def prepare_lazy(self, ready: Any, tensors_read: threading.Event) -> None:
        """A lazy async_save, in its own thread: the GPU engine reads the caller's tensors ahead of the writer
        (``ready``: an event recorded on the caller's stream at the call); the CPU engine copies them first."""
        if self.device is None:
            self.prepare_async()
            tensors_read.set()
            return
        from ..engines.gpu.snapshot import clone_host_tensors

        clone_host_tensors(self.plan)
        self.ready = ready
        self.tensors_read = tensors_read
        self.stats["snapshot"] = {str(self.device): "read-ahead"}

    def run(self, cancel: threading.Event | None = None, running: lifecycle.Running | None = None) -> SaveResult:
        """Write the file.  ``cancel`` (set by SaveFuture.cancel or a SIGTERM past its grace) stops it and
        leaves the target as it was; ``running``: the registration an async_save made at its call."""
        cancel = cancel or (running.cancel if running is not None else threading.Event())
        running = running or self.register(cancel)
        try:
            return self._run(cancel, running.turn)
        except CancelledError:
            lifecycle.end(running)
            lifecycle.cancelled_by_sigterm(running)
            raise
        finally:
            lifecycle.end(running)

    def _run(self, cancel: threading.Event, turn: Any = None) -> SaveResult:
        begun = time.perf_counter()
        if not self.caller_decides and self.device is not None:
            self._decide()  # the CPU engine verifies the candidates itself, beside its coding of the rest
        items, extra = self._items()
        items = _cancellable(items, cancel)
        try:
            return self._write(items, extra, cancel, turn, begun)
        finally:
            # Stop the engine on every way out (write_items does once it runs; an error before it, such as
            # a missing folder, must not leave the engine's threads to the exception's traceback).
            close = getattr(items, "close", None)
            if close is not None:
                close()

    def _decide(self) -> None:
        """Verify the derived-tensor candidates before the GPU engine reads.  Where the caller recorded where its
        work stood at the call (``ready``: an async_save), the comparisons are ordered after that alone: a
        lazy save's caller has queued its next forward and backward on the default stream since, and
        comparisons ordered after those would hold the engine's reads back until the step's kernels ran."""
        if self.ready is None:
            self.plan.decide()
            return
        from ..engines.gpu.backend import device_streams

        stream = device_streams(self.device)[0]  # the engine's compute stream, which waits for ``ready`` too
        stream.wait_event(self.ready)
        with torch.cuda.stream(stream):
            self.plan.decide()

    def _write(self, items: Any, extra: dict[str, Any], cancel: threading.Event, turn: Any,
               begun: float) -> SaveResult:
        self.phases["start_engine"] = time.perf_counter() - begun
        if self.tensors_read is not None:
            # Read ahead: the caller waits until every tensor is read, so read before anything else
            # (the file, the index bound, the leftover check come after it is released).
            items = _ReadFirst(items, self.tensors_read)
        target = self.target
        if target.atomic:
            left = target.leftovers()
            if left:
                warnings.warn(LeftoverTemporaryWarning(
                    f"{len(left)} temporary file(s) of an earlier save to {target.name} that did not finish: "
                    f"{', '.join(map(os.path.basename, left))}; `nvckpt recover TMP OUT` salvages their complete "
                    "tensors (remove them when done)"), stacklevel=_outside_nvckpt())
        info = writer_info(extra)
        raw_bytes = self.plan.raw_bytes  # every tensor the file restores: views and derived ones too
        alignment = self.options.alignment
        if alignment is None:  # O_DIRECT / GPUDirect reads of single chunks want 4 KiB; the CPU reader nothing
            alignment = 1 if self.device is None else 4096

        def last_call() -> None:
            """Right before the file appears (the rename; a stream: before its index): a cancel from now on is
            too late (SaveFuture.cancel returns False)."""
            if turn is not None:
                turn.wait()  # saves to this target publish in the order they started
            if self.publishing is not None:
                self.publishing()
            elif cancel.is_set():
                raise CancelledError("the save was cancelled; the file at the target path was not changed")

        if not target.atomic:  # what was written stays written: a cancel stops it before the index, or not at all
            items = _then(items, last_call)
        blocks = {"block_size": CPU_BLOCK, "blocks": CPU_BLOCKS} if self.engine == "cpu" else {}
        try:
            sink = target.open_sink(SinkOptions(direct=self.options.direct_io, **blocks))
            size = write_items(sink, items, self.plan, alignment=alignment, info=info, progress=self.progress)
            if cancel.is_set():
                raise CancelledError("the save was cancelled; the file at the target path was not changed")
            target.commit(last_call if target.atomic else None)
        except BaseException as exc:
            target.abort()  # the target as it was; nothing half-written beside it
            restated = target.restate(exc)
            if restated is not exc:
                raise restated from None
            raise
        return self._result(target.path, raw_bytes, size)

    def _result(self, path: str | None, raw_bytes: int, size: int) -> SaveResult:
        stats = dict(self.stats)
        stats["phases"] = {k: round(v, 6) for k, v in {**self.plan.seconds, **self.phases}.items()}
        stats["plan"] = {"layout_reused": self.plan.layout_reused, "derived_searched": self.plan.searched}
        return SaveResult(path, raw_bytes, size, time.perf_counter() - self.start, self.engine, stats)


class _ReadFirst:
    """An engine's items, the first of them taken at once until the engine has read every tensor
    (``tensors_read``) or hands over a chunk (beyond its pinned limit it must write before it can read
    on); iterating yields them all, in order."""

    def __init__(self, items: Iterator, tensors_read: threading.Event) -> None:
        self._items = items
        self._first: deque[Any] = deque()
        for item in items:
            self._first.append(item)
            if tensors_read.is_set() or isinstance(item, EncodedChunk):
                break

    def __iter__(self) -> Iterator:
        while self._first:
            yield self._first.popleft()
        yield from self._items

    def close(self) -> None:
        self._first.clear()
        close = getattr(self._items, "close", None)
        if close is not None:
            close()


def _then(items: Iterator, last: Callable[[], None]) -> Iterator:
    """``items``, then ``last()`` once they are all given (before the writer writes the index)."""
    yield from items
    last()


def _cancellable(items: Iterator, cancel: threading.Event) -> Iterator:
    try:
        for item in items:
            if cancel.is_set():
                raise CancelledError("the save was cancelled; the file at the target path was not changed")
            yield item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()  # lets the engine release its buffers


class SaveFuture(Future):
    """The result of ``async_save``: a concurrent.futures.Future of a SaveResult.

    ``blocked_seconds`` is how long ``async_save`` held the caller, and ``fence_wait_seconds`` how long the
    fenced optimizers' steps then waited for a lazy save's reads (0 when they were done in time); ``snapshot``
    says per device how the state was taken: "device" (a copy on the GPU), "host" (a copy in host memory)
    or "read-ahead" (read by the GPU engine before the call returned, or in a lazy save before the step).  ``cancel()``
    also stops a save that is already running, unless it has reached its final
    rename; a cancelled save leaves the target path with whatever file it had before."""

    def __init__(self) -> None:
        super().__init__()
        self.blocked_seconds = 0.0
        self.fence_wait_seconds = 0.0
        self.snapshot: dict[str, str] = {}
        self._stop = threading.Event()
        self._read: threading.Event | None = None
        self._publish_lock = threading.Lock()
        self._published = False
        self._ended: threading.Event | None = None  # set when the save's thread has ended (cleaned up)
        self._failure: lifecycle.Failure | None = None  # set when it fails: exit reports it unless it was seen

    def result(self, timeout: float | None = None) -> Any:
        try:
            self._wait_cleanup(timeout)
            return super().result(timeout)
        finally:
            self._seen()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self._wait_cleanup(timeout)
            return super().exception(timeout)
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
        """Stop the save unless it has reached its final rename (then False): as for any Future, a True means
        that ``cancelled()`` is True from now on and ``result()`` raises CancelledError (once the save's
        thread has removed its temporary file)."""
        with self._publish_lock:
            if self.cancelled():
                return True
            if self.done() or self._published:
                return False  # done, or at its final rename: the new file is (being) published
            self._stop.set()
            notify = self._set_cancelled()
        # The done-callbacks run after the lock is let go: one that asks for the outcome (exception(),
        # result()) waits for the save's thread, which takes the lock on its way out (_publish).
        if notify:
            self._invoke_callbacks()
        return True

    def _publish(self) -> None:
        """The save's last step before its rename: honour a cancel that came in time, refuse later ones."""
        with self._publish_lock:
            if self._stop.is_set():
                raise CancelledError("the save was cancelled; the file at the target path was not changed")
            self._published = True

    def _set_cancelled(self) -> bool:
        """cancel() stops the running save: cancelled() is True and result() raises CancelledError.  True when
        this call made it so (its caller then runs the done-callbacks)."""
        from concurrent.futures._base import CANCELLED_AND_NOTIFIED

        with self._condition:
            if self._state == CANCELLED_AND_NOTIFIED:
                return False
            self._state = CANCELLED_AND_NOTIFIED
            for waiter in self._waiters:  # concurrent.futures.wait / as_completed already waiting on it
                waiter.add_cancelled(self)
            self._condition.notify_all()
        return True

    def _finish(self, result: Any = None, exc: BaseException | None = None) -> None:
        """The save's thread's outcome, unless cancel() already decided it."""
        if self.cancelled():
            return
        if exc is not None:
            _detach_traceback(exc)
            self.set_exception(exc)
        else:
            self.set_result(result)


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


def _register(target: Target, options: SaveOptions, cancel: threading.Event, future: Any = None) -> lifecycle.Running:
    """This save as one in progress, and its turn among the saves to its target (taken at the call)."""
    turn = TURNS.take(target.order_key, cancel) if target.order_key is not None else None
    return lifecycle.begin(target.name, cancel, float(options.preemption_grace), future, turn=turn)


def _gpu_budget(options: SaveOptions) -> Callable[[torch.device], int]:
    """The GPU memory a lazy call may take on a device (its gather of small copies): the save's budget."""
    from ..options import default_memory_budget

    return lambda device: (options.gpu.memory_budget
                           or default_memory_budget(torch.cuda.get_device_properties(device).total_memory))


_hooks: list[tuple[Any, SaveFuture]] = []  # step pre-hooks of lazy saves, with their futures
_hooks_lock = threading.Lock()


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
    future = SaveFuture()
    future.set_running_or_notify_cancel()
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
            future.snapshot = dict(session.stats.get("snapshot", {}))
            return session
    else:
        prepared = SaveSession(obj, target, options)
        t0 = time.perf_counter()
        prepared.prepare_async()
        prepared.phases["prepare"] = time.perf_counter() - t0
        future.snapshot = dict(prepared.stats.get("snapshot", {}))
        future._read = prepared.tensors_read

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
                if future._set_cancelled():
                    future._invoke_callbacks()
            else:
                future._finish(exc=exc)
        except BaseException as exc:
            if not future.cancelled():  # a cancelled save's later error is not a lost checkpoint
                future._failure = lifecycle.failed(running, exc)
            future._finish(exc=exc)
        else:
            future._finish(result)
        finally:
            lifecycle.end(running)
            if future._read is not None:
                future._read.set()  # also when it failed before reading: whoever waits sees the outcome
            future._ended.set()

    running = _register(target, options, future._stop, future)  # before the thread starts: an exit now waits for it
    launched = time.perf_counter()
    try:
        threading.Thread(target=work, name="nvckpt-async-save", daemon=False).start()
    except BaseException:
        lifecycle.end(running)  # no thread: its turn at the path must not hold up later saves
        raise
    if not fences and prepared.caller_decides:
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


__all__ = ["SaveResult", "SaveSession", "SaveFuture", "start_async", "write_items", "writer_info"]
