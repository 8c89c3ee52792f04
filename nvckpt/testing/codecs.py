"""Contract tests for codecs (nvckpt.codecs): every pipeline a codec takes part in runs them.

Subclass ``CodecTests`` and give ``pipelines()``; the tests check what a codec
promises the rest of nvckpt (SPEC 11): its configuration survives the codec
table (JSON, the registry), its host coder round-trips bytes exactly and
refuses a wrong raw length, its byte-plane fast path (if any) agrees with its
steps, what it writes passes its own ``check_stored``, and its device route is
one a GPU loader follows.  A codec with no host decoder (nvcomp-ans) is
round-tripped on a GPU only (``tests/test_gpu.py``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from ..codecs.base import HOST_ROUTE, RAW_ROUTE, DeviceOp, Pipeline
from ..codecs.registry import pipeline_from_json


def sample_bytes() -> list[bytes]:
    """Chunks a codec meets: empty, tiny, structured floats (bf16 and fp32 of smooth values, as trained weights
    are: a narrow exponent range), runs of zeros, and text."""
    x = np.linspace(-3.0, 3.0, 40_000, dtype=np.float32) * np.cos(np.arange(40_000, dtype=np.float32) / 7.0)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
    return [b"", bytes(8), x.tobytes(), bf16.tobytes(), bytes(65_536), ("nvckpt " * 5000).encode()[:32_768]]


class CodecTests:
    """The codec contract (see the module docstring)."""

    def pipelines(self) -> list[Pipeline]:
        """The pipelines under test: override in the subclass (a fixture)."""
        raise NotImplementedError

    @staticmethod
    def _fits(p: Pipeline, data: bytes) -> bytes:
        """``data`` cut to a whole number of the pipeline's elements (byteshuffle(k) needs that)."""
        k = max([getattr(s, "elementsize", 1) for s in p.steps] + [1])
        return data[: len(data) - len(data) % k]

    def test_configuration_survives_the_codec_table(self) -> None:
        for p in self.pipelines():
            again = pipeline_from_json(json.loads(json.dumps(p.to_json())))
            assert again == p and hash(again) == hash(p), p.describe()

    def test_host_round_trip_is_exact(self) -> None:
        for p in self.pipelines():
            if p.needs_gpu:
                continue
            for raw in map(lambda d: self._fits(p, d), sample_bytes()):
                stored = bytes(memoryview(p.encode(memoryview(raw))).cast("B"))
                assert bytes(memoryview(p.decode(memoryview(stored), len(raw))).cast("B")) == raw, p.describe()
                out = np.empty(len(raw), dtype=np.uint8)
                p.decode_into(stored, out)
                assert out.tobytes() == raw, p.describe()

    def test_byte_plane_path_agrees_with_the_steps(self) -> None:
        for p in self.pipelines():
            if p.needs_gpu or p.encode_bound(1) is None:
                continue
            for raw in map(lambda d: self._fits(p, d), sample_bytes()):
                if not raw:
                    continue
                out = np.empty(p.encode_bound(len(raw)), dtype=np.uint8)
                n = p.encode_into(raw, out)
                stored = out[:n].tobytes()
                assert bytes(memoryview(p.decode(memoryview(stored), len(raw))).cast("B")) == raw, p.describe()

    def test_a_wrong_raw_length_is_refused(self) -> None:
        for p in self.pipelines():
            if p.needs_gpu or p.is_raw:
                continue
            raw = self._fits(p, sample_bytes()[2])
            stored = bytes(memoryview(p.encode(memoryview(raw))).cast("B"))
            k = max([getattr(s, "elementsize", 1) for s in p.steps] + [1])
            try:
                got = memoryview(p.decode(memoryview(stored), len(raw) + k)).cast("B")
            except Exception:  # noqa: BLE001 - each decoder names its own error: any refusal is right
                continue
            pytest.fail(f"{p.describe()} decoded the stream of {len(raw)} bytes as {got.nbytes} bytes instead of "
                        "refusing a raw length it does not hold")

    def test_what_it_writes_passes_its_own_check(self) -> None:
        for p in self.pipelines():
            if p.needs_gpu:
                continue
            stored = memoryview(p.encode(memoryview(self._fits(p, sample_bytes()[2])))).cast("B")
            p.check_stored(stored)

    def test_device_route_is_one_a_loader_follows(self) -> None:
        for p in self.pipelines():
            for opt_in in (False, True):
                route: Any = p.device_route(opt_in)
                assert (route in (RAW_ROUTE, HOST_ROUTE) or isinstance(route, DeviceOp)
                        or (isinstance(route, tuple) and route[0] == "planes" and route[1] >= 1)), (p.describe(), route)
                if p.needs_gpu:
                    assert isinstance(route, DeviceOp), "a codec without a host decoder must have a device form"


__all__ = ["CodecTests", "sample_bytes"]
