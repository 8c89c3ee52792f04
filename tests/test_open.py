"""nvckpt.open(): names, metadata, lazy reads, errors, threads; load(keys=...)."""

from __future__ import annotations

import enum
import io
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import nvckpt
from conftest import assert_tensor_equal, assert_tree_equal, small_training_state, tensors_of


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    state = small_training_state()
    path = tmp_path_factory.mktemp("open") / "state.nvckpt"
    meta = {"step": 3, "run": "tiny", "lrs": [1e-3, 5e-4], "ok": True, "none": None, "nested": {"a": {"b": 1}}}
    nvckpt.save(state, path, metadata=meta, chunk_size=2048)
    return path, state, meta


def test_keys_metadata_writer(saved):
    path, state, meta = saved
    with nvckpt.open(path) as ck:
        keys = ck.keys()
        expected = [f"model/{k}" for k in state["model"]]
        expected += [f"optimizer/state/{i}/{k}" for i, s in state["optimizer"]["state"].items() for k in s]
        expected += ["rng"]
        assert keys == expected
        assert "model/head.weight" in keys and "model/embed.weight" in keys  # tied: the alias path is a key too
        assert len(ck) == len(keys) and list(ck) == keys and "rng" in ck and "nope" not in ck
        assert ck.metadata() == meta
        writer = ck.writer()
        assert writer["name"] == "nvckpt" and writer["version"] == nvckpt.__version__
        assert writer["torch"] == torch.__version__.split("+")[0]
        for key in keys:
            value = state
            for part in key.split("/"):
                value = value[int(part)] if isinstance(value, dict) and part.isdigit() and int(part) in value else value[part]
            assert_tensor_equal(ck.get_tensor(key), value, key)


def test_tensor_not_found(saved):
    path, _, _ = saved
    with nvckpt.open(path) as ck:
        with pytest.raises(nvckpt.TensorNotFoundError) as info:
            ck.get_tensor("model/missing.weight")
        assert isinstance(info.value, KeyError) and isinstance(info.value, nvckpt.NvckptError)
        assert "model/missing.weight" in str(info.value) and str(path) in str(info.value)
        with pytest.raises(KeyError):
            ck.get_slice("step")  # a scalar, not a tensor
        with pytest.raises(nvckpt.TensorNotFoundError):
            ck.load(keys=["model/pos", "nope"])


def test_load_keys_returns_just_those(saved):
    path, state, _ = saved
    wanted = ["model/pos", "optimizer/state/0/exp_avg", "model/head.weight", "model/embed.weight"]
    got = nvckpt.load(path, keys=wanted)
    assert list(got) == wanted
    assert_tensor_equal(got["model/pos"], state["model"]["pos"])
    assert_tensor_equal(got["optimizer/state/0/exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert_tensor_equal(got["model/head.weight"], state["model"]["embed.weight"])
    assert got["model/head.weight"] is got["model/embed.weight"]
    assert nvckpt.load(path, keys=[]) == {}


def test_full_load_round_trips(saved):
    path, state, _ = saved
    back = nvckpt.load(path)
    assert_tree_equal(back, state)
    assert back["model"]["head.weight"] is back["model"]["embed.weight"]


def test_open_is_lazy(saved):
    path, state, _ = saved
    with nvckpt.open(path) as ck:
        after_open = ck.bytes_read
        ck.keys(), ck.metadata()
        assert ck.bytes_read == after_open
        entry = ck.index.tensors[ck.index.paths["model/pos"]]
        ck.get_tensor("model/pos")
        assert ck.bytes_read - after_open == entry.stored_bytes


@pytest.mark.parametrize("source", ["path", "stream"])
def test_concurrent_reads_from_threads(saved, source):
    path, state, _ = saved
    truth = {}
    with nvckpt.open(path) as ck:
        for key in ck.keys():
            truth[key] = ck.get_tensor(key).clone()
    target = path if source == "path" else io.BytesIO(path.read_bytes())
    rng = random.Random(0)
    jobs = []
    for _ in range(400):
        key = rng.choice(list(truth))
        t = truth[key]
        if t.dim() and t.shape[0] > 1 and rng.random() < 0.5:
            a = rng.randrange(t.shape[0])
            b = rng.randrange(a, t.shape[0] + 1)
            jobs.append((key, slice(a, b)))
        else:
            jobs.append((key, None))

    with nvckpt.open(target) as ck:
        def work(job):
            key, index = job
            got = ck.get_tensor(key) if index is None else ck.get_slice(key)[index]
            return key, index, got

        with ThreadPoolExecutor(8) as pool:
            for key, index, got in pool.map(work, jobs):
                expected = truth[key] if index is None else truth[key][index]
                assert_tensor_equal(got, expected, f"{key}[{index}]")


def test_concurrent_loads_of_big_multichunk_tensor(tmp_path):
    big = torch.randn(2048, 128)
    path = tmp_path / "big.nvckpt"
    nvckpt.save({"big": big}, path, chunk_size=16 << 10, codec="zstd")
    with nvckpt.open(path, workers=4) as ck:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: ck.get_slice("big")[i * 100: i * 100 + 357], range(18)))
            wholes = list(pool.map(lambda _: ck.get_tensor("big"), range(4)))
    for i, got in enumerate(results):
        assert_tensor_equal(got, big[i * 100: i * 100 + 357])
    for got in wholes:
        assert_tensor_equal(got, big)


def test_checkpoint_from_stream_and_tensors_list(saved):
    path, state, _ = saved
    with nvckpt.open(io.BytesIO(path.read_bytes())) as ck:
        assert_tree_equal(ck.load(), state)
    assert len(tensors_of(state)) > 10


def test_max_tensor_bytes_refuses_before_allocating(tmp_path, monkeypatch):
    """A caller's limit on what one read materializes (SPEC 16, 20): a small file may declare a huge tensor."""
    path = tmp_path / "limit.nvckpt"
    nvckpt.save({"big": torch.zeros(512, 1024), "small": torch.arange(10)}, path, chunk_size=4096)
    assert path.stat().st_size < 128 * 1024  # zeros: 2 MiB of tensor in a small file (with either zstd backend)
    allocated = []
    real_empty = torch.empty

    def watch(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        allocated.append(t.numel() * t.element_size())
        return t

    with nvckpt.open(path, max_tensor_bytes=4096) as ck:
        assert torch.equal(ck.get_tensor("small"), torch.arange(10))
        assert torch.equal(ck.get_slice("big")[:1], torch.zeros(1, 1024))  # one 4 KiB row fits
        monkeypatch.setattr(torch, "empty", watch)
        with pytest.raises(nvckpt.LimitError, match="max_tensor_bytes=4096") as info:
            ck.get_tensor("big")
        assert info.value.tensor == "big"
        with pytest.raises(nvckpt.LimitError):
            ck.get_slice("big")[:2]
        with pytest.raises(nvckpt.LimitError):
            ck.load()
        assert not any(n > 4096 for n in allocated)
    monkeypatch.undo()
    with pytest.raises(ValueError):
        nvckpt.open(path, max_tensor_bytes=-1)
    assert nvckpt.load(path, max_tensor_bytes=None)["big"].shape == (512, 1024)


def test_a_path_that_is_a_pipe_is_refused_as_one(tmp_path):
    """A FIFO path (a shell's <(cat f), /dev/stdin from a pipe) was reported as a damaged 0-byte file."""
    import errno
    import threading

    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    data = io.BytesIO()
    nvckpt.save({"x": torch.ones(4)}, data)

    def feed() -> None:
        fd = os.open(fifo, os.O_WRONLY)  # waits for the reader's open
        try:
            os.write(fd, data.getvalue())
        except BrokenPipeError:  # the reader refused the pipe and closed it
            pass
        finally:
            os.close(fd)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    with pytest.raises(OSError, match="does not seek") as err:
        nvckpt.load(fifo)
    assert err.value.errno == errno.ESPIPE and err.value.filename == fifo
    writer.join(5)


def test_tensor_name_is_the_path_of_the_key_as_stored():
    # A key that is a subclass (an int-valued enum) is stored as its base type, so its path is
    # str() of the stored key; the entry used to be named after str() of the enum ("Key.A").
    class Key(int, enum.Enum):
        A = 1

    stream = io.BytesIO()
    nvckpt.save({Key.A: torch.ones(2)}, stream)
    stream.seek(0)
    with nvckpt.open(stream) as ck:
        assert ck.keys() == ["1"]
        assert [e.name for e in ck.index.tensors] == ["1"]


def test_reading_a_closed_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "c.nvckpt"
    nvckpt.save({"w": torch.ones(2)}, path)
    ck = nvckpt.open(path)
    ck.close()
    # Used to be AttributeError: 'NoneType' object has no attribute 'seek'.
    with pytest.raises(nvckpt.NvckptError, match="closed"):
        ck.get_tensor("w")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_a_checkpoint_dropped_without_close_closes_its_file(tmp_path):
    # nvckpt.open(p)["w"] (no with, no close) kept one descriptor per call until "Too many open files".
    import gc

    path = tmp_path / "f.nvckpt"
    nvckpt.save({"w": torch.arange(10.0)}, path)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        assert float(nvckpt.open(path)["w"][3]) == 3.0
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before + 2


def test_metadata_is_a_copy_for_each_call_and_keys_of_a_wrong_type_are_named():
    buf = io.BytesIO()
    nvckpt.save({"1": torch.ones(1)}, buf, metadata={"run": "a", "tags": ["x"]})
    buf.seek(0)
    with nvckpt.open(buf) as f:
        md = f.metadata()
        md["run"] = "b"
        md["tags"].append("y")
        assert f.metadata() == {"run": "a", "tags": ["x"]}
        with pytest.raises(TypeError, match="keys must be a str path .* got int 1"):
            f.load(keys=1)
        assert torch.equal(f.load(keys="1"), torch.ones(1))


def test_gpu_loader_reads_the_file_the_checkpoint_opened(tmp_path):
    """An atomic save over an open checkpoint's path must not change what the GPU loader's reads see."""
    from nvckpt.format.structs import xxh3
    from nvckpt.io.source import LocalFile

    path = tmp_path / "ck.nvckpt"
    nvckpt.save({"a": torch.arange(100000.0)}, path, codec="raw")
    with nvckpt.open(path) as ck:
        chunk = ck.index.tensors[0].chunks[0]
    reader = LocalFile(path)
    try:
        nvckpt.save({"a": torch.arange(100000.0) + 1}, path, codec="raw")  # replaces the file
        files = reader.range_reads(True)
        try:
            head = chunk.offset % 4096
            buf = torch.empty(1 << 20, dtype=torch.uint8)
            view = files.read(chunk.offset - head, 1 << 19, head + chunk.stored_length, memoryview(buf.numpy()))
            assert xxh3(view[head: head + chunk.stored_length]) == chunk.checksum
        finally:
            files.close()
    finally:
        reader.close()


def test_close_while_other_threads_read_gives_named_errors_and_right_bytes(tmp_path):
    path = tmp_path / "f.nvckpt"
    tensors = {f"t{i}": torch.arange(50_000, dtype=torch.float32) * i for i in range(8)}
    nvckpt.save(tensors, path, chunk_size=16 << 10)
    for _ in range(5):
        ck = nvckpt.open(path, workers=4)
        errors: list[str] = []
        start = threading.Barrier(9)

        def reader(k: int) -> None:
            start.wait()
            for r in range(40):
                name = f"t{(k + r) % 8}"
                try:
                    t = ck.get_tensor(name)
                except nvckpt.NvckptError:
                    continue  # closed: a named error
                except Exception as exc:  # noqa: BLE001 - the property under test
                    errors.append(f"{type(exc).__name__}: {exc}")
                    return
                if not torch.equal(t, tensors[name]):
                    errors.append(f"{name}: wrong bytes")

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        start.wait()
        ck.close()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        with pytest.raises(nvckpt.NvckptError, match="closed"):
            ck.get_tensor("t1")
