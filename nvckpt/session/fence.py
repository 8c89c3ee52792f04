"""What a lazy async_save (``fence=``) holds at its call: the object's containers copied, and copies of
the small tensors that no fence owns.

The call's caller waits for all of this (it is the lazy mode's blocked time), so it is one pass over the
object with a few cheap steps per tensor.  Measured on the H200 (benchmarks/probe_lazy_call.py, the 514M
GPT of bench_training: 1,460 tensors, 1,168 of them the optimizer's, 194 small storages it does not own):
the optimizer's storages looked up 2.3 ms, the walk 2.5 ms, a pinned buffer and a copy per small storage
3.4 ms and the tensors made over them another 2-4 ms; gathered on the GPU into one buffer and copied to the
host at once the same storages take 0.34 ms, and their tensors are made in the save's thread.  The whole
call: 12.2 ms before, 6.1 ms so (medians of 30 and 20).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..engines.gpu.memory import DEVICE_MEMORY

#: A lazy save copies at the call the small tensors its fences do not own, storage by storage: BatchNorm
#: statistics and other buffers a forward updates in place (the step pre-hook does not hold the forward
#: back).  A larger one (a weight matrix: frozen, or a bf16 copy the step rewrites) is read lazily, as the
#: optimizer's tensors are.  Measured on the H200 (bench_training, 514M GPT with bf16 weights outside the
#: optimizer): copies of up to 16 MiB each made the lazy call 0.018 s instead of 0.003 s.
UNFENCED_COPY_BYTES = 1 << 20
UNFENCED_COPY_TOTAL = 64 << 20


def containers(node: Any, leaf: Callable[[Any], Any] | None = None, kind: type = torch.Tensor) -> Any:
    """The object's containers copied, its leaves (tensors, scalars) shared -- what a lazy save holds at the
    call -- or each leaf of type ``kind`` replaced by ``leaf(it)``."""
    if isinstance(node, dict):
        return {k: containers(v, leaf, kind) for k, v in node.items()}
    if isinstance(node, list):
        return [containers(v, leaf, kind) for v in node]
    if isinstance(node, tuple):
        return tuple(containers(v, leaf, kind) for v in node)
    if isinstance(node, set):  # its items are scalars (hashable): a shallow copy is the snapshot
        return set(node)
    if leaf is not None and isinstance(node, kind):
        return leaf(node)
    return node


def storage_ptr(t: torch.Tensor) -> int:
    """``t.untyped_storage().data_ptr()`` without making the storage object (a third of the cost per tensor,
    and a lazy call does this for every tensor of the state while the caller waits)."""
    p = t.data_ptr()
    if p == 0:  # an empty tensor's data_ptr() is 0 whatever its storage (an empty view of a large one)
        return t.untyped_storage().data_ptr()
    return p - t.storage_offset() * t.element_size()


class Owned:
    """The storages the fences' steps write (parameters, their state): by the tensor objects themselves
    (an optimizer's state_dict() hands out its state's own tensors: a set lookup) and by storage address
    (model.state_dict()'s are new tensors over the same storages; CUDA's unified addresses keep host and
    device pointers apart)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.ids = {id(t) for t in tensors}  # the fences hold these objects for the whole call
        self.ptrs: set[int] = set()
        for t in tensors:
            try:
                self.ptrs.add(storage_ptr(t))
            except (RuntimeError, NotImplementedError):  # sparse, meta: no storage pointer
                pass

    def __contains__(self, ptr: int) -> bool:
        return ptr in self.ptrs


def owned_storages(fences: list[Any]) -> Owned | None:
    """What the fences' steps write, or None where a fence is no torch Optimizer (nothing then is known to
    be safe to read lazily but what it says)."""
    tensors: list[torch.Tensor] = []
    for f in fences:
        groups, state = getattr(f, "param_groups", None), getattr(f, "state", None)
        if not isinstance(groups, list) or not hasattr(state, "values"):
            return None
        for g in groups:
            tensors.extend(p for p in g.get("params", ()) if isinstance(p, torch.Tensor))
        for st in state.values():
            if isinstance(st, dict):
                tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return Owned(tensors)


class _Pending:
    """A small tensor's place in the skeleton until the save's thread makes it over its storage's copy."""

    __slots__ = ("ptr", "dtype", "offset", "size", "stride")

    def __init__(self, ptr: int, t: torch.Tensor) -> None:
        self.ptr, self.dtype = ptr, t.dtype
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()


class SmallCopies:
    """The storages of the small tensors no fence owns, copied at the call: per device, gathered into one
    buffer (one ``torch.cat``; from a GPU, on the caller's stream, then one copy into pinned host memory,
    ordered before whatever the caller queues next), and split into a storage each in the save's thread
    (``storages``).  The gather takes GPU memory for as long as the copy is queued: at most
    ``gpu_budget`` bytes, else (or when the GPU has no room) each storage is copied into its slice of the
    pinned buffer by itself."""

    def __init__(self, gpu_budget: Callable[[torch.device], int]) -> None:
        self._sources: dict[torch.device, dict[int, torch.Tensor]] = {}  # device -> storage ptr -> its bytes
        self._gpu_budget = gpu_budget
        self.total = 0
        self.storages_copied = 0
        self._parts: list[tuple[Any, torch.Tensor, list[tuple[int, int, int]]]] = []  # (event, buffer, [(ptr, at, n)])
        self._held: list[Any] = []  # DEVICE_MEMORY grants of the gathers, given back once their copies are done

    def add(self, ptr: int, t: torch.Tensor) -> bool:
        """Copy the storage of ``t`` (unless a view of it is copied already); False when it is too large."""
        srcs = self._sources.setdefault(t.device, {})
        if ptr not in srcs:
            storage = t.untyped_storage()
            n = storage.nbytes()
            if n > UNFENCED_COPY_BYTES or self.total + n > UNFENCED_COPY_TOTAL:
                return False
            srcs[ptr] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            self.total += n
            self.storages_copied += 1
        return True

    def queue(self) -> None:
        """The copies, made (CPU) or queued on each device's current stream (CUDA)."""
        for device, srcs in self._sources.items():
            if not srcs:
                continue
            views = list(srcs.values())
            places, at = [], 0
            for ptr, v in srcs.items():
                places.append((ptr, at, v.numel()))
                at += v.numel()
            if device.type != "cuda" or at == 0:
                self._parts.append((None, torch.cat(views).cpu(), places))
                continue
            host = torch.empty(at, dtype=torch.uint8, pin_memory=True)
            gathered = None
            # The gather's device memory comes from the process's account (other saves may hold the budget).
            held = DEVICE_MEMORY.take_copy(device, at, self._gpu_budget(device))
            if held is not None:
                self._held.append(held)
                try:
                    gathered = torch.cat(views)
                except torch.cuda.OutOfMemoryError:
                    gathered = None
            if gathered is not None:
                host.copy_(gathered, non_blocking=True)
                del gathered  # its block is reused only after the copy (stream order)
            else:
                for (_, a, n), v in zip(places, views):
                    host[a: a + n].copy_(v, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._parts.append((event, host, places))
        self._sources.clear()

    def storages(self) -> dict[int, torch.Tensor]:
        """Each copied storage (by its source's address) as a CPU tensor of its own, once its copy is done."""
        out: dict[int, torch.Tensor] = {}
        for event, host, places in self._parts:
            if event is not None:
                event.synchronize()
            for ptr, a, n in places:
                out[ptr] = host[a: a + n].clone()  # a storage each: the walk tells views of one storage apart
        self._parts.clear()
        self.release()
        return out

    def release(self) -> None:
        """Give the gathers' device memory back to the account (their copies are done, or the save failed)."""
        for event, _, _ in self._parts:
            if event is not None:
                event.synchronize()  # the gather's block is free once the copy that reads it is done
        while self._held:
            self._held.pop().release()

    def finish(self, skeleton: Any) -> Any:
        """The skeleton with every pending tensor made over its storage's copy."""
        made = self.storages()

        def make(p: _Pending) -> torch.Tensor:
            return torch.empty(0, dtype=p.dtype).set_(made[p.ptr].untyped_storage(), p.offset, p.size, p.stride)

        return containers(skeleton, make, _Pending) if made else skeleton


def copy_unfenced(node: Any, fences: list[Any], gpu_budget: Callable[[torch.device], int]
                  ) -> tuple[Any, SmallCopies | None]:
    """``containers(node)`` with its small tensors that no fence owns copied now (views of one storage sharing
    one copy); the copies' ``finish(skeleton)`` (in the save's thread) puts them in the skeleton.  One pass,
    a few microseconds per tensor: it runs while the caller waits."""
    owned = owned_storages(fences)
    if owned is None:
        return containers(node), None
    ids, ptrs = owned.ids, owned.ptrs
    copies = SmallCopies(gpu_budget)

    def leaf(t: torch.Tensor) -> Any:
        if id(t) in ids:
            return t
        try:
            ptr = storage_ptr(t)
        except (RuntimeError, NotImplementedError):  # sparse, or a subclass without storage of its own
            return t
        if ptr in ptrs:
            return t
        if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg() or t.is_meta:
            return t  # the walk refuses or resolves these as it does for any save
        return _Pending(ptr, t) if copies.add(ptr, t) else t

    with torch.no_grad():
        skeleton = containers(node, leaf)
        copies.queue()
    return skeleton, copies if copies.storages_copied else None
