"""nvckpt verify (nvckpt.tools.verify) checks what a reader checks: the frame rules of SPEC 4.3, what the spec
rejects in a stored payload, and tensors this reader cannot build (reported, not failed)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import saved_bytes
from nvckpt.tools.verify import verify

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from conformance import craft  # noqa: E402  (the conformance suite's file crafter)

FILES = os.path.join(ROOT, "conformance", "files")


def case(cid: str) -> str:
    return os.path.join(FILES, f"{cid}.nvckpt")


@pytest.mark.parametrize("cid", ["bool-byte-2", "chunk-frame-padding-nonzero"])
def test_verify_fails_what_the_spec_rejects(cid):
    assert not verify(case(cid)).ok
    from nvckpt import cli

    assert cli.main(["verify", case(cid)]) == 1


def test_verify_reports_a_tensor_this_reader_cannot_build():
    report = verify(case("valid-unknown-dtype"))
    assert report.ok and any("not readable here" in n.message for n in report.undecoded)


def _verify_crafted(tmp_path, name, nv):
    path = tmp_path / f"{name}.nvckpt"
    path.write_bytes(craft.build(nv))
    return [str(p) for p in verify(path, workers=1).problems]


def test_verify_reports_chunk_frames_before_their_tensor_or_codec_frame(tmp_path):
    base = saved_bytes({"w": torch.arange(6, dtype=torch.float32)}, tensor_checksums=False)
    nv = craft.parse(base)
    t, c, k, i = nv.frames
    assert [f.frame_type for f in nv.frames] == [craft.TENSOR, craft.CODEC, craft.CHUNK, craft.INDEX]
    nv.frames = [c, k, t, i]
    assert any("before its TENSOR frame" in p for p in _verify_crafted(tmp_path, "a", nv))
    nv = craft.parse(base)
    t, c, k, i = nv.frames
    nv.frames = [t, k, c, i]
    assert any("before its CODEC frame" in p for p in _verify_crafted(tmp_path, "b", nv))
    for name in ("chunk-before-codec-frame", "chunk-before-tensor-frame"):  # the conformance suite's
        assert not verify(case(name), workers=1).ok


@pytest.mark.parametrize("index_pipe,frame_pipe,zstd", [
    ([{"name": "foo"}], [{"name": "bar"}], False),  # two unregistered codecs: the names differ
    ([{"name": "zstd"}], [{"name": "zstd", "configuration": {"level": 1}}], True),  # absent configuration is {}
    ([{"name": "foo", "configuration": {"a": 1}}], [{"name": "foo", "configuration": {"a": 1.0}}], False),  # int vs float
])
def test_verify_compares_codec_frames_as_spec_rule_3_says(tmp_path, index_pipe, frame_pipe, zstd):
    nv = craft.parse(saved_bytes({"w": torch.arange(6, dtype=torch.float32)}, tensor_checksums=False))
    nv.index["codecs"] = [index_pipe]
    next(f for f in nv.frames if f.frame_type == craft.CODEC).payload = craft.pack(frame_pipe)
    if zstd:
        import zstandard

        chunk = nv.chunk_frame(0, 0)
        raw = chunk.payload
        chunk.payload, chunk.raw_length = zstandard.ZstdCompressor().compress(raw), len(raw)
    problems = _verify_crafted(tmp_path, "codec", nv)
    assert any("CODEC frame for codec id 0 disagrees" in p for p in problems), problems


def test_verify_accepts_codec_frames_that_differ_only_in_bytes(tmp_path):
    assert verify(case("valid-codec-frame-same-pipeline"), workers=1).ok
    nv = craft.parse(saved_bytes({"w": torch.arange(6, dtype=torch.float32)}, tensor_checksums=False))
    nv.index["codecs"] = [[{"name": "foo", "configuration": {"a": 1, "b": [2.5]}}]]
    next(f for f in nv.frames if f.frame_type == craft.CODEC).payload = craft.pack([{"configuration": {"b": [2.5], "a": 1}, "name": "foo"}])
    assert _verify_crafted(tmp_path, "same", nv) == []


def test_unknown_codecs_of_other_names_are_not_equal():
    from nvckpt.codecs.registry import pipeline_from_json

    assert pipeline_from_json([{"name": "foo"}]) != pipeline_from_json([{"name": "bar"}])
    assert pipeline_from_json([{"name": "foo"}]) == pipeline_from_json([{"name": "foo", "configuration": {}}])
