"""One save: plan -> engine -> frame writer -> sink -> publish.  Every way of writing a file goes through here
(``save``, ``async_save``, ``nvckpt convert``), so each gets the same engines, sink and atomic replace."""

from __future__ import annotations

import gc
import os
import platform
import threading
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from .. import __version__
from ..codecs.base import Pipeline
from ..codecs.presets import GPU_PRESETS, chooser
from ..errors import UnsupportedCodecError
from ..format.frames import FrameWriter, check_index_floor
from ..io.atomic import AtomicReplace
from ..io.sink import FileSink
from ..options import SaveOptions
from ..plan.chunking import CPU_CHUNK_SIZE, GPU_CHUNK_SIZE
from ..plan.walk import SavePlan, plan_save
from ..engines.items import EncodedChunk, TensorReady


@dataclass(frozen=True)
class SaveResult:
    """What a save wrote: sizes, time, and what the engine measured (``stats``)."""

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
        check_index_floor(plan.entries(), plan.chunk_lengths(), plan.tree, plan.metadata, info)
        writer = FrameWriter(stream, plan.entries(), plan.chunk_lengths(), alignment=alignment)
        for item in items:
            if isinstance(item, TensorReady):
                writer.tensor(item.tensor_id, item.checksum)
                continue
            try:
                writer.chunk(item.tensor_id, item.chunk_index, item.pipeline, item.payload, item.raw_length, item.checksum)
            finally:
                if item.release is not None:
                    item.release()
            if progress is not None:
                progress(item.raw_length)
        return writer.finish(plan.tree, plan.metadata, info)
    finally:
        # Stop the engine now, also on an error: its threads and buffers must not live on in the traceback.
        close = getattr(items, "close", None)
        if close is not None:
            close()


def _gpu_device(plan: SavePlan, options: SaveOptions) -> torch.device | None:
    """The CUDA device whose GPU engine should run this save, else None (the CPU engine)."""
    codec, engine = options.codec, options.engine
    if engine == "cpu" or isinstance(codec, Pipeline) or codec not in GPU_PRESETS:
        return None
    device = next((t.data.device for t in plan.tensors if t.data is not None and t.data.device.type == "cuda"), None)
    if engine == "auto" and device is None:
        return None
    from ..codecs.nvcomp import backend as nb

    if not nb.available():
        if engine == "gpu" or codec == "ans":
            raise UnsupportedCodecError("the GPU engine needs CUDA and nvCOMP (pip install 'nvckpt[gpu]')")
        return None
    from ..engines.gpu.backend import cuda_device

    return cuda_device(device if device is not None else "cuda")


class SaveSession:
    """One save of ``obj`` to ``target`` (a path, written atomically, or a binary stream that never seeks)."""

    def __init__(self, obj: Any, target: Any, options: SaveOptions, *,
                 progress: Callable[[int], None] | None = None) -> None:
        self.start = time.perf_counter()
        self.options = options
        self.target = target
        self.progress = progress
        self.plan = plan_save(obj, metadata=options.metadata, derive_bf16=options.derive_bf16,
                              chunk_size=options.chunk_size or CPU_CHUNK_SIZE)
        self.device = _gpu_device(self.plan, options)
        if options.chunk_size is None and self.device is not None:
            self.plan.rechunk(GPU_CHUNK_SIZE)  # the GPU engine's own default
        self.ready: Any = None  # per device: what the engine waits for (a snapshot's copies)
        self.stats: dict[str, Any] = {}

    @property
    def engine(self) -> str:
        return "cpu" if self.device is None else "gpu"

    def snapshot(self) -> None:
        """Copy every tensor, so the caller may change its own right away (async_save)."""
        if self.device is not None:
            from ..engines.gpu.snapshot import snapshot

            snap = snapshot(self.plan, self.options.gpu)
            self.ready = snap.events.get(self.device)
            self.stats["snapshot"] = snap.strategies
            return
        with torch.no_grad():
            for t in self.plan.tensors:
                if t.data is not None:
                    t.data = torch.empty(t.data.shape, dtype=t.data.dtype, device="cpu").copy_(t.data)

    def _items(self) -> tuple[Iterator[TensorReady | EncodedChunk], dict[str, Any]]:
        o = self.options
        if self.device is None:
            from ..engines.cpu import encode_cpu

            return encode_cpu(self.plan, chooser(o.codec, o.zstd_level), workers=o.workers,
                              tensor_checksums=o.tensor_checksums), {}
        from ..codecs.nvcomp import backend as nb
        from ..engines.gpu.backend import CudaBackend
        from ..engines.gpu.encode import encode_batches

        version = nb.nvcomp_version()
        items = encode_batches(self.plan, chooser(o.codec, o.zstd_level, gpu=True, nvcomp_version=version),
                               CudaBackend(self.device, timing=o.gpu.timing), o.gpu,
                               tensor_checksums=o.tensor_checksums, ready=self.ready, stats=self.stats)
        return items, {"nvcomp": version}

    def run(self, cancel: threading.Event | None = None) -> SaveResult:
        items, extra = self._items()
        if cancel is not None:
            items = _cancellable(items, cancel)
        info = writer_info(extra)
        raw_bytes = self.plan.stored_raw_bytes
        alignment = self.options.alignment
        if hasattr(self.target, "write"):
            size = write_items(self.target, items, self.plan, alignment=alignment, info=info, progress=self.progress)
            return self._result(None, raw_bytes, size)
        direct = self.options.direct_io
        out = AtomicReplace(os.fspath(self.target), lambda tmp: FileSink(tmp, direct=direct))
        try:
            size = write_items(out.writer, items, self.plan, alignment=alignment, info=info, progress=self.progress)
            if cancel is not None and cancel.is_set():
                raise CancelledError("async save cancelled; the file at the target path was not changed")
        except BaseException as exc:
            out.abort()
            mapped = out.as_target(exc)
            if mapped is not exc:
                raise mapped from None
            raise
        out.commit()
        return self._result(out.path, raw_bytes, size)

    def _result(self, path: str | None, raw_bytes: int, size: int) -> SaveResult:
        return SaveResult(path, raw_bytes, size, time.perf_counter() - self.start, self.engine, dict(self.stats))


def _cancellable(items: Iterator, cancel: threading.Event) -> Iterator:
    try:
        for item in items:
            if cancel.is_set():
                raise CancelledError("async save cancelled; the file at the target path was not changed")
            yield item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()  # lets the engine release its buffers


class SaveFuture(Future):
    """The result of ``async_save``: a concurrent.futures.Future of a SaveResult.

    ``blocked_seconds`` is how long ``async_save`` held the caller; ``snapshot``
    says per device how the state was copied ("device" or "host").  ``cancel()``
    also stops a save that is already running, unless it has reached its final
    rename; a cancelled save leaves the target path with whatever file it had before."""

    def __init__(self) -> None:
        super().__init__()
        self.blocked_seconds = 0.0
        self.snapshot: dict[str, str] = {}
        self._stop = threading.Event()

    def cancel(self) -> bool:
        if self.done():
            return False
        self._stop.set()
        return True


def start_async(obj: Any, target: Any, options: SaveOptions) -> SaveFuture:
    """Plan and snapshot in the caller's thread, then save in a thread of its own."""
    start = time.perf_counter()
    # No garbage-collection pass while the caller waits: in a large process (torch,
    # a model, its optimizer) one full pass can take longer than the whole snapshot.
    collecting = gc.isenabled()
    gc.disable()
    try:
        session = SaveSession(obj, target, options)
        session.snapshot()
    finally:
        if collecting:
            gc.enable()
    future = SaveFuture()
    future.snapshot = dict(session.stats.get("snapshot", {}))
    future.set_running_or_notify_cancel()

    def work() -> None:
        try:
            result = session.run(future._stop)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    threading.Thread(target=work, name="nvckpt-async-save", daemon=False).start()
    future.blocked_seconds = time.perf_counter() - start
    return future


__all__ = ["SaveResult", "SaveSession", "SaveFuture", "start_async", "write_items", "writer_info"]
