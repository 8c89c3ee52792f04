"""What a save asks of an engine, and which engine runs a save (chosen once, then asked).

An engine turns a plan's tensors into the frame writer's items (``TensorReady``
then the tensor's ``EncodedChunk``s, SPEC 6) and says what suits it: its chunk
size and payload alignment, the sink it wants, and how an ``async_save`` takes
the state at its call (``prepare_async``: copy it, or read it ahead).  The CPU
engine (nvckpt.engines.cpu) codes with the host codecs on a thread pool; the
GPU engine (nvckpt.engines.gpu.engine) with nvCOMP on the tensors' device.
A new engine implements this protocol and gets a branch in ``select_engine``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Protocol

from .._fork import importing
from ..codecs.base import Pipeline
from ..codecs.presets import GPU_PRESETS, gpu_only
from ..errors import UnsupportedCodecError
from ..io.target import SinkOptions
from .items import EncodedChunk, TensorReady

if TYPE_CHECKING:
    from ..options import SaveOptions
    from ..plan.walk import PlannedTensor, SavePlan


@dataclass
class Prepared:
    """How an async_save took the state at its call (or a plain save: nothing taken)."""

    ready: Any = None  # what the engine's work waits for (the caller's queued work, a snapshot's copies)
    tensors_read: threading.Event | None = None  # set once the engine reads the caller's tensors no more
    caller_decides: bool = False  # the caller's thread verifies the derived-tensor candidates meanwhile
    snapshot: dict[str, str] = field(default_factory=dict)  # per device: "host", "device" or "read-ahead"
    held: Any = None  # the device memory a snapshot holds (a DEVICE_MEMORY grant), given back when the save ends

    def release(self) -> None:
        """Give back the device memory the snapshot holds (the save ended, or failed)."""
        held, self.held = self.held, None
        if held is not None:
            held.release()


class Engine(Protocol):
    """A save's engine (see the module docstring).  ``SaveOptions.engine`` takes an instance too."""

    name: str  # SaveResult.engine
    chunk_size: int  # raw bytes per chunk unless the save says otherwise
    alignment: int  # payload alignment unless the save says otherwise

    def sink_options(self, options: "SaveOptions") -> SinkOptions:
        """What a local file's sink should be for this engine's writes."""
        ...

    def prepare_async(self, plan: "SavePlan", options: "SaveOptions", lazy: bool = False) -> Prepared:
        """At an async_save's call: take the state so the caller may change its tensors once the call returns
        (a copy, or a read ahead that the session waits for through ``tensors_read``).  ``lazy``: the call
        returned already (a fence holds the optimizer's next step): read ahead, copy nothing big."""
        ...

    def prepare_lazy(self, plan: "SavePlan", options: "SaveOptions", ready: Any,
                     tensors_read: threading.Event) -> Prepared:
        """In a lazy async_save's thread: read the caller's tensors after ``ready`` (an event recorded on the
        caller's stream at the call) and set ``tensors_read`` once done with them."""
        ...

    def encode(self, plan: "SavePlan", prepared: Prepared, options: "SaveOptions",
               stats: dict[str, Any]) -> tuple[Iterator[TensorReady | EncodedChunk], dict[str, Any]]:
        """The items for the frame writer, and what the index's "writer" map should add (SPEC 8.2);
        ``stats`` is filled with what the run measured.  Closing the iterator stops the engine and gives its
        buffers back."""
        ...


def gpu_device(tensors: list["PlannedTensor"], options: "SaveOptions") -> Any:
    """The CUDA device whose GPU engine should run a save of ``tensors``, else None (the CPU engine)."""
    codec, engine = options.codec, options.engine
    if engine == "cpu" or isinstance(codec, Pipeline) or codec not in GPU_PRESETS:
        return None
    device = next((t.data.device for t in tensors if t.data is not None and t.data.is_cuda), None)
    if engine == "auto" and device is None:
        return None
    from ..codecs.nvcomp import device as nb

    if not nb.available():
        if engine == "gpu" or gpu_only(codec):
            raise UnsupportedCodecError("the GPU engine needs CUDA and nvCOMP (pip install 'nvckpt[gpu]')")
        return None
    from .gpu.backend import cuda_device

    return cuda_device(device if device is not None else "cuda")


def select_engine(tensors: list["PlannedTensor"], options: "SaveOptions") -> Engine:
    """The engine of a save of ``tensors``: ``options.engine`` if it is one; else the GPU engine for CUDA
    tensors where nvCOMP is (and the codec is one it encodes), else the CPU engine ("cpu" / "gpu" insist)."""
    if not isinstance(options.engine, str):
        return options.engine
    device = gpu_device(tensors, options)
    # On first use, maybe in an async save's thread: a fork waits for the import (nvckpt._fork).
    with importing():
        if device is None:
            from .cpu import CpuEngine

            return CpuEngine()
        from .gpu.engine import GpuEngine

        return GpuEngine(device)


def is_engine(value: Any) -> bool:
    """Does ``value`` implement the Engine protocol (its methods and attributes)?"""
    return all(hasattr(value, a) for a in ("name", "chunk_size", "alignment", "sink_options", "prepare_async",
                                             "prepare_lazy", "encode"))


__all__ = ["Engine", "Prepared", "select_engine", "is_engine"]
