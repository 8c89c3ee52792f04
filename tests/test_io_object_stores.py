"""The object-store backends against the io protocols' contracts (nvckpt.testing.io): s3:// on a real
SeaweedFS server, and fsspec's memory:// filesystem."""

from __future__ import annotations

import itertools

import pytest

from nvckpt.io.directory import open_directory
from nvckpt.io.source import open_source
from nvckpt.io.target import open_target
from nvckpt.testing.io import ByteSourceTests, DirectoryTests, TargetTests

_names = itertools.count()


@pytest.fixture(scope="module")
def shared_bucket(s3_server):
    """One bucket for this module's contract tests (making one costs seconds here); each test has its prefix."""
    s3_server.start()
    return s3_server.create_bucket(), s3_server.client()


@pytest.mark.slow  # a real S3 server: its start takes seconds on 2 shared cores
class _OnS3:
    @pytest.fixture(autouse=True)
    def _bucket(self, s3_server, shared_bucket, monkeypatch):
        s3_server.start()
        for key, value in s3_server.env().items():  # where boto3 users keep them
            monkeypatch.setenv(key, value)
        self.server = s3_server
        self.bucket, self.client = shared_bucket
        self.prefix = f"t{next(_names)}"

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}/{name}"


class TestS3Source(_OnS3, ByteSourceTests):
    def source_of(self, data, tmp_path):
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/src.bin", Body=data)
        return open_source(self.url("src.bin"))


class TestS3SourceSmallReads(TestS3Source):
    """Reads larger than ``read_size`` are cut into concurrent GETs, and none comes from open's tail."""

    def source_of(self, data, tmp_path):
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/src.bin", Body=data)
        source = open_source(self.url("src.bin"), {"read_size": 1000})
        source._tail_start, source._tail = source.size, b""
        return source


class TestS3Target(_OnS3, TargetTests):
    def target_at(self, name, tmp_path):
        return open_target(self.url(name), storage_options={"part_size": 5 << 20})

    def stored(self, name, tmp_path):
        client = self.client
        try:
            return client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}")["Body"].read()
        except client.exceptions.NoSuchKey:
            return None


class TestS3Directory(_OnS3, DirectoryTests):
    def directory_at(self, name, tmp_path):
        return open_directory(self.url(name))


class _InMemory:
    @pytest.fixture(autouse=True)
    def _root(self):
        pytest.importorskip("fsspec")
        self.root = f"memory://nvckpt-test-{next(_names)}"
        yield
        import fsspec

        fs = fsspec.filesystem("memory")
        if fs.exists(self.root):
            fs.rm(self.root, recursive=True)


class TestFsspecSource(_InMemory, ByteSourceTests):
    def source_of(self, data, tmp_path):
        import fsspec

        fsspec.filesystem("memory").pipe_file(f"{self.root}/src.bin", data)
        return open_source(f"{self.root}/src.bin")


class TestFsspecTarget(_InMemory, TargetTests):
    def target_at(self, name, tmp_path):
        return open_target(f"{self.root}/{name}")

    def stored(self, name, tmp_path):
        import fsspec

        fs = fsspec.filesystem("memory")
        path = f"{self.root}/{name}"
        return fs.cat_file(path) if fs.isfile(path) else None


class TestFsspecDirectory(_InMemory, DirectoryTests):
    def directory_at(self, name, tmp_path):
        return open_directory(f"{self.root}/{name}")
