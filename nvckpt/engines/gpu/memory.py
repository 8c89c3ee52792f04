"""The device memory nvckpt holds, accounted process-wide: every save's snapshot, staging and encode draw from it.

``GpuSaveOptions.memory_budget`` bounds what nvckpt holds on a device at any moment, whatever runs at once:
an async_save's device snapshot, the DCP stager's device copies, a lazy save's gather of small copies and
each encode's batches all take a ``Grant`` from ``DEVICE_MEMORY`` before they allocate and give it back when
their memory is free (a save's end, or its failure).  Without it each save kept within the budget by itself,
and two saves at once (a lazy save still reading when a plain one starts, a DCP stage beside the encode of
the previous step's save) held the budget two or three times over.

Copies of the caller's state (snapshots, staging) take at most half the budget between them, so an encode
always finds room to run; an encode takes what is left (its batches shrink to fit) and waits, when less
than one batch's worth is left, for the other saves' encodes to give theirs back.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch


class Grant:
    """Device memory taken from the account; ``release()`` (idempotent) gives it back."""

    __slots__ = ("account", "device", "nbytes", "key", "copy")

    def __init__(self, account: "DeviceMemory", device: torch.device, nbytes: int, key: Any, copy: bool) -> None:
        self.account, self.device, self.nbytes, self.key, self.copy = account, device, nbytes, key, copy

    def release(self) -> None:
        account, self.account = self.account, None
        if account is not None:
            account._give(self)

    def __enter__(self) -> "Grant":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class DeviceMemory:
    """Bytes granted per device (``held``), the most ever held at once (``peak``), and who holds them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: dict[torch.device, int] = {}
        self._copies: dict[torch.device, int] = {}  # the part of it that copies of the state hold
        self._by_owner: dict[tuple[torch.device, int], int] = {}
        self._peak: dict[torch.device, int] = {}

    def held(self, device: Any) -> int:
        with self._cond:
            return self._held.get(torch.device(device), 0)

    def peak(self, device: Any) -> int:
        with self._cond:
            return self._peak.get(torch.device(device), 0)

    def reset_peak(self, device: Any) -> None:
        device = torch.device(device)
        with self._cond:
            self._peak[device] = self._held.get(device, 0)

    def take_copy(self, device: Any, nbytes: int, budget: int, owner: Any = None) -> Grant | None:
        """Room for a copy of the state (a snapshot, staging) of ``nbytes``, or None: copies hold at most half
        the budget between them, and the whole stays within it."""
        device = torch.device(device)
        with self._cond:
            held = self._held.get(device, 0)
            if self._copies.get(device, 0) + nbytes > budget // 2 or held + nbytes > budget:
                return None
            self._copies[device] = self._copies.get(device, 0) + nbytes
            return self._grant(device, nbytes, owner, copy=True)

    def take_work(self, device: Any, want: int, need: int, budget: int, owner: Any = None,
                  stop: threading.Event | None = None) -> Grant:
        """Working memory for an engine: ``want`` bytes, or what is left of the budget if that is at least
        ``need``; else wait until other holders give enough back.  ValueError if this owner's own copies leave
        less than ``need``: waiting would never end."""
        device = torch.device(device)
        with self._cond:
            own = self._by_owner.get((device, id(owner)), 0) if owner is not None else 0
            if need > budget - own:
                raise ValueError(f"GpuSaveOptions.memory_budget {budget} leaves {budget - own} bytes beside this "
                                 f"save's copy of the state on {device}, and its engine needs at least {need}: "
                                 "give a larger memory_budget (or use smaller chunks, or fewer batches in flight)")
            while budget - self._held.get(device, 0) < need:
                if stop is not None and stop.is_set():
                    raise RuntimeError("the save stopped while waiting for device memory held by another save")
                self._cond.wait(0.1)
            n = max(need, min(want, budget - self._held.get(device, 0)))
            return self._grant(device, n, owner, copy=False)

    def _grant(self, device: torch.device, nbytes: int, owner: Any, copy: bool) -> Grant:  # under the lock
        held = self._held[device] = self._held.get(device, 0) + nbytes
        self._peak[device] = max(self._peak.get(device, 0), held)
        key = (device, id(owner))
        if owner is not None:
            self._by_owner[key] = self._by_owner.get(key, 0) + nbytes
        return Grant(self, device, nbytes, key if owner is not None else None, copy)

    def _give(self, grant: Grant) -> None:
        key = grant.key
        with self._cond:
            self._held[grant.device] -= grant.nbytes
            if grant.copy:
                self._copies[grant.device] -= grant.nbytes
            if key:
                left = self._by_owner[key] - grant.nbytes
                if left:
                    self._by_owner[key] = left
                else:
                    del self._by_owner[key]
            self._cond.notify_all()


#: The process's account (state, not a setting).
DEVICE_MEMORY = DeviceMemory()


def release_with(tensors: list[torch.Tensor], grant: Grant) -> None:
    """Give ``grant`` back once every tensor of ``tensors`` is gone (their storages freed): copies handed to a
    caller who decides when they die (DCP's staged state, dropped when its save ends or fails).  Views count
    by their base, which every view of them (DCP's slices included) keeps alive."""
    bases = {id(b): b for b in ((t._base if t._base is not None else t) for t in tensors)}
    tensors = list(bases.values())
    if not tensors:
        grant.release()
        return
    left = [len(tensors)]
    lock = threading.Lock()

    def one_gone() -> None:
        with lock:
            left[0] -= 1
            done = left[0] == 0
        if done:
            grant.release()

    for t in tensors:
        weakref.finalize(t, one_gone)


__all__ = ["DEVICE_MEMORY", "DeviceMemory", "Grant", "release_with"]
