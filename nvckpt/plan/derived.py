"""Derived tensors (SPEC 14.2): exact functions of another tensor, computed and found with torch.

bf16_rne: a bfloat16 tensor that is round-to-nearest-even of a float32 one,
with the NaN rule of SPEC.md.  Computed in integer arithmetic, so it gives the
same bits on every device and library (torch's own float->bf16 cast differs
between CPU and CUDA for NaN).  copy: a tensor bit for bit equal to another of
the same dtype and shape that is not a view of its storage.

Both are found where the tensors live (torch ops on their device, no copy to the
host): candidates are matched on a fingerprint of their first elements first,
then verified in full.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..format.constants import BF16_RNE, COPY

if TYPE_CHECKING:
    from .walk import PlannedTensor

_BLOCK = 1 << 22  # elements per step: bounds the int64 temporaries


def bf16_rne(source: torch.Tensor) -> torch.Tensor:
    """bfloat16 bits of ``source`` (float32) rounded to nearest even."""
    if source.dtype != torch.float32:
        raise TypeError(f"bf16_rne needs a float32 source, got {source.dtype}")
    flat = source.reshape(-1).view(torch.int32)
    out = torch.empty(flat.shape, dtype=torch.int16, device=source.device)
    for start in range(0, flat.numel(), _BLOCK):
        u = flat[start : start + _BLOCK].to(torch.int64) & 0xFFFFFFFF
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        quiet_nan = (u >> 16) | 0x0040
        bits = torch.where((u & 0x7FFFFFFF) > 0x7F800000, quiet_nan, rounded) & 0xFFFF
        out[start : start + _BLOCK] = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return out.view(torch.bfloat16).reshape(source.shape)


def is_bf16_rne_of(candidate: torch.Tensor, source: torch.Tensor) -> bool:
    """True when ``candidate`` (bf16) is exactly bf16_rne(``source``) (fp32), bit for bit."""
    if candidate.dtype != torch.bfloat16 or source.dtype != torch.float32 or candidate.shape != source.shape:
        return False
    if candidate.device != source.device:
        return False
    c, s = candidate.reshape(-1), source.reshape(-1)
    head = min(64, c.numel())  # cheap rejection of most non-matching pairs
    if not torch.equal(bf16_rne(s[:head]).view(torch.int16), c[:head].view(torch.int16)):
        return False
    return torch.equal(bf16_rne(s).view(torch.int16), c.view(torch.int16))


def find_derived(tensors: list[PlannedTensor]) -> None:
    """Store a bf16 tensor as derived when it is exactly bf16_rne of a stored fp32 one.

    Candidates are first matched on the rounding of their first 64 elements
    (computed for all tensors of a device at once), so a state with hundreds
    of same-shaped tensors (biases, norms, Adam moments) costs one full
    comparison per bf16 tensor instead of one per same-shaped pair."""
    sources = [t for t in tensors
               if t.data is not None and t.entry["dtype"] == "float32" and not t.entry.get("internal")]
    candidates = [t for t in tensors if t.data is not None and t.entry["dtype"] == "bfloat16"
                  and t.data.numel() > 0 and not t.entry.get("internal")]
    if not sources or not candidates:
        return
    index: dict[tuple, list[PlannedTensor]] = {}
    for t, head in zip(sources, _heads(sources, rne=True)):
        index.setdefault((tuple(t.entry["shape"]), t.data.device, head), []).append(t)
    for t, head in zip(candidates, _heads(candidates, rne=False)):
        for src in index.get((tuple(t.entry["shape"]), t.data.device, head), []):
            if is_bf16_rne_of(t.data, src.data):  # verified bit for bit before use
                t.entry["derived"] = {"function": BF16_RNE, "source": src.tensor_id}
                t.data = None
                t.chunks = []
                break


def find_copies(tensors: list[PlannedTensor]) -> None:
    """Store a tensor as a ``copy`` of an earlier one when their bytes, dtype and shape are equal
    (different storages: tensors of one storage are views already, walk._dedupe)."""
    stored = [t for t in tensors if t.data is not None and t.data.numel() > 0 and not t.entry.get("internal")]
    groups: dict[tuple, list[PlannedTensor]] = {}
    for t in stored:
        groups.setdefault((t.entry["dtype"], tuple(t.entry["shape"]), t.data.device), []).append(t)
    candidates = [g for g in groups.values() if len(g) > 1]
    if not candidates:
        return
    flat = [t for g in candidates for t in g]
    heads = dict(zip((id(t) for t in flat), _heads(flat, rne=False, raw=True)))
    for group in candidates:
        firsts: dict[bytes, list[PlannedTensor]] = {}
        for t in group:
            head = heads[id(t)]
            for src in firsts.get(head, []):
                if torch.equal(src.flat_bytes(), t.flat_bytes()):  # bit for bit, on their device
                    t.entry["derived"] = {"function": COPY, "source": src.tensor_id}
                    t.data = None
                    t.chunks = []
                    break
            else:
                firsts.setdefault(head, []).append(t)


def _heads(tensors: list[PlannedTensor], *, rne: bool, raw: bool = False) -> list[bytes]:
    """The bf16 bits of each tensor's first 64 elements (rounded from fp32 with ``rne``): one host copy per device."""
    out: list[bytes] = [b""] * len(tensors)
    by_device: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.data.device, []).append(i)
    for idx in by_device.values():
        if raw:  # the first 64 bytes, any dtype
            parts = [tensors[i].flat_bytes()[:64] for i in idx]
            bits = torch.cat(parts).cpu().numpy()
        else:
            parts = [tensors[i].data.reshape(-1)[:64] for i in idx]
            flat = torch.cat(parts)
            bits = (bf16_rne(flat) if rne else flat).view(torch.int16).cpu().numpy()
        at = 0
        for i, part in zip(idx, parts):
            out[i] = bits[at: at + part.numel()].tobytes()
            at += part.numel()
    return out


__all__ = ["bf16_rne", "is_bf16_rne_of", "find_derived", "find_copies"]
