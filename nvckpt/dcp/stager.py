"""``nvckpt.dcp.Stager``: the ``async_stager=`` of ``dcp.async_save``, staging through nvckpt's snapshot.

DCP's default stager copies every shard into CPU memory before
``async_save`` returns: the caller waits for a device-to-host copy of the
whole state.  This one copies CUDA shards into new device memory (the
device snapshot of ``nvckpt.async_save``: grouped device-to-device copies at
HBM speed), so the background save compresses them on the GPU with
``nvckpt.dcp.Writer``.  The copy takes its memory from the budget every
nvckpt save on the device shares (``GpuSaveOptions.memory_budget``: copies of
states at most half of it, the engines the rest; see
nvckpt.engines.gpu.memory) and gives it back when DCP drops the staged state;
a state that does not fit (or is larger than the device's free memory, or
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

from ..engines.gpu.memory import DEVICE_MEMORY, release_with
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
        self._held: dict[torch.device, Any] = {}

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
        self._held = {}
        try:
            strategies = self._to_host_where_no_room(planned, moved)
            on_device = [t for t in planned if t.tensor_id not in moved]  # (and CPU tensors, which it clones)
            snap = snapshot(SavePlan(None, on_device, {}))
            for ev in snap.events.values():
                ev.synchronize()  # the writer's streams read the copies: they must be complete
        except BaseException:
            for held in self._held.values():
                held.release()
            raise
        # Each device's copies give their memory back to the account when DCP drops them (its save ended,
        # or failed): the staged state is DCP's from here on.
        for device, held in self._held.items():
            release_with([t.data for t in on_device if t.data.device == device], held)
        self._held = {}
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
        ``moved``); returns {device: "host"}, and the device memory the rest takes from the process's
        account (DEVICE_MEMORY) in ``self._held``.

        Room is what async_save's snapshot gets: at most half the budget for copies of states (with every
        other save's copies), within the budget with every engine's memory, and within the memory the device
        has free -- never the allocator's cached blocks, which are the training step's working set."""
        need: dict[torch.device, int] = {}
        for t in planned:
            if t.data.device.type == "cuda":
                need[t.data.device] = need.get(t.data.device, 0) + t.nbytes
        out = {}
        for device, nbytes in need.items():
            free, total = torch.cuda.mem_get_info(device)
            budget = self.gpu.memory_budget or default_memory_budget(total)
            held = None
            if nbytes <= free and (self.device_limit is None or nbytes <= self.device_limit):
                held = DEVICE_MEMORY.take_copy(device, nbytes, budget)
            if held is not None:
                self._held[device] = held
                continue
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
