"""The torch bridge both directions share: SPEC dtypes as torch dtypes (``dtypes``), a tensor's raw bytes
(``flat_bytes``), and the aligned staging of byte ranges into one buffer that the GPU engines and nvCOMP's
coders use (``staging``).  Saving (plan, engines) and loading (sessions, engines) import it; it imports
neither."""

from __future__ import annotations

import torch


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The C-contiguous raw bytes of ``t`` as a 1-D uint8 tensor (same device)."""
    data = t.contiguous()
    # Dense in C order, but a size-1 or empty dim may keep any stride (x[3:4, 2] has stride 7),
    # which view() would refuse: flatten with an explicit unit stride.
    return data.as_strided((data.numel(),), (1,)).view(torch.uint8)


__all__ = ["flat_bytes"]
