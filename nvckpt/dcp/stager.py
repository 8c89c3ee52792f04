"""``nvckpt.dcp.Stager``: the ``async_stager=`` of ``dcp.async_save``, staging through nvckpt's snapshot.

DCP's default stager copies every shard into CPU memory before
``async_save`` returns: the caller waits for a device-to-host copy of the
whole state.  This one copies CUDA shards into new device memory (the
device snapshot of ``nvckpt.async_save``: grouped device-to-device copies at
HBM speed), so the background save compresses them on the GPU with
``nvckpt.dcp.Writer``.  A device without room for the copy (its free and
cached memory, less the engine's ``GpuSaveOptions.memory_budget``, or more
than the ``device_limit`` given) is staged to host memory instead.  CPU
tensors are cloned.
DTensors keep their mesh and placements, so DCP plans the staged state as
it would the original.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from ..engines.gpu.snapshot import snapshot
from ..options import GpuSaveOptions, default_memory_budget
from ..plan.walk import PlannedTensor, SavePlan

_IMMUTABLE = (int, float, bool, str, bytes, type(None), complex)


class _Slot:
    """Where a staged tensor goes back into the copied structure."""

    def __init__(self, index: int, dtensor: Any = None) -> None:
        self.index = index
        self.dtensor = dtensor


def _map_leaves(node: Any, fn: Any) -> Any:
    """A copy of nested dicts, lists and (plain) tuples with ``fn`` applied to everything else."""
    if isinstance(node, dict):
        return {k: _map_leaves(v, fn) for k, v in node.items()}
    if isinstance(node, list):
        return [_map_leaves(v, fn) for v in node]
    if type(node) is tuple:
        return tuple(_map_leaves(v, fn) for v in node)
    return fn(node)


class Stager:
    """``dcp.async_save(state, storage_writer=nvckpt.dcp.Writer(DIR), async_stager=nvckpt.dcp.Stager())``.

    ``gpu``: the GPU engine's options the save will use (its ``memory_budget``
    is left free on the device); ``device_limit``: stage at most this many
    bytes per device on the device (None: as many as fit).  After each
    ``stage``, ``last_seconds`` is how long it held the caller and
    ``last_strategies`` what it did per device ("device" or "host")."""

    _synchronize_after_execute = False  # stage() returns once the copies are complete

    def __init__(self, gpu: GpuSaveOptions | None = None, device_limit: int | None = None) -> None:
        self.gpu = gpu or GpuSaveOptions()
        if not isinstance(self.gpu, GpuSaveOptions):
            raise TypeError(f"gpu must be a nvckpt.GpuSaveOptions, got {type(self.gpu).__qualname__}")
        if device_limit is not None and (type(device_limit) is not int or device_limit < 0):
            raise ValueError(f"device_limit must be a non-negative integer or None, got {device_limit!r}")
        self.device_limit = device_limit
        self.last_seconds = 0.0
        self.last_strategies: dict[str, str] = {}

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        from torch.distributed.tensor import DTensor

        planned: list[PlannedTensor] = []

        def take(t: torch.Tensor) -> int:
            planned.append(PlannedTensor(len(planned), {"name": str(len(planned))}, t.detach(),
                                         [(0, t.numel() * t.element_size())]))
            return len(planned) - 1

        def leaf(node: Any) -> Any:
            if isinstance(node, DTensor):
                return _Slot(take(node.to_local()), node)
            if type(node) is torch.Tensor or type(node) is torch.nn.Parameter:
                return _Slot(take(node))
            if isinstance(node, torch.Tensor):
                raise TypeError(f"nvckpt.dcp.Stager stages torch.Tensor and DTensor, not {type(node).__qualname__} "
                                "(use DCP's DefaultStager for it)")
            return node if isinstance(node, _IMMUTABLE) else copy.deepcopy(node)

        skeleton = _map_leaves(state_dict, leaf)
        moved: set[int] = set()
        strategies = self._to_host_where_no_room(planned, moved)
        on_device = [t for t in planned if t.tensor_id not in moved]  # (and CPU tensors, which it clones)
        snap = snapshot(SavePlan(None, on_device, {}))
        for ev in snap.events.values():
            ev.synchronize()  # the writer's streams read the copies: they must be complete
        strategies.update(snap.strategies)

        def fill(node: Any) -> Any:
            if not isinstance(node, _Slot):
                return node
            data, src = planned[node.index].data, node.dtensor
            if src is None:
                return data
            return DTensor.from_local(data, src.device_mesh, src.placements, run_check=False,
                                      shape=src.shape, stride=src.stride())

        staged = _map_leaves(skeleton, fill)
        self.last_strategies = strategies
        self.last_seconds = time.perf_counter() - start
        return staged

    def _to_host_where_no_room(self, planned: list[PlannedTensor], moved: set[int]) -> dict[str, str]:
        """Copy to host memory the tensors of each CUDA device that has no room for them (their ids into
        ``moved``); returns {device: "host"}."""
        need: dict[torch.device, int] = {}
        for t in planned:
            if t.data.device.type == "cuda":
                need[t.data.device] = need.get(t.data.device, 0) + t.nbytes
        out = {}
        for device, nbytes in need.items():
            free, total = torch.cuda.mem_get_info(device)
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            budget = self.gpu.memory_budget or default_memory_budget(total)
            limit = free + max(0, cached) - budget if self.device_limit is None else self.device_limit
            if nbytes > limit:
                with torch.no_grad():
                    for t in planned:
                        if t.data.device == device:
                            t.data = t.data.to("cpu", memory_format=torch.contiguous_format)
                            moved.add(t.tensor_id)
                out[str(device)] = "host"
        return out

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once its copies are done."""

    def close(self) -> None:
        """Nothing to release: each staged copy is freed with the save that used it."""


__all__ = ["Stager"]
