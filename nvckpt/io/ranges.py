"""The one coalescing policy: which stored ranges one read covers.

A reader wants the stored bytes of some chunks (sorted by offset).  Reading
each alone costs a call (a syscall on a local file, a request on an object
store); reading neighbours together costs the bytes between them.  ``Coalescing``
says how far apart two ranges may be and still share a read, how large one read
may grow, from which size a range is read on its own (straight into its
destination, no byte outside it read), and how reads are aligned (O_DIRECT).
Each byte source says what suits its medium (``ByteSource.coalescing``); a
reader adapts it to its buffers (``with_``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

_NO_LIMIT = 1 << 62


@dataclass(frozen=True)
class Coalescing:
    """How ranges are grouped into reads (see the module docstring)."""

    max_gap: int  # bytes between two ranges that one read may still cover
    max_span: int  # bytes one read covers at most (a range larger than this is read alone)
    alone_from: int = _NO_LIMIT  # a range of at least this many bytes is read on its own
    max_ranges: int = _NO_LIMIT  # ranges one read covers at most
    align: int = 1  # a read starts and ends at multiples of this (O_DIRECT: 4096)
    # a whole load reads a tensor's chunks in these groups too, not chunk by chunk (an object store, where
    # each read is a request)
    whole_loads: bool = False
    load_span: int = _NO_LIMIT  # a whole load's runs of chunks cover at most this (its read-ahead's buffers)

    def with_(self, **changes: int) -> "Coalescing":
        return dataclasses.replace(self, **changes)


#: A local file: a read costs a syscall (~1-2 us), so only what lies within a frame header and its padding
#: of the last range is worth covering; a large chunk is read alone, straight into its destination.
LOCAL = Coalescing(max_gap=8 << 10, max_span=8 << 20, alone_from=16 << 10, max_ranges=1 << 14)


@dataclass
class Read:
    """One read [start, start + length) covering ranges ``first`` .. ``stop - 1`` of the caller's list."""

    start: int
    length: int
    first: int
    stop: int

    @property
    def members(self) -> range:
        return range(self.first, self.stop)


def coalesce(offsets: Sequence[int], lengths: Sequence[int], policy: Coalescing) -> list[Read]:
    """Group ranges (``offsets[i]``, ``lengths[i]``), in the caller's order, into reads.

    Consecutive ranges share a read while the next starts at or after the
    previous one's end, the gap between them is at most ``max_gap``, the read
    (aligned) stays within ``max_span`` bytes and ``max_ranges`` ranges, and
    neither is ``alone_from`` bytes or more.  A range that starts before the
    previous one ends (a tensor whose chunks are not in file order) starts a
    new read."""
    reads: list[Read] = []
    align = policy.align
    cur: Read | None = None
    prev_end = 0
    prev_alone = True
    for i, (o, n) in enumerate(zip(offsets, lengths)):
        lo = o - o % align
        hi = -(-(o + n) // align) * align
        alone = n >= policy.alone_from
        if (cur is not None and not alone and not prev_alone and 0 <= o - prev_end <= policy.max_gap
                and hi - cur.start <= policy.max_span and i - cur.first < policy.max_ranges):
            cur.length = max(cur.length, hi - cur.start)
            cur.stop = i + 1
        else:
            cur = Read(lo, hi - lo, i, i + 1)
            reads.append(cur)
        prev_end, prev_alone = o + n, alone
    return reads


__all__ = ["Coalescing", "LOCAL", "Read", "coalesce"]
