"""Fresh host memory for the tensors a load fills, backed by transparent huge pages where Linux offers them.

A load writes every byte of the memory it has just allocated, and glibc maps each allocation of more
than 32 MiB anew: at 4 KiB a page that is one page fault per 4 KiB, which on virtual machines costs
more than decoding the bytes (a 47 MiB tensor filled at 1.7 GB/s, 5.6 GB/s with huge pages, on a
2-core VM).  ``madvise(MADV_HUGEPAGE)`` on the untouched range asks for 2 MiB pages instead, as numpy
does for every array of 4 MiB or more.  The advice changes no byte and no behaviour of the tensor;
where it is not available (another OS, THP set to "never", no libc) the memory is used as it is.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import torch

HUGE_FROM = 4 << 20  # numpy's threshold: below it the allocation is most likely reused heap memory
_PAGE = 4096
_MADV_HUGEPAGE = 14  # Linux, every architecture

def _libc_madvise() -> Any:
    """libc's madvise, or None where there is none to call (loading libc takes microseconds: done at import)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages behind ``t``'s memory (a CPU tensor not yet written); True if the advice was taken."""
    n = t.untyped_storage().nbytes()
    if n < HUGE_FROM or t.device.type != "cpu" or (fn := _madvise) is None:
        return False
    start = t.untyped_storage().data_ptr()
    lo, hi = (start + _PAGE - 1) & ~(_PAGE - 1), (start + n) & ~(_PAGE - 1)
    return hi > lo and fn(lo, hi - lo, _MADV_HUGEPAGE) == 0


def host_empty(nbytes: int) -> torch.Tensor:
    """``torch.empty(nbytes, dtype=uint8)`` on the host, advised to huge pages (see the module docstring)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    advise_huge_pages(out)
    return out
