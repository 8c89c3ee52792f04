"""async_save's device snapshot: a copy of a (small) state on its GPU, so the caller may change it at once.

Used when the state fits in half the engine's memory budget (larger states are
read by the engine ahead of the writer instead, see nvckpt.session.save): a
device-to-device copy of every CUDA tensor into one new buffer per device and
dtype, issued on the caller's current stream with grouped copy kernels
(``torch._foreach_copy_``).  It is asynchronous: the copies are ordered before
anything the caller does next on that stream (an optimizer step), so the
caller is blocked only for the launches; the engine's streams wait for an
event recorded after them.  CPU tensors are cloned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...plan.walk import PlannedTensor, SavePlan


@dataclass
class Snapshot:
    events: dict[torch.device, Any] = field(default_factory=dict)  # per device: the copies are done after it
    strategies: dict[str, str] = field(default_factory=dict)  # per device: "device"


def clone_host_tensors(plan: SavePlan) -> None:
    """CPU tensors (an optimizer's step counts): copied at the call, whatever the engine does with the rest."""
    with torch.no_grad():
        for t in plan.tensors:
            if t.data is not None and t.data.device.type == "cpu":
                t.data = t.data.clone(memory_format=torch.contiguous_format)


def snapshot(plan: SavePlan) -> Snapshot:
    """Copy every tensor of the plan (CUDA ones on their device)."""
    clone_host_tensors(plan)
    out = Snapshot()
    by_device: dict[torch.device, list[PlannedTensor]] = {}
    for t in plan.tensors:
        if t.data is not None and t.data.device.type == "cuda":
            by_device.setdefault(t.data.device, []).append(t)
    with torch.no_grad():
        for device, ts in by_device.items():
            by_dtype: dict[torch.dtype, list[PlannedTensor]] = {}
            for t in ts:
                by_dtype.setdefault(t.data.dtype, []).append(t)
            for dtype, group in by_dtype.items():
                _copy_group(group, dtype, device)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
            out.events[device] = ev
            out.strategies[str(device)] = "device"
    return out


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


__all__ = ["Snapshot", "snapshot", "clone_host_tensors"]
