"""nvckpt's own storage implementations against the io protocols' contracts (nvckpt.testing.io)."""

from __future__ import annotations

import io
import os
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
    """A FIFO per save, read to its end by a thread of the test (one FIFO for two saves would merge them: a
    second writer that opens before the reader has seen the first one's end joins the same read)."""

    atomic = False

    @pytest.fixture(autouse=True)
    def _fifos(self, tmp_path):
        self.closed: list[tuple[threading.Thread, list[bytes]]] = []  # the saves that closed their FIFO, in order
        self.readers: list[tuple[str, threading.Thread]] = []
        yield
        for fifo, thread in self.readers:  # a FIFO no save opened: its reader still waits for a writer
            while thread.is_alive():
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:  # ENXIO: the reader has not opened it yet
                    pass
                thread.join(0.05)

    def target_at(self, name, tmp_path):
        fifo = str(tmp_path / f"fifo{len(self.readers)}")
        os.mkfifo(fifo)
        got: list[bytes] = []

        def read() -> None:
            with open(fifo, "rb") as f:
                got.append(f.read())

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        self.readers.append((fifo, thread))
        closed = self.closed

        class Read(SpecialFile):
            def commit(self, before_publish=None):
                super().commit(before_publish)
                closed.append((thread, got))

            def abort(self):
                if self._file is not None:
                    closed.append((thread, got))
                super().abort()

        return Read(fifo)

    def stored(self, name, tmp_path):
        if not self.closed:
            return None
        thread, got = self.closed[-1]
        thread.join(30)
        return got[0]


class TestLocalDirectory(DirectoryTests):
    def directory_at(self, name, tmp_path):
        return LocalDirectory(tmp_path / name)
