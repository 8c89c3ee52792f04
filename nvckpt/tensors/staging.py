"""Aligned packing of pieces into one buffer: the layout every staging copy of the GPU engines uses."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch


def align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def packed_offsets(lengths: Iterable[int], align: int) -> tuple[list[int], int]:
    """Offsets of pieces of ``lengths`` bytes laid end to end, each starting ``align``-aligned; and the total."""
    offsets, at = [], 0
    for n in lengths:
        offsets.append(at)
        at += align_up(n, align)
    return offsets, at


def is_flat_bytes(t: torch.Tensor) -> bool:
    """Is ``t`` a tensor's flat bytes (1-D, uint8, contiguous), which a byte range slices directly?"""
    return t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous()


def byte_range_views(t: torch.Tensor, start: int, length: int) -> list[torch.Tensor]:
    """Views of ``t`` (any strides) that hold, one after the other in C order, bytes [start, start + length)
    of its C-contiguous layout (``start`` and ``length`` whole elements): a chunk of a non-contiguous tensor
    copied without a contiguous copy of the whole tensor (which could be larger than the memory budget)."""
    size = t.element_size()
    if start % size or length % size:
        raise ValueError(f"bytes [{start}, {start + length}) are not whole {size}-byte elements")
    out: list[torch.Tensor] = []

    def take(v: torch.Tensor, a: int, b: int) -> None:  # elements [a, b) of v in C order
        if a >= b:
            return
        if v.dim() <= 1 or v.is_contiguous():
            out.append(v.reshape(-1)[a:b] if v.is_contiguous() else v[a:b])
            return
        row = v[0].numel()
        first, last = a // row, (b - 1) // row
        if first == last:
            take(v[first], a - first * row, b - first * row)
            return
        take(v[first], a - first * row, row)
        if last > first + 1:
            out.append(v[first + 1: last])  # whole rows: one view
        take(v[last], 0, b - last * row)

    take(t, start // size, (start + length) // size)
    return out


def stage_parts(parts: Sequence[tuple[Any, int, int]], which: Sequence[int], align: int,
                device: Any) -> list[tuple[torch.Tensor, int, int]]:
    """Copies of the byte ranges ``parts[i]`` ((tensor, start, length), for i in ``which``) packed into one new
    uint8 buffer on ``device``, each at an ``align``-aligned offset (torch's device allocations start 512-byte
    aligned, so up to 512 the addresses are too), copied on the current stream; their (buffer, offset, length).
    A part's tensor is its flat bytes (1-D uint8, contiguous) or a tensor of any strides (byte_range_views)."""
    offsets, total = packed_offsets((parts[i][2] for i in which), align)
    stage = torch.empty(total, dtype=torch.uint8, device=device)
    out = []
    for i, o in zip(which, offsets):
        base, start, n = parts[i]
        if is_flat_bytes(base):
            stage[o: o + n].copy_(base[start: start + n])
        else:
            at = o
            for v in byte_range_views(base, start, n):
                k = v.numel() * v.element_size()
                stage[at: at + k].view(v.dtype).view(v.shape).copy_(v)
                at += k
        out.append((stage, o, n))
    return out


__all__ = ["align_up", "byte_range_views", "is_flat_bytes", "packed_offsets", "stage_parts"]
