"""Atomic save to a path: a failed save leaves the old file untouched and no temporary file behind."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import nvckpt
from nvckpt.engines import cpu as encode_cpu
from nvckpt.io.target import AtomicFile
from conftest import OLD_STATE, assert_tree_equal, assert_untouched

NEW = {"new": torch.randn(4096, 64), "more": [torch.randn(300, 300), "text"], "step": 2}


class Boom(Exception):
    pass


class FailingDisk(AtomicFile):
    """The atomic local file on a disk whose writes fail once ``after`` bytes are written (with ``exc``)."""

    def __init__(self, path, after: int, exc: type[BaseException]):
        super().__init__(str(path))
        self.after, self.exc, self.written = after, exc, 0

    def open_sink(self, options):
        sink = super().open_sink(options)
        write, write_many = sink.write, sink.write_many

        def count(n: int) -> None:
            if self.written + n > self.after:
                raise self.exc("disk on fire")
            self.written += n

        def failing_write(data):
            count(memoryview(data).nbytes)
            return write(data)

        def failing_write_many(pieces):
            count(sum(memoryview(p).nbytes for p in pieces))
            return write_many(pieces)

        sink.write, sink.write_many = failing_write, failing_write_many
        return sink


@pytest.mark.parametrize("after", [0, 24, 5000, 300_000])
@pytest.mark.parametrize("exc", [Boom, OSError, KeyboardInterrupt])
def test_failure_while_writing_keeps_old_file(old_file, after, exc):
    path, old_bytes = old_file
    target = FailingDisk(path, after, exc)
    with pytest.raises(exc):
        nvckpt.save(NEW, target, chunk_size=16 << 10)
    assert target.written <= after
    assert_untouched(path, old_bytes)


def test_failure_in_an_encoder_keeps_old_file(old_file, monkeypatch):
    path, old_bytes = old_file
    original = encode_cpu.encode_chunk
    calls = [0]

    def failing_encode(pipeline, raw, buffers=None):
        calls[0] += 1
        if calls[0] == 7:
            raise RuntimeError("encoder crashed")
        return original(pipeline, raw, buffers)

    monkeypatch.setattr(encode_cpu, "encode_chunk", failing_encode)
    with pytest.raises(RuntimeError, match="encoder crashed"):  # an encoder failure propagates as itself
        nvckpt.save(NEW, path, chunk_size=16 << 10)
    monkeypatch.undo()
    assert_untouched(path, old_bytes)


def test_failure_in_fsync_or_rename_keeps_old_file(old_file, monkeypatch):
    path, old_bytes = old_file
    for name in ("fsync", "replace"):
        def fail(*args, **kwargs):
            raise OSError(f"{name} failed")

        monkeypatch.setattr(os, name, fail)
        with pytest.raises(OSError, match=name):
            nvckpt.save(NEW, path)
        monkeypatch.undo()
        assert_untouched(path, old_bytes)


@pytest.mark.parametrize("bad", [
    {"deep": [1, {"x": (torch.ones(3), {1, torch.ones(2)})}]},  # a set cannot hold a tensor
    {"w": torch.randn(1000, 100), "z": object()},
    {"w": torch.randn(10), "big": {2**70: 1}},  # an int beyond 64 bits is a value, never a key
])
def test_unsupported_object_deep_in_tree_keeps_old_file(old_file, bad):
    path, old_bytes = old_file
    with pytest.raises(nvckpt.UnsupportedObjectError):
        nvckpt.save(bad, path)
    assert_untouched(path, old_bytes)


def test_bad_arguments_keep_old_file(old_file):
    path, old_bytes = old_file
    for kwargs in ({"codec": "lz4"}, {"chunk_size": 0}, {"alignment": 3}):
        with pytest.raises(ValueError):
            nvckpt.save(NEW, path, **kwargs)
        assert_untouched(path, old_bytes)


def test_successful_save_replaces(old_file):
    path, old_bytes = old_file
    result = nvckpt.save(NEW, path)
    assert result.path == str(path) and result.file_bytes == path.stat().st_size
    assert path.read_bytes() != old_bytes
    assert os.listdir(path.parent) == [path.name]
    assert_tree_equal(nvckpt.load(path), NEW)


@pytest.mark.skipif(not hasattr(os, "O_PATH") or not os.path.isdir("/proc/self/fd"), reason="Linux only")
def test_the_replaced_file_is_freed_off_the_callers_path_and_no_descriptor_is_left(old_file, monkeypatch):
    """The old file is held (O_PATH) across the rename and let go by a thread of its own, which frees its
    blocks instead of the rename; every such descriptor is closed, also when the rename fails."""
    import threading

    from nvckpt.io import atomic

    path, old_bytes = old_file
    held = []
    real_hold = atomic._hold
    monkeypatch.setattr(atomic, "_hold", lambda p: held.append(real_hold(p)) or held[-1])

    def settle():
        """The descriptors still open on replaced files of the folder (once the releasing threads are done)."""
        for t in threading.enumerate():
            if t.name == "nvckpt-free-replaced":
                t.join()
        targets = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        return [t for t in targets if t.startswith(str(path.parent)) and t.endswith("(deleted)")]

    assert settle() == []
    with open(path, "rb") as reader:  # a reader of the old file keeps reading it whole
        for i in range(20):
            nvckpt.save({**NEW, "step": i}, path)
        assert reader.read() == old_bytes
    assert len(held) == 20 and all(isinstance(fd, int) for fd in held)
    assert nvckpt.load(path)["step"] == 19
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("replace failed")))
    with pytest.raises(OSError, match="replace failed"):
        nvckpt.save(NEW, path)
    monkeypatch.setattr(os, "replace", real_replace)
    assert len(held) == 21
    assert settle() == []  # none of the 21 descriptors is still open
    assert os.listdir(path.parent) == [path.name]


def _replaced_descriptors(folder) -> list[str]:
    """This process's descriptors on files of ``folder`` that have been replaced (deleted)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [t for t in targets if t.startswith(str(folder)) and t.endswith("(deleted)")]


@pytest.fixture
def slow_freeing(monkeypatch):
    """The thread that lets go of a replaced file takes a second (a large file's blocks on a busy disk)."""
    import time

    from nvckpt.io import atomic

    real_close = atomic._close
    monkeypatch.setattr(atomic, "_close", lambda fd: (time.sleep(1.0), real_close(fd)))


def test_an_async_save_frees_the_replaced_file_before_its_future_is_done(old_file, slow_freeing):
    """Its thread pays the freeing, not the caller: once result() returns, the old file's blocks are free (before,
    a caller that checked the free space then still saw them)."""
    path, _ = old_file
    nvckpt.async_save(NEW, path).result()
    assert _replaced_descriptors(path.parent) == []
    assert nvckpt.load(path)["step"] == 2


def test_a_child_forked_while_a_replaced_file_is_held_does_not_keep_it(old_file, slow_freeing):
    """A save's replaced file is let go a moment after save() returns; a child forked in that moment (a DataLoader
    worker) got a copy of the descriptor and kept the old file's blocks for as long as it lived."""
    from conftest import forked_exit_code

    path, _ = old_file
    nvckpt.save(NEW, path)
    assert _replaced_descriptors(path.parent)  # held by the parent, for the second slow_freeing takes
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _replaced_descriptors(path.parent) == [] else 3)
    assert forked_exit_code(pid, 30, "the forked child hung") == 0


def test_failed_first_save_creates_nothing(tmp_path):
    path = tmp_path / "fresh.nvckpt"
    with pytest.raises(OSError):
        nvckpt.save(NEW, FailingDisk(path, 0, OSError))
    assert os.listdir(tmp_path) == []


def test_save_into_missing_directory_or_onto_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        nvckpt.save(OLD_STATE, tmp_path / "no" / "such" / "dir.nvckpt")
    (tmp_path / "adir").mkdir()
    with pytest.raises(IsADirectoryError):
        nvckpt.save(OLD_STATE, tmp_path / "adir")
    assert os.listdir(tmp_path) == ["adir"] and os.listdir(tmp_path / "adir") == []


def test_a_read_only_filesystem_is_named_as_such_and_the_error_names_the_target(tmp_path, monkeypatch):
    """On a read-only filesystem the temporary file cannot be created nor unlinked: the unlink's error replaced
    the first one (naming the temporary file), and an existing file was called write-protected."""
    import errno

    from nvckpt.io import atomic

    new = tmp_path / "new.nvckpt"
    real_open = os.open

    def refuse(path, flags, *a, **k):
        if str(path).endswith(".nvckpt-tmp"):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *a, **k)

    def unlink(path, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(os, "open", refuse)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(OSError) as err:
        nvckpt.save({"x": torch.ones(3)}, new)
    assert err.value.errno == errno.EROFS and err.value.filename == str(new) and "nvckpt-tmp" not in str(err.value)
    monkeypatch.undo()

    old = tmp_path / "old.nvckpt"
    nvckpt.save({"x": torch.ones(3)}, old)
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    monkeypatch.setattr(atomic, "_read_only_filesystem", lambda folder: True)
    with pytest.raises(OSError, match="Read-only file system") as err:
        nvckpt.save({"x": torch.zeros(3)}, old)
    assert err.value.errno == errno.EROFS
    monkeypatch.setattr(atomic, "_read_only_filesystem", lambda folder: False)
    with pytest.raises(PermissionError, match="write-protected"):
        nvckpt.save({"x": torch.zeros(3)}, old)


def test_a_target_ending_in_a_separator_is_refused(tmp_path):
    with pytest.raises(IsADirectoryError, match="ends with a separator"):
        nvckpt.save({"x": 1}, str(tmp_path / "ckpts") + "/")
    assert not (tmp_path / "ckpts").exists()
    with pytest.raises(IsADirectoryError, match="ends with a separator"):
        nvckpt.async_save({"x": 1}, str(tmp_path / "ckpts") + "/")


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


@pytest.mark.parametrize("length", [234, 235, 250, 255])
def test_target_names_up_to_name_max_save_and_replace(tmp_path, length):
    name = ("é" * 200).encode()[: length - 7].decode("utf-8", "ignore")
    name += "x" * (length - 7 - len(name.encode())) + ".nvckpt"
    assert len(name.encode()) == length
    target = tmp_path / name
    for value in (1.0, 2.0):  # create, then replace
        nvckpt.save({"w": torch.full((3,), value)}, target)
        assert torch.equal(nvckpt.load(target)["w"], torch.full((3,), value))
    assert os.listdir(tmp_path) == [name]


def test_errors_name_the_callers_path_not_the_temporary(tmp_path):
    missing = tmp_path / "no-such-folder" / "ckpt.nvckpt"
    with pytest.raises(FileNotFoundError) as info:
        nvckpt.save({"w": torch.ones(2)}, missing)
    assert info.value.filename == str(missing) and "nvckpt-tmp" not in str(info.value)
    too_long = tmp_path / ("n" * 256)
    with pytest.raises(OSError) as info:
        nvckpt.save({"w": torch.ones(2)}, too_long)
    assert "nvckpt-tmp" not in str(info.value) and info.value.filename == str(too_long)
    assert os.listdir(tmp_path) == []
