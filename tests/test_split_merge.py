"""nvckpt split and merge: a state as a one-rank DCP directory and back as it was (keys a directory cannot give
back refused, errors naming the destination), and info on a split directory with a damaged rank file.
What every tool checks of a directory that mixes two saves is tests/test_dcp_directory.py."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch

import nvckpt
from nvckpt.cli import EXIT_IO, EXIT_OK, EXIT_PROBLEMS, EXIT_UNSUPPORTED
from test_cli import one_error_line, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


@pytest.mark.slow
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
