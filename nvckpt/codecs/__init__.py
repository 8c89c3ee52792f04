"""Codecs (SPEC 11): steps, pipelines, the registry and the presets users name.

Importing this package loads neither numpy nor zstandard nor nvCOMP: each is
imported by the step that first needs it.
"""

from .base import Codec, DeviceOp, Pipeline
from .builtin import ByteShuffle, Raw, SignShift, Zstd
from .nvcomp.ans import NvcompAns
from .presets import PRESETS, chooser, portable
from .registry import RAW, REGISTRY, pipeline_from_json

__all__ = ["Codec", "DeviceOp", "Pipeline", "Raw", "Zstd", "ByteShuffle", "SignShift", "NvcompAns", "REGISTRY", "RAW",
           "pipeline_from_json", "portable", "chooser", "PRESETS"]
