"""async_save's snapshot: a copy of the state, so the caller may change its tensors as soon as it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...codecs.nvcomp.staging import align_up
from ...options import GpuSaveOptions
from ...plan.walk import PlannedTensor, SavePlan


@dataclass
class Snapshot:
    events: dict[torch.device, Any] = field(default_factory=dict)  # per device: the copies are done after it
    strategies: dict[str, str] = field(default_factory=dict)  # per device: "device" or "host"


def snapshot(plan: SavePlan, options: GpuSaveOptions) -> Snapshot:
    """Copy the state the plan holds, so the caller may change its tensors as soon as this returns.

    Strategy, chosen by measurement (benchmarks/results/bench_h200.md): a
    device-to-device copy of every CUDA tensor into one new buffer per device
    and dtype, issued on the caller's current stream with grouped copy kernels
    (``torch._foreach_copy_``).  It is asynchronous: the copies are ordered
    before anything the caller does next on that stream (an optimizer step),
    so the caller is blocked only for the launches and the Python around
    them (tens of microseconds per tensor), while the copies run at HBM speed
    (~2 TB/s: a few ms for 6 GB).  The engine's streams wait for an event
    recorded after them.  Compressing into device memory instead would need
    as much memory at its peak (nvCOMP reserves its output bound, larger than
    the input, until sizes are known) and a host sync to learn the sizes, so
    it is not used.

    Fallback when the device lacks room (free + cached memory less than the
    state + ``options.snapshot_reserve`` + the engine's own batches): the tensors are
    copied to (pageable) host memory, which blocks the caller for the
    device-to-host copy (~0.5 s for 6 GB) but cannot fail for lack of GPU
    memory.  CPU tensors are cloned.  Returns the events the engine waits for
    and what was done per device.
    """
    events: dict[torch.device, Any] = {}
    strategies: dict[str, str] = {}
    by_device: dict[torch.device, list[PlannedTensor]] = {}
    with torch.no_grad():
        for t in plan.tensors:
            if t.data is None:
                continue
            if t.data.device.type == "cuda":
                by_device.setdefault(t.data.device, []).append(t)
            else:
                t.data = t.data.clone(memory_format=torch.contiguous_format)
        for device, ts in by_device.items():
            need = sum(align_up(t.nbytes, 512) for t in ts)
            engine = (options.inflight + 1) * 2 * options.batch_bytes
            if _device_room(device) >= need + options.snapshot_reserve + engine:
                by_dtype: dict[torch.dtype, list[PlannedTensor]] = {}
                for t in ts:
                    by_dtype.setdefault(t.data.dtype, []).append(t)
                for dtype, group in by_dtype.items():
                    _copy_group(group, dtype, device)
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(device))
                events[device] = ev
                strategies[str(device)] = "device"
            else:
                for t in ts:
                    t.data = t.data.to("cpu", memory_format=torch.contiguous_format)
                strategies[str(device)] = "host"
    return Snapshot(events, strategies)


def _copy_group(group: list[PlannedTensor], dtype: torch.dtype, device: torch.device) -> None:
    """Copy tensors of one dtype into one new buffer, each starting 512-byte aligned (as nvCOMP likes)."""
    item = group[0].data.element_size()
    sizes: list[int] = []
    for t in group:
        n = t.data.numel()
        sizes += [n, -(n * item) % 512 // item]
    flat = torch.empty(sum(sizes), dtype=dtype, device=device)
    copies = list(torch.split_with_sizes(flat, sizes)[0::2])
    sources = [t.data.reshape(-1) for t in group]
    try:
        torch._foreach_copy_(copies, sources)  # grouped kernels: few launches for many tensors
    except (RuntimeError, NotImplementedError, TypeError):  # a dtype without foreach kernels
        for c, s in zip(copies, sources):
            c.copy_(s)
    for t, c in zip(group, copies):
        t.data = c.view(t.data.shape)


def _device_room(device: torch.device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(0, cached))


__all__ = ["available", "writer_info", "encode_gpu", "encode_batches", "snapshot", "pipeline_chooser",
           "CudaDevice", "HostDevice", "TensorChecksums", "CHUNK_SIZE", "last_stats", "last_snapshot"]


__all__ = ["Snapshot", "snapshot"]
