"""One save: plan -> engine -> frame writer -> target.  Every way of writing a file goes through here
(``save``, ``async_save``, ``nvckpt convert``, the DCP writer), so each gets the same engines and targets.
An async_save's call and its thread are nvckpt.session.async_save."""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections import deque
from concurrent.futures import CancelledError
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

from ..engines.base import Engine, Prepared, select_engine
from ..format.index import writer_info
from ..engines.items import EncodedChunk, TensorReady
from ..errors import LeftoverTemporaryWarning
from ..format.frames import FrameWriter, check_index_floor
from ..io.atomic import TURNS
from ..io.target import Target, open_target
from ..options import SaveOptions
from ..plan.walk import SavePlan, plan_save
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
        """raw_bytes / file_bytes (1.0 for an empty file)."""
        return self.raw_bytes / self.file_bytes if self.file_bytes else 1.0


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


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _outside_nvckpt() -> int:
    """warnings.warn's stacklevel for the first frame outside nvckpt (the caller's line, whichever API it
    came through; in an async_save's thread, the thread's outermost frame)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def register(target: Target, options: SaveOptions, cancel: threading.Event, future: Any = None) -> lifecycle.Running:
    """A save to ``target`` as one in progress (finished at exit, given a grace on SIGTERM), and its turn among
    the saves to that target (saves to one target publish in the order they started; an async_save takes its
    turn at the call)."""
    key = target.order_key
    turn = TURNS.take(key, cancel) if key is not None else None
    return lifecycle.begin(target.name, cancel, float(options.preemption_grace), future, turn=turn)


class SaveSession:
    """One save of ``obj`` to ``target``: plan, then the engine chosen for it, then frames onto the target.

    ``target``: anything ``open_target`` takes (a path, a URL, a binary stream, a Target).  The engine is
    ``select_engine``'s (``options.engine``, or the one for where the tensors live)."""

    def __init__(self, obj: Any, target: Any, options: SaveOptions, *,
                 progress: Callable[[int], None] | None = None) -> None:
        self.start = time.perf_counter()
        self.options = options
        self.target = open_target(target, storage_options=options.storage_options)
        self.progress = progress
        bf16, copies = options.derives
        # Derived-tensor candidates are verified later (SavePlan.decide): by the engine, or, in a read-ahead
        # async_save, in the caller's thread while the engine reads every other tensor.
        self.plan = plan_save(obj, metadata=options.metadata, derive=bf16, copies=copies, chunk_size=None,
                              defer=True)
        self.engine: Engine = select_engine(self.plan.tensors, options)
        self.plan.cut(options.chunk_size or self.engine.chunk_size)
        self.prepared = Prepared()  # how an async_save took the state (nothing, for a plain save)
        # Where the time of a save goes, in seconds (SaveResult.stats["phases"], with the plan's own):
        # what runs before the engine reads the first tensor; async_save adds what held its caller.
        self.phases: dict[str, float] = {}
        self.publishing: Callable[[], None] | None = None  # an async_save's future: too late to cancel from now
        self.stats: dict[str, Any] = {}
        lifecycle.prepare(async_save=False)

    def prepare_async(self, lazy: bool = False) -> None:
        """What async_save does at its call, so that the caller may change its tensors once it returns."""
        self.prepared = self.engine.prepare_async(self.plan, self.options, lazy)
        self.stats["snapshot"] = self.prepared.snapshot

    def prepare_lazy(self, ready: Any, tensors_read: threading.Event) -> None:
        """A lazy async_save, in its own thread: the engine reads the caller's tensors after ``ready``."""
        self.prepared = self.engine.prepare_lazy(self.plan, self.options, ready, tensors_read)
        self.stats["snapshot"] = self.prepared.snapshot

    def register(self, cancel: threading.Event, future: Any = None) -> lifecycle.Running:
        return register(self.target, self.options, cancel, future)

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
            self.release()
            lifecycle.end(running)

    def release(self) -> None:
        """Let go of the snapshot (the device memory it holds goes back to the account): the save is over."""
        if self.prepared.held is not None:
            for t in self.plan.tensors:
                t.data = None  # the copies: freed now, not when the session object goes
            self.prepared.release()

    def _run(self, cancel: threading.Event, turn: Any = None) -> SaveResult:
        begun = time.perf_counter()
        items, extra = self.engine.encode(self.plan, self.prepared, self.options, self.stats)
        items = _cancellable(items, cancel)
        try:
            return self._write(items, extra, cancel, turn, begun)
        finally:
            # Stop the engine on every way out (write_items does once it runs; an error before it, such as
            # a missing folder, must not leave the engine's threads to the exception's traceback).
            close = getattr(items, "close", None)
            if close is not None:
                close()

    def _write(self, items: Any, extra: dict[str, Any], cancel: threading.Event, turn: Any,
               begun: float) -> SaveResult:
        self.phases["start_engine"] = time.perf_counter() - begun
        if self.prepared.tensors_read is not None:
            # Read ahead: the caller waits until every tensor is read, so read before anything else
            # (the file, the index bound, the leftover check come after it is released).
            items = _ReadFirst(items, self.prepared.tensors_read)
        target = self.target
        if target.atomic:
            left = target.leftovers()
            if left:
                advice = getattr(target, "leftover_advice", None)  # an object store's open uploads
                warnings.warn(LeftoverTemporaryWarning(
                    f"{len(left)} temporary file(s) of an earlier save to {target.name} that did not finish: "
                    f"{', '.join(map(os.path.basename, left))}; " + (advice() if advice is not None else
                    "`nvckpt recover TMP OUT` salvages their complete tensors (remove them when done)")),
                    stacklevel=_outside_nvckpt())
        alignment = self.options.alignment or self.engine.alignment

        def last_call() -> None:
            """Right before the file appears (the commit; a stream: before its index): a cancel from now on is
            too late (SaveFuture.cancel returns False)."""
            if turn is not None:
                turn.wait()  # saves to this target publish in the order they started
            if self.publishing is not None:
                self.publishing()
            elif cancel.is_set():
                raise CancelledError("the save was cancelled; the file at the target path was not changed")

        if not target.atomic:  # what was written stays written: a cancel stops it before the index, or not at all
            items = _then(items, last_call)
        if self.publishing is not None and hasattr(target, "free_replaced_now"):
            target.free_replaced_now = True  # an async save: its thread frees the replaced file, before it is done
        try:
            # at most what the file can hold: every raw byte (a chunk is stored raw where encoding does not
            # pay), plus frames, padding and the index
            expected = self.plan.raw_bytes + self.plan.raw_bytes // 16 + (64 << 20)
            sink = target.open_sink(replace(self.engine.sink_options(self.options), expected_bytes=expected))
            size = write_items(sink, items, self.plan, alignment=alignment, info=writer_info(extra),
                               progress=self.progress)
            if cancel.is_set():
                raise CancelledError("the save was cancelled; the file at the target path was not changed")
            target.commit(last_call if target.atomic else None)
        except BaseException as exc:
            target.abort()  # the target as it was; nothing half-written beside it
            restated = target.restate(exc)
            if restated is not exc:  # the same error naming the caller's target; where it came from stays
                raise restated.with_traceback(exc.__traceback__) from None
            raise
        return self._result(target.path, size)

    def _result(self, path: str | None, size: int) -> SaveResult:
        stats = dict(self.stats)
        stats["phases"] = {k: round(v, 6) for k, v in {**self.plan.seconds, **self.phases}.items()}
        stats["plan"] = {"layout_reused": self.plan.layout_reused, "derived_searched": self.plan.searched}
        # raw_bytes: every tensor the file restores (views and derived ones too)
        return SaveResult(path, self.plan.raw_bytes, size, time.perf_counter() - self.start, self.engine.name, stats)


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




__all__ = ["SaveResult", "SaveSession", "register", "write_items", "writer_info"]
