"""The GPU engine as a save asks it (nvckpt.engines.base.Engine): nvCOMP on the tensors' device.

Its work is ``encode_batches`` (encode.py) on a device ``Backend``: ``CudaBackend``
on a CUDA device, or the host stand-in ``HostBackend`` (the same scheduling with
the host codecs), which CI runs.  An async_save's state is taken by a device
snapshot when it fits in half the engine's memory budget, else read ahead: the
engine compresses it into pinned host memory before the caller is released.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import torch

from ..._fork import importing
from ...codecs.presets import chooser
from ...io.target import SinkOptions
from ...options import SaveOptions, default_memory_budget
from ...plan.chunking import GPU_CHUNK_SIZE
from ...plan.walk import SavePlan
from ..base import Prepared
from ..items import EncodedChunk, TensorReady
from .backend import Backend
from .memory import DEVICE_MEMORY


class GpuEngine:
    """One save's GPU engine on ``device`` (a CUDA device), or on ``backend`` (the host stand-in)."""

    name = "gpu"
    chunk_size = GPU_CHUNK_SIZE
    alignment = 4096  # O_DIRECT and GPUDirect reads of single chunks

    def __init__(self, device: torch.device | None = None, *, backend: Backend | None = None) -> None:
        if (device is None) == (backend is None):
            raise ValueError("a GpuEngine runs on a CUDA device or on a given backend (one of them)")
        self.device = device if device is not None else backend.device  # type: ignore[union-attr]
        self._backend = backend

    def backend(self, options: SaveOptions) -> Backend:
        if self._backend is not None:
            return self._backend
        from .backend import CudaBackend

        return CudaBackend(self.device, timing=options.gpu.timing)

    def nvcomp_version(self) -> str:
        """nvCOMP's version, which the index records for ANS chunks ("" on the host stand-in, no nvCOMP)."""
        if self._backend is not None:
            return ""
        from ...codecs.nvcomp import device as nb

        return nb.nvcomp_version()

    def sink_options(self, options: SaveOptions) -> SinkOptions:
        return SinkOptions(direct=options.direct_io)

    def memory_budget(self, options: SaveOptions) -> int:
        """The GPU memory this save may use: GpuSaveOptions.memory_budget, else the default share of the device."""
        return options.gpu.memory_budget or default_memory_budget(self.backend(options).memory_total())

    def prepare_async(self, plan: SavePlan, options: SaveOptions, lazy: bool = False) -> Prepared:
        """A state that fits in half the memory budget is copied on the device (a few ms); a larger one -- or
        any, with ``lazy`` -- is not copied at all: the engine reads it ahead of the writer (compressed chunks
        into pinned host memory), and the caller is released once every tensor has been read."""
        from .snapshot import clone_host_tensors, snapshot

        on_device = sum(t.nbytes for t in plan.tensors if t.data is not None and t.data.device.type == self.device.type)
        # The copy draws from the process's device-memory account: beside other saves' copies and engines
        # (a lazy save still reading, a DCP stage) there may be no room for it, and the state is read ahead.
        held = None if lazy else DEVICE_MEMORY.take_copy(self.device, on_device, self.memory_budget(options), plan)
        if held is not None:
            try:
                plan.decide()
                snap = snapshot(plan)
            except BaseException:
                held.release()
                raise
            return Prepared(ready=snap.events.get(self.device), snapshot=snap.strategies, held=held)
        clone_host_tensors(plan)
        ready = self.backend(options).caller_mark()  # the caller's work so far, on the caller's stream
        # The caller's thread verifies the candidates while the engine reads (not in a lazy save: its caller
        # has returned already).
        return Prepared(ready=ready, tensors_read=threading.Event(), caller_decides=not lazy,
                        snapshot={str(self.device): "read-ahead"})

    def prepare_lazy(self, plan: SavePlan, options: SaveOptions, ready: Any, tensors_read: threading.Event) -> Prepared:
        from .snapshot import clone_host_tensors

        clone_host_tensors(plan)
        return Prepared(ready=ready, tensors_read=tensors_read, snapshot={str(self.device): "read-ahead"})

    def _decide(self, plan: SavePlan, ready: Any) -> None:
        """Verify the derived-tensor candidates before the engine reads.  Where the caller recorded where its work
        stood at the call (``ready``: an async_save), the comparisons are ordered after that alone: a lazy save's
        caller has queued its next forward and backward on the default stream since, and comparisons ordered
        after those would hold the engine's reads back until the step's kernels ran."""
        if ready is None:
            plan.decide()
            return
        from .backend import device_streams

        stream = device_streams(self.device)[0]  # the engine's compute stream, which waits for ``ready`` too
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            plan.decide()

    def encode(self, plan: SavePlan, prepared: Prepared, options: SaveOptions,
               stats: dict[str, Any]) -> tuple[Iterator[TensorReady | EncodedChunk], dict[str, Any]]:
        with importing():  # maybe in an async save's thread: a fork waits for the import (nvckpt._fork)
            from .encode import encode_batches

        if not prepared.caller_decides:
            self._decide(plan, prepared.ready)
        o = options
        version = self.nvcomp_version()
        # Whole-tensor checksums, unless asked otherwise: not in a read-ahead async_save, where hashing the raw
        # bytes would keep the caller waiting for a device-to-host copy of the whole state (every stored byte
        # still has its chunk checksum).
        asked = o.tensor_checksums
        checksums = asked if asked is not None else prepared.tensors_read is None
        items = encode_batches(plan, chooser(o.codec, o.zstd_level, gpu=bool(version), nvcomp_version=version),
                               self.backend(o), o.gpu, tensor_checksums=checksums, ready=prepared.ready, stats=stats,
                               read_ahead=prepared.tensors_read)
        return items, ({"nvcomp": version} if version else {})


__all__ = ["GpuEngine"]
