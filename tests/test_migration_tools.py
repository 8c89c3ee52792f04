"""Migration in one command: `nvckpt convert --allow-pickle` for one's own legacy torch.save file, and a DCP
directory of torch's FileSystemWriter read by convert, merge, info and ls (with the same explicit trust);
directories and files list their values under one naming scheme."""

from __future__ import annotations

import enum
import json
import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import nvckpt
from nvckpt.cli import EXIT_OK, EXIT_UNSUPPORTED, main


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


class Precision(str, enum.Enum):  # a str enum of the user's own: torch.load(weights_only=True) refuses its class
    BF16 = "bf16-mixed"


def test_convert_allow_pickle_reads_ones_own_legacy_file(tmp_path, capsys):
    legacy = tmp_path / "old.pt"
    state = {"model": {"w": torch.arange(6.0)}, "best": np.float64(0.25), "epochs": np.int64(3),
             "precision": Precision.BF16}
    torch.save(state, legacy)
    code, _, err = run(capsys, "convert", legacy, tmp_path / "new.nvckpt")
    assert code == EXIT_UNSUPPORTED and "--allow-pickle" in err  # never without the word
    code, out, err = run(capsys, "convert", "--allow-pickle", legacy, tmp_path / "new.nvckpt")
    assert code == EXIT_OK, err
    back = nvckpt.load(tmp_path / "new.nvckpt")
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert back["best"] == 0.25 and back["epochs"] == 3 and back["precision"] == "bf16-mixed"


def test_convert_allow_pickle_names_what_still_cannot_be_stored(tmp_path, capsys):
    torch.save({"w": torch.ones(2), "cfg": {"run": Box()}}, tmp_path / "old.pt")
    code, _, err = run(capsys, "convert", "--allow-pickle", tmp_path / "old.pt", tmp_path / "new.nvckpt")
    assert code == EXIT_UNSUPPORTED and "cfg/run" in err and "state_dict()" in err
    assert not (tmp_path / "new.nvckpt").exists()


class Box:
    def __init__(self) -> None:
        self.n = 1


@pytest.fixture()
def filesystem_dir(tmp_path):
    """A DCP checkpoint as torch's own FileSystemWriter writes it (one process)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7, "extra": {"name": "x"}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs")), no_dist=True)
    return tmp_path / "fs", state


def test_a_filesystem_writer_directory_converts_and_merges_in_one_command(filesystem_dir, tmp_path, capsys):
    path, state = filesystem_dir
    for command in ("convert", "merge"):
        out = tmp_path / f"{command}.nvckpt"
        code, _, err = run(capsys, command, path, out)
        assert code == EXIT_UNSUPPORTED and "FileSystemWriter" in err and "--allow-pickle" in err
        code, _, err = run(capsys, command, "--allow-pickle", path, out)
        assert code == EXIT_OK, err
        back = nvckpt.load(out)
        for k, v in state["model"].items():
            assert torch.equal(back["model"][k], v)
        assert torch.equal(back["optim"]["state"]["0"]["exp_avg"], state["optim"]["state"][0]["exp_avg"])
        assert back["step"] == 7 and back["extra"] == {"name": "x"}
    code, _, err = run(capsys, "convert", "--allow-pickle", path, tmp_path / "model.safetensors")
    assert code == EXIT_OK, err


def test_info_and_ls_of_a_filesystem_writer_directory(filesystem_dir, capsys):
    path, state = filesystem_dir
    code, _, err = run(capsys, "info", path)
    assert code == EXIT_UNSUPPORTED and "--allow-pickle" in err
    code, out, err = run(capsys, "info", "--allow-pickle", path)
    assert code == EXIT_OK and "FileSystemWriter" in out and "__0_0.distcp" in out, out + err
    code, out, _ = run(capsys, "ls", "--allow-pickle", "--json", path)
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["model/0.weight"]["shape"] == [3, 4] and rows["model/0.weight"]["fqn"] == "model.0.weight"
    assert rows["optim/param_groups/0/lr"]["kind"] == "object"


def test_a_directory_and_its_merged_file_list_the_same_names(tmp_path, capsys):
    """`nvckpt ls DIR` names values as a file does (model/0.weight), so a name read off either finds the value
    in the merged file; DCP's dotted name (in --json's "fqn") finds it too."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    nvckpt.save({"model": model.state_dict(), "step": 3}, tmp_path / "s.nvckpt")
    assert run(capsys, "split", tmp_path / "s.nvckpt", tmp_path / "dir")[0] == EXIT_OK
    code, out, _ = run(capsys, "ls", "--json", tmp_path / "dir")
    rows = json.loads(out)
    assert run(capsys, "merge", tmp_path / "dir", tmp_path / "m.nvckpt")[0] == EXIT_OK
    with nvckpt.open(tmp_path / "m.nvckpt") as merged:
        assert {r["name"] for r in rows if r["kind"] == "tensor"} == set(merged.keys()) == {"model/0.weight",
                                                                                          "model/0.bias"}
        for r in rows:
            assert r["name"] in merged and r["fqn"] in merged
