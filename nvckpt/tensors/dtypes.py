"""The SPEC 10 dtypes as torch dtypes (the torch side of nvckpt.format.dtypes)."""

from __future__ import annotations

import torch

from ..errors import FormatError, UnsupportedObjectError
from ..format.dtypes import DTYPES

# Only the dtypes this torch build has (older builds lack some fp8 types).
TORCH_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in DTYPES if isinstance(getattr(torch, n, None), torch.dtype)
}
_BY_TORCH = {d: n for n, d in TORCH_DTYPES.items()}


def name_of(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedObjectError(
            f"dtype {dtype} has no fixed-width byte layout in nvckpt (supported: {', '.join(DTYPES)})"
        ) from None


def to_torch(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise FormatError(f"dtype {name!r} is not available in torch {torch.__version__}") from None


__all__ = ["TORCH_DTYPES", "name_of", "to_torch"]
