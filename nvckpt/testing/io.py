"""Contract tests for the storage protocols (nvckpt.io): every implementation runs them.

As ``zarr.testing.store.StoreTests``: subclass one of these in a pytest module
and implement its hooks; the class's ``test_*`` methods then run against the
implementation.  nvckpt's own sources, targets and directories run them in
``tests/test_io_contracts.py``; a new backend adds one subclass per protocol.

    class TestMySource(ByteSourceTests):
        def source_of(self, data, tmp_path):
            return MySource(upload(data))
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from ..errors import NvckptError, TruncatedError
from ..io.directory import Directory
from ..io.ranges import Coalescing
from ..io.source import ByteSource
from ..io.target import SinkOptions, Target

DATA = bytes(range(256)) * 40 + b"tail"  # 10,244 bytes: not a multiple of 4096


class ByteSourceTests:
    """The ByteSource contract: exact positional reads, bounds, counting, thread safety, close."""

    def source_of(self, data: bytes, tmp_path: Any) -> ByteSource:
        """A source holding exactly ``data`` (from its offset 0)."""
        raise NotImplementedError

    @pytest.fixture
    def source(self, tmp_path: Any) -> Any:
        s = self.source_of(DATA, tmp_path)
        yield s
        s.close()

    def test_is_a_byte_source(self, source: Any) -> None:
        assert isinstance(source, ByteSource)
        assert isinstance(source.coalescing, Coalescing)
        assert isinstance(source.name, str) and isinstance(source.exact_size, bool)

    def test_size(self, source: Any) -> None:
        assert source.size == len(DATA)

    @pytest.mark.parametrize("offset,length", [(0, 0), (0, 1), (0, len(DATA)), (5000, 4096), (len(DATA) - 4, 4),
                                               (len(DATA), 0)])
    def test_read_returns_exactly_the_range(self, source: Any, offset: int, length: int) -> None:
        assert bytes(source.read(offset, length)) == DATA[offset: offset + length]

    @pytest.mark.parametrize("offset,length", [(0, len(DATA) + 1), (len(DATA) - 1, 2), (-1, 1), (len(DATA) + 10, 0)])
    def test_read_past_the_end_is_truncated(self, source: Any, offset: int, length: int) -> None:
        with pytest.raises(TruncatedError):
            source.read(offset, length)

    def test_read_into_fills_the_buffer(self, source: Any) -> None:
        buf = bytearray(3000)
        source.read_into(1234, buf)
        assert bytes(buf) == DATA[1234: 4234]
        with pytest.raises(TruncatedError):
            source.read_into(len(DATA) - 10, bytearray(11))

    def test_bytes_read_counts_reads(self, source: Any) -> None:
        before = source.bytes_read
        source.read(10, 100)
        source.read_into(200, bytearray(50))
        assert source.bytes_read - before == 150

    def test_concurrent_reads(self, source: Any) -> None:
        errors: list[BaseException] = []

        def work(k: int) -> None:
            try:
                for i in range(40):
                    offset = (k * 997 + i * 131) % (len(DATA) - 300)
                    assert bytes(source.read(offset, 300)) == DATA[offset: offset + 300]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]

    @pytest.mark.parametrize("direct", [False, True])
    def test_range_reads(self, source: Any, direct: bool) -> None:
        reads = source.range_reads(direct)
        buf = memoryview(bytearray(8192))
        before = source.bytes_read
        try:
            view = reads.read(4096, 8192, len(DATA) - 4096, buf)  # the last, short span: fewer bytes than asked
            assert bytes(view[: len(DATA) - 4096]) == DATA[4096:]
            view = reads.read(0, 4096, 4096, buf)
            assert bytes(view[:4096]) == DATA[:4096]
        finally:
            reads.close()
        assert source.bytes_read - before >= len(DATA)

    def test_close(self, tmp_path: Any) -> None:
        source = self.source_of(DATA, tmp_path)
        source.read(0, 10)
        source.close()
        assert source.closed
        with pytest.raises(NvckptError):
            source.read(0, 10)
        source.close()  # twice: nothing


class TargetTests:
    """The Target contract: what is written is what is stored after commit; an atomic target shows the old
    file until its commit, and an abort, a failed write or a ``before_publish`` that raises leaves it as it was."""

    atomic = True  # the target's kind (set False for a stream or a special file)

    def target_at(self, name: str, tmp_path: Any) -> Target:
        """A fresh Target for a save to ``name`` (the same name: the same stored file)."""
        raise NotImplementedError

    def stored(self, name: str, tmp_path: Any) -> bytes | None:
        """The bytes stored under ``name`` now (None: nothing)."""
        raise NotImplementedError

    def _write(self, target: Target, data: bytes, pieces: int = 3) -> None:
        sink = target.open_sink(SinkOptions(direct=False, block_size=4096, blocks=4))
        step = -(-len(data) // pieces)
        for i in range(0, len(data), step):
            sink.write(memoryview(data)[i: i + step])

    def test_is_a_target(self, tmp_path: Any) -> None:
        target = self.target_at("a", tmp_path)
        assert isinstance(target, Target) and target.atomic is self.atomic
        assert isinstance(target.name, str)

    def test_commit_stores_what_was_written(self, tmp_path: Any) -> None:
        target = self.target_at("a", tmp_path)
        target.check()
        self._write(target, DATA)
        target.commit()
        assert self.stored("a", tmp_path) == DATA

    def test_write_many(self, tmp_path: Any) -> None:
        target = self.target_at("a", tmp_path)
        sink = target.open_sink(SinkOptions(direct=False, block_size=4096, blocks=4))
        pieces = [DATA[:10], DATA[10:5000], DATA[5000:]]
        write_many = getattr(sink, "write_many", None)
        if write_many is None:
            target.abort()
            pytest.skip("this target's sink has no write_many")
        write_many(pieces)
        target.commit()
        assert self.stored("a", tmp_path) == DATA

    def test_an_empty_file(self, tmp_path: Any) -> None:
        target = self.target_at("a", tmp_path)
        target.open_sink(SinkOptions(direct=False, block_size=4096, blocks=4))
        target.commit()
        assert self.stored("a", tmp_path) == b""

    def test_replaces_only_at_commit(self, tmp_path: Any) -> None:
        first = self.target_at("a", tmp_path)
        self._write(first, b"old" * 100)
        first.commit()
        second = self.target_at("a", tmp_path)
        self._write(second, DATA)
        if self.atomic:
            assert self.stored("a", tmp_path) == b"old" * 100  # the old file until the commit
        seen = []
        second.commit(lambda: seen.append(self.stored("a", tmp_path)))
        if self.atomic:
            assert seen == [b"old" * 100]
        assert self.stored("a", tmp_path) == DATA

    def test_abort_leaves_the_old_file(self, tmp_path: Any) -> None:
        first = self.target_at("a", tmp_path)
        self._write(first, b"old")
        first.commit()
        second = self.target_at("a", tmp_path)
        self._write(second, DATA)
        second.abort()
        second.abort()  # twice: nothing
        if self.atomic:
            assert self.stored("a", tmp_path) == b"old"

    def test_before_publish_that_raises_leaves_the_old_file(self, tmp_path: Any) -> None:
        if not self.atomic:
            pytest.skip("a non-atomic target publishes as it writes")
        first = self.target_at("a", tmp_path)
        self._write(first, b"old")
        first.commit()
        second = self.target_at("a", tmp_path)
        self._write(second, DATA)

        def refuse() -> None:
            raise RuntimeError("cancelled")

        with pytest.raises(RuntimeError, match="cancelled"):
            second.commit(refuse)
        second.abort()  # after a failed commit: nothing more
        assert self.stored("a", tmp_path) == b"old"

    def test_abort_of_a_new_file_leaves_nothing(self, tmp_path: Any) -> None:
        if not self.atomic:
            pytest.skip("a non-atomic target publishes as it writes")
        target = self.target_at("new", tmp_path)
        self._write(target, DATA)
        target.abort()
        assert self.stored("new", tmp_path) is None

    def test_restate_returns_an_exception(self, tmp_path: Any) -> None:
        target = self.target_at("a", tmp_path)
        exc = OSError(28, "No space left on device")
        assert isinstance(target.restate(exc), BaseException)


class DirectoryTests:
    """The Directory contract: a staged checkpoint is invisible until ``publish``, then whole; the old one
    stays whole until then; ``discard`` and ``remove_stale`` leave nothing of a save that did not publish."""

    def directory_at(self, name: str, tmp_path: Any) -> Directory:
        """The Directory ``name`` (the same name: the same stored directory)."""
        raise NotImplementedError

    @staticmethod
    def own(name: str) -> bool:
        return name.startswith("__") or name == "manifest"

    def _save(self, d: Directory, files: dict[str, bytes], number: int | None = None) -> Any:
        staging = d.stage()
        for name, data in files.items():
            if name == "manifest":
                staging.write_bytes(name, data)
                continue
            target = staging.target(name)
            sink = target.open_sink(SinkOptions(direct=False, block_size=4096, blocks=4))
            sink.write(data)
            target.commit()
        return staging

    def test_is_a_directory(self, tmp_path: Any) -> None:
        d = self.directory_at("ck", tmp_path)
        assert isinstance(d, Directory) and not d.exists() and d.entries() == []
        assert d.one_save() is False  # nothing published: nothing to vouch for

    def test_published_only_whole(self, tmp_path: Any) -> None:
        d = self.directory_at("ck", tmp_path)
        d.check_replaceable(self.own, overwrite=True)
        staging = self._save(d, {"__0": DATA, "__1": b"one", "manifest": b"{}"})
        assert staging.size("__0") == len(DATA)
        assert self.directory_at("ck", tmp_path).size("__0") is None  # staged: not visible
        staging.publish()
        d = self.directory_at("ck", tmp_path)
        assert d.exists() and {"__0", "__1", "manifest"} <= set(d.entries())
        assert d.read_bytes("__1") == b"one" and d.size("__0") == len(DATA)
        source = d.open_source("__0")
        try:
            assert source.read(100, 50) == DATA[100:150]
        finally:
            source.close()
        with pytest.raises(FileNotFoundError):
            d.read_bytes("missing")
        assert d.size("missing") is None

    def test_old_checkpoint_whole_until_publish(self, tmp_path: Any) -> None:
        d = self.directory_at("ck", tmp_path)
        self._save(d, {"__0": b"old0", "manifest": b"old"}).publish()
        staging = self._save(d, {"__0": b"new0", "manifest": b"new"})
        assert d.read_bytes("__0") == b"old0" and d.read_bytes("manifest") == b"old"
        d.check_replaceable(self.own, overwrite=True)
        with pytest.raises(FileExistsError):
            d.check_replaceable(self.own, overwrite=False)
        staging.publish()
        assert d.read_bytes("__0") == b"new0" and d.read_bytes("manifest") == b"new"

    def test_another_rank_writes_into_the_same_staging(self, tmp_path: Any) -> None:
        d = self.directory_at("ck", tmp_path)
        staging = d.stage()
        other = self.directory_at("ck", tmp_path).staging(staging.token)
        target = other.target("__1")
        target.open_sink(SinkOptions(direct=False, block_size=4096, blocks=4)).write(b"rank one")
        target.commit()
        staging.write_bytes("manifest", b"{}")
        assert staging.size("__1") == len(b"rank one")
        staging.publish()
        assert d.read_bytes("__1") == b"rank one"

    def test_discard_leaves_nothing(self, tmp_path: Any) -> None:
        d = self.directory_at("ck", tmp_path)
        self._save(d, {"__0": b"old0", "manifest": b"old"}).publish()
        staging = self._save(d, {"__0": DATA, "manifest": b"new"})
        other = self.directory_at("ck", tmp_path).staging(staging.token)
        assert staging.alive() and other.alive()
        staging.discard()
        staging.discard()
        assert not staging.alive() and not other.alive()  # another rank sees it gone
        assert d.read_bytes("__0") == b"old0" and d.read_bytes("manifest") == b"old"
        assert d.remove_stale() == []

    def test_remove_stale_removes_an_abandoned_staging(self, tmp_path: Any) -> None:
        d = self.directory_at("ck", tmp_path)
        staging = self._save(d, {"__0": DATA})
        assert d.remove_stale() == []  # a staging this process is writing is not stale
        release = getattr(staging, "release", None)
        if release is None:
            pytest.skip("this directory has no staging to abandon")
        release()  # as a failed save does
        assert len(d.remove_stale()) == 1
        assert d.remove_stale() == []

    def test_refuses_to_replace_what_is_not_a_checkpoint(self, tmp_path: Any) -> None:
        d = self.directory_at("ck", tmp_path)
        self._save(d, {"notes.txt": b"mine"}).publish()
        with pytest.raises(FileExistsError):
            self.directory_at("ck", tmp_path).check_replaceable(self.own, overwrite=True)


__all__ = ["ByteSourceTests", "TargetTests", "DirectoryTests"]
