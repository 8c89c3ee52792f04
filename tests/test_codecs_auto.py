"""codec="auto" on CPU: ratio on real bf16 weights, real round trips, raw fallback, what it picks."""

from __future__ import annotations

import io

import pytest
import torch

import nvckpt
from conftest import assert_tree_equal, small_training_state


def codec_of_chunks(data: bytes, name: str) -> list[list[dict]]:
    with nvckpt.open(io.BytesIO(data)) as ck:
        entry = ck.index.tensors[ck.index.paths[name]]
        return [ck.file.pipelines[c.codec_id].to_json() for c in entry.chunks]


@pytest.mark.slow
def test_minilm_bf16_ratio(tmp_path, minilm_state):
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in minilm_state.items()}
    assert sum(v.dtype == torch.bfloat16 for v in state.values()) == 103  # all but position_ids (int64)
    raw = sum(v.numel() * v.element_size() for v in state.values())
    path = tmp_path / "minilm-bf16.nvckpt"
    result = nvckpt.save(state, path, codec="auto")
    size = path.stat().st_size
    assert result.file_bytes == size and result.raw_bytes == raw
    ratio = raw / size
    print(f"MiniLM bf16: {raw} raw bytes -> {size} file bytes, ratio {ratio:.3f} ({result.seconds:.2f} s)")
    assert size <= raw / 1.40, f"ratio {ratio:.3f} < 1.40"
    assert_tree_equal(nvckpt.load(path), state)


@pytest.mark.slow
def test_minilm_fp32_round_trip(tmp_path, minilm_state):
    path = tmp_path / "minilm.nvckpt"
    result = nvckpt.save(minilm_state, path)
    print(f"MiniLM fp32: ratio {result.ratio:.3f}")
    assert result.raw_bytes == sum(v.numel() * v.element_size() for v in minilm_state.values())
    assert sum(v.numel() for v in minilm_state.values()) > 22_000_000
    back = nvckpt.load(path)
    assert list(back) == list(minilm_state)
    assert_tree_equal(back, minilm_state)


@pytest.mark.parametrize("codec", ["auto", "raw", "zstd"])
def test_adamw_training_state_round_trip(tmp_path, codec):
    state = small_training_state(steps=4)
    assert state["optimizer"]["state"][0]["step"].shape == ()  # AdamW keeps 0-d step tensors
    path = tmp_path / "train.nvckpt"
    nvckpt.save(state, path, codec=codec, chunk_size=4096)
    back = nvckpt.load(path)
    assert_tree_equal(back, state)
    assert back["model"]["head.weight"] is back["model"]["embed.weight"]
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_incompressible_chunks_are_stored_raw():
    gen = torch.Generator().manual_seed(4)
    noise = torch.randint(0, 256, (64 << 10,), dtype=torch.uint8, generator=gen)
    noise_f32 = torch.randint(-(2**31), 2**31 - 1, (16 << 10,), dtype=torch.int32, generator=gen).view(torch.float32)
    zeros = torch.zeros(16 << 10)
    state = {"noise": noise, "noise_f32": noise_f32, "zeros": zeros}
    for codec in ("auto", "zstd", "portable"):
        stream = io.BytesIO()
        nvckpt.save(state, stream, codec=codec, chunk_size=16 << 10)
        data = stream.getvalue()
        raw = [{"name": "raw", "configuration": {}}]
        assert codec_of_chunks(data, "noise") == [raw] * 4
        assert codec_of_chunks(data, "noise_f32") == [raw] * 4
        assert all(c != raw for c in codec_of_chunks(data, "zeros"))
        with nvckpt.open(io.BytesIO(data)) as ck:
            for name in ("noise", "noise_f32"):
                entry = ck.index.tensors[ck.index.paths[name]]
                assert all(c.stored_length == c.raw_length for c in entry.chunks)
            entry = ck.index.tensors[ck.index.paths["zeros"]]
            assert entry.stored_bytes < entry.nbytes / 100
        assert_tree_equal(nvckpt.load(io.BytesIO(data)), state)


def test_auto_picks_byteshuffle_zstd_for_floats_and_zstd_for_bytes():
    """auto on CPU = portable: signshift+byteshuffle+zstd for bf16/fp32, byteshuffle+zstd for other floats,
    plain zstd for 1-byte types."""
    state = {
        "bf16": torch.randn(4096).to(torch.bfloat16), "f32": torch.randn(4096), "f64": torch.randn(4096, dtype=torch.float64),
        "u8": torch.arange(4096) % 7 == 0, "i8": (torch.arange(4096) % 5).to(torch.int8),
    }
    stream = io.BytesIO()
    nvckpt.save(state, stream, codec="auto")
    data = stream.getvalue()
    for name, size in (("bf16", 2), ("f32", 4), ("f64", 8)):
        shift = [{"name": "signshift", "configuration": {"elementsize": size}}] if size < 8 else []
        assert codec_of_chunks(data, name)[0] == shift + [
            {"name": "byteshuffle", "configuration": {"elementsize": size}}, {"name": "zstd", "configuration": {"level": 1}}]
    for name in ("u8", "i8"):
        assert codec_of_chunks(data, name)[0] == [{"name": "zstd", "configuration": {"level": 1}}]


def test_byteshuffle_helps_bf16():
    """The reason for the filter: on real-ish bf16 weights it beats zstd alone."""
    w = (torch.randn(256, 256) * 0.02).to(torch.bfloat16)
    auto = nvckpt.save({"w": w}, io.BytesIO(), codec="auto").file_bytes
    zstd = nvckpt.save({"w": w}, io.BytesIO(), codec="zstd").file_bytes
    assert auto < zstd


def test_explicit_pipeline_and_levels():
    from nvckpt.codecs import ByteShuffle, Pipeline, Zstd

    w = torch.randn(512, 64)
    stream = io.BytesIO()
    nvckpt.save({"w": w}, stream, codec=Pipeline((ByteShuffle(4), Zstd(9))), chunk_size=8192)
    assert codec_of_chunks(stream.getvalue(), "w")[0] == [
        {"name": "byteshuffle", "configuration": {"elementsize": 4}}, {"name": "zstd", "configuration": {"level": 9}}]
    stream.seek(0)
    assert_tree_equal(nvckpt.load(stream), {"w": w})
    stream = io.BytesIO()
    nvckpt.save({"w": w}, stream, codec="zstd", zstd_level=7)
    assert codec_of_chunks(stream.getvalue(), "w")[0] == [{"name": "zstd", "configuration": {"level": 7}}]


def test_ans_codec_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: ans is tested in the GPU tests")
    with pytest.raises(nvckpt.UnsupportedCodecError, match="nvCOMP"):
        nvckpt.save({"w": torch.randn(10)}, io.BytesIO(), codec="ans")
