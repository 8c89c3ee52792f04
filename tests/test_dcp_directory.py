"""A DCP directory (nvckpt.dcp.Writer's) is one save: every tool that reads one checks what dcp.load checks.

A directory is one save when its ``.metadata`` (what dcp.load plans from), its manifest (what the tools read)
and every rank file name the same save_id.  A copy or rsync taken while a new save was published over the
directory can leave parts of two saves of the same layout; ``dcp.load`` with ``nvckpt.dcp.Reader`` refuses it,
and so must ``merge``, ``convert``, ``verify``, ``info`` and ``ls``, instead of assembling rows of each
tensor from different saves.  And a save that fails (a full disk) leaves no staging directory behind.
"""

from __future__ import annotations

import datetime
import os
import resource
import shutil
import signal
import subprocess
import sys
import warnings

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import nvckpt  # noqa: E402
import nvckpt.dcp  # noqa: E402
from nvckpt import cli  # noqa: E402
from nvckpt.sharded.assemble import assemble  # noqa: E402
from nvckpt.io.publish import TMPDIR_SUFFIX  # noqa: E402

ROWS, WIDTH = 8, 4


def _state(scale: int) -> dict:
    return {"model": {"w": torch.arange(ROWS * WIDTH, dtype=torch.float32).reshape(ROWS, WIDTH) * scale,
                      "b": torch.full((WIDTH,), float(scale))},
            "step": torch.tensor(scale)}


def _save_one_process(state: dict, path: str) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, storage_writer=nvckpt.dcp.Writer(path, codec="raw"))


def _load(path: str) -> dict:
    target = _state(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(target, storage_reader=nvckpt.dcp.Reader(path))
    return target


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


# -- two ranks over gloo: rank files of a sharded tensor -----------------------------------------
def _rank_saves(rank: int, world: int, store: str, paths: list[str], fail_rank: int) -> None:
    """Each of ``paths`` saved by ``world`` ranks, ``w`` sharded by rows (save i scales the state by i + 1);
    rank ``fail_rank`` writes on a disk that is full after 256 bytes (its rank file cannot be written)."""
    from torch.distributed._tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (world,))
        for i, path in enumerate(paths):
            state = _state(i + 1)
            state["model"]["w"] = distribute_tensor(state["model"]["w"], mesh, [Shard(0)])
            if rank == fail_rank:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as ENOSPC
                resource.setrlimit(resource.RLIMIT_FSIZE, (256, resource.RLIM_INFINITY))
            try:
                dcp.save(state, storage_writer=nvckpt.dcp.Writer(path, codec="raw"))
            except CheckpointException as exc:
                with open(f"{path}.failed-{rank}", "w") as f:
                    f.write(repr(exc.failures)[:200] if rank == fail_rank else repr(exc.failures))
    finally:
        dist.destroy_process_group()


def _spawn_saves(tmp_path, paths: list[str], fail_rank: int = -1) -> None:
    mp.spawn(_rank_saves, args=(2, str(tmp_path / "store"), paths, fail_rank), nprocs=2, join=True)


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory) -> tuple[str, str]:
    # Two-rank saves in processes of their own: tens of seconds on 2 shared cores, so its tests are marked slow.
    """Two directories of the same layout, saved by 2 ranks: rank files __0 and __1 hold rows 0-3 and 4-7."""
    tmp = tmp_path_factory.mktemp("two-saves")
    a, b = str(tmp / "A"), str(tmp / "B")
    _spawn_saves(tmp, [a, b])
    return a, b


def _mixed(tmp_path, two_saves, part: str) -> str:
    """A copy of save A holding ``part`` of save B (a rank file, .metadata or the manifest)."""
    a, b = two_saves
    mixed = str(tmp_path / "mixed")
    shutil.copytree(a, mixed)
    shutil.copy(os.path.join(b, part), os.path.join(mixed, part))
    return mixed


@pytest.mark.slow
def test_two_saves_load_whole(two_saves):
    a, b = two_saves
    assert sorted(os.listdir(a)) == [".metadata", "__0.nvckpt", "__1.nvckpt", "nvckpt-dcp.json"]
    for path, scale in ((a, 1), (b, 2)):
        loaded = assemble(path)
        assert torch.equal(loaded["model"]["w"], _state(scale)["model"]["w"])
        assert torch.equal(_load(path)["model"]["w"], _state(scale)["model"]["w"])


@pytest.mark.slow
@pytest.mark.parametrize("out", ["out.nvckpt", "out.safetensors", "out.pt"])
def test_merge_refuses_a_rank_file_of_another_save(tmp_path, two_saves, capsys, out):
    """Before: exit 0, rows 4-7 of w from save B beside rows 0-3 from save A."""
    mixed = _mixed(tmp_path, two_saves, "__1.nvckpt")
    with pytest.raises(CheckpointException, match="written by another save"):
        _load(mixed)
    code, text = _cli(capsys, "merge", mixed, str(tmp_path / out))
    assert code == 1 and "rank file __1.nvckpt was written by another save" in text, text
    assert not os.path.exists(tmp_path / out)


@pytest.mark.slow
def test_convert_and_assemble_refuse_a_rank_file_of_another_save(tmp_path, two_saves, capsys):
    mixed = _mixed(tmp_path, two_saves, "__0.nvckpt")
    code, text = _cli(capsys, "convert", mixed, str(tmp_path / "out.safetensors"))
    assert code == 1 and "rank file __0.nvckpt was written by another save" in text, text
    assert not os.path.exists(tmp_path / "out.safetensors")
    with pytest.raises(nvckpt.FormatError, match="written by another save"):
        assemble(mixed)


@pytest.mark.slow
@pytest.mark.parametrize("part", [".metadata", "nvckpt-dcp.json"])
def test_metadata_or_manifest_of_another_save_is_refused_by_every_tool(tmp_path, two_saves, capsys, part):
    """Before: verify passed a .metadata of another save, which dcp.load then refused; merge used the manifest
    without asking whose it was."""
    mixed = _mixed(tmp_path, two_saves, part)
    expected = "of two saves"
    if part == ".metadata":  # what dcp.load refuses (its plan is the other save's; the rank files are this one's)
        with pytest.raises(CheckpointException, match="another save|of two saves"):
            _load(mixed)
    else:
        with pytest.raises(CheckpointException, match=expected):
            _load(mixed)
    code, text = _cli(capsys, "verify", mixed)
    assert code == 1 and expected in text, text
    code, text = _cli(capsys, "merge", mixed, str(tmp_path / "out.nvckpt"))
    assert code == 1 and expected in text, text
    assert not os.path.exists(tmp_path / "out.nvckpt")
    code, text = _cli(capsys, "info", mixed)
    assert code == 1 and expected in text, text
    code, text = _cli(capsys, "ls", mixed)
    assert code == 1 and expected in text, text


@pytest.mark.slow
def test_info_and_ls_name_a_rank_file_of_another_save(tmp_path, two_saves, capsys):
    mixed = _mixed(tmp_path, two_saves, "__1.nvckpt")
    for tool in ("info", "ls", "verify"):
        code, text = _cli(capsys, tool, mixed)
        assert code == 1 and "rank file __1.nvckpt was written by another save" in text, (tool, text)


def test_a_rank_file_renamed_within_its_save_is_refused(tmp_path):
    """A rank file records its own name: __0 copied over __1 of the same save holds the wrong rows."""
    a = str(tmp_path / "A")
    _save_one_process(_state(1), a)
    shutil.copy(os.path.join(a, "__0.nvckpt"), os.path.join(a, "__0.copy"))
    from contextlib import closing

    from nvckpt.sharded.layout import foreign_rank_file
    from nvckpt.read.reader import ChunkReader

    with closing(ChunkReader(os.path.join(a, "__0.nvckpt"))) as f:
        meta = f.index.metadata
    save_id = meta["nvckpt.dcp"]["save_id"]
    assert foreign_rank_file(meta, save_id, "__0.nvckpt") is None
    assert "holds the shards of __0.nvckpt" in foreign_rank_file(meta, save_id, "__1.nvckpt")
    assert "another save" in foreign_rank_file(meta, "0" * 32, "__0.nvckpt")


def test_a_metadata_that_is_no_dcp_metadata_is_named_without_running_it(tmp_path, capsys):
    """verify reads the .metadata's save without unpickling it: a pickle that would run code is not run."""
    a = str(tmp_path / "A")
    _save_one_process(_state(1), a)
    import pickle

    marker = tmp_path / "ran"

    class Runs:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(os.path.join(a, ".metadata"), "wb") as f:
        pickle.dump(Runs(), f)
    code, text = _cli(capsys, "verify", a)
    assert code == 1 and ".metadata holds a posix.system" in text and "not DCP Metadata" in text, text
    assert not marker.exists()


# -- manifests that no save writes (found by tools/fuzz.py --targets all) -----------------------------
@pytest.mark.parametrize("paths,int_keys", [
    ({"model.w": ["model", ["w"]]}, None),  # a path element that is neither str nor int: TypeError in merge
    ({"model.w": []}, None),  # an empty path: the value was dropped silently
    ({"model.w": ["model", 10**9]}, None),  # a list position far beyond the values: a billion Nones appended
    ({"model.w": ["model", -1]}, None),  # IndexError
    ({"model.w": ["model", 0], "model.b": ["model", "b"]}, None),  # a list and a dict at one place: TypeError
    ({"model.w": ["model"], "model.b": ["model", "b"]}, None),  # a value where a container is: AttributeError
    ({"model.w": ["model", "w"], "model.b": ["model", "w"]}, None),  # two values at one path: one was dropped
    ({"model.w": ["model", "w"]}, {"model.w": [1]}),  # an int key that is no integer: ValueError in merge
])
def test_a_manifest_whose_paths_no_state_has_is_named(tmp_path, capsys, paths, int_keys):
    import json

    a = str(tmp_path / "A")
    _save_one_process(_state(1), a)
    where = os.path.join(a, "nvckpt-dcp.json")
    with open(where) as f:
        doc = json.load(f)
    doc["paths"].update(paths)
    if int_keys is not None:
        doc["int_keys"] = int_keys
    with open(where, "w") as f:
        json.dump(doc, f)
    code, text = _cli(capsys, "merge", a, str(tmp_path / "out.nvckpt"))
    assert code == 1 and "bad manifest" in text and "Traceback" not in text, text
    assert not os.path.exists(tmp_path / "out.nvckpt")


# -- a failed save leaves no staging directory -----------------------------------------------------
def _staging_left(folder) -> list[str]:
    return [n for n in os.listdir(folder) if n.endswith(TMPDIR_SUFFIX)]


@pytest.mark.slow
def test_a_save_failing_on_a_full_disk_leaves_no_staging_directory(tmp_path):
    """One process, a disk full after 64 KiB: the save fails naming the disk, and leaves nothing beside its
    target (before: its staging directory, until the next save)."""
    code = (
        "import resource, signal, warnings, torch, torch.distributed.checkpoint as dcp, nvckpt.dcp\n"
        "warnings.filterwarnings('ignore')\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    dcp.save({'w': torch.randn(1 << 16)}, storage_writer=nvckpt.dcp.Writer('ck', codec='raw'))\n"
        "except BaseException as exc:  # DCP's CheckpointException is a BaseException\n"
        "    print('failed:', repr(exc)[:300])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "failed:" in done.stdout and "File too large" in done.stdout, done.stdout + done.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_a_save_failing_on_one_rank_leaves_no_staging_directory(tmp_path):
    """Rank 1's disk is full; rank 0 writes its file.  The save fails on both ranks, the previous checkpoint
    stays, and neither rank's file stays in a staging directory."""
    a = str(tmp_path / "A")
    _save_one_process(_state(5), a)
    _spawn_saves(tmp_path, [a], fail_rank=1)
    assert os.path.exists(f"{a}.failed-0") and os.path.exists(f"{a}.failed-1")
    with open(f"{a}.failed-0") as f:
        assert "File too large" in f.read()  # rank 1's error as the OS gave it (EFBIG; ENOSPC on a full disk)
    assert _staging_left(tmp_path) == []
    assert torch.equal(_load(a)["model"]["w"], _state(5)["model"]["w"])
