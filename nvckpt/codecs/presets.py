"""The codec presets a user names (``codec="auto"`` ...): the one place they are defined.

A preset maps each tensor's dtype to a pipeline, for the engine that encodes
it: the CPU engine writes the portable codecs, the GPU engine also nvcomp-ans.
"""

from __future__ import annotations

from typing import Callable

from ..errors import UnsupportedCodecError
from ..format.dtypes import DTYPES
from .base import Pipeline
from .builtin import ByteShuffle, SignShift, Zstd
from .nvcomp.ans import NvcompAns, data_type_for
from .registry import RAW

PRESETS = ("auto", "portable", "portable-1.0", "zstd", "raw", "ans")
DESCRIPTIONS = {
    "auto": "nvcomp-ans on a GPU with nvCOMP, else portable",
    "portable": "signshift+byteshuffle+zstd (bf16, fp32), byteshuffle+zstd, zstd (1-byte types): one zstd frame "
                "per byte plane, any zstd library reads it",
    "portable-1.0": "byteshuffle+zstd as nvckpt 0.1 wrote it (one frame per chunk): readable by readers "
                    "that predate signshift",
    "zstd": "zstd of the raw bytes",
    "raw": "the bytes as they are",
    "ans": "nvCOMP ANS (GPU only, to write and to read)",
}
# What the GPU engine encodes; "raw", "zstd" and "portable" go to the CPU engine (for GPU tensors too), so a
# portable file is the same bytes whichever device held the state (nvckpt.codecs.planes).
GPU_PRESETS = ("auto", "ans")
INTEGER_DTYPES = ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")
SIGNSHIFT_DTYPES = ("bfloat16", "float32")  # measured on MiniLM: +0.013 / +0.004 of ratio; none on float16, less on float64


def gpu_only(codec: object) -> bool:
    """A preset only the GPU engine encodes ("ans")."""
    return codec == "ans"


def check_preset(codec: object) -> None:
    if not isinstance(codec, Pipeline) and codec not in PRESETS:
        raise ValueError(f"codec must be one of {PRESETS} or a Pipeline, got {codec!r}")


def portable(dtype: str | int, level: int = 1) -> Pipeline:
    """The portable pipeline of a dtype (name, or an itemsize): signshift+byteshuffle+zstd for bfloat16 and
    float32, byteshuffle+zstd for other multi-byte elements, zstd for bytes; coded one frame per byte plane."""
    itemsize = dtype if isinstance(dtype, int) else DTYPES[dtype].itemsize
    if dtype in SIGNSHIFT_DTYPES:
        return Pipeline((SignShift(itemsize), ByteShuffle(itemsize), Zstd(level)), planar=True)
    matches = dtype in INTEGER_DTYPES
    if itemsize > 1:
        return Pipeline((ByteShuffle(itemsize), Zstd(level)), planar=True, matches=matches)
    return Pipeline((Zstd(level),), planar=True, matches=matches)


def portable_v1(itemsize: int, level: int = 1) -> Pipeline:
    """byteshuffle+zstd for multi-byte elements, zstd for bytes, each chunk one frame (nvckpt 0.1's portable)."""
    if itemsize > 1:
        return Pipeline((ByteShuffle(itemsize), Zstd(level)))
    return Pipeline((Zstd(level),))


def chooser(codec: str | Pipeline, zstd_level: int = 1, *, gpu: bool = False,
            nvcomp_version: str = "") -> Callable[[str], Pipeline]:
    """dtype name -> the pipeline that encodes it, on the GPU engine (``gpu``) or the CPU engine."""
    check_preset(codec)
    if isinstance(codec, Pipeline):
        return lambda dtype: codec
    if codec == "raw":
        return lambda dtype: RAW
    if codec == "zstd":
        zstd = Pipeline((Zstd(zstd_level),))
        return lambda dtype: zstd
    if codec == "portable-1.0":
        return lambda dtype: portable_v1(DTYPES[dtype].itemsize, zstd_level)
    if codec == "portable" or (codec == "auto" and not gpu):
        cache: dict[str, Pipeline] = {}
        return lambda dtype: cache.get(dtype) or cache.setdefault(dtype, portable(dtype, zstd_level))
    if not gpu:  # "ans"
        raise UnsupportedCodecError("codec='ans' (nvcomp-ans) encodes only on a CUDA GPU with nvCOMP (pip install 'nvckpt[gpu]')")
    ans_cache: dict[str, Pipeline] = {}

    def ans(dtype: str) -> Pipeline:
        dt = data_type_for(dtype)
        if dt not in ans_cache:
            ans_cache[dt] = Pipeline((NvcompAns(dt, nvcomp_version, "raw"),))
        return ans_cache[dt]

    return ans


__all__ = ["PRESETS", "GPU_PRESETS", "gpu_only", "DESCRIPTIONS", "check_preset", "portable", "portable_v1", "chooser"]
