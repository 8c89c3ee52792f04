"""nvckpt recover: truncated and damaged files give back exactly their complete tensors.

The expected result of every cut is computed here from the frames of the intact
file (SPEC.md 7: a tensor is complete when its TENSOR frame and all its CHUNK
frames lie before the cut, and a view's base or a derived tensor's source is
complete), independently of the recovery code.
"""

from __future__ import annotations

import io
import os
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch

import nvckpt
from conftest import assert_tensor_equal, assert_tree_equal, saved_bytes
from nvckpt.cli import EXIT_OK, EXIT_PROBLEMS, main
from nvckpt.codecs import NvcompAns, Pipeline, portable
from nvckpt.format.constants import FOOTER_SIZE, FRAME_CHUNK, FRAME_HEADER_SIZE, FRAME_INDEX, FRAME_TENSOR, PREAMBLE_SIZE
from nvckpt.engines.cpu import encode_cpu
from nvckpt.engines.items import EncodedChunk
from nvckpt.format.frames import iter_frames
from nvckpt.io.source import LocalFile
from nvckpt.plan.walk import plan_save
from nvckpt.session.save import write_items
from nvckpt.tools.recover import LOST, RECOVERED_FROM, recover
from nvckpt.tools.verify import verify

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from conformance import craft  # noqa: E402  (the conformance suite's file crafter)
from nvckpt.read.reader import ChunkReader  # noqa: E402
from test_cli import run  # noqa: E402

METADATA = {"run": "r1", "step": 12}


def recover_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 16, generator=g)
    flat = torch.randn(300, generator=g)
    return {
        "model": {"embed": w, "head": w, "norm": torch.randn(16, generator=g).bfloat16(),
                  "q": flat[:64].view(8, 8), "k": flat[100:164].view(8, 8)},
        "master": {"w16": w.bfloat16()},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(40, 16, generator=g), "step": torch.tensor(5.0)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "ids": torch.arange(50),
        "empty": torch.zeros(0, 3),
        "odd/name~": torch.ones(2, dtype=torch.float16),
        "step": 12,
    }


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("recover") / "original.nvckpt")
    # small chunks (many frames), alignment 256 (some payloads padded), a derived bf16 tensor, views, ties
    nvckpt.save(recover_state(), path, metadata=METADATA, chunk_size=256, alignment=256, derive_bf16=True)
    return path


def frames_of(path: str) -> list[tuple[int, int, Any]]:
    """(start, end, header) of every frame of an intact file."""
    source = LocalFile(path)
    try:
        return [(o, o + h.payload_skip + h.stored_length, h) for o, h in iter_frames(source)]
    finally:
        source.close()


def expected_at(path: str, cut: int) -> tuple[set[str], set[str]]:
    """(complete, announced-but-incomplete) non-internal tensor names of ``path`` cut at ``cut`` bytes."""
    with nvckpt.open(path) as ck:
        entries = ck.index.tensors
    ends: dict[int, list[int]] = {}
    announced: set[int] = set()
    for start, end, h in frames_of(path):
        if h.frame_type in (FRAME_TENSOR, FRAME_CHUNK):
            ends.setdefault(h.tensor_id, []).append(end)
            if h.frame_type == FRAME_TENSOR and end <= cut:
                announced.add(h.tensor_id)

    def complete(tid: int) -> bool:
        e = entries[tid]
        if any(end > cut for end in ends[tid]):
            return False
        if e.view is not None:
            return complete(e.view["base"])
        if e.derived is not None:
            return complete(e.derived["source"])
        return True

    named = [e for e in entries if not e.internal]
    done = {e.name for e in named if complete(e.tensor_id)}
    return done, {e.name for e in named if e.tensor_id in announced} - done


def cut_points(path: str) -> list[int]:
    """Every frame boundary, a point inside every frame header and payload, and inside the footer."""
    size = os.path.getsize(path)
    points = {PREAMBLE_SIZE, size - FOOTER_SIZE, size - FOOTER_SIZE // 2}
    for start, end, h in frames_of(path):
        points |= {start, start + FRAME_HEADER_SIZE // 2, start + h.payload_skip + max(1, h.stored_length // 2), end}
    return sorted(points)


def check_recovered(out: str, original: str, names: set[str]) -> None:
    """``out`` is a valid file holding exactly ``names``, bit for bit as in ``original``."""
    report = verify(out)
    assert report.ok, [str(p) for p in report.problems]
    with nvckpt.open(out) as got, nvckpt.open(original) as want:
        assert {e.name for e in got.index.tensors if not e.internal} == names  # (an intact index also restores alias paths)
        for name in names:
            assert_tensor_equal(got.get_tensor(name), want.get_tensor(name), name)
    nvckpt.load(out)


@pytest.mark.slow
def test_recover_every_cut(original, tmp_path):
    data = Path(original).read_bytes()
    points = cut_points(original)
    assert len(points) > 100
    index_end = next(end for _, end, h in frames_of(original) if h.frame_type == FRAME_INDEX)
    cut_file, out = tmp_path / "cut.nvckpt", str(tmp_path / "out.nvckpt")
    seen_partial = 0
    for cut in points:
        cut_file.write_bytes(data[:cut])
        report = recover(cut_file, out)
        complete, lost = expected_at(original, cut)
        assert set(report.recovered) == complete, cut
        assert set(report.lost) == lost, cut
        check_recovered(out, original, complete)
        if cut >= index_end:  # only the footer is cut off: the index is intact, nothing is lost
            assert report.complete and report.tree_kept
            assert "footer is missing or damaged" in (report.footer_problem or ""), cut  # but it is said
            assert_tree_equal(nvckpt.load(out), nvckpt.load(original))
            continue
        assert not report.complete and not report.index_found
        assert report.stopped_at is not None and report.stopped_at <= cut
        with nvckpt.open(out) as ck:
            assert ck.metadata() == {RECOVERED_FROM: os.path.abspath(cut_file), LOST: list(report.lost)}
        seen_partial += bool(complete and lost)
    assert seen_partial > 10  # the cuts did land between the first and the last chunk of tensors


def test_recover_intact_file_keeps_everything(original, tmp_path, capsys):
    out = str(tmp_path / "whole.nvckpt")
    assert main(["recover", original, out]) == EXIT_OK
    assert "the index was intact: the tree, non-tensor values and metadata are kept" in capsys.readouterr().out
    report = recover(original, str(tmp_path / "again.nvckpt"))
    assert report.complete and report.tree_kept and report.lost == {} and report.problems == []
    assert report.footer_problem is None
    assert_tree_equal(nvckpt.load(out), nvckpt.load(original))
    with nvckpt.open(out) as ck:
        assert ck.metadata() == dict(METADATA, **{RECOVERED_FROM: os.path.abspath(original), LOST: []})
    assert verify(out).ok


def test_recover_stored_chunks_are_reused(original, tmp_path):
    # No re-encoding: the recovered file holds the same chunk payloads with the same codecs.
    out = str(tmp_path / "whole.nvckpt")
    recover(original, out)
    with nvckpt.open(original) as a, nvckpt.open(out) as b:
        for name in a.keys():
            ea, eb = a.index.tensors[a.index.paths[name]], b.index.tensors[b.index.paths[name]]
            assert [(c.stored_length, c.raw_length, c.checksum) for c in ea.chunks or ()] == \
                   [(c.stored_length, c.raw_length, c.checksum) for c in eb.chunks or ()]
            assert [a.index.codecs[c.codec_id] for c in ea.chunks or ()] == [b.index.codecs[c.codec_id] for c in eb.chunks or ()]
            assert (ea.view is None, ea.derived is None, ea.internal) == (eb.view is None, eb.derived is None, eb.internal)


def test_recover_damaged_chunk_payload(original, tmp_path, capsys):
    # A flipped byte in one chunk: that tensor (and what derives from it) is lost, the walk goes on.
    with nvckpt.open(original) as ck:
        entry = ck.index.tensors[ck.index.paths["model/embed"]]
        chunk = entry.chunks[1]
    data = bytearray(Path(original).read_bytes())
    data[chunk.offset + 3] ^= 0x10
    bad = tmp_path / "bad.nvckpt"
    bad.write_bytes(bytes(data))
    out = str(tmp_path / "out.nvckpt")
    code = main(["recover", str(bad), out])
    text = capsys.readouterr().out
    assert code == EXIT_PROBLEMS
    report = recover(bad, str(tmp_path / "out2.nvckpt"))
    assert report.index_found and not report.tree_kept
    assert set(report.lost) == {"model/embed", "master/w16"}  # w16 is bf16_rne of embed
    assert "checksum mismatch" in report.lost["model/embed"] and "source" in report.lost["master/w16"]
    assert any("payload checksum mismatch, skipped" in p for p in report.problems)
    with nvckpt.open(original) as ck:
        everything = {e.name for e in ck.index.tensors if not e.internal}
    assert "model/head" not in everything  # an alias path has no entry of its own
    check_recovered(out, original, everything - {"model/embed", "master/w16"})
    assert "LOST       model/embed" in text
    with nvckpt.open(out) as ck:
        assert ck.metadata()["run"] == "r1"  # the index was intact: its metadata is kept


def test_recover_stops_at_damaged_header(original, tmp_path):
    with nvckpt.open(original) as ck:
        tid = ck.index.paths["optimizer/state/0/exp_avg"]
    start, _, header = next(f for f in frames_of(original) if f[2].frame_type == FRAME_CHUNK and f[2].tensor_id == tid)
    data = bytearray(Path(original).read_bytes())
    data[start + 30] ^= 0x01  # inside stored_length: the header checksum catches it
    bad = tmp_path / "bad.nvckpt"
    bad.write_bytes(bytes(data))
    out = str(tmp_path / "out.nvckpt")
    report = recover(bad, out)
    assert report.stopped_at == start and "header checksum" in report.stop_reason
    complete, lost = expected_at(original, start)
    assert set(report.recovered) == complete and set(report.lost) == lost
    check_recovered(out, original, complete)


def test_recover_duplicate_frames_are_not_used(original, tmp_path):
    frames = frames_of(original)
    start, end, header = next(f for f in frames if f[2].frame_type == FRAME_CHUNK and f[2].tensor_id == 0)
    cut = next(s for s, _, h in frames if h.frame_type == FRAME_INDEX)
    data = Path(original).read_bytes()
    dup = tmp_path / "dup.nvckpt"
    dup.write_bytes(data[:cut] + data[start:end])  # the same CHUNK frame twice, then no index
    report = recover(dup, str(tmp_path / "out.nvckpt"))
    with nvckpt.open(original) as ck:
        name = ck.index.tensors[0].name
    assert report.lost[name] == f"chunk {header.chunk_index} appears twice"
    assert any("second CHUNK frame" in p for p in report.problems)


def test_recover_damaged_tensor_frame(original, tmp_path):
    with nvckpt.open(original) as ck:
        tid = ck.index.paths["ids"]
    start, end, header = next(f for f in frames_of(original) if f[2].frame_type == FRAME_TENSOR and f[2].tensor_id == tid)
    data = bytearray(Path(original).read_bytes())
    data[end - 1] ^= 0x01
    bad = tmp_path / "bad.nvckpt"
    bad.write_bytes(bytes(data))
    out = str(tmp_path / "out.nvckpt")
    report = recover(bad, out)
    with nvckpt.open(original) as ck:
        total = len(ck.keys()) - 1  # minus the tied alias
    # Its name was in the damaged frame, but the intact index names it: reported lost (SPEC 15.2), not left out.
    assert "ids" not in report.recovered and "TENSOR frame is damaged" in report.lost["ids"]
    assert any(f"TENSOR frame for tensor id {tid}: frame payload checksum does not match, skipped" in p for p in report.problems)
    assert any("belong to no intact TENSOR frame" in p for p in report.problems)
    assert len(report.recovered) == total - 1
    assert verify(out).ok


def test_recover_names_and_root_tensor(tmp_path):
    # Names that need escaping come back unchanged; so does a file whose root is one tensor.
    state = {"a/b": {"~x": torch.ones(4)}, "": torch.zeros(2), "list": [torch.arange(3), torch.arange(2)]}
    src, out = str(tmp_path / "names.nvckpt"), str(tmp_path / "out.nvckpt")
    nvckpt.save(state, src)
    cut = tmp_path / "cut.nvckpt"
    cut.write_bytes(Path(src).read_bytes()[: -FOOTER_SIZE - 1])  # into the INDEX frame: no tree
    report = recover(cut, out)
    assert not report.index_found
    with nvckpt.open(src) as ck:
        names = set(ck.keys())
    assert set(report.recovered) == names == {"a~1b/~0x", "", "list/0", "list/1"}
    check_recovered(out, src, names)
    loaded = nvckpt.load(out)
    assert_tensor_equal(loaded["a/b"]["~x"], state["a/b"]["~x"])
    assert_tensor_equal(loaded["list"]["1"], state["list"][1])

    nvckpt.save(torch.arange(10), src)
    cut.write_bytes(Path(src).read_bytes()[:-1])
    recover(cut, out)
    assert_tensor_equal(nvckpt.load(out), torch.arange(10))


def test_recover_keeps_undecodable_codecs(tmp_path):
    # nvcomp-ans chunks are copied as they are (this machine cannot decode them) and the writer notes nvCOMP.
    plan = plan_save({"ans": torch.randn(32, 16), "plain": torch.arange(40)}, chunk_size=512)
    ans = Pipeline((NvcompAns("<f4", "6.0.0"),))
    src = tmp_path / "ans.nvckpt"
    def labelled(items):
        for item in items:
            if isinstance(item, EncodedChunk) and item.tensor_id == 0:
                item = EncodedChunk(0, item.chunk_index, ans, bytes([item.chunk_index]) * 7, item.raw_length)
            yield item

    with open(src, "wb") as f:
        write_items(f, labelled(encode_cpu(plan, lambda dtype: portable(8))), plan, alignment=4096, info={"name": "test"})
    cut = tmp_path / "cut.nvckpt"
    cut.write_bytes(src.read_bytes()[:-FOOTER_SIZE])
    out = str(tmp_path / "out.nvckpt")
    report = recover(cut, out)
    assert set(report.recovered) == {"ans", "plain"}
    with nvckpt.open(out) as ck:
        assert ck.writer()["nvcomp"] == "6.0.0"
        assert ans in ck.file.pipelines
        assert_tensor_equal(ck.get_tensor("plain"), torch.arange(40))
        with pytest.raises(nvckpt.UnsupportedCodecError):
            ck.get_tensor("ans")
    result = verify(out)
    assert result.ok and len(result.undecoded) == 4


@pytest.mark.parametrize("where", ["codec-frame", "codec-frame-and-index"])
def test_recover_keeps_an_unregistered_codecs_configuration_as_stored(tmp_path, capsys, where):
    """An unregistered codec's configuration is any msgpack value, kept as stored (SPEC 11.1): an ext value, bytes,
    a map with int keys.  `nvckpt recover` crashed with "TypeError: Object of type Ext is not JSON serializable"
    (a pipeline's hash went through json.dumps), then could not write the ext back (msgpack's packer)."""
    import io

    import msgpack

    from conformance import craft

    buf = io.BytesIO()
    nvckpt.save({"w": torch.arange(10.0)}, buf, codec="zstd")
    nv = craft.parse(buf.getvalue())
    future = [{"name": "future", "configuration": {"x": msgpack.ExtType(1, b"\0\0\0\0"), "y": {1: b"by"}}}]
    next(f for f in nv.frames if f.frame_type == craft.CODEC).payload = craft.pack(future)
    if where == "codec-frame-and-index":
        nv.index["codecs"][0] = future
    src, out = tmp_path / "ext.nvckpt", tmp_path / "out.nvckpt"
    src.write_bytes(craft.build(nv))
    assert main(["recover", str(src), str(out)]) == EXIT_OK, capsys.readouterr().err
    with nvckpt.open(out) as ck:
        (pipeline,) = ck.file.pipelines
        step = pipeline.steps[0]
        assert step.name == "future" and step.configuration()["y"] == {1: b"by"}
        assert (step.configuration()["x"].code, step.configuration()["x"].data) == (1, b"\0\0\0\0")
        assert "future(" in repr(pipeline) and hash(pipeline) == hash(pipeline)
        with pytest.raises(nvckpt.UnsupportedCodecError):
            ck.get_tensor("w")
    recovered = next(f for f in craft.parse(out.read_bytes()).frames if f.frame_type == craft.CODEC)
    assert craft.unpack(recovered.payload) == future  # written back as it was stored


def test_recover_errors(tmp_path, capsys):
    short = tmp_path / "short.nvckpt"
    short.write_bytes(b"\x89NVCKPT\n\x01")
    assert main(["recover", str(short), str(tmp_path / "o.nvckpt")]) == EXIT_PROBLEMS
    err = capsys.readouterr().err
    assert err.startswith("nvckpt: error: ") and "preamble" in err and len(err.strip().splitlines()) == 1
    junk = tmp_path / "junk.nvckpt"
    junk.write_bytes(os.urandom(500))
    assert main(["recover", str(junk), str(tmp_path / "o.nvckpt")]) == EXIT_PROBLEMS
    assert "not an nvckpt file" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o.nvckpt")


def test_recover_hostile_tensor_frames(original, tmp_path):
    # Frames a valid writer never writes must not make recover write an invalid file.
    import msgpack

    from nvckpt.format.structs import FrameHeader, xxh3

    def tensor_frame(tid: int, entry: dict) -> bytes:
        payload = msgpack.packb(entry)
        return FrameHeader(FRAME_TENSOR, len(payload), len(payload), xxh3(payload), tensor_id=tid).pack() + payload

    index_at = next(s for s, _, h in frames_of(original) if h.frame_type == FRAME_INDEX)
    deep = "/".join(["a"] * 100)  # a name too deep to nest into a tree
    extra = (tensor_frame(1000, {"name": "ids", "dtype": "int64", "shape": [0], "nchunks": 0})  # a name taken
             + tensor_frame(1001, {"name": deep, "dtype": "float32", "shape": [0], "nchunks": 0})
             + tensor_frame(1002, {"name": "big", "dtype": "float32", "shape": [0, 1 << 62], "nchunks": 0})
             + tensor_frame(1003, {"name": "bad", "dtype": "float99", "shape": [1], "nchunks": 1}))
    bad = tmp_path / "bad.nvckpt"
    bad.write_bytes(Path(original).read_bytes()[:index_at] + extra)
    out = str(tmp_path / "out.nvckpt")
    report = recover(bad, out)
    with nvckpt.open(original) as ck:
        ids_tid = ck.index.paths["ids"]
    assert "ids" in report.recovered  # the first tensor of that name is kept, the second is not
    assert report.lost["ids"] == f"tensor id {ids_tid} has the same name"
    assert deep in report.recovered and "big" not in report.recovered and "bad" not in report.recovered
    assert any("do not nest into one tree" in p for p in report.problems)
    assert any("tensor id 1002" in p for p in report.problems)
    assert report.lost["bad"] == "chunk 0 of 1 is missing"  # an unknown dtype is valid (SPEC 10): its chunk is not
    assert verify(out).ok
    with nvckpt.open(out) as ck:
        assert_tensor_equal(ck.get_tensor("ids"), recover_state()["ids"])
        assert ck.get_tensor(deep.replace("/", "~1")).shape == (0,)  # stored flat, under its escaped path


def _zstd_file() -> bytes:
    buf = io.BytesIO()
    nvckpt.save({"a": torch.zeros(4096), "b": torch.ones(8, dtype=torch.bool)}, buf, codec="zstd")
    return buf.getvalue()


def _edit_chunk(data: bytes, tensor: str, payload: bytes) -> bytes:
    nv = craft.parse(data)
    tid = nv.tensor_id(tensor)
    nv.chunk_frame(tid, 0).payload = payload
    return craft.build(nv)


@pytest.mark.parametrize("what", ["garbage-zstd", "bool-2", "tensor-checksum"])
def test_recover_keeps_only_tensors_that_decode_and_match(what, tmp_path):
    data = _zstd_file()
    if what == "garbage-zstd":  # a valid checksum over bytes that are no zstd frame
        data = _edit_chunk(data, "a", b"\x28\xb5\x2f\xfd" + bytes(40))
        lost = "a"
    elif what == "bool-2":
        data = _edit_chunk(data, "b", bytes([1, 2, 0, 1, 0, 1, 0, 1]))
        lost = "b"
    else:  # the stored bytes decode, but not to what the tensor checksum says
        nv = craft.parse(data)
        tid = nv.tensor_id("a")
        entry = craft.unpack(nv.tensor_frame(tid).payload)
        entry["checksum"] ^= 1
        nv.tensor_frame(tid).payload = craft.pack(entry)
        data = craft.build(nv)
        lost = "a"
    src = tmp_path / "src.nvckpt"
    src.write_bytes(data)
    report = recover(src, tmp_path / "out.nvckpt")
    assert lost in report.lost and lost not in report.recovered, report.lost
    with nvckpt.open(tmp_path / "out.nvckpt") as ck:
        assert lost not in ck.keys()


def test_recover_a_source_whose_name_is_not_utf8(tmp_path, capsys):
    src = os.path.join(os.fsencode(tmp_path), b"bad\xff.nvckpt")
    nvckpt.save({"w": torch.ones(4)}, os.fsdecode(src))
    dst = str(tmp_path / "out.nvckpt")
    code, _, err = run(capsys, "recover", os.fsdecode(src), dst)
    assert code == EXIT_OK and err == "", err  # before: a UnicodeEncodeError traceback
    with nvckpt.open(dst) as ck:
        origin = ck.metadata()[RECOVERED_FROM]
        assert origin.endswith("bad\\xff.nvckpt") and origin.encode("utf-8")
        assert_tensor_equal(ck.get_tensor("w"), torch.ones(4))


def test_recover_checks_the_index_with_the_preambles_features(tmp_path):
    nv = craft.parse(saved_bytes({"w": torch.zeros(4), "dt": torch.float16}, tensor_checksums=False))  # the tree holds ext 3 (a dtype)
    nv.preamble.required_features = 0
    nv.preamble.version_minor = 0
    nv.index["version"] = [1, 0]
    src = tmp_path / "typed-without-bit-1.nvckpt"
    src.write_bytes(craft.build(nv))
    report = recover(src, tmp_path / "out.nvckpt")
    # before: the typed tree was kept and the result called complete (SPEC 9.2: the index is invalid)
    assert not report.complete and not report.tree_kept
    assert any("INDEX frame" in p and "required_features bit 1" in p for p in report.problems), report.problems
    assert report.recovered == ["w"]


def test_recover_uses_the_index_where_a_tensor_frame_disagrees(tmp_path):
    nv = craft.parse(saved_bytes({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, tensor_checksums=False))
    frame = nv.tensor_frame(0)
    desc = craft.unpack(frame.payload)
    desc["shape"] = [3, 2]
    frame.payload = craft.pack(desc)
    src, dst = tmp_path / "disagrees.nvckpt", tmp_path / "out.nvckpt"
    src.write_bytes(craft.build(nv))
    report = recover(src, dst)
    assert not report.complete and report.tree_kept and report.lost == {}
    assert any("disagrees with the index on shape" in p for p in report.problems), report.problems
    assert tuple(nvckpt.load(dst)["w"].shape) == (2, 3)  # before: (3, 2), from the TENSOR frame


@pytest.mark.parametrize("case", ["valid-unknown-codec", "valid-unknown-dtype"])
def test_recover_keeps_complete_tensors_it_cannot_decode(tmp_path, case):
    src, dst = os.path.join(ROOT, "conformance", "files", f"{case}.nvckpt"), tmp_path / "out.nvckpt"
    report = recover(src, dst)
    assert report.complete and report.lost == {} and report.problems == [], report  # before: one tensor dropped
    with closing(ChunkReader(src, workers=1)) as a, closing(ChunkReader(dst, workers=1)) as b:
        assert [e.name for e in a.index.tensors] == [e.name for e in b.index.tensors]
        for e, f in zip(a.index.tensors, b.index.tensors):
            assert (e.dtype.name, e.shape, e.kind) == (f.dtype.name, f.shape, f.kind)
            for i in range(len(e.chunks or ())):  # the stored bytes, copied as they are
                assert bytes(a.read_payload(e, i)) == bytes(b.read_payload(f, i))
    assert verify(dst, workers=1).ok


def test_recover_names_an_indexed_tensor_whose_tensor_frame_is_damaged(tmp_path):
    nv = craft.parse(saved_bytes({"a": torch.ones(3), "b": torch.zeros(2)}, tensor_checksums=False))
    frame = nv.tensor_frame(nv.tensor_id("b"))
    frame.payload_checksum = 12345  # the payload no longer matches its checksum
    src = tmp_path / "damaged.nvckpt"
    src.write_bytes(craft.build(nv))
    report = recover(src, tmp_path / "out.nvckpt")
    assert report.recovered == ["a"] and "TENSOR frame is damaged" in report.lost["b"], report
