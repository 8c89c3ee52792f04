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


def stage_parts(parts: Sequence[tuple[Any, int, int]], which: Sequence[int], align: int,
                device: Any) -> list[tuple[torch.Tensor, int, int]]:
    """Copies of the byte ranges ``parts[i]`` ((tensor, start, length), for i in ``which``) packed into one new
    uint8 buffer on ``device``, each at an ``align``-aligned offset (torch's device allocations start 512-byte
    aligned, so up to 512 the addresses are too), copied on the current stream; their (buffer, offset, length)."""
    offsets, total = packed_offsets((parts[i][2] for i in which), align)
    stage = torch.empty(total, dtype=torch.uint8, device=device)
    out = []
    for i, o in zip(which, offsets):
        base, start, n = parts[i]
        stage[o: o + n].copy_(base[start: start + n])
        out.append((stage, o, n))
    return out


__all__ = ["align_up", "packed_offsets", "stage_parts"]
