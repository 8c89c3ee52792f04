"""nvckpt.io.publish (a checkpoint directory replaced in one step) and what nvckpt.dcp.Writer refuses."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from nvckpt.io import publish


def _dir(path, files: dict[str, bytes]) -> str:
    os.makedirs(path)
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    return str(path)


def _contents(path) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_publish_replaces_the_old_directory(tmp_path, monkeypatch, exchange):
    final = _dir(tmp_path / "ck", {"old": b"1"})
    if not exchange:
        monkeypatch.setattr(publish, "_exchange", lambda a, b: False)
    staging = _dir(publish.staging_name(final), {"new": b"2"})
    publish.publish_directory(staging, final)
    assert _contents(final) == {"new": b"2"}
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # neither the old one nor the staging name is left


def test_publish_without_a_previous_directory(tmp_path):
    final = str(tmp_path / "ck")
    staging = _dir(publish.staging_name(final), {"new": b"2"})
    publish.publish_directory(staging, final)
    assert _contents(final) == {"new": b"2"} and os.listdir(tmp_path) == ["ck"]


def test_a_failed_rename_puts_the_old_directory_back(tmp_path, monkeypatch):
    final = _dir(tmp_path / "ck", {"old": b"1"})
    staging = _dir(publish.staging_name(final), {"new": b"2"})
    monkeypatch.setattr(publish, "_exchange", lambda a, b: False)
    real_rename = os.rename

    def rename(a, b):
        if a == staging:
            raise OSError(5, "Input/output error")
        return real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError):
        publish.publish_directory(staging, final)
    monkeypatch.undo()
    assert _contents(final) == {"old": b"1"}


def test_publish_refuses_to_replace_a_file(tmp_path):
    final = tmp_path / "ck"
    final.write_bytes(b"x")
    staging = _dir(publish.staging_name(str(final)), {"new": b"2"})
    with pytest.raises(NotADirectoryError):
        publish.publish_directory(staging, str(final))
    assert final.read_bytes() == b"x"


def test_remove_stale_keeps_other_targets(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sa, sb = publish.staging_name(a), publish.staging_name(b)
    os.mkdir(sa)
    os.mkdir(sb)
    assert publish.remove_stale(a) == [sa]
    assert os.path.isdir(sb)


def _save(state, path, **kw):
    import torch.distributed.checkpoint as dcp

    import nvckpt.dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, storage_writer=nvckpt.dcp.Writer(path, **kw))


def test_writer_will_not_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    target = _dir(tmp_path / "data", {"notes.txt": b"mine"})
    with pytest.raises((CheckpointException, FileExistsError)) as info:
        _save({"x": torch.ones(2)}, target)
    assert "not a checkpoint" in str(info.value)
    assert _contents(target) == {"notes.txt": b"mine"}
    assert sorted(os.listdir(tmp_path)) == ["data"]


def test_writer_overwrite_false_keeps_the_checkpoint(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    target = str(tmp_path / "ck")
    _save({"x": torch.ones(2)}, target)
    before = _contents(target)
    with pytest.raises((CheckpointException, FileExistsError)) as info:
        _save({"x": torch.zeros(2)}, target, overwrite=False)
    assert "overwrite=False" in str(info.value)
    assert _contents(target) == before


def test_reader_names_a_foreign_directory(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import nvckpt
    import nvckpt.dcp

    target = str(tmp_path / "fs")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.save({"x": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(target))
        with pytest.raises((CheckpointException, nvckpt.FormatError)) as info:
            dcp.load({"x": torch.zeros(2)}, storage_reader=nvckpt.dcp.Reader(target))
    assert "FileSystemReader" in str(info.value)
