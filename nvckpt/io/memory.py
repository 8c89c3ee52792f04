"""Host memory that a load writes into.

A freshly allocated page costs a page fault on its first write, and a fault taken inside the kernel
(a ``pread`` into the page) costs more than one taken by a write from user space.  On a VM each fault is
slow: reading from the page cache into new memory ran at ~1.1 GB/s here, into memory already
touched at ~6 GB/s.  So a load's destination is allocated with transparent huge pages advised
(Linux, ``madvise(MADV_HUGEPAGE)``: one fault per 2 MiB instead of per 4 KiB, where the system
allows them) and each chunk's range is touched from user space just before the chunk is read or
decoded into it (``prefault``), on the decode thread that fills it.  Both are hints: where
``madvise`` is missing or refused, memory is ordinary memory.  ``NVCKPT_HUGE_PAGES=0`` turns the
advice off (on a host where huge pages are scarce, for example).
"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import torch

PAGE = 4096
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux, every architecture
_MIN_ADVISED = 2 * HUGE_PAGE  # smaller allocations rarely hold an aligned 2 MiB range


def _madvise() -> "ctypes._CFuncPtr | None":
    if not sys.platform.startswith("linux") or os.environ.get("NVCKPT_HUGE_PAGES", "1") == "0":
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def advise_huge_pages(ptr: int, nbytes: int) -> bool:
    """Ask for huge pages on the 2 MiB-aligned part of [ptr, ptr + nbytes); True if the OS took the hint."""
    if _MADVISE is None or nbytes < _MIN_ADVISED:
        return False
    lo = (ptr + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    hi = (ptr + nbytes) & ~(HUGE_PAGE - 1)
    return hi > lo and _MADVISE(lo, hi - lo, MADV_HUGEPAGE) == 0


def host_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uninitialised uint8 host memory, huge pages advised (a load's destination)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    advise_huge_pages(out.data_ptr(), nbytes)
    return out


def prefault(array: np.ndarray) -> None:
    """Touch every page of ``array`` (uint8, 1-D, about to be overwritten) from user space, so the read or
    decode that fills it does not fault page by page."""
    if array.nbytes >= PAGE:
        array[::PAGE] = 0
        array[-1] = 0
