"""nvckpt's codecs against the codec contract (nvckpt.testing.codecs), in every pipeline the presets make."""

from __future__ import annotations

from nvckpt.codecs.base import Pipeline
from nvckpt.codecs.builtin import ByteShuffle, Raw, SignShift, Zstd
from nvckpt.codecs.nvcomp.ans import NvcompAns
from nvckpt.codecs.presets import chooser, portable, portable_v1
from nvckpt.format.dtypes import DTYPES
from nvckpt.testing.codecs import CodecTests


class TestBuiltinCodecs(CodecTests):
    def pipelines(self):
        return [Pipeline((Raw(),)), Pipeline((Zstd(1),)), Pipeline((Zstd(19),)), Pipeline((Zstd(-5),)),
                Pipeline((ByteShuffle(2), Zstd(1))), Pipeline((ByteShuffle(4), Zstd(1))),
                Pipeline((SignShift(2), ByteShuffle(2), Zstd(1))), Pipeline((SignShift(4), ByteShuffle(4), Zstd(1)))]


class TestPresets(CodecTests):
    """Every pipeline a preset chooses for a dtype, on the CPU engine (the planar ones take the byte-plane path)."""

    def pipelines(self):
        out = {portable(d) for d in DTYPES} | {portable_v1(DTYPES[d].itemsize) for d in DTYPES}
        for preset in ("zstd", "raw"):
            out |= {chooser(preset)(d) for d in DTYPES}
        return sorted(out, key=Pipeline.describe)


class TestNvcompAns(CodecTests):
    """No host decoder: its configuration and device route here, its round trip on a GPU (tests/test_gpu.py)."""

    def pipelines(self):
        return [Pipeline((NvcompAns(dt, "6.0.0", "raw"),)) for dt in ("<f2", "<f4", "|u1")]
