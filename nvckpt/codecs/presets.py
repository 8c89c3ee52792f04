"""The codec presets a user names (``codec="auto"`` ...): the one place they are defined.

A preset maps each tensor's dtype to a pipeline, for the engine that encodes
it: the CPU engine writes the portable codecs, the GPU engine also nvcomp-ans.
"""

from __future__ import annotations

from typing import Callable

from ..errors import UnsupportedCodecError
from ..format.dtypes import DTYPES
from .base import Pipeline
from .builtin import ByteShuffle, Zstd
from .nvcomp.ans import NvcompAns, data_type_for
from .registry import RAW

PRESETS = ("auto", "portable", "zstd", "raw", "ans")
DESCRIPTIONS = {
    "auto": "nvcomp-ans on a GPU with nvCOMP, else portable",
    "portable": "byteshuffle+zstd (zstd for 1-byte types): any zstd library reads it",
    "zstd": "zstd of the raw bytes",
    "raw": "the bytes as they are",
    "ans": "nvCOMP ANS (GPU only, to write and to read)",
}
GPU_PRESETS = ("auto", "ans", "portable")  # what the GPU engine encodes; "raw"/"zstd" go to the CPU engine


def check_preset(codec: object) -> None:
    if not isinstance(codec, Pipeline) and codec not in PRESETS:
        raise ValueError(f"codec must be one of {PRESETS} or a Pipeline, got {codec!r}")


def portable(itemsize: int, level: int = 1) -> Pipeline:
    """byteshuffle+zstd for multi-byte elements, zstd for bytes: any zstd library reads it."""
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
    if codec == "portable" or (codec == "auto" and not gpu):
        return lambda dtype: portable(DTYPES[dtype].itemsize, zstd_level)
    if not gpu:  # "ans"
        raise UnsupportedCodecError("codec='ans' (nvcomp-ans) encodes only on a CUDA GPU with nvCOMP (pip install 'nvckpt[gpu]')")
    cache: dict[str, Pipeline] = {}

    def ans(dtype: str) -> Pipeline:
        dt = data_type_for(dtype)
        if dt not in cache:
            cache[dt] = Pipeline((NvcompAns(dt, nvcomp_version, "raw"),))
        return cache[dt]

    return ans


__all__ = ["PRESETS", "GPU_PRESETS", "DESCRIPTIONS", "check_preset", "portable", "chooser"]
