"""Review 3 of the tools (convert, recover, verify, info DIR, split/merge, --json): one test per bug found."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
from contextlib import closing

import pytest
import torch

import nvckpt
from conftest import assert_tensor_equal
from nvckpt.cli import EXIT_IO, EXIT_OK, EXIT_PROBLEMS, EXIT_UNSUPPORTED, EXIT_USAGE, main
from nvckpt.read.reader import ChunkReader
from nvckpt.tools.recover import RECOVERED_FROM, recover
from nvckpt.tools.verify import verify

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "conformance"))
import craft  # noqa: E402  (the conformance suite's file crafter)


from test_cli import one_error_line, run  # noqa: E402


def saved_bytes(obj, **kw) -> bytes:
    import io

    kw.setdefault("codec", "raw")
    kw.setdefault("engine", "cpu")
    kw.setdefault("tensor_checksums", False)
    b = io.BytesIO()
    nvckpt.save(obj, b, **kw)
    return b.getvalue()


# -- convert ---------------------------------------------------------------------------------------

def test_convert_to_nvckpt_writes_the_file_once(tmp_path, monkeypatch):
    from nvckpt.session import save as session_save
    from nvckpt.tools.convert import convert

    src = str(tmp_path / "m.pt")
    torch.save({"w": torch.randn(64, 64)}, src)
    runs = []
    original = session_save.SaveSession.run
    monkeypatch.setattr(session_save.SaveSession, "run", lambda self, *a, **k: runs.append(self.target) or original(self, *a, **k))
    convert(src, str(tmp_path / "m.nvckpt"))
    assert len(runs) == 1, runs  # before: twice, the whole file written again after the first write


@pytest.mark.parametrize("kind", ["sparse", "meta"])
@pytest.mark.parametrize("dst", ["out.nvckpt", "out.safetensors", "out.pt", "out-dir"])
def test_convert_of_sparse_or_meta_tensors_is_one_line_exit_3(tmp_path, capsys, kind, dst):
    pytest.importorskip("safetensors")
    src = str(tmp_path / f"{kind}.pt")
    tensor = torch.ones(3).to_sparse() if kind == "sparse" else torch.ones(3, device="meta")
    torch.save({"emb": tensor, "ok": torch.zeros(2)}, src)
    command = "split" if dst == "out-dir" else "convert"
    code, _, err = run(capsys, command, src, str(tmp_path / dst))
    line = one_error_line(err)
    assert code == EXIT_UNSUPPORTED and f"{src}: tensor at emb" in line, line
    assert ("layout torch.sparse_coo" if kind == "sparse" else "meta device") in line
    assert not [n for n in os.listdir(tmp_path) if n.startswith((".out", "out"))]


def test_convert_format_hint_lists_what_each_option_accepts(tmp_path, capsys):
    src = str(tmp_path / "a.nvckpt")
    nvckpt.save({"w": torch.ones(2)}, src)
    code, _, err = run(capsys, "convert", src, str(tmp_path / "out.weights"))
    line = one_error_line(err)
    assert code == EXIT_USAGE and "--from/--to (nvckpt, safetensors, torch;" in line, line
    listed = line.split("--from/--to (")[1].split(";")[0].split(", ")
    for fmt in listed:  # every format the hint offers is one the option takes (before: dcp, which it refused)
        assert run(capsys, "convert", src, str(tmp_path / f"out-{fmt}.weights"), "--to", fmt)[0] == EXIT_OK
    # merge and split have no --from/--to: the hint does not offer them
    split = str(tmp_path / "dir")
    assert run(capsys, "split", src, split)[0] == EXIT_OK
    code, _, err = run(capsys, "merge", split, str(tmp_path / "merged.weights"))
    line = one_error_line(err)
    assert code == EXIT_USAGE and "--from" not in line and "--to" not in line and "extensions" in line, line


# -- --json ---------------------------------------------------------------------------------------

def _strict_json(text: str):
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_json_output_is_valid_json_with_non_finite_metadata(tmp_path, capsys):
    path = str(tmp_path / "c.nvckpt")
    nvckpt.save({"w": torch.ones(2)}, path, metadata={"best": float("inf"), "worst": float("-inf"),
                                                        "last": float("nan"), "hist": [1.5, float("inf")]})
    code, out, _ = run(capsys, "info", "--json", path)
    assert code == EXIT_OK
    meta = _strict_json(out)["metadata"]  # before: Infinity / NaN, which strict parsers reject
    assert meta == {"best": "inf", "worst": "-inf", "last": "nan", "hist": [1.5, "inf"]}


# -- recover --------------------------------------------------------------------------------------

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
    nv = craft.parse(saved_bytes({"w": torch.zeros(4), "dt": torch.float16}))  # the tree holds ext 3 (a dtype)
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
    nv = craft.parse(saved_bytes({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}))
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
    nv = craft.parse(saved_bytes({"a": torch.ones(3), "b": torch.zeros(2)}))
    frame = nv.tensor_frame(nv.tensor_id("b"))
    frame.payload_checksum = 12345  # the payload no longer matches its checksum
    src = tmp_path / "damaged.nvckpt"
    src.write_bytes(craft.build(nv))
    report = recover(src, tmp_path / "out.nvckpt")
    assert report.recovered == ["a"] and "TENSOR frame is damaged" in report.lost["b"], report


# -- verify: frame rules 3 and 4 (SPEC 4.3) ----------------------------------------------------------

def _verify_crafted(tmp_path, name, nv):
    path = tmp_path / f"{name}.nvckpt"
    path.write_bytes(craft.build(nv))
    return [str(p) for p in verify(path, workers=1).problems]


def test_verify_reports_chunk_frames_before_their_tensor_or_codec_frame(tmp_path):
    base = saved_bytes({"w": torch.arange(6, dtype=torch.float32)})
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
        assert not verify(os.path.join(ROOT, "conformance", "files", f"{name}.nvckpt"), workers=1).ok


@pytest.mark.parametrize("index_pipe,frame_pipe,zstd", [
    ([{"name": "foo"}], [{"name": "bar"}], False),  # two unregistered codecs: the names differ
    ([{"name": "zstd"}], [{"name": "zstd", "configuration": {"level": 1}}], True),  # absent configuration is {}
    ([{"name": "foo", "configuration": {"a": 1}}], [{"name": "foo", "configuration": {"a": 1.0}}], False),  # int vs float
])
def test_verify_compares_codec_frames_as_spec_rule_3_says(tmp_path, index_pipe, frame_pipe, zstd):
    nv = craft.parse(saved_bytes({"w": torch.arange(6, dtype=torch.float32)}))
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
    assert verify(os.path.join(ROOT, "conformance", "files", "valid-codec-frame-same-pipeline.nvckpt"), workers=1).ok
    nv = craft.parse(saved_bytes({"w": torch.arange(6, dtype=torch.float32)}))
    nv.index["codecs"] = [[{"name": "foo", "configuration": {"a": 1, "b": [2.5]}}]]
    next(f for f in nv.frames if f.frame_type == craft.CODEC).payload = craft.pack([{"configuration": {"b": [2.5], "a": 1}, "name": "foo"}])
    assert _verify_crafted(tmp_path, "same", nv) == []


def test_unknown_codecs_of_other_names_are_not_equal():
    from nvckpt.codecs.registry import pipeline_from_json

    assert pipeline_from_json([{"name": "foo"}]) != pipeline_from_json([{"name": "bar"}])
    assert pipeline_from_json([{"name": "foo"}]) == pipeline_from_json([{"name": "foo", "configuration": {}}])


# -- DCP directories: info, split, merge ------------------------------------------------------------------

def test_info_on_a_directory_with_a_damaged_rank_file_exits_1(tmp_path, capsys):
    src, d = str(tmp_path / "s.nvckpt"), tmp_path / "dir"
    nvckpt.save({"model": {"w": torch.randn(64, 64)}}, src)
    assert run(capsys, "split", src, str(d))[0] == EXIT_OK
    rank = d / "__0.nvckpt"
    data = bytearray(rank.read_bytes())
    data[-30] ^= 0xFF  # the footer
    rank.write_bytes(bytes(data))
    code, out, _ = run(capsys, "info", str(d))
    assert code == EXIT_PROBLEMS and "problem: rank file __0.nvckpt" in out, out  # before: exit 0
    code, out, _ = run(capsys, "info", "--json", str(d))
    doc = json.loads(out)
    assert code == EXIT_PROBLEMS and any("__0.nvckpt" in p["message"] for p in doc["problems"]), doc["problems"]


def _same(a, b) -> bool:
    """Equal trees, dict keys of the same types (any order), tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (isinstance(b, dict) and {(type(k), k) for k in a} == {(type(k), k) for k in b}
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def test_split_then_merge_keeps_empty_dicts_and_key_types(tmp_path, capsys):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())  # not stepped: its "state" is {}
    state = {"model": dict(model.state_dict()), "optim": opt.state_dict(), "hist": [],
             "extra": {None: 1, 2.5: torch.ones(2), True: {}, 3: {"x": {}}}, "l": [torch.zeros(1), {}, {"y": {}}]}
    src, d, back = str(tmp_path / "s.nvckpt"), str(tmp_path / "dir"), str(tmp_path / "m.nvckpt")
    nvckpt.save(state, src)
    assert run(capsys, "split", src, d)[0] == EXIT_OK
    assert run(capsys, "merge", d, back)[0] == EXIT_OK
    got = nvckpt.load(back)
    assert _same(got, state), got  # before: "state" and the other empty dicts gone, None/2.5/True keys str
    torch.optim.AdamW(model.parameters()).load_state_dict(got["optim"])  # before: KeyError 'state'


def test_merge_of_a_manifest_without_the_new_fields_works_as_before(tmp_path, capsys):
    state = {"optim": {"state": {}, "per": {0: torch.ones(1)}}, "extra": {None: torch.zeros(1)}}
    src, d, back = str(tmp_path / "s.nvckpt"), tmp_path / "dir", str(tmp_path / "m.nvckpt")
    nvckpt.save(state, src)
    assert run(capsys, "split", src, str(d))[0] == EXIT_OK
    manifest = d / "nvckpt-dcp.json"
    doc = json.loads(manifest.read_text())
    assert doc["empty_dicts"] and doc["key_types"] and doc["int_keys"]
    del doc["empty_dicts"], doc["key_types"]  # an older writer's manifest
    manifest.write_text(json.dumps(doc))
    assert run(capsys, "merge", str(d), back)[0] == EXIT_OK
    got = nvckpt.load(back)
    assert list(got["optim"]) == ["per"] and list(got["optim"]["per"]) == [0] and list(got["extra"]) == ["None"]


@pytest.mark.parametrize("keys,says", [
    ({("a", 1): 1}, "dict key ('a', 1) at x has type tuple"),
    ({1: 1, "1": 2}, "dict keys 1 and '1' at x are both stored as '1'"),
])
def test_split_refuses_keys_a_directory_cannot_give_back(tmp_path, capsys, keys, says):
    src = str(tmp_path / "s.pt")
    torch.save({"w": torch.ones(2), "x": keys}, src)
    code, _, err = run(capsys, "split", src, str(tmp_path / "dir"))
    line = one_error_line(err)
    assert code == EXIT_UNSUPPORTED and f"{src}: {says}" in line, line
    assert os.listdir(tmp_path) == ["s.pt"]


def _small_disk() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))


def test_split_errors_name_the_destination_not_the_staging_directory(tmp_path, capsys, monkeypatch):
    src = str(tmp_path / "s.nvckpt")
    nvckpt.save({"w": torch.randn(100_000)}, src)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "nvckpt", "split", src, str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, preexec_fn=_small_disk, timeout=300)
    line = one_error_line(p.stderr)
    assert p.returncode == EXIT_IO and line.startswith(f"nvckpt: error: {tmp_path / 'out' / '__0.nvckpt'}: "), line
    assert "nvckpt-tmpdir" not in line
    assert sorted(os.listdir(tmp_path)) == ["s.nvckpt"]  # the failed save's staging directory is gone too

    import nvckpt.dcp.writer as writer_module

    def refused(path, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(writer_module.os, "mkdir", refused)  # a folder this user may not write in
    code, _, err = run(capsys, "split", src, str(tmp_path / "out2"))
    line = one_error_line(err)
    assert code == EXIT_IO and line == f"nvckpt: error: {tmp_path / 'out2'}: Permission denied", line


def test_split_refuses_paths_that_dcp_would_join_into_one_name(tmp_path, capsys):
    # DCP names a value by its keys joined with ".": a key "a.b" beside a dict "a" holding "b" ended in a traceback.
    src = tmp_path / "s.nvckpt"
    nvckpt.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, src)
    code, _, err = run(capsys, "split", str(src), str(tmp_path / "d"))
    assert code == EXIT_UNSUPPORTED
    assert "a.b and a/b would both be 'a.b'" in one_error_line(err)
    assert not (tmp_path / "d").exists()
