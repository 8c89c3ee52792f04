"""The writer's rules of SPEC.md that nvckpt follows (SPEC 1, 11.4, 18.1)."""

from __future__ import annotations

import io
import os

import pytest
import torch
import zstandard

import nvckpt
from nvckpt.codecs.builtin import MAX_ZSTD_WINDOW, Zstd, zstd_window_sizes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_writer_refuses_two_nan_keys():
    """SPEC 1: every NaN is the same key; a Python dict can hold two, a file may not."""
    with pytest.raises(nvckpt.UnsupportedObjectError, match="NaN"):
        nvckpt.save({float("nan"): 1, float("nan"): 2}, io.BytesIO())
    buf = io.BytesIO()
    nvckpt.save({float("nan"): 1, "t": torch.ones(2)}, buf)  # one NaN key is fine
    buf.seek(0)
    assert len(nvckpt.load(buf)) == 2


@pytest.mark.parametrize("level", [1, 3, 19])
@pytest.mark.parametrize("size", [1, 4096, 1 << 20])
def test_zstd_frames_obey_the_window_bound(level, size):
    """SPEC 11.4: nvckpt writes one frame whose window is at most the chunk (single-segment when it fits)."""
    data = memoryview(bytes(range(256)) * (size // 256) + bytes(size % 256))
    out = Zstd(level).encode(data)
    (window,) = zstd_window_sizes(out)
    assert window == zstandard.get_frame_parameters(out).window_size
    assert 0 < window <= size <= MAX_ZSTD_WINDOW


def test_zstd_decoder_refuses_a_window_over_the_bound():
    raw = bytes(1000)
    frame = bytearray(zstandard.ZstdCompressor(write_content_size=False).compress(raw))
    frame[5] = 14 << 3  # Window_Size 2^24: the limit, accepted
    assert bytes(Zstd().decode(memoryview(bytes(frame)), len(raw))) == raw
    frame[5] = 15 << 3  # 2^25
    with pytest.raises(ValueError, match="window"):
        Zstd().decode(memoryview(bytes(frame)), len(raw))


def test_spec_writer_rule_allows_the_typed_tree_bit():
    """SPEC 18.1's writer rule agrees with section 3: a writer sets feature bit 1 (a typed tree, format 1.1)."""
    with open(os.path.join(ROOT, "SPEC.md"), encoding="utf-8") as f:
        spec = f.read()
    writer = spec[spec.index("### 18.1 Writer"): spec.index("### 18.2")]
    assert "MUST NOT set feature bits" not in writer and "bit 1" in writer and "1.1" in writer
    assert "a file shorter\nthan 24 bytes is `TruncatedError`, and" not in spec
