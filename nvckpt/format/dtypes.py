"""Element types: the dtype names of SPEC.md 10 and their sizes (torch forms: nvckpt.tensors.dtypes)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import FormatError, UnsupportedFeatureError


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


def from_name(name: object) -> DType:
    if not isinstance(name, str):
        raise FormatError(f"dtype must be a string, got {name!r:.80}")
    if name not in DTYPES:
        raise UnsupportedFeatureError(f"unknown dtype {name!r:.80} (this reader knows {', '.join(DTYPES)})")
    return DTYPES[name]


def unknown(name: str) -> DType:
    """Stand-in for a dtype this reader does not know (SPEC 10: the error comes when the tensor is read)."""
    return DType(name, 0, False)
