"""nvckpt.dcp: torch.distributed.checkpoint's storage, on CPU processes over gloo.

One spawn of 2 processes trains a small FSDP2 transformer with AdamW, saves
it, saves again with ``async_save`` + nvckpt's stager while training goes on,
loads at world size 2 (FSDP2, and Shard(1)/Replicate DTensors), then saves a
third time with rank 1 killed mid-write.  One spawn of 4 loads at world size
4.  This process loads at world size 1 and checks everything bit for bit
against full state dicts the ranks saved with torch.save.
"""

from __future__ import annotations

import datetime
import io
import os
import pathlib
import shutil
import time
import warnings

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.multiprocessing.spawn import ProcessException  # noqa: E402

import nvckpt  # noqa: E402
import nvckpt.dcp  # noqa: E402
from nvckpt.sharded.layout import read_manifest  # noqa: E402

SPAWN_TIMEOUT = 150
VOCAB, WIDTH = 50, 16  # 50 rows over 4 ranks: uneven shards (13, 13, 13, 11)


# -- what the ranks run (module level: spawn pickles them by name) ---------------------------------
def _quiet() -> None:
    warnings.filterwarnings("ignore")


def _init(rank: int, world: int, store: str) -> None:
    _quiet()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))


def _model(world: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, WIDTH),
        torch.nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True),
        torch.nn.Linear(WIDTH, VOCAB),
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (4, 8), generator=g)
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _map(node, fn):
    if isinstance(node, dict):
        return {k: _map(v, fn) for k, v in node.items()}
    if isinstance(node, list):
        return [_map(v, fn) for v in node]
    return fn(node) if isinstance(node, torch.Tensor) else node


def _full(state) -> dict:
    """Every DTensor gathered (collective), everything on CPU: what torch.save can hold."""
    from torch.distributed.tensor import DTensor

    return _map(state, lambda t: t.full_tensor().clone() if isinstance(t, DTensor) else t.clone())


def _resharded_like(full, mesh):
    """A target state of DTensors sharded another way: Shard(1) for matrices, Replicate otherwise."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def other(t):
        if t.dim() == 0:
            return torch.zeros_like(t)
        return distribute_tensor(torch.zeros_like(t), mesh, [Shard(1) if t.dim() >= 2 else Replicate()])

    return _map(full, other)


def _save_and_reshard(rank: int, world: int, store: str, root: str) -> None:
    _init(rank, world, store)
    a, b = os.path.join(root, "A"), os.path.join(root, "B")
    model, opt, mesh = _model(world, seed=0)
    _step(model, opt, 1)
    state = _state(model, opt)
    full_a = _full(state)
    dcp.save(state, storage_writer=nvckpt.dcp.Writer(a))

    # async: the file holds the state at the call, though training goes on at once
    _step(model, opt, 2)
    state = _state(model, opt)
    full_b = _full(state)
    stager = nvckpt.dcp.Stager()
    ckpt_group = dist.new_group(backend="gloo")  # the save's collectives run beside training's: their own group
    future = dcp.async_save(state, storage_writer=nvckpt.dcp.Writer(b), async_stager=stager, process_group=ckpt_group)
    _step(model, opt, 3)  # changes the parameters and moments in place while the save runs
    future.result(timeout=60)
    if rank == 0:
        torch.save(full_a, os.path.join(root, "full_a.pt"))
        torch.save(full_b, os.path.join(root, "full_b.pt"))

    # load A at the same world size into a fresh FSDP2 model and optimizer
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model2, opt2, _ = _model(world, seed=123)
    target = _state(model2, opt2)
    dcp.load(target, storage_reader=nvckpt.dcp.Reader(a))
    set_state_dict(model2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    _assert_same(_full(_state(model2, opt2)), full_a, "FSDP2 at world size 2")

    # load A with another sharding
    other = _resharded_like(full_a, mesh)
    dcp.load(other, storage_reader=nvckpt.dcp.Reader(a))
    _assert_same(_full(other), full_a, "Shard(1)/Replicate at world size 2")
    dist.barrier()
    open(os.path.join(root, f"checked-{rank}"), "w").close()

    # a save that dies: rank 1 is killed while its file is half written
    if rank == 1:
        import nvckpt.session.save as save_module

        write_items = save_module.write_items

        def killed(stream, items, plan, **kw):
            kw["progress"] = lambda n: os._exit(9)
            return write_items(stream, items, plan, **kw)

        save_module.write_items = killed
    _step(model, opt, 4)
    dcp.save(_state(model, opt), storage_writer=nvckpt.dcp.Writer(a))
    open(os.path.join(root, f"survived-{rank}"), "w").close()


def _load_at(rank: int, world: int, store: str, root: str) -> None:
    _init(rank, world, store)
    model, opt, _ = _model(world, seed=7)
    target = _state(model, opt)
    reader = nvckpt.dcp.Reader(os.path.join(root, "A"))
    dcp.load(target, storage_reader=reader)
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    _assert_same(_full(_state(model, opt)), torch.load(os.path.join(root, "full_a.pt"), weights_only=True),
                 f"FSDP2 at world size {world}")
    with open(os.path.join(root, f"read-{rank}"), "w") as f:
        f.write(str(reader.bytes_read))


def _assert_same(got, want, what: str, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: {path} is a {type(got).__name__}"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {path} {got.dtype}{list(got.shape)}"
        g, w = got.contiguous().reshape(-1), want.contiguous().reshape(-1)
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), f"{what}: {path} differs"
    elif isinstance(want, dict):
        assert set(got) == set(want), f"{what}: {path} keys {sorted(map(str, got))} != {sorted(map(str, want))}"
        for k in want:
            _assert_same(got[k], want[k], what, f"{path}/{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), f"{what}: {path} length"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, what, f"{path}/{i}")
    else:
        assert got == want, f"{what}: {path} {got!r} != {want!r}"


def _spawn(fn, world: int, root: str, *, expect_exit: dict[int, int] | None = None) -> None:
    """Run ``fn(rank, world, store, root)`` in ``world`` processes, within SPAWN_TIMEOUT; kill them all if not."""
    store = os.path.join(root, f"store-{fn.__name__}-{time.monotonic_ns()}")
    ctx = mp.start_processes(fn, args=(world, store, root), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT
    try:
        while True:
            try:
                if ctx.join(timeout=max(1.0, deadline - time.monotonic())):
                    break
            except ProcessException:
                # The first failure join() saw: the killed rank, or the rank left waiting for it (either may
                # be reported first).  What counts is that the expected rank exited with its code.
                if expect_exit:
                    for i in expect_exit:
                        ctx.processes[i].join(10)
                    if all(ctx.processes[i].exitcode == code for i, code in expect_exit.items()):
                        return
                raise
            if time.monotonic() > deadline:
                pytest.fail(f"{fn.__name__} on {world} processes did not finish in {SPAWN_TIMEOUT} s")
        assert not expect_exit, f"{fn.__name__}: a process was to exit with {expect_exit}, none did"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)


# -- the tests -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    # Two ranks in processes of their own save, reshard and are killed: tens of seconds on 2 shared cores, so
    # every test that reads this directory is marked slow (the quick run keeps the single-process tests).
    root = str(tmp_path_factory.mktemp("dcp"))
    _spawn(_save_and_reshard, 2, root, expect_exit={1: 9})
    return root


def _load_single(path: str, like: dict, **reader) -> dict:
    target = _zeros_like(like)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(target, storage_reader=nvckpt.dcp.Reader(path, **reader))
    return target


def _zeros_like(node):
    return _map(node, torch.zeros_like)


def _full_a(root):
    return torch.load(os.path.join(root, "full_a.pt"), weights_only=True)


@pytest.mark.slow
def test_ranks_checked_resharding_at_world_size_2(saved):
    # FSDP2 -> FSDP2 and FSDP2 -> Shard(1)/Replicate, asserted inside the ranks
    assert os.path.exists(os.path.join(saved, "checked-0")) and os.path.exists(os.path.join(saved, "checked-1"))


@pytest.mark.slow
def test_load_on_one_process_is_bit_exact(saved):
    want = _full_a(saved)
    _assert_same(_load_single(os.path.join(saved, "A"), want), want, "world size 1")


@pytest.mark.slow
def test_async_save_holds_the_state_at_the_call(saved):
    want = torch.load(os.path.join(saved, "full_b.pt"), weights_only=True)
    _assert_same(_load_single(os.path.join(saved, "B"), want), want, "async_save")
    assert not torch.equal(want["model"]["0.weight"], _full_a(saved)["model"]["0.weight"])


@pytest.mark.slow
def test_a_killed_rank_leaves_the_previous_checkpoint(saved):
    assert not os.path.exists(os.path.join(saved, "survived-1"))
    visible = sorted(n for n in os.listdir(saved) if not n.startswith("."))
    assert [n for n in visible if n in ("A", "B")] == ["A", "B"]
    hidden = [n for n in os.listdir(saved) if n.startswith(".A.")]
    assert hidden and all(n.endswith(".nvckpt-tmpdir") for n in hidden)  # what the dead save left
    want = _full_a(saved)
    _assert_same(_load_single(os.path.join(saved, "A"), want), want, "after the killed save")


@pytest.mark.slow
def test_load_at_world_size_4_reads_only_its_rows(saved):
    _spawn(_load_at, 4, saved)
    read = []
    for r in range(4):
        with open(os.path.join(saved, f"read-{r}")) as f:
            read.append(int(f.read()))
    total = sum(os.path.getsize(os.path.join(saved, "A", f)) for f in read_manifest(os.path.join(saved, "A")).files)
    assert all(0 < n < 0.8 * total for n in read), (read, total)


@pytest.mark.slow
def test_rank_files_are_ordinary_nvckpt_files(saved):
    import hashlib

    from conformance.reference_reader import decode_file

    manifest = read_manifest(os.path.join(saved, "A"))
    assert manifest.world_size == 2 and sorted(manifest.files) == ["__0.nvckpt", "__1.nvckpt"]
    for name in manifest.files:
        path = os.path.join(saved, "A", name)
        independent = decode_file(path)  # the conformance suite's reader, which shares no code with nvckpt
        assert independent["status"] == "ok", independent
        with nvckpt.open(path) as ck:
            assert ck.metadata()["nvckpt.dcp"]["file"] == name
            assert sorted(ck.keys()) == sorted(independent["keys"])
            for key in ck.keys():
                raw = ck.get_tensor(key).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                assert hashlib.sha256(raw).hexdigest() == independent["tensors"][key]["sha256"], key
    emb = manifest.tensors["model.0.weight"]
    assert emb.shape == (VOCAB, WIDTH) and emb.coverage_gaps() == 0 and len(emb.shards) == 2


def _flip_a_byte(directory: str, shard) -> str:
    """Damage the first chunk of a stored shard; returns its rank file."""
    path = os.path.join(directory, shard.file)
    with nvckpt.open(path) as ck:
        chunk = ck.file.entry(shard.tensor).chunks[0]
    with open(path, "r+b") as f:
        f.seek(chunk.offset + chunk.stored_length // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    return path


@pytest.mark.slow
def test_corrupt_shard_names_rank_file_and_tensor(saved, tmp_path):
    copy = str(tmp_path / "A")
    shutil.copytree(os.path.join(saved, "A"), copy)
    shard = read_manifest(copy).tensors["model.0.weight"].shards[1]
    path = _flip_a_byte(copy, shard)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as info:  # DCP's wrapper (a BaseException) of each rank's error
        _load_single(copy, _full_a(saved))
    (error, _), = info.value.failures.values()
    assert isinstance(error, nvckpt.ChecksumError)
    assert error.path == path and error.tensor == shard.tensor and str(info.value).count(shard.file)


@pytest.mark.slow
def test_stale_staging_is_removed_by_the_next_save(saved, tmp_path):
    target = str(tmp_path / "C")
    shutil.copytree(os.path.join(saved, "A"), target)
    stale = str(tmp_path / ".C.0badf00d.nvckpt-tmpdir")
    os.mkdir(stale)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({"x": torch.arange(5)}, storage_writer=nvckpt.dcp.Writer(target))
    assert sorted(os.listdir(tmp_path)) == ["C"]  # the stale staging directory is gone
    assert torch.equal(_load_single(target, {"x": torch.zeros(5, dtype=torch.long)})["x"], torch.arange(5))


def test_a_failed_saves_staging_is_removed_by_the_next_save_in_the_same_process(tmp_path):
    """The failed Writer can outlive the save (DCP's future holds the exception's traceback): its staging
    directory is stale as soon as its own write fails, and the next save removes it."""
    from torch.distributed.checkpoint.api import CheckpointException

    target = str(tmp_path / "F")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({"a": torch.ones(3)}, storage_writer=nvckpt.dcp.Writer(target))
        kept = []
        writer = nvckpt.dcp.Writer(target)
        with pytest.raises(CheckpointException):
            dcp.save({"a": torch.ones(3), "m": torch.empty(3, device="meta")}, storage_writer=writer)
        kept.append(writer)  # alive, as a traceback would keep it
        dcp.save({"a": torch.full((3,), 4.0)}, storage_writer=nvckpt.dcp.Writer(target))
    assert sorted(os.listdir(tmp_path)) == ["F"]
    assert torch.equal(_load_single(target, {"a": torch.zeros(3)})["a"], torch.full((3,), 4.0))


@pytest.mark.slow
def test_an_overwrite_keeps_the_users_files_in_the_directory(saved, tmp_path):
    """As FileSystemWriter, which writes its files into DIR: a config or an export beside the checkpoint
    stays; the old checkpoint's own files (FileSystemWriter's .distcp too) are replaced."""
    target = tmp_path / "D"
    shutil.copytree(os.path.join(saved, "A"), target)
    (target / "config.yaml").write_text("lr: 1")
    (target / "export").mkdir()
    (target / "export" / "model.bin").write_bytes(b"weights")
    (target / "__0_0.distcp").write_bytes(b"an older FileSystemWriter shard")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({"x": torch.arange(5)}, storage_writer=nvckpt.dcp.Writer(str(target)))
    assert sorted(os.listdir(target)) == [".metadata", "__0.nvckpt", "config.yaml", "export", "nvckpt-dcp.json"]
    assert (target / "config.yaml").read_text() == "lr: 1" and (target / "export" / "model.bin").read_bytes() == b"weights"
    assert torch.equal(_load_single(str(target), {"x": torch.zeros(5, dtype=torch.long)})["x"], torch.arange(5))


# -- the command line on a DCP directory -------------------------------------------------------------
def _cli(capsys, *argv):
    from nvckpt.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.slow
def test_cli_info_ls_verify_on_a_directory(saved, capsys):
    a = os.path.join(saved, "A")
    code, out = _cli(capsys, "info", a)
    assert code == 0 and "world size 2" in out and "__1.nvckpt" in out
    code, out = _cli(capsys, "ls", a)
    assert code == 0 and "model/0.weight" in out and "[50, 16]" in out  # named as in a file
    code, out = _cli(capsys, "verify", a)
    assert code == 0 and out.startswith("OK")


@pytest.mark.slow
def test_cli_verify_names_missing_and_damaged_rank_files(saved, tmp_path, capsys):
    copy = str(tmp_path / "A")
    shutil.copytree(os.path.join(saved, "A"), copy)
    shard = read_manifest(copy).tensors["model.0.weight"].shards[0]
    _flip_a_byte(copy, shard)
    code, out = _cli(capsys, "verify", copy)
    assert code == 1 and f"{shard.file}: " in out and repr(shard.tensor) in out and "checksum" in out
    other = "__1.nvckpt" if shard.file == "__0.nvckpt" else "__0.nvckpt"
    os.unlink(os.path.join(copy, other))
    code, out = _cli(capsys, "verify", copy)
    assert code == 1 and f"rank file {other} is missing" in out
    code, out = _cli(capsys, "info", copy)
    assert code == 1 and f"rank file {other} is missing" in out
    code, out = _cli(capsys, "ls", copy)  # a script that checks with ls learns it too
    assert code == 1 and f"warning: rank file {other} is missing" in out and "model/0.weight" in out


def test_split_takes_codec_and_level_without_a_warning(tmp_path, capsys):
    src = str(tmp_path / "s.nvckpt")
    nvckpt.save({"w": torch.arange(4096.0)}, src)
    code, out = _cli(capsys, "split", src, str(tmp_path / "d"), "--codec", "zstd", "--level", "19")
    assert code == 0 and "not compressed" not in out
    (name,) = [f for f in os.listdir(tmp_path / "d") if f.endswith(".nvckpt")]
    with nvckpt.open(str(tmp_path / "d" / name)) as f:
        assert "level=19" in f.file.pipelines[-1].describe()


def test_a_keyboard_interrupt_in_write_data_is_not_handed_to_torchs_future(tmp_path):
    """torch's Future takes Exceptions only: Ctrl-C during a split printed an AssertionError traceback.  The
    interrupted save leaves nothing behind (its staging goes)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Interrupted(DefaultSavePlanner):  # Ctrl-C while the rank gathers its items
        def resolve_data(self, write_item):
            raise KeyboardInterrupt

    w = nvckpt.dcp.Writer(str(tmp_path / "ck"))
    planner = Interrupted()
    planner.set_up_planner({"w": torch.ones(3)}, is_coordinator=True)
    plan = w.prepare_global_plan([planner.create_local_plan()])[0]
    assert os.listdir(tmp_path)  # the staging
    with pytest.raises(KeyboardInterrupt):
        w.write_data(plan, planner)
    assert os.listdir(tmp_path) == []


def test_a_rank_file_of_another_save_and_a_damaged_metadata_are_named(tmp_path, capsys):
    """A rank file copied in from another save of the same shapes would load as part of this one: the
    Reader and verify compare the save_id it records; a missing or cut .metadata is named by both too."""
    from torch.distributed.checkpoint.api import CheckpointException

    a, b = str(tmp_path / "A"), str(tmp_path / "B")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({"x": torch.arange(5)}, storage_writer=nvckpt.dcp.Writer(a, codec="raw"))
        dcp.save({"x": torch.arange(5) * 2}, storage_writer=nvckpt.dcp.Writer(b, codec="raw"))
    shutil.copy(os.path.join(b, "__0.nvckpt"), os.path.join(a, "__0.nvckpt"))
    with pytest.raises(CheckpointException) as caught:
        _load_single(a, {"x": torch.zeros(5, dtype=torch.long)})
    assert "written by another save" in repr(caught.value.failures)
    code, out = _cli(capsys, "verify", a)
    assert code == 1 and "rank file __0.nvckpt was written by another save" in out
    meta = pathlib.Path(b, ".metadata")
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    code, out = _cli(capsys, "verify", b)
    assert code == 1 and ".metadata is damaged" in out
    os.unlink(meta)
    code, out = _cli(capsys, "verify", b)
    assert code == 1 and ".metadata is missing" in out
    with pytest.raises(CheckpointException) as caught:
        _load_single(b, {"x": torch.zeros(5, dtype=torch.long)})
    assert ".metadata is missing" in repr(caught.value.failures)


class _Opaque:  # a class torch.load(weights_only=True) refuses to rebuild
    pass


def test_merge_of_a_value_torch_refuses_to_unpickle_is_one_line_without_torchs_advice(tmp_path, capsys):
    blob = io.BytesIO()
    torch.save(_Opaque(), blob)
    blob.seek(0)
    target = str(tmp_path / "O")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({"x": torch.arange(3), "extra": blob}, storage_writer=nvckpt.dcp.Writer(target))
    code, out = _cli(capsys, "merge", target, str(tmp_path / "o.nvckpt"))
    assert code != 0 and "refuses" in out and "'extra'" in out
    assert "weights_only=False" not in out and "Traceback" not in out


@pytest.mark.slow
def test_merge_and_split(saved, tmp_path, capsys):
    want = _full_a(saved)
    merged = str(tmp_path / "merged.nvckpt")
    code, out = _cli(capsys, "merge", os.path.join(saved, "A"), merged)
    assert code == 0, out
    got = nvckpt.load(merged)
    _assert_same(got["model"], want["model"], "merge")
    _assert_same(got["optim"]["state"], want["optim"]["state"], "merge")
    assert got["optim"]["param_groups"][0]["lr"] == want["optim"]["param_groups"][0]["lr"]
    split = str(tmp_path / "split")
    code, out = _cli(capsys, "split", merged, split)
    assert code == 0, out
    assert read_manifest(split).world_size == 1
    _assert_same(_load_single(split, want), want, "merge then split")
    st = str(tmp_path / "a.safetensors")
    code, out = _cli(capsys, "convert", os.path.join(saved, "A"), st)
    assert code == 0, out
    from safetensors.torch import load_file

    assert torch.equal(load_file(st)["model/0.weight"], want["model"]["0.weight"])


def test_overlapping_saves_to_one_directory_the_newest_wins(tmp_path):
    """A dcp save still writing when the next one to the same directory starts: the later one neither deletes
    the running one's staging directory nor is replaced by it when it finishes later (it is refused)."""
    import glob
    import threading
    import warnings

    import torch.distributed.checkpoint as dcp

    target = str(tmp_path / "ck")
    big = {f"w{i}": torch.randn(256, 1024) for i in range(24)}
    out = {}

    def first():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(dict(big, step=torch.tensor(1)), storage_writer=nvckpt.dcp.Writer(target, codec="zstd", zstd_level=12,
                                                                                chunk_size=64 << 10, workers=1),
                         no_dist=True)
            out["first"] = "ok"
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            out["first"] = str(exc)

    t = threading.Thread(target=first)
    t.start()
    deadline = time.monotonic() + 60
    while not glob.glob(str(tmp_path / ".ck.*.nvckpt-tmpdir" / ".__0*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"step": torch.tensor(2)}, storage_writer=nvckpt.dcp.Writer(target), no_dist=True)
    t.join(120)
    assert "published there first" in out["first"], out
    got = {"step": torch.tensor(0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, storage_reader=nvckpt.dcp.Reader(target), no_dist=True)
    assert int(got["step"]) == 2
    assert not glob.glob(str(tmp_path / ".ck.*"))  # nothing of the older save stays


def test_split_then_merge_keeps_an_optimizers_int_keys(tmp_path, capsys):
    """DCP writes every dict key as str; split records which were ints, so merge gives back a state dict an
    optimizer loads with its moments (before: keys '0', '1', and load_state_dict silently lost them)."""
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    src, split, back = str(tmp_path / "s.nvckpt"), str(tmp_path / "d"), str(tmp_path / "b.nvckpt")
    nvckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "by_name": {"0": torch.ones(1)}}, src)
    assert _cli(capsys, "split", src, split)[0] == 0
    assert _cli(capsys, "merge", split, back)[0] == 0
    got = nvckpt.load(back)
    assert list(got["optim"]["state"]) == [0, 1] and list(got["by_name"]) == ["0"]
    opt2 = torch.optim.Adam(torch.nn.Linear(8, 4).parameters())
    opt2.load_state_dict(got["optim"])
    assert all(torch.equal(opt2.state_dict()["state"][k]["exp_avg"], opt.state_dict()["state"][k]["exp_avg"]) for k in (0, 1))


def test_dcp_default_reader_on_an_nvckpt_directory_says_which_reader_to_use(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    target = str(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3)}, storage_writer=nvckpt.dcp.Writer(target), no_dist=True)
        with pytest.raises(BaseException, match="nvckpt.dcp.Reader"):  # DCP wraps it in a CheckpointException
            dcp.load({"w": torch.zeros(3)}, checkpoint_id=target, no_dist=True)


def test_split_into_a_folder_it_must_not_replace_is_one_line(tmp_path, capsys):
    """An error inside dcp.save (DCP wraps it in a CheckpointException with every rank's traceback) is
    nvckpt's own one-line error and exit code."""
    src = str(tmp_path / "s.nvckpt")
    nvckpt.save({"x": torch.ones(2)}, src)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, out = _cli(capsys, "split", src, str(other))
    assert code == 2 and "exists (a directory that is not empty)" in out and "--force" in out, out
    code, out = _cli(capsys, "split", src, str(other), "--force")
    assert code == 4 and "holding other files" in out and "Traceback" not in out, out
    assert (other / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_files_several_ranks_read_are_read_through_the_page_cache(saved, monkeypatch):
    """A reshard (every rank reads a box of every stored shard) reads those rank files buffered, so one
    read from the disk serves every rank on the host; a file one rank alone reads keeps O_DIRECT."""
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    import nvckpt.dcp.reader as reader_module

    reader = nvckpt.dcp.Reader(os.path.join(saved, "A"))
    reader.set_up_storage_reader(reader.read_metadata(), True)
    by_file: dict[str, list] = {}
    for index, loc in reader.storage_data.items():
        by_file.setdefault(loc.file, []).append(index)

    def item(index):
        return ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=torch.Size([0]),
                        storage_index=index, storage_offsets=torch.Size([0]), lengths=torch.Size([1]))

    plans = [LoadPlan([item(i) for i in by_file["__0.nvckpt"][:2] + by_file["__1.nvckpt"][:2]]),
             LoadPlan([item(i) for i in by_file["__1.nvckpt"][2:4]])]
    out = reader.prepare_global_plan(plans)
    assert [p.storage_data["shared_files"] for p in out] == [["__1.nvckpt"], ["__1.nvckpt"]]
    assert [p.items for p in out] == [p.items for p in plans]

    opened = []

    class Opened(Exception):
        pass

    class Recording:
        def __init__(self, source, options):  # a rank file's byte source, from the directory
            opened.append((os.path.basename(source.name), options.gpu.direct_io))
            source.close()
            raise Opened  # stop the read here: only how the file was opened matters

    class Planner:
        def resolve_tensor(self, item):
            return torch.empty(item.lengths)

    monkeypatch.setattr(reader_module, "Checkpoint", Recording)
    for plan in out:
        with pytest.raises(Opened):
            reader.read_data(plan, Planner()).wait()
    assert opened == [("__0.nvckpt", True), ("__1.nvckpt", False)]
