"""Derived tensors (SPEC.md, "Derived tensors"): exact functions of another tensor.

bf16_rne: a bfloat16 tensor that is round-to-nearest-even of a float32 one,
with the NaN rule of SPEC.md.  Computed in integer arithmetic, so it gives the
same bits on every device and library (torch's own float->bf16 cast differs
between CPU and CUDA for NaN).
"""

from __future__ import annotations

import torch

BF16_RNE = "bf16_rne"
FUNCTIONS = (BF16_RNE,)

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
