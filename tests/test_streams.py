"""Bugs found in review: each test failed before its fix."""

from __future__ import annotations

import enum
import io
import warnings
import os
import threading
import time

import numpy as np
import pytest
import torch

import nvckpt
from conftest import assert_tensor_equal, forked_exit_code


def _nested_dicts(levels: int) -> dict:
    """``levels`` dicts, each inside the one before (the outermost is level 1)."""
    root: dict = {}
    node = root
    for _ in range(levels - 1):
        node["a"] = {}
        node = node["a"]
    return root


def test_metadata_nested_65_deep_is_refused_by_save():
    # The reader rejects metadata nested deeper than 64 (SPEC 8.6, the map itself is level 1);
    # save used to count from 0 and write a file that then could not be opened.
    with pytest.raises(nvckpt.LimitError):
        nvckpt.save({"w": torch.ones(2)}, io.BytesIO(), metadata=_nested_dicts(65))
    stream = io.BytesIO()
    nvckpt.save({"w": torch.ones(2)}, stream, metadata=_nested_dicts(64))
    stream.seek(0)
    with nvckpt.open(stream) as ck:
        assert ck.metadata() == _nested_dicts(64)


def test_tree_of_64_containers_with_leaves_inside_saves_and_loads():
    # SPEC 9 counts containers (the root is depth 1): 64 nested lists are legal, whatever leaf
    # the innermost holds.  save used to count the leaf as a level and refuse the tree.
    for leaf in (7, torch.arange(3)):
        obj: object = leaf
        for _ in range(64):
            obj = [obj]
        stream = io.BytesIO()
        nvckpt.save(obj, stream)
        stream.seek(0)
        back = nvckpt.load(stream)
        for _ in range(64):
            assert isinstance(back, list) and len(back) == 1
            back = back[0]
        if isinstance(leaf, torch.Tensor):
            assert_tensor_equal(back, leaf)
        else:
            assert back == leaf
    with pytest.raises(nvckpt.LimitError):
        nvckpt.save([obj], io.BytesIO())  # 65 containers


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


def test_get_slice_with_a_bool_index_follows_torch():
    # A Python bool is an int, but torch reads x[True] as a mask that adds a dimension;
    # get_slice used to return row 1 instead.
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    stream = io.BytesIO()
    nvckpt.save({"w": w}, stream)
    stream.seek(0)
    with nvckpt.open(stream) as ck:
        s = ck.get_slice("w")
        for index in (True, False, (True, 1)):
            assert_tensor_equal(s[index], w[index], repr(index))


class _DiskFull(io.RawIOBase):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if self.written + n > self.limit:
            raise OSError(28, "No space left on device")
        self.written += n
        return n


def test_a_closed_cpu_encoder_leaves_no_work_on_the_shared_threads(monkeypatch):
    # The CPU engine's threads are the process's (nvckpt._threads): a save that ends early (a full
    # disk, an error in the writer: its generator is closed) drops its queued chunks and waits for the
    # running ones, so that no task reads the tensors or the engine's buffers once the save has returned.
    import nvckpt.engines.cpu as cpu
    from nvckpt.codecs.presets import chooser
    from nvckpt.plan.walk import plan_save

    started, ended = [], []
    encode_group = cpu._encode_group

    def slow(items, buffers):
        started.append(1)
        time.sleep(0.05)
        try:
            return encode_group(items, buffers)
        finally:
            ended.append(1)

    monkeypatch.setattr(cpu, "_encode_group", slow)
    state = {f"w{i}": torch.randn(256, 1024, generator=torch.Generator().manual_seed(i)) for i in range(16)}
    items = cpu.encode_cpu(plan_save(state, chunk_size=1 << 20), chooser("portable"), workers=2)
    next(items)
    items.close()
    assert len(ended) == len(started) < 16  # the running ones were waited for, the queued ones dropped
    time.sleep(0.2)
    assert len(started) == len(ended)  # and none started later


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


def test_a_sink_that_cannot_start_leaves_no_fd_and_no_temporary_file(tmp_path, monkeypatch):
    import mmap
    import os

    path = tmp_path / "ck.nvckpt"
    nvckpt.save({"a": torch.ones(3)}, path)
    before = path.read_bytes()
    fds = len(os.listdir("/proc/self/fd"))

    def no_memory(*args, **kwargs):
        raise MemoryError("no staging memory")

    from nvckpt.io import sink

    monkeypatch.setattr(mmap, "mmap", no_memory)
    monkeypatch.setattr(sink._POOL, "_free", {})  # no staging block kept from an earlier save either
    with pytest.raises(MemoryError):
        nvckpt.save({"a": torch.zeros(3)}, path)
    assert len(os.listdir("/proc/self/fd")) == fds
    assert sorted(os.listdir(tmp_path)) == ["ck.nvckpt"] and path.read_bytes() == before


def test_bool_tensor_with_bytes_other_than_0_and_1_is_stored_as_torch_reads_it(tmp_path):
    """A uint8 tensor viewed as bool (or torch.empty) may hold 2..255: stored as True (1), so the file is one
    its reader and `nvckpt verify` accept (SPEC 10), and the values torch showed are the values loaded."""
    raw = torch.tensor([0, 1, 2, 255, 0, 7], dtype=torch.uint8)
    mask = raw.view(torch.bool)
    state = {"mask": mask, "strided": mask[::2], "fine": torch.tensor([True, False]), "empty": torch.empty(0, dtype=torch.bool)}
    path = tmp_path / "b.nvckpt"
    nvckpt.save(state, path)
    back = nvckpt.load(path)
    assert back["mask"].tolist() == [False, True, True, True, False, True]
    assert back["mask"].view(torch.uint8).tolist() == [0, 1, 1, 1, 0, 1]
    assert back["strided"].tolist() == [False, True, False] and back["fine"].tolist() == [True, False]
    assert raw.tolist() == [0, 1, 2, 255, 0, 7]  # the caller's tensor is not changed
    from nvckpt.tools.verify import verify

    report = verify(path)
    assert report.ok, report.problems


def test_a_checkpoint_in_a_stream_after_a_header_is_read_from_where_it_begins():
    """save writes at the stream's position; load and open read from the position the stream has (as
    torch.load does), and a stream left at its end is read from its start."""
    buf = io.BytesIO()
    buf.write(b"MYHEADER\n")
    start = buf.tell()
    nvckpt.save({"w": torch.arange(5.0)}, buf)
    buf.seek(start)
    assert nvckpt.load(buf)["w"].tolist() == [0.0, 1, 2, 3, 4]
    buf.seek(start)
    with nvckpt.open(buf) as ck:
        assert ck.keys() == ["w"]
    plain = io.BytesIO()
    nvckpt.save({"x": 1}, plain)
    assert nvckpt.load(plain) == {"x": 1}  # written, not rewound
    buf.seek(0)
    with pytest.raises(nvckpt.FormatError, match="not an nvckpt file"):
        nvckpt.load(buf)  # the header is not a checkpoint


class _Precision(str, enum.Enum):  # as Lightning's precision names: a str that is also an enum member
    BF16 = "bf16-mixed"


class _Level(enum.IntEnum):
    HIGH = 3


def test_enum_members_are_stored_as_the_str_or_int_they_are():
    # str() of a (str, Enum) member is "Cls.MEMBER" on Python 3.11+: saved as that, it changed the value.
    state = {"hparams": {"precision": _Precision.BF16, "level": _Level.HIGH},
             _Precision.BF16: torch.ones(1), "names": {_Precision.BF16}}
    buf = io.BytesIO()
    nvckpt.save(state, buf)
    buf.seek(0)
    got = nvckpt.load(buf)
    assert got["hparams"] == {"precision": "bf16-mixed", "level": 3}
    assert type(got["hparams"]["precision"]) is str and type(got["hparams"]["level"]) is int
    assert set(got) == {"hparams", "bf16-mixed", "names"} and got["names"] == {"bf16-mixed"}


def test_an_int_too_large_for_a_reader_is_refused_at_save():
    # SPEC 16: a reader refuses big integers over 1024 bytes; save wrote them, and the file did not load.
    ok = io.BytesIO()
    nvckpt.save({"seed": 1 << 8190}, ok)  # 1024 bytes: the limit itself
    ok.seek(0)
    assert nvckpt.load(ok)["seed"] == 1 << 8190
    with pytest.raises(nvckpt.LimitError, match="integer at seed takes 1026 bytes"):
        nvckpt.save({"w": torch.ones(2), "seed": 2 ** 8200}, io.BytesIO())


def test_a_views_base_takes_a_name_no_tensor_of_the_state_has():
    # SPEC 14.3: "<first view>@base", else another unique name; a tensor named "w@base" made the save fail.
    buf = torch.arange(20.0)
    state = {"w": buf[:10], "v": buf[5:15], "w@base": torch.ones(3), "w@base1": torch.zeros(2)}
    out = io.BytesIO()
    nvckpt.save(state, out)
    out.seek(0)
    got = nvckpt.load(out)
    for k, v in state.items():
        assert_tensor_equal(got[k], v)
    got["w"][7] = -1.0  # still views of one storage
    assert float(got["v"][2]) == -1.0
    out.seek(0)
    with nvckpt.open(out) as f:
        assert "w@base2" in {e.name for e in f._file.index.tensors}


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


def test_rows_of_views_and_derived_tensors_are_read_without_building_them_whole():
    # A slice of a view of a flat buffer (or of a bf16 rounding stored as derived) built the whole base first:
    # with max_tensor_bytes a 512-byte read was refused, naming the internal "@base" entry.
    torch.manual_seed(0)
    flat = torch.randn(1000, 64)
    master = torch.randn(300, 64)
    state = {"a": flat[:500], "b": flat[500:], "t": flat[:64].t(), "master": master, "w": master.to(torch.bfloat16)}
    buf = io.BytesIO()
    nvckpt.save(state, buf, derive=True)
    buf.seek(0)
    with nvckpt.open(buf, max_tensor_bytes=64 * 1024) as f:
        assert f._file.entry("w").derived is not None and f._file.entry("a").view is not None
        assert_tensor_equal(f.get_slice("a")[0:2], flat[0:2])
        assert_tensor_equal(f.get_slice("b")[3], flat[503])
        assert_tensor_equal(f.get_slice("b")[[1, 7, 2]], flat[500:][[1, 7, 2]])
        assert_tensor_equal(f.read_box("b", (10, 5), (2, 7)), flat[510:512, 5:12])
        assert_tensor_equal(f.get_slice("w")[5:9], master[5:9].to(torch.bfloat16))
        assert_tensor_equal(f.read_box("w", (0, 0), (1, 64)), master[:1].to(torch.bfloat16))
        with pytest.raises(nvckpt.LimitError):  # a transposed view has no rows of its own: built whole (128 KB)
            f.get_slice("t")[0:1]
    buf.seek(0)
    with nvckpt.open(buf) as f:
        assert_tensor_equal(f.get_slice("t")[3:5], flat[:64].t()[3:5])


def test_checkpoints_saved_back_to_back_in_one_stream_load_in_turn():
    """As torch.load: a load leaves the stream just after its checkpoint, and a checkpoint followed by more
    bytes (a second save into the same stream) is not taken for a damaged one."""
    buf = io.BytesIO()
    nvckpt.save({"a": torch.ones(2)}, buf)
    first_end = buf.tell()
    nvckpt.save({"b": torch.zeros(3), "n": 7}, buf)
    buf.write(b"trailer")
    buf.seek(0)
    assert nvckpt.load(buf)["a"].tolist() == [1.0, 1.0]
    assert buf.tell() == first_end
    second = nvckpt.load(buf)
    assert second["n"] == 7 and second["b"].tolist() == [0.0, 0.0, 0.0]
    assert buf.read() == b"trailer"
    buf.seek(first_end)
    with nvckpt.open(buf) as ck:
        assert ck.keys() == ["b"]
    damaged = bytearray(buf.getvalue()[:first_end])
    damaged[-30] ^= 1  # the footer of a lone checkpoint: still refused, and named
    with pytest.raises(nvckpt.ChecksumError, match="footer"):
        nvckpt.load(io.BytesIO(bytes(damaged)))


def test_reading_checkpoints_from_a_stream_until_its_end_stops_there():
    """A loop that loads until EOFError (as with pickle.load) ends after the last checkpoint: a stream
    that nvckpt's reader left at its end is not read from its start again."""
    buf = io.BytesIO()
    for i in range(3):
        nvckpt.save({"i": i, "w": torch.full((2,), float(i))}, buf)
    buf.seek(0)
    seen = []
    while True:
        try:
            seen.append(nvckpt.load(buf)["i"])
        except EOFError as exc:
            assert isinstance(exc, nvckpt.EndOfStreamError) and "no checkpoint follows" in str(exc)
            break
        assert len(seen) <= 3
    assert seen == [0, 1, 2] and buf.tell() == len(buf.getvalue())
    nvckpt.save({"i": 3}, buf)  # written after the end, not rewound: read from the start, as before
    assert nvckpt.load(buf)["i"] == 0
    buf.seek(0)
    assert nvckpt.load(buf)["i"] == 0


def test_a_raw_stream_that_reads_fewer_bytes_than_asked_is_read_whole():
    """io.RawIOBase.read may return fewer bytes than asked (FileIO over 2 GiB, sockets): that is not a
    truncated file."""
    data = io.BytesIO()
    nvckpt.save({"w": torch.arange(100_000.0)}, data)

    class Short(io.RawIOBase):
        def __init__(self, b):
            self.b, self.pos = b, 0

        def readable(self):
            return True

        def seekable(self):
            return True

        def seek(self, pos, whence=0):
            self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else len(self.b) + pos)
            return self.pos

        def tell(self):
            return self.pos

        def read(self, n=-1):
            n = min(n if n >= 0 else len(self.b), 1000)
            out = self.b[self.pos: self.pos + n]
            self.pos += len(out)
            return out

    assert torch.equal(nvckpt.load(Short(data.getvalue()))["w"], torch.arange(100_000.0))


@pytest.mark.parametrize("target,says", [(b"\x89NVCKPT", "io.BytesIO"), (bytearray(8), "io.BytesIO"),
                                         (memoryview(b"x"), "io.BytesIO"), (None, "not NoneType"),
                                         (3, "not int")])
def test_what_is_not_a_path_or_a_file_object_is_named(target, says):
    with pytest.raises(TypeError, match=says):
        nvckpt.load(target)


def test_a_stream_that_does_not_seek_is_refused_with_one_line():
    r, w = os.pipe()
    os.write(w, b"\x89NVCKPT\n")
    os.close(w)
    with open(r, "rb") as pipe, pytest.raises(TypeError, match="does not seek"):
        nvckpt.load(pipe)


def test_a_stream_that_takes_fewer_bytes_than_given_gets_them_all():
    # io.RawIOBase.write may write less than asked (a socket, a pipe) and says how much: the rest was lost.
    class Short(io.RawIOBase):
        def __init__(self):
            self.buf = bytearray()

        def writable(self):
            return True

        def write(self, b):
            b = memoryview(b).cast("B")[:4096]
            self.buf += b
            return len(b)

    state = {"w": torch.randn(256, 64), "step": 3}
    out = Short()
    result = nvckpt.save(state, out)
    assert result.file_bytes == len(out.buf)
    got = nvckpt.load(io.BytesIO(bytes(out.buf)))
    assert_tensor_equal(got["w"], state["w"]) and got["step"] == 3

    class Stuck(Short):
        def write(self, b):
            return 0

    with pytest.raises(OSError, match="took no bytes"):
        nvckpt.save(state, Stuck())


def test_a_map_location_callable_may_return_none_as_in_torch_load():
    # torch.load: the callable "should return either None or a storage"; None keeps the default placement.
    state = {"w": torch.randn(3, 3), "v": torch.arange(4)}
    buf = io.BytesIO()
    nvckpt.save(state, buf)
    buf.seek(0)
    got = nvckpt.load(buf, map_location=lambda storage, loc: None)
    assert_tensor_equal(got["w"], state["w"]) and got["w"].device.type == "cpu"
    buf.seek(0)
    with pytest.raises(TypeError, match="not a storage or None"):
        nvckpt.load(buf, map_location=lambda storage, loc: 3)


def test_a_callable_map_location_relocates_slices_and_boxes_too(tmp_path):
    """get_slice and read_box return what get_tensor returns: relocated by a callable map_location."""
    path = tmp_path / "c.nvckpt"
    w = torch.arange(60.0).reshape(12, 5)
    nvckpt.save({"w": w}, path)
    calls = []

    def relocate(storage, location):
        calls.append(location)
        return storage.clone()  # a new storage: the result must not share the first one's memory

    with nvckpt.open(path, map_location=relocate) as f:
        whole = f.get_tensor("w")
        assert len(calls) == 1
        for got, want in ((f.get_slice("w")[2:5], w[2:5]), (f.get_slice("w")[3], w[3]),
                          (f.get_slice("w")[[1, 4]], w[[1, 4]]), (f.read_box("w", (1, 2), (3, 2)), w[1:4, 2:4])):
            assert torch.equal(got, want)
        assert len(calls) == 5 and whole.untyped_storage().data_ptr() != 0


def test_a_uint8_mask_in_get_slice_is_torchs_mask():
    w = torch.arange(6.0).reshape(2, 3)
    buf = io.BytesIO()
    nvckpt.save({"w": w}, buf)
    buf.seek(0)
    mask = torch.tensor([1, 0], dtype=torch.uint8)
    with nvckpt.open(buf) as f, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of uint8 masks
        assert torch.equal(f.get_slice("w")[mask], w[mask])


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


def test_cancel_returns_when_a_done_callback_asks_for_the_outcome(tmp_path):
    """cancel() ran the done-callbacks under the lock that the save's thread takes before its rename: a callback
    calling exception() (a common logging pattern) waited for that thread, and both waited for good."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import time, torch, nvckpt
        import nvckpt.io.sink as sink
        close = sink.FileSink.close
        def slow_close(self, *a, **k):  # a slow final fsync (a network filesystem)
            time.sleep(0.5)
            return close(self, *a, **k)
        sink.FileSink.close = slow_close
        path = {str(tmp_path / "ck.nvckpt")!r}
        nvckpt.save({{"old": 1}}, path)
        f = nvckpt.async_save({{"x": torch.randn(1000)}}, path)
        seen = []
        def log(fut):
            try:
                seen.append(repr(fut.exception()))
            except BaseException as exc:
                seen.append(type(exc).__name__)
        f.add_done_callback(log)
        time.sleep(0.2)  # the items are written: the thread is in its final close
        print(f.cancel(), seen, nvckpt.load(path))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "['CancelledError']", "{'old':", "1}"]


def test_a_forked_child_loads_and_saves_on_threads_of_its_own(tmp_path):
    """The worker threads are the process's and a forked child (a DataLoader worker) has none of its
    parent's: its loads and saves start pools of their own instead of queueing work no thread runs."""
    state = {f"w{i}": torch.randn(256, 1024, generator=torch.Generator().manual_seed(i)) for i in range(4)}
    nvckpt.save(state, tmp_path / "a.nvckpt", workers=2)
    nvckpt.load(tmp_path / "a.nvckpt", workers=2)  # the parent's pool of 2 is started
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            got = nvckpt.load(tmp_path / "a.nvckpt", workers=2)
            nvckpt.save(got, tmp_path / "b.nvckpt", workers=2)
            # numpy, not torch.equal: torch's own OpenMP threads do not survive a fork (DataLoader workers
            # run with torch.set_num_threads(1) for that reason); nvckpt's must.
            code = 0 if all(np.array_equal(got[k].numpy(), v.numpy()) for k, v in state.items()) else 2
        finally:
            os._exit(code)
    assert forked_exit_code(pid, 60, "the forked child hung in load or save") == 0
    assert all(torch.equal(nvckpt.load(tmp_path / "b.nvckpt")[k], v) for k, v in state.items())


def test_closing_a_checkpoint_waits_for_its_reads_on_the_shared_threads(tmp_path, monkeypatch):
    """close() returns only once the file's own work on the shared threads has ended (its reads use the
    descriptor that close releases), not waiting for other files' work."""
    import nvckpt.read.reader as file_mod

    nvckpt.save({"a": torch.arange(1 << 20, dtype=torch.float32)}, tmp_path / "a.nvckpt", workers=2)
    ended = []
    ck = file_mod.ChunkReader(str(tmp_path / "a.nvckpt"), workers=2)

    def slow() -> None:
        time.sleep(0.3)
        ended.append(1)

    future = ck.submit(slow)
    ck.close()
    assert future.done() and ended == [1]
    with pytest.raises(nvckpt.NvckptError, match="closed"):
        ck.submit(slow)


def test_a_checkpoints_map_runs_on_the_caller_and_the_shared_threads(tmp_path):
    """ChunkReader.map: the caller and workers - 1 shared threads take the items in turn (not a task
    each), results in the items' order; the first error stops the others and is raised once they have."""
    from nvckpt.read.reader import ChunkReader

    nvckpt.save({"a": torch.arange(10.0)}, tmp_path / "a.nvckpt")
    ck = ChunkReader(str(tmp_path / "a.nvckpt"), workers=3)
    try:
        names = set()

        def double(x):
            names.add(threading.current_thread().name)
            time.sleep(0.005)
            return 2 * x

        assert ck.map(double, list(range(60))) == [2 * x for x in range(60)]
        assert threading.current_thread().name in names and len(names) == 3
        started = []

        def five(x):
            started.append(x)
            if x == 5:
                raise ValueError("five")
            time.sleep(0.01)
            return x

        with pytest.raises(ValueError, match="five"):
            ck.map(five, list(range(200)))
        n = len(started)
        time.sleep(0.1)
        assert len(started) == n < 20  # nobody took another item after the error
    finally:
        ck.close()


def test_the_cpu_engines_output_buffers_are_kept_for_the_next_save_within_their_bound(tmp_path):
    # A portable save codes each chunk into a buffer of the engine's pool; the pool keeps them for the
    # next save (fresh memory costs a page fault per 4 KiB), at most its `keep` bytes, and a buffer taken
    # is never handed out twice while it is held.
    import nvckpt.engines.cpu as cpu

    pool = cpu._Buffers(keep=3 << 16)
    a, b = pool.take(1000), pool.take(1 << 16)
    assert a.nbytes == b.nbytes == 1 << 16 and a is not b
    pool.give(a)
    pool.give(b)
    assert pool.take(5) is b and pool.take(5) is a  # given back, then taken again (last in, first out)
    big = pool.take((1 << 16) + 1)
    assert big.nbytes == 1 << 17
    pool.give(a)
    pool.give(big)  # 64 + 128 KiB: within the 192 KiB kept
    pool.give(b)  # beyond it: dropped
    assert pool._kept == 3 << 16 and pool.take(5) is a and pool.take(5) is not b

    state = {f"w{i}": torch.randn(64, 4096, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
             for i in range(6)}
    nvckpt.save(state, tmp_path / "one.nvckpt", codec="portable", chunk_size=1 << 18)
    kept = cpu._KEPT._kept
    assert 0 < kept <= 64 << 20
    nvckpt.save(state, tmp_path / "two.nvckpt", codec="portable", chunk_size=1 << 18)
    assert cpu._KEPT._kept == kept  # the second save ran on the first one's buffers and gave them back
    assert (tmp_path / "one.nvckpt").read_bytes() == (tmp_path / "two.nvckpt").read_bytes()
    loaded = nvckpt.load(tmp_path / "two.nvckpt")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_child_forked_while_a_save_held_the_buffer_pools_saves(tmp_path):
    # The CPU engine's coded-chunk buffers and the file sink's write blocks are process-wide pools with a
    # lock each; a fork while another thread holds one (a save running beside a DataLoader's fork) must not
    # leave the child's copy locked forever: its first save would hang.
    import nvckpt.engines.cpu as cpu
    from nvckpt.io import sink

    state = {"w": torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)}
    with cpu._KEPT._lock, sink._POOL._lock:
        pid = os.fork()
        if pid == 0:  # the child: save, load back, exit without running the parent's test machinery
            try:
                torch.set_num_threads(1)  # as a DataLoader worker does (OpenMP's threads do not survive a fork)
                nvckpt.save(state, tmp_path / "child.nvckpt", codec="portable")
                ok = torch.equal(nvckpt.load(tmp_path / "child.nvckpt")["w"], state["w"])
                os._exit(0 if ok else 3)
            except BaseException:
                os._exit(4)
    assert forked_exit_code(pid, 30, "the forked child hung on a pool's lock") == 0
