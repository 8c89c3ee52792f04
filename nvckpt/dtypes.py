"""Element types: the dtype names of SPEC.md and their torch and numpy forms."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import FormatError, UnsupportedFeatureError, UnsupportedObjectError


@dataclass(frozen=True)
class DType:
    name: str  # as written in the index
    itemsize: int
    is_float: bool  # IEEE-like floating point: byteshuffle and ANS float modes apply


def _table() -> dict[str, DType]:
    floats = {
        "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
        "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
        "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    }
    others = {
        "complex32": 4, "complex64": 8, "complex128": 16,
        "int8": 1, "int16": 2, "int32": 4, "int64": 8,
        "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
        "bool": 1,
    }
    table = {n: DType(n, s, True) for n, s in floats.items()}
    table.update({n: DType(n, s, False) for n, s in others.items()})
    return table


DTYPES: dict[str, DType] = _table()

# Only the dtypes this torch build has (older builds lack some fp8 types).
TORCH_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in DTYPES if isinstance(getattr(torch, n, None), torch.dtype)
}
_BY_TORCH = {d: n for n, d in TORCH_DTYPES.items()}


def from_name(name: object) -> DType:
    if not isinstance(name, str):
        raise FormatError(f"dtype must be a string, got {name!r:.80}")
    if name not in DTYPES:
        raise UnsupportedFeatureError(f"unknown dtype {name!r:.80} (this reader knows {', '.join(DTYPES)})")
    return DTYPES[name]


def name_of(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedObjectError(
            f"dtype {dtype} has no fixed-width byte layout in nvckpt "
            f"(supported: {', '.join(DTYPES)})"
        ) from None


def to_torch(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise FormatError(f"dtype {name!r} is not available in torch {torch.__version__}") from None
