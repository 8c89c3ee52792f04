"""Aligned packing of pieces into one buffer: the layout every staging copy of the GPU engines uses."""

from __future__ import annotations

from typing import Iterable


def align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def packed_offsets(lengths: Iterable[int], align: int) -> tuple[list[int], int]:
    """Offsets of pieces of ``lengths`` bytes laid end to end, each starting ``align``-aligned; and the total."""
    offsets, at = [], 0
    for n in lengths:
        offsets.append(at)
        at += align_up(n, align)
    return offsets, at


__all__ = ["align_up", "packed_offsets"]
