"""nvcomp-ans: nvCOMP's ANS coder (RAW bitstream, one chunk per stream).

The bitstream is proprietary and undocumented, has no CPU decoder, and changed
in nvCOMP 6.0, so the configuration records the nvCOMP version that wrote it.
Only nvCOMP on a CUDA GPU decodes it; the GPU engines do that in batches
(nvckpt.codecs.nvcomp.device).  This class is the codec-table entry.
"""

from __future__ import annotations

import re
from typing import Any

from ...errors import UnsupportedCodecError
from ..base import Codec

# nvCOMP ANS data-type modes (SPEC 11.6) and the element size each reads.
ITEMSIZE = {"<f2": 2, "<f4": 4, "|f1": 1, "|u1": 1}
DATA_TYPES = tuple(ITEMSIZE)


def data_type_for(dtype_name: str) -> str:
    """The ANS data-type mode a writer uses for a SPEC 10 dtype (the float modes beat bytes by 15-20 %)."""
    if dtype_name in ("bfloat16", "float16", "complex32"):
        return "<f2"
    if dtype_name in ("float32", "complex64"):
        return "<f4"
    if dtype_name == "float8_e4m3fn":
        return "|f1"
    return "|u1"
_VERSION = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+")  # SPEC 11.6: ASCII digits only (re's \d would take others)


class NvcompAns(Codec):
    name = "nvcomp-ans"
    readers = "nvCOMP (nvidia-nvcomp-cu12) on a CUDA GPU"
    needs_gpu = True

    def __init__(self, data_type: str = "|u1", nvcomp_version: str = "", bitstream: str = "raw") -> None:
        if data_type not in DATA_TYPES:
            raise ValueError(f"nvcomp-ans data_type must be one of {DATA_TYPES}, got {data_type!r}")
        if not isinstance(nvcomp_version, str):
            raise ValueError(f"nvcomp-ans nvcomp_version must be a string, got {nvcomp_version!r}")
        if bitstream != "raw":
            raise ValueError(f"nvcomp-ans bitstream must be 'raw', got {bitstream!r}")
        self.data_type = data_type
        self.nvcomp_version = nvcomp_version
        self.bitstream = bitstream

    def configuration(self) -> dict[str, Any]:
        return {"data_type": self.data_type, "nvcomp_version": self.nvcomp_version, "bitstream": self.bitstream}

    @classmethod
    def from_configuration(cls, configuration: dict[str, Any]) -> "NvcompAns":
        keys = {"data_type", "nvcomp_version", "bitstream"}
        if set(configuration) != keys:
            raise ValueError(f"nvcomp-ans configuration needs exactly {sorted(keys)}, got {sorted(configuration)}")
        version = configuration["nvcomp_version"]
        if not isinstance(version, str) or not _VERSION.fullmatch(version):
            raise ValueError(f"nvcomp-ans nvcomp_version must be 'MAJOR.MINOR.PATCH' (SPEC 11.6), got {version!r:.40}")
        return cls(**configuration)

    def device_step(self) -> dict[str, Any]:
        return {"algorithm": "ans", "data_type": self.data_type, "written_by": self.nvcomp_version}

    def encode(self, data: memoryview) -> bytes:
        raise UnsupportedCodecError("nvcomp-ans encodes only on a CUDA GPU with nvCOMP (use the GPU engine)")

    def decode(self, data: memoryview, raw_length: int) -> bytes:
        raise UnsupportedCodecError(
            f"chunk is coded with nvcomp-ans (nvCOMP {self.nvcomp_version or '?'}, data type {self.data_type}), "
            f"which only {self.readers} decodes: load it with device='cuda' where nvCOMP is installed "
            "(pip install 'nvckpt[gpu]'), or convert it there with `nvckpt convert --codec portable`"
        )
