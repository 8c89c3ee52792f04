"""nvckpt's own storage implementations against the io protocols' contracts (nvckpt.testing.io)."""

from __future__ import annotations

import io
import os
import queue
import threading

import pytest

from nvckpt.io.directory import LocalDirectory
from nvckpt.io.source import FileObjectSource, LocalFile
from nvckpt.io.target import AtomicFile, SpecialFile, StreamTarget
from nvckpt.testing.io import ByteSourceTests, DirectoryTests, TargetTests


class TestLocalFile(ByteSourceTests):
    def source_of(self, data, tmp_path):
        path = tmp_path / "src.bin"
        path.write_bytes(data)
        return LocalFile(path)


class TestFileObjectSource(ByteSourceTests):
    def source_of(self, data, tmp_path):
        return FileObjectSource(io.BytesIO(data))


class TestFileObjectSourceAfterAHeader(ByteSourceTests):
    """A checkpoint after a caller's header: offsets are the checkpoint's own."""

    def source_of(self, data, tmp_path):
        stream = io.BytesIO(b"caller's header" + data)
        stream.seek(len(b"caller's header"))
        return FileObjectSource(stream)


class TestAtomicFile(TargetTests):
    def target_at(self, name, tmp_path):
        return AtomicFile(str(tmp_path / name))

    def stored(self, name, tmp_path):
        path = tmp_path / name
        return path.read_bytes() if path.exists() else None


class TestStreamTarget(TargetTests):
    atomic = False

    def target_at(self, name, tmp_path):
        self.streams = getattr(self, "streams", {})
        self.streams[name] = io.BytesIO()
        return StreamTarget(self.streams[name])

    def stored(self, name, tmp_path):
        stream = getattr(self, "streams", {}).get(name)
        return None if stream is None else stream.getvalue()


class TestSpecialFile(TargetTests):
    """A FIFO, read by a thread of the test as each save writes it."""

    atomic = False

    @pytest.fixture(autouse=True)
    def _reader(self, tmp_path):
        self.got: "queue.Queue[bytes]" = queue.Queue()
        self.closed = 0  # writes closed (committed or aborted): each is one read of the FIFO to its end
        self.last: bytes | None = None
        self.fifo = str(tmp_path / "fifo")
        os.mkfifo(self.fifo)
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                with open(self.fifo, "rb") as f:
                    self.got.put(f.read())

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        yield
        stop.set()
        with open(self.fifo, "wb"):  # wake the reader's open
            pass
        thread.join(5)

    def target_at(self, name, tmp_path):
        test = self

        class Counted(SpecialFile):
            def commit(self, before_publish=None):
                super().commit(before_publish)
                test.closed += 1

            def abort(self):
                if self._file is not None:
                    test.closed += 1
                super().abort()

        return Counted(self.fifo)

    def stored(self, name, tmp_path):
        while self.closed:
            self.last = self.got.get(timeout=30)
            self.closed -= 1
        return self.last


class TestLocalDirectory(DirectoryTests):
    def directory_at(self, name, tmp_path):
        return LocalDirectory(tmp_path / name)
