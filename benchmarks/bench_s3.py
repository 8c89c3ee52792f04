"""Object storage benchmark: S3 clients and checkpoint peers on one real S3 server, side by side.

    pip install -e ".[test]" obstore==0.12.1 "s3torchconnector[dcp]==1.5.0"
    python benchmarks/bench_s3.py [--reps 2] [--layers 6] [--stall-cap 200] [--out benchmarks/results]

The server is SeaweedFS (``weed mini``, nvckpt.testing.seaweedfs) on 127.0.0.1, started and stopped by
this script; faults come from nvckpt.testing.faultproxy.  The data is real checkpoint bytes: the state of
a transformer (``--layers`` encoder layers of width ``--dim``) trained ``--steps`` AdamW steps here, as
bench_cpu.py builds it (bf16 weights, fp32 master weights, Adam moments, step counters), saved once by
nvckpt (portable codec) to a local file; the raw clients move that file's bytes, the peers save and load
the state itself.

Parts of the run (``--parts``, comma-separated):

- ``raw``: each client's ceiling on those bytes: a multipart PUT streaming from 8 MiB memory chunks
  (16 MiB parts, 8 in flight), a whole GET (one request, streamed into a preallocated buffer) and
  concurrent ranged GETs (16 MiB ranges, 8 in flight, into the same buffer); both GETs again into fresh
  memory (allocated within the clock, first touched by the transfer, as a load's result is).  Clients: boto3/s3transfer,
  obstore (Rust object_store) and s3fs (aiobotocore), each as its users configure it (endpoint, part size
  and concurrency set alike; retries and timeouts left at their defaults).
- ``peers``: save and load of the whole state by torch.save + boto3, s3torchconnector's S3Checkpoint and
  its DCP S3StorageWriter/S3StorageReader, DCP through fsspec (s3fs), and safetensors + boto3.
- ``tensor``: one 4 MiB tensor (an fp32 attention projection) read from the saved checkpoint by each
  peer, and the floor: one ranged GET of its bytes; the requests each made (counted by an idle proxy).
- ``link``: loads through a link slower than this machine's CPU (``--link-mbit``, default 1,000 Mbit/s:
  the S3 port's traffic on loopback shaped by tc, which needs root): each raw client's GETs into fresh
  memory, and each peer's load, against the ceiling for the bytes it reads.
- ``faults``: each raw client (and the CRT client of s3torchconnector) against the fault proxy: 503
  SlowDown and resets on parts and GETs (retried? object exact?), a server killed in the middle of a
  multipart upload (time to an error, the upload left open?), a source that fails in the middle (does the
  client abort its multipart upload?), and a stalled server (accepts, never answers): the time until an
  error with the client's defaults and with a 20 s no-progress timeout where the client has one, within
  ``--stall-cap`` seconds.  ``stalls`` runs the stall probes with the read timeout alone (to redo rows).

Every measurement runs in a process of its own (one client's imports and memory, no connection reuse
between clients): wall time, client CPU seconds (user + system of that process, all its threads; the
server is another process) and peak RSS above the process's RSS before the operation (the payload or
the state already in memory); a peer's modules are imported before its measurement (``Peer.imports``),
as nvckpt is, so a row times the operation, not a first import.  Correctness is checked on every transfer
(sha256 of the bytes, bit-exact tensors).  Repetitions are interleaved (every client once per repetition).  SeaweedFS's CPU shares the
same cores and bounds every PUT here: compare rows with each other, not with a real S3.
Writes bench_s3.json and bench_s3.md.

nvckpt's own rows are the peers ``nvckpt`` (save, load, open + get_tensor of one file) and ``nvckpt_dcp``
(nvckpt.dcp.Writer / Reader); ``--merge`` puts the rows of a partial run into the committed results.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime
import hashlib
import importlib
import io
import json
import mmap
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable
from urllib.parse import urlsplit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

MiB = 1 << 20
CHUNK = 8 * MiB    # the memory chunks a streaming writer hands over
PART = 16 * MiB    # multipart part size, every client
RANGE = 16 * MiB   # ranged GET size
CONCURRENCY = 8    # parts or ranges in flight, every client
TENSOR = "master/enc.layers.0.self_attn.out_proj.weight"  # fp32 [dim, dim]: 4 MiB at dim 1024
REGION = "us-east-1"
FAULT_BYTES = 160 * MiB  # the fault probes move the checkpoint file's first 160 MiB
RAW_OPS = ("put", "get_whole", "get_ranged", "get_whole_fresh", "get_ranged_fresh")
RAW_OP_NAMES = {"put": "PUT", "get_whole": "GET whole", "get_ranged": "GET ranged",
                "get_whole_fresh": "GET whole, fresh", "get_ranged_fresh": "GET ranged, fresh"}


# -- measuring ----------------------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Meter:
    """Wall time, CPU seconds (this process, all threads) and peak RSS above the RSS at entry.

    The peak is the kernel's high-water mark, reset at entry (``/proc/self/clear_refs``); where that is
    not allowed, a thread samples RSS every 5 ms."""

    def __enter__(self) -> Meter:
        self.base = _status_kb("VmRSS")
        self._sampler: threading.Thread | None = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self._peak, self._stop = self.base, threading.Event()

            def sample() -> None:
                while not self._stop.wait(0.005):
                    self._peak = max(self._peak, _status_kb("VmRSS"))

            self._sampler = threading.Thread(target=sample, daemon=True)
            self._sampler.start()
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu0 = r.ru_utime + r.ru_stime
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu = r.ru_utime + r.ru_stime - self.cpu0
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            peak = self._peak
        else:
            peak = _status_kb("VmHWM")
        self.peak_mb = max(0, peak - self.base) / 1024

    def row(self, nbytes: int) -> dict[str, float]:
        return {"seconds": round(self.wall, 3), "MB_per_s": round(nbytes / self.wall / 1e6, 1),
                "cpu_s": round(self.cpu, 3), "cpu_s_per_GB": round(self.cpu / (nbytes / 1e9), 3),
                "peak_rss_MB": round(self.peak_mb, 1)}


def sha256(buf: Any) -> str:
    return hashlib.sha256(buf).hexdigest()


def payload(path: str, limit: int | None = None) -> tuple[bytearray, list[memoryview]]:
    """The checkpoint file's bytes (its first ``limit``) in memory, and the CHUNK-sized pieces a streaming
    writer would hand over."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray(size if limit is None else min(size, limit))
        f.readinto(data)
    view = memoryview(data)
    return data, [view[i:i + CHUNK] for i in range(0, len(data), CHUNK)]


class ChunkReader(io.RawIOBase):
    """A non-seekable stream over memory chunks: what a streaming writer offers a file-object API."""

    def __init__(self, chunks: list[memoryview], fail_after: int | None = None) -> None:
        self.chunks, self.i, self.at, self.sent, self.fail_after = chunks, 0, 0, 0, fail_after

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:  # a file's read: n bytes unless the stream ends (s3transfer relies on it)
        out = bytearray()
        while n < 0 or len(out) < n:
            piece = bytearray(CHUNK if n < 0 else min(CHUNK, n - len(out)))
            got = self.readinto(piece)
            if not got:
                break
            out += piece[:got]
        return bytes(out)

    def readinto(self, b: Any) -> int:
        if self.fail_after is not None and self.sent >= self.fail_after:
            raise RuntimeError("the source failed in the middle of the upload")
        if self.i >= len(self.chunks):
            return 0
        c = self.chunks[self.i]
        n = min(len(b), len(c) - self.at)
        b[:n] = c[self.at:self.at + n]
        self.at += n
        self.sent += n
        if self.at == len(c):
            self.i, self.at = self.i + 1, 0
        return n


def failing_iter(chunks: list[memoryview], fail_after: int | None):
    sent = 0
    for c in chunks:
        if fail_after is not None and sent >= fail_after:
            raise RuntimeError("the source failed in the middle of the upload")
        yield c
        sent += len(c)


def ranges(size: int) -> list[tuple[int, int]]:
    return [(a, min(size, a + RANGE)) for a in range(0, size, RANGE)]


# -- raw clients ----------------------------------------------------------------------------------------
class RawClient:
    """One S3 client's raw transfers.  ``timeout``: a no-progress (read) timeout in seconds to configure,
    None for the client's defaults."""

    name = ""
    key = ""

    def __init__(self, endpoint: str, env: dict[str, str], timeout: float | None = None) -> None:
        self.endpoint, self.env, self.timeout = endpoint, env, timeout

    def put(self, bucket: str, key: str, chunks: list[memoryview], fail_after: int | None = None) -> None: ...
    def get_whole(self, bucket: str, key: str, dest: memoryview) -> None: ...
    def get_ranged(self, bucket: str, key: str, dest: memoryview) -> None: ...
    def get_range(self, bucket: str, key: str, start: int, end: int) -> bytes: ...


class Boto3Raw(RawClient):
    name = "boto3 / s3transfer"
    key = "boto3"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        extra: dict[str, Any] = {}
        if self.timeout is not None:  # a no-progress bound: the read timeout, 3 attempts in all
            extra = {"read_timeout": self.timeout, "connect_timeout": min(self.timeout, 10),
                     "retries": {"total_max_attempts": 3, "mode": "standard"}}
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            config=Config(max_pool_connections=CONCURRENCY + 2, s3={"addressing_style": "path"}, **extra))
        self.transfer = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY)

    def put(self, bucket, key, chunks, fail_after=None):
        self.client.upload_fileobj(ChunkReader(chunks, fail_after), bucket, key, Config=self.transfer)

    def get_whole(self, bucket, key, dest):
        raw = self.client.get_object(Bucket=bucket, Key=key)["Body"]._raw_stream  # urllib3: readinto
        at = 0
        while at < len(dest):
            n = raw.readinto(dest[at:at + CHUNK])
            if not n:
                raise IOError(f"short read at {at}")
            at += n

    def _range_into(self, bucket, key, dest, a, b):
        raw = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={a}-{b - 1}")["Body"]._raw_stream
        at = a
        while at < b:
            n = raw.readinto(dest[at:b])
            if not n:
                raise IOError(f"short read at {at}")
            at += n

    def get_ranged(self, bucket, key, dest):
        with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
            for f in [pool.submit(self._range_into, bucket, key, dest, a, b) for a, b in ranges(len(dest))]:
                f.result()

    def get_range(self, bucket, key, start, end):
        return self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"].read()


class ObstoreRaw(RawClient):
    name = "obstore (object_store)"
    key = "obstore"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.stores: dict[str, Any] = {}

    def store(self, bucket: str) -> Any:
        if bucket not in self.stores:
            from obstore.store import S3Store

            opts: dict[str, Any] = {"allow_http": True}
            retry: dict[str, Any] = {}
            if self.timeout is not None:  # a no-progress bound: the read timeout, 3 attempts in all
                import datetime as dt

                opts.update(read_timeout=f"{self.timeout:g}s", connect_timeout="10s", timeout="3600s")
                retry = {"retry_config": {"max_retries": 2, "retry_timeout": dt.timedelta(seconds=3 * self.timeout)}}
            self.stores[bucket] = S3Store(
                bucket, endpoint=self.endpoint, region=REGION, access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"], virtual_hosted_style_request=False,
                client_options=opts, **retry)
        return self.stores[bucket]

    def put(self, bucket, key, chunks, fail_after=None):
        import obstore

        obstore.put(self.store(bucket), key, failing_iter(chunks, fail_after), chunk_size=PART,
                    max_concurrency=CONCURRENCY)

    def get_whole(self, bucket, key, dest):
        import obstore

        at = 0
        for piece in obstore.get(self.store(bucket), key).stream(min_chunk_size=CHUNK):
            m = memoryview(piece)
            dest[at:at + len(m)] = m
            at += len(m)
        if at != len(dest):
            raise IOError(f"short read: {at} of {len(dest)}")

    def get_ranged(self, bucket, key, dest):
        import obstore

        store = self.store(bucket)

        async def run() -> None:
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(a: int, b: int) -> None:
                async with gate:
                    piece = await obstore.get_range_async(store, key, start=a, end=b)
                    dest[a:b] = memoryview(piece)

            await asyncio.gather(*(one(a, b) for a, b in ranges(len(dest))))

        asyncio.run(run())

    def get_range(self, bucket, key, start, end):
        import obstore

        return bytes(obstore.get_range(self.store(bucket), key, start=start, end=end))


class S3fsRaw(RawClient):
    name = "s3fs (aiobotocore)"
    key = "s3fs"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        import s3fs

        config: dict[str, Any] = {}
        if self.timeout is not None:  # a no-progress bound: the read timeout, 3 attempts in all
            config = {"read_timeout": self.timeout, "connect_timeout": min(self.timeout, 10),
                      "retries": {"total_max_attempts": 3, "mode": "standard"}}
        self.fs = s3fs.S3FileSystem(key=self.env["AWS_ACCESS_KEY_ID"], secret=self.env["AWS_SECRET_ACCESS_KEY"],
                                    endpoint_url=self.endpoint, client_kwargs={"region_name": REGION},
                                    config_kwargs=config, max_concurrency=CONCURRENCY, skip_instance_cache=True,
                                    use_listings_cache=False)
        if self.timeout is not None:
            self.fs.retries = 1  # s3fs's own retry loop around botocore's (a class attribute, 5)

    def put(self, bucket, key, chunks, fail_after=None):
        with self.fs.open(f"{bucket}/{key}", "wb", block_size=PART) as f:
            for c in failing_iter(chunks, fail_after):
                f.write(c)

    def get_whole(self, bucket, key, dest):
        with self.fs.open(f"{bucket}/{key}", "rb", block_size=CHUNK, cache_type="none") as f:
            at = 0
            while at < len(dest):
                n = f.readinto(dest[at:at + CHUNK])
                if not n:
                    raise IOError(f"short read at {at}")
                at += n

    def get_ranged(self, bucket, key, dest):
        rs = ranges(len(dest))
        path = f"{bucket}/{key}"
        for i in range(0, len(rs), CONCURRENCY):  # CONCURRENCY ranges at a time: bounded memory
            batch = rs[i:i + CONCURRENCY]
            pieces = self.fs.cat_ranges([path] * len(batch), [a for a, _ in batch], [b for _, b in batch])
            for (a, b), piece in zip(batch, pieces):
                dest[a:b] = piece

    def get_range(self, bucket, key, start, end):
        return self.fs.cat_file(f"{bucket}/{key}", start=start, end=end)


class CrtRaw(RawClient):
    """s3torchconnector's CRT client (through its S3Checkpoint writer and reader): for the fault probes."""

    name = "s3torchconnector (CRT)"
    key = "crt"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        from s3torchconnector import S3Checkpoint, S3ClientConfig

        self.cp = S3Checkpoint(region=REGION, endpoint=self.endpoint,
                               s3client_config=S3ClientConfig(part_size=PART, force_path_style=True))

    def put(self, bucket, key, chunks, fail_after=None):
        with self.cp.writer(f"s3://{bucket}/{key}") as w:
            for c in failing_iter(chunks, fail_after):
                w.write(c)

    def get_whole(self, bucket, key, dest):
        with self.cp.reader(f"s3://{bucket}/{key}") as r:
            at = 0
            while at < len(dest):
                n = r.readinto(dest[at:at + CHUNK])
                if not n:
                    raise IOError(f"short read at {at}")
                at += n


RAW_CLIENTS: dict[str, type[RawClient]] = {c.key: c for c in (Boto3Raw, ObstoreRaw, S3fsRaw, CrtRaw)}
RAW_MEASURED = ["boto3", "obstore", "s3fs"]


# -- peers: whole checkpoints ------------------------------------------------------------------------
def flatten(obj: Any, prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors by path, other leaves by path) of a nested state; paths joined with '/'."""
    import torch

    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            t, r = flatten(v, f"{prefix}/{k}" if prefix else str(k))
            tensors.update(t)
            rest.update(r)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            t, r = flatten(v, f"{prefix}/{i}" if prefix else str(i))
            tensors.update(t)
            rest.update(r)
    else:
        rest[prefix] = obj
    return tensors, rest


def assert_same_tensors(a: dict[str, Any], b: dict[str, Any]) -> None:
    import torch

    assert a.keys() == b.keys(), f"different tensors: {sorted(a.keys() ^ b.keys())[:5]}"
    for k in a:
        x, y = a[k], b[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"bytes differ: {k}"


def dcp_state(state: dict[str, Any]) -> dict[str, Any]:
    """What DCP saves of the state: its tensors (DCP keeps the tree), with the optimizer's param ids as str."""
    opt = state["optimizer"]
    return {"model": state["model"], "master": state["master"],
            "optimizer": {"state": {str(k): v for k, v in opt["state"].items()}}, "step": state["step"]}


def empty_like_tree(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj)
    if isinstance(obj, dict):
        return {k: empty_like_tree(v) for k, v in obj.items()}
    return obj


class Peer:
    name = ""
    key = ""
    # The modules a peer's operations use, imported before each measurement, as nvckpt is (load_state): a
    # measurement is the operation, not the first import (torch.distributed.checkpoint's alone takes ~1 s of
    # CPU on a 2-core VM, which every DCP route would otherwise pay inside its one-tensor read).
    imports: tuple[str, ...] = ()

    def __init__(self, endpoint: str, env: dict[str, str]) -> None:
        self.endpoint, self.env = endpoint, env

    def save(self, state: Any, bucket: str, prefix: str) -> None: ...
    def load(self, bucket: str, prefix: str, like: Any) -> Any: ...
    def read_tensor(self, bucket: str, prefix: str, path: str, like: Any) -> Any: ...

    def boto3(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            config=Config(max_pool_connections=CONCURRENCY + 2, s3={"addressing_style": "path"}))

    def transfer(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY)


class TorchSaveBoto3(Peer):
    name = "torch.save + boto3 upload / download"
    key = "torch_boto3"
    imports = ("boto3",)

    def save(self, state, bucket, prefix):
        import torch

        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        self.boto3().upload_fileobj(buf, bucket, f"{prefix}/ckpt.pt", Config=self.transfer())

    def load(self, bucket, prefix, like):
        import torch

        buf = io.BytesIO()
        self.boto3().download_fileobj(bucket, f"{prefix}/ckpt.pt", buf, Config=self.transfer())
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    def read_tensor(self, bucket, prefix, path, like):
        state = self.load(bucket, prefix, like)
        for part in path.split("/"):
            state = state[part]
        return state


class S3CheckpointPeer(Peer):
    name = "s3torchconnector S3Checkpoint (torch.save)"
    key = "s3checkpoint"
    imports = ("s3torchconnector",)

    def cp(self) -> Any:
        from s3torchconnector import S3Checkpoint, S3ClientConfig

        return S3Checkpoint(region=REGION, endpoint=self.endpoint,
                            s3client_config=S3ClientConfig(part_size=PART, force_path_style=True))

    def save(self, state, bucket, prefix):
        import torch

        with self.cp().writer(f"s3://{bucket}/{prefix}/ckpt.pt") as w:
            torch.save(state, w)

    def load(self, bucket, prefix, like):
        import torch

        with self.cp().reader(f"s3://{bucket}/{prefix}/ckpt.pt") as r:
            return torch.load(r, weights_only=True)

    read_tensor = TorchSaveBoto3.read_tensor


class DcpS3Peer(Peer):
    name = "s3torchconnector DCP S3StorageWriter / S3StorageReader"
    key = "dcp_s3torchconnector"
    imports = ("torch.distributed.checkpoint", "s3torchconnector.dcp")

    def config(self) -> Any:
        from s3torchconnector import S3ClientConfig

        return S3ClientConfig(part_size=PART, force_path_style=True)

    def save(self, state, bucket, prefix):
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageWriter

        dcp.save(dcp_state(state), storage_writer=S3StorageWriter(REGION, f"s3://{bucket}/{prefix}",
                                                                  s3client_config=self.config()))

    def load(self, bucket, prefix, like):
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageReader

        target = empty_like_tree(dcp_state(like))
        dcp.load(target, storage_reader=S3StorageReader(REGION, f"s3://{bucket}/{prefix}", s3client_config=self.config()))
        return target

    def read_tensor(self, bucket, prefix, path, like):
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageReader

        group, name = path.split("/", 1)
        target = {group: {name: empty_like_tree(like[group][name])}}
        dcp.load(target, storage_reader=S3StorageReader(REGION, f"s3://{bucket}/{prefix}", s3client_config=self.config()))
        return target[group][name]


class DcpFsspecPeer(Peer):
    name = "DCP through fsspec (s3fs)"
    key = "dcp_fsspec"
    imports = ("torch.distributed.checkpoint", "torch.distributed.checkpoint._fsspec_filesystem")

    def save(self, state, bucket, prefix):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dcp.save(dcp_state(state), storage_writer=FsspecWriter(f"s3://{bucket}/{prefix}", **self.options()))

    def options(self) -> dict[str, Any]:
        return {"key": self.env["AWS_ACCESS_KEY_ID"], "secret": self.env["AWS_SECRET_ACCESS_KEY"],
                "endpoint_url": self.endpoint, "client_kwargs": {"region_name": REGION}}

    def load(self, bucket, prefix, like):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        target = empty_like_tree(dcp_state(like))
        dcp.load(target, storage_reader=FsspecReader(f"s3://{bucket}/{prefix}", **self.options()))
        return target

    def read_tensor(self, bucket, prefix, path, like):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        group, name = path.split("/", 1)
        target = {group: {name: empty_like_tree(like[group][name])}}
        dcp.load(target, storage_reader=FsspecReader(f"s3://{bucket}/{prefix}", **self.options()))
        return target[group][name]


class SafetensorsBoto3(Peer):
    name = "safetensors + boto3"
    key = "safetensors_boto3"
    imports = ("boto3", "safetensors.torch")

    def save(self, state, bucket, prefix):
        from safetensors.torch import save

        tensors, rest = flatten(state)
        blob = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"rest": json.dumps(rest)})
        self.boto3().upload_fileobj(io.BytesIO(blob), bucket, f"{prefix}/model.safetensors", Config=self.transfer())

    def load(self, bucket, prefix, like):
        from safetensors.torch import load

        buf = io.BytesIO()
        self.boto3().download_fileobj(bucket, f"{prefix}/model.safetensors", buf, Config=self.transfer())
        return load(buf.getvalue())  # flat: compared as flat

    def read_tensor(self, bucket, prefix, path, like):
        """safetensors' own random access over S3: one ranged GET for the length and header (64 KiB, a second
        one if the header is longer), one for the tensor."""
        import struct

        import torch

        client, key = self.boto3(), f"{prefix}/model.safetensors"
        head = client.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{64 * 1024 - 1}")["Body"].read()
        n = struct.unpack("<Q", head[:8])[0]
        if 8 + n > len(head):
            head += client.get_object(Bucket=bucket, Key=key, Range=f"bytes={len(head)}-{8 + n - 1}")["Body"].read()
        info = json.loads(head[8:8 + n])[path]
        a, b = info["data_offsets"]
        data = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={8 + n + a}-{8 + n + b - 1}")["Body"].read()
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}[info["dtype"]]
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(info["shape"])


class NvckptPeer(Peer):
    name = "nvckpt.save / load / open (s3://, obstore)"
    key = "nvckpt"

    def url(self, bucket: str, prefix: str) -> str:
        return f"s3://{bucket}/{prefix}/ckpt.nvckpt"

    def options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint}  # the rest (credentials, region) from the environment

    def save(self, state, bucket, prefix):
        import nvckpt

        nvckpt.save(state, self.url(bucket, prefix), storage_options=self.options())

    def load(self, bucket, prefix, like):
        import nvckpt

        return nvckpt.load(self.url(bucket, prefix), storage_options=self.options())

    def read_tensor(self, bucket, prefix, path, like):
        """open (one suffix GET for the footer and index, one for the preamble), then the tensor's chunks."""
        import nvckpt

        with nvckpt.open(self.url(bucket, prefix), storage_options=self.options()) as ck:
            return ck.get_tensor(path)


class NvckptDcpPeer(NvckptPeer):
    name = "nvckpt.dcp.Writer / Reader (s3://)"
    key = "nvckpt_dcp"
    imports = ("torch.distributed.checkpoint", "nvckpt.dcp.writer", "nvckpt.dcp.reader")

    def save(self, state, bucket, prefix):
        import torch.distributed.checkpoint as dcp

        import nvckpt.dcp

        dcp.save(dcp_state(state), storage_writer=nvckpt.dcp.Writer(f"s3://{bucket}/{prefix}",
                                                                     storage_options=self.options()))

    def load(self, bucket, prefix, like):
        import torch.distributed.checkpoint as dcp

        import nvckpt.dcp

        target = empty_like_tree(dcp_state(like))
        dcp.load(target, storage_reader=nvckpt.dcp.Reader(f"s3://{bucket}/{prefix}", storage_options=self.options()))
        return target

    def read_tensor(self, bucket, prefix, path, like):
        import torch.distributed.checkpoint as dcp

        import nvckpt.dcp

        group, name = path.split("/", 1)
        target = {group: {name: empty_like_tree(like[group][name])}}
        dcp.load(target, storage_reader=nvckpt.dcp.Reader(f"s3://{bucket}/{prefix}", storage_options=self.options()))
        return target[group][name]


PEERS: dict[str, type[Peer]] = {p.key: p for p in (TorchSaveBoto3, S3CheckpointPeer, DcpS3Peer, DcpFsspecPeer,
                                                    SafetensorsBoto3, NvckptPeer, NvckptDcpPeer)}


# -- the data -------------------------------------------------------------------------------------------
def build_state(layers: int, dim: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """bench_cpu.py's training state, at a size for object storage: a transformer of ``layers`` encoder
    layers of width ``dim`` (16 heads, vocabulary 8192) trained ``steps`` AdamW steps in fp32 on the CPU
    (batches of 4 of 16 sequences); bf16 weights, fp32 master weights, Adam moments, step counters."""
    from bench_cpu import training_state

    return training_state(steps, seed, d=dim, layers=layers, heads=16, vocab=8192, rows=16, batch_size=4)


def checkpoint_file(work: str, layers: int, dim: int, steps: int) -> str:
    """The state saved by nvckpt to a local file (made once per configuration, then reused)."""
    path = os.path.join(work, f"state_l{layers}_d{dim}_s{steps}.nvckpt")
    if not os.path.exists(path):
        import nvckpt

        t0 = time.perf_counter()
        state = build_state(layers, dim, steps)
        print(f"  trained {steps} steps in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        nvckpt.save(state, path + ".tmp", codec="portable")
        os.replace(path + ".tmp", path)
    return path


def load_state(path: str) -> Any:
    import nvckpt

    return nvckpt.load(path)


# -- one measurement (a worker process) -------------------------------------------------------------------
def worker(spec: dict[str, Any]) -> dict[str, Any]:
    env = spec["env"]
    kind = spec["kind"]
    if kind == "raw":
        return raw_op(spec, env)
    if kind == "peer":
        return peer_op(spec, env)
    if kind == "fault":
        return fault_op(spec, env)
    raise ValueError(kind)


def raw_op(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    client = RAW_CLIENTS[spec["client"]](env["AWS_ENDPOINT_URL"], env)
    data, chunks = payload(spec["file"])
    digest = sha256(data)
    bucket, key, op = spec["bucket"], spec["key"], spec["op"]
    client.get_range(bucket, spec.get("warm_key", key), 0, 1)  # a connection made and credentials resolved, untimed
    if op == "put":
        with Meter() as m:
            client.put(bucket, key, chunks)
        return m.row(len(data))
    if op == "get_range":  # the floor of one tensor: one ranged GET
        with Meter() as m:
            got = client.get_range(bucket, key, spec["start"], spec["end"])
        assert bytes(got) == bytes(data[spec["start"]:spec["end"]])
        return m.row(len(got))
    del chunks
    get = client.get_whole if op.startswith("get_whole") else client.get_ranged
    if op.endswith("_fresh"):
        # Into memory allocated (and so first touched) within the clock, as a load's result is: on this kind of
        # VM the page faults of a fresh destination cost about as much CPU as the transfer itself.
        with Meter() as m:
            dest = mmap.mmap(-1, len(data))
            get(bucket, key, memoryview(dest))
        row = m.row(len(data))
        row["peak_rss_MB"] = round(max(0.0, m.peak_mb - len(data) / MiB), 1)  # beyond the destination
    else:
        dest = bytearray(len(data))  # the destination exists before the read: the peak is the client's own
        with Meter() as m:
            get(bucket, key, memoryview(dest))
        row = m.row(len(data))
    assert sha256(dest) == digest, f"{client.name} {op}: wrong bytes"
    return row


def _counted(endpoint: str, fn: Callable[[str], Any]) -> tuple[Any, dict[str, int]]:
    """Run ``fn(endpoint)`` through an idle fault proxy (also the endpoint in AWS_ENDPOINT_URL meanwhile, for
    the clients that read it from there alone) and count its requests by method."""
    from nvckpt.testing.faultproxy import FaultProxy

    with FaultProxy(endpoint) as proxy:
        old = os.environ.get("AWS_ENDPOINT_URL")
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint_url
        try:
            out = fn(proxy.endpoint_url)
        finally:
            if old is None:
                del os.environ["AWS_ENDPOINT_URL"]
            else:
                os.environ["AWS_ENDPOINT_URL"] = old
        counts: dict[str, int] = {}
        for r in proxy.requests:
            counts[r.method] = counts.get(r.method, 0) + 1
    return out, counts


def peer_op(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    import torch

    os.environ.update(env)  # s3torchconnector's DCP classes take the endpoint only from AWS_ENDPOINT_URL
    torch.set_num_threads(os.cpu_count() or 1)
    state = load_state(spec["file"])
    tensors, _ = flatten(state)
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    peer = PEERS[spec["peer"]](env["AWS_ENDPOINT_URL"], env)
    for module in peer.imports:
        importlib.import_module(module)
    bucket, prefix, op = spec["bucket"], spec["prefix"], spec["op"]
    if op == "save":
        with Meter() as m:
            peer.save(state, bucket, prefix)
        row = m.row(raw)
        row["stored_bytes"] = stored_bytes(env, bucket, prefix)
        return row
    if op == "load":
        like = {k: v for k, v in state.items()}
        with Meter() as m:
            got = peer.load(bucket, prefix, like)
        row = m.row(raw)
        row["peak_rss_beyond_result_MB"] = round(m.peak_mb - raw / MiB, 1)
        got_t, _ = flatten(got)
        want = (tensors if spec["peer"] in ("torch_boto3", "s3checkpoint", "safetensors_boto3", "nvckpt")
                else flatten(dcp_state(state))[0])
        assert_same_tensors(got_t, want)
        return row
    if op == "tensor":
        want = tensors[TENSOR]
        with Meter() as m:
            got = peer.read_tensor(bucket, prefix, TENSOR, state)
        assert_same_tensors({"t": got}, {"t": want})
        counted = PEERS[spec["peer"]]
        _, counts = _counted(env["AWS_ENDPOINT_URL"], lambda url: counted(url, env).read_tensor(bucket, prefix, TENSOR, state))
        row = m.row(want.numel() * want.element_size())
        row["requests"] = counts
        return row
    raise ValueError(op)


def stored_bytes(env: dict[str, str], bucket: str, prefix: str) -> int:
    import boto3

    client = boto3.session.Session().client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=REGION,
                                            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sum(o["Size"] for p in pages for o in p.get("Contents", []))


def fault_op(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """One client against one fault; the result says what the client did.  Runs the transfer in a thread
    and gives up waiting after ``cap`` seconds (then the process exits with the thread still stuck)."""
    from nvckpt.testing.faultproxy import FaultProxy

    server_pid = spec["server_pid"]
    proxy = FaultProxy(env["AWS_ENDPOINT_URL"], on_kill=lambda: os.kill(server_pid, signal.SIGKILL)).start()
    client = RAW_CLIENTS[spec["client"]](proxy.endpoint_url, env, timeout=spec.get("timeout"))
    data, chunks = payload(spec["file"], FAULT_BYTES)
    bucket, key, scenario = spec["bucket"], spec["key"], spec["scenario"]
    fail_after = None
    if scenario == "throttle":
        proxy.fail(503, "SlowDown", times=3, method=spec["method"])
    elif scenario == "reset":
        proxy.reset(during="request" if spec["method"] == "PUT" else "response", after_bytes=MiB, times=3,
                    method=spec["method"])
    elif scenario == "stall":
        proxy.stall(method=spec["method"], skip=2)  # from the third request on: in the middle of the transfer
    elif scenario == "kill":
        proxy.kill_server(during="request", after_bytes=4 * MiB, method="PUT", skip=2)
    elif scenario == "source_fails":
        fail_after = 100 * MiB
    outcome: dict[str, Any] = {}
    dest = memoryview(bytearray(len(data))) if spec["method"] == "GET" else None

    def run() -> None:
        t0 = time.perf_counter()
        try:
            if spec["method"] == "PUT":
                client.put(bucket, key, chunks, fail_after)
            else:
                client.get_ranged(bucket, key, dest) if spec["client"] != "crt" else client.get_whole(bucket, key, dest)
            outcome["error"] = None
        except BaseException as exc:  # what the client raised, in one line
            outcome["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        outcome["seconds"] = round(time.perf_counter() - t0, 2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(spec["cap"])
    if thread.is_alive():
        outcome = {"error": f"no error within {spec['cap']} s", "seconds": None, "hung": True}
    if dest is not None and outcome.get("error") is None:
        outcome["exact"] = sha256(dest) == sha256(data)
    statuses: dict[str, int] = {}
    for r in proxy.requests:
        label = f"{r.method} {r.fault or r.status}"
        statuses[label] = statuses.get(label, 0) + 1
    outcome["requests"] = statuses
    outcome["faults_fired"] = sum(1 for r in proxy.requests if r.fault)
    if not outcome.get("hung"):
        proxy.close()
    return outcome


def run_worker(spec: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """Run one measurement in a new process; its last stdout line is its result."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **spec["env"]})
    return _result(proc.returncode, proc.stdout, proc.stderr, spec)


def _result(code: int, stdout: str, stderr: str, spec: dict[str, Any]) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = "\n".join(stderr.strip().splitlines()[-5:])
    return {"error": f"worker failed (exit {code}): {tail[-600:]}"}


# -- the run --------------------------------------------------------------------------------------------
def run_raw(server: Any, file: str, reps: int) -> dict[str, Any]:
    env = server.env()
    bucket = server.create_bucket()
    base = {"env": env, "file": file, "bucket": bucket, "kind": "raw"}
    # every GET reads one object (the same bytes for every client), put there once, untimed
    client = server.client()
    with open(file, "rb") as f:
        client.upload_fileobj(f, bucket, "payload")
    digest = sha256(open(file, "rb").read())
    rows: dict[str, dict[str, list[dict[str, float]]]] = {c: {} for c in RAW_MEASURED}
    for rep in range(reps):
        order = RAW_MEASURED[rep % len(RAW_MEASURED):] + RAW_MEASURED[:rep % len(RAW_MEASURED)]
        for op in RAW_OPS:
            for c in order:
                key = f"put-{c}" if op == "put" else "payload"
                r = run_worker({**base, "client": c, "op": op, "key": key, "warm_key": "payload"})
                print(f"  raw {c} {op}: {r}", file=sys.stderr)
                rows[c].setdefault(op, []).append(r)
                if op == "put" and rep == 0 and "error" not in r:  # the upload is exact
                    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
                    assert sha256(body) == digest, f"{c} put wrong bytes"
                    del body
    return {c: {op: summarize(rs) for op, rs in ops.items()} for c, ops in rows.items()}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    good = [r for r in rows if "error" not in r]
    if not good:
        return {"error": rows[0].get("error")}
    out: dict[str, Any] = {"runs": len(good)}
    for k in good[0]:
        if isinstance(good[0][k], (int, float)):
            out[k] = round(statistics.median(r[k] for r in good), 3)
        else:
            out[k] = good[0][k]
    if "seconds" in out:
        out["seconds_all"] = [r["seconds"] for r in good]
    return out


def run_peers(server: Any, file: str, reps: int, peers: list[str]) -> dict[str, Any]:
    env = server.env()
    bucket = server.create_bucket()
    out: dict[str, Any] = {}
    for p in peers:
        rows: dict[str, list[dict[str, Any]]] = {"save": [], "load": []}
        for rep in range(reps):
            spec = {"env": env, "file": file, "bucket": bucket, "kind": "peer", "peer": p, "prefix": f"{p}"}
            for op in ("save", "load"):
                r = run_worker({**spec, "op": op})
                print(f"  peer {p} {op}: {r}", file=sys.stderr)
                rows[op].append(r)
        out[p] = {op: summarize(rs) for op, rs in rows.items()}
        r = run_worker({"env": env, "file": file, "bucket": bucket, "kind": "peer", "peer": p, "prefix": p, "op": "tensor"})
        print(f"  peer {p} tensor: {r}", file=sys.stderr)
        out[p]["tensor"] = r
    return out


def tensor_floor(server: Any, file: str) -> dict[str, Any]:
    """One ranged GET of the tensor's bytes (its place in the safetensors object), per raw client."""
    import struct

    env = server.env()
    client = server.client()
    bucket = server.create_bucket()
    state = load_state(file)
    from safetensors.torch import save

    tensors, _ = flatten(state)
    blob = save({k: v.contiguous() for k, v in tensors.items()})
    del state, tensors
    path = os.path.join(os.path.dirname(file), "floor.safetensors")
    with open(path, "wb") as f:
        f.write(blob)
    client.put_object(Bucket=bucket, Key="floor", Body=blob)
    n = struct.unpack("<Q", blob[:8])[0]
    a, b = json.loads(blob[8:8 + n])[TENSOR]["data_offsets"]
    del blob
    out = {}
    for c in RAW_MEASURED:
        rows = [run_worker({"env": env, "file": path, "bucket": bucket, "kind": "raw", "client": c, "op": "get_range",
                            "key": "floor", "start": 8 + n + a, "end": 8 + n + b}) for _ in range(5)]
        out[c] = summarize(rows)
        print(f"  floor {c}: {out[c]}", file=sys.stderr)
    os.remove(path)
    return out


def run_faults(server: Any, file: str, cap: float, clients: list[str], only_stalls: bool = False,
               stall_timeouts: tuple[float | None, ...] = (None, 20.0)) -> dict[str, Any]:
    env = server.env()
    bucket = server.create_bucket()
    client = server.client()
    with open(file, "rb") as f:
        head = f.read(FAULT_BYTES)
    client.put_object(Bucket=bucket, Key="payload", Body=head)
    head_digest = sha256(head)
    del head
    out: dict[str, Any] = {c: {} for c in clients}

    def spec(c: str, scenario: str, method: str, key: str, **kw: Any) -> dict[str, Any]:
        return {"env": env, "file": file, "bucket": bucket, "kind": "fault", "client": c, "scenario": scenario,
                "method": method, "key": key, "server_pid": server.pid, "cap": kw.pop("cap", 600), **kw}

    def visible(key: str) -> bool:
        return key in server.keys(bucket, key)

    for c in clients if not only_stalls else []:
        for scenario in ("throttle", "reset"):
            for method in ("PUT", "GET"):
                key = f"{c}-{scenario}" if method == "PUT" else "payload"
                r = run_worker(spec(c, scenario, method, key))
                if method == "PUT":
                    r["object_visible"] = visible(key)
                    if r["object_visible"] and not r.get("error"):
                        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
                        r["exact"] = sha256(body) == head_digest
                        del body
                r["open_uploads"] = len(server.open_uploads(bucket, key)) if method == "PUT" else None
                out[c][f"{scenario} {method}"] = r
                print(f"  fault {c} {scenario} {method}: {r}", file=sys.stderr)
        key = f"{c}-source-fails"
        r = run_worker(spec(c, "source_fails", "PUT", key))
        r["object_visible"], r["open_uploads"] = visible(key), len(server.open_uploads(bucket, key))
        out[c]["source fails PUT"] = r
        print(f"  fault {c} source fails: {r}", file=sys.stderr)
        key = f"{c}-killed"
        r = run_worker(spec(c, "kill", "PUT", key, cap=min(cap, 300)))
        server.start()  # the worker killed it by its pid: back on the same ports
        r["object_visible"], r["open_uploads"] = visible(key), len(server.open_uploads(bucket, key))
        out[c]["server killed PUT"] = r
        print(f"  fault {c} killed: {r}", file=sys.stderr)
    # stalls: every client and setting at once (each waits alone on its own stalled proxy)
    procs = []
    for c in clients:
        for method in ("PUT", "GET"):
            for timeout in stall_timeouts:
                if timeout is not None and c == "crt":
                    continue  # S3ClientConfig has no timeout to set
                s = spec(c, "stall", method, f"{c}-stall" if method == "PUT" else "payload", cap=cap, timeout=timeout)
                p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(s)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
                procs.append((c, method, timeout, s, p))
    for c, method, timeout, s, p in procs:
        try:
            so, se = p.communicate(timeout=cap + 120)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        r = _result(p.returncode, so, se, s)
        label = f"stall {method}" + (" (defaults)" if timeout is None else f" (read timeout {timeout:g} s, 3 attempts)")
        out[c][label] = r
        print(f"  fault {c} {label}: {r}", file=sys.stderr)
    for c in clients:
        out[c]["open uploads after stalls"] = len(server.open_uploads(bucket, f"{c}-stall"))
    return out


# -- a link slower than the client's CPU -----------------------------------------------------------------
@contextlib.contextmanager
def shaped_link(port: int, mbit: int) -> Any:
    """Loopback traffic to and from ``port`` (the S3 endpoint's) limited to ``mbit`` Mbit/s, as a training
    node's share of its network limits each rank's transfers; SeaweedFS's traffic between its own servers
    stays unlimited.  tc: an htb qdisc on lo whose default class is unlimited and whose second class, where
    u32 filters put that port's packets, has the rate.  Needs root (CAP_NET_ADMIN) and iproute2; removed on
    exit."""

    def tc(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["tc", *args], capture_output=True, text=True)

    try:
        shown = tc("qdisc", "show", "dev", "lo").stdout
    except FileNotFoundError:
        raise SystemExit("bench_s3: the 'link' part needs tc (iproute2) to shape the loopback link") from None
    if "noqueue" not in shown:
        raise SystemExit(f"bench_s3: lo already has a queueing discipline ({shown.strip()}); remove it first "
                         "(tc qdisc del dev lo root) or leave out the 'link' part")
    steps = [("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "10", "r2q", "100000"),
             ("class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", "100gbit"),
             # the bucket holds several 64 KiB loopback packets: a burst below that would stall the class
             ("class", "add", "dev", "lo", "parent", "1:", "classid", "1:20", "htb", "rate", f"{mbit}mbit",
              "ceil", f"{mbit}mbit", "burst", "2mb", "cburst", "2mb")]
    steps += [("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
               side, str(port), "0xffff", "flowid", "1:20") for side in ("sport", "dport")]
    try:
        for step in steps:
            done = tc(*step)
            if done.returncode:
                raise SystemExit(f"bench_s3: cannot shape the loopback link (tc {' '.join(step[:2])}: "
                                 f"{done.stderr.strip()}); the 'link' part needs root (CAP_NET_ADMIN)")
        yield
    finally:
        tc("qdisc", "del", "dev", "lo", "root")


def run_link(server: Any, file: str, reps: int, peers: list[str], mbit: int,
             clients: tuple[str, ...] = ("boto3", "obstore")) -> dict[str, Any]:
    """Loads through a link of ``mbit`` Mbit/s: each raw client's GETs of the checkpoint file into fresh
    memory (the ceiling) and each peer's load of the whole state, which it saved beforehand at full speed
    (untimed: this machine's saves are bound by the server's CPU, not the link)."""
    env = server.env()
    bucket = server.create_bucket()
    with open(file, "rb") as f:
        server.client().upload_fileobj(f, bucket, "payload")
    stored: dict[str, int] = {}
    for p in peers:
        r = run_worker({"env": env, "file": file, "bucket": bucket, "kind": "peer", "peer": p, "prefix": p,
                        "op": "save"})
        if "error" in r:
            raise SystemExit(f"bench_s3: {p} could not save for the link part: {r['error']}")
        stored[p] = r["stored_bytes"]
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {c: {} for c in clients}
    loads: dict[str, list[dict[str, Any]]] = {p: [] for p in peers}
    with shaped_link(urlsplit(env["AWS_ENDPOINT_URL"]).port, mbit):
        for rep in range(reps):
            for c in clients:
                for op in ("get_whole_fresh", "get_ranged_fresh"):
                    r = run_worker({"env": env, "file": file, "bucket": bucket, "kind": "raw", "client": c, "op": op,
                                    "key": "payload"})
                    print(f"  link {mbit} Mbit/s raw {c} {op}: {r}", file=sys.stderr)
                    raw[c].setdefault(op, []).append(r)
            for p in peers if rep % 2 == 0 else peers[::-1]:
                r = run_worker({"env": env, "file": file, "bucket": bucket, "kind": "peer", "peer": p, "prefix": p,
                                "op": "load"})
                print(f"  link {mbit} Mbit/s peer {p} load: {r}", file=sys.stderr)
                loads[p].append(r)
    return {"mbit": mbit, "raw": {c: {op: summarize(rs) for op, rs in ops.items()} for c, ops in raw.items()},
            "peers": {p: {**summarize(rs), "stored_bytes": stored[p]} for p, rs in loads.items()}}


def link_lines(link: dict[str, Any]) -> list[str]:
    """The link part's tables: its ceilings, then each route's load against the ceiling for what it reads."""
    mbit = link["mbit"]
    best = max((r.get("MB_per_s", 0) for ops in link["raw"].values() for r in ops.values()), default=0)
    lines = [f"## Through a {mbit:,} Mbit/s link ({mbit / 8:,.0f} MB/s): loads bound by the connection", "",
             f"The S3 port's traffic on loopback shaped by tc to {mbit:,} Mbit/s (`--link-mbit`; SeaweedFS's traffic "
             "between its own servers is not), a node's network share per rank: here the link, not this machine's "
             "CPU, is the bound.  Every GET writes into fresh memory.  Ceiling: the fastest raw GET below "
             f"({best} MB/s) for the bytes a route reads.", ""]
    lines += raw_table(link["raw"])
    lines += ["| route | load s | bytes read MB | ceiling for those bytes s | load / ceiling | load CPU s/GB | "
              "load peak beyond the result MB |", "|---|---|---|---|---|---|---|"]
    for p, r in link["peers"].items():
        if "error" in r:
            lines.append(f"| {PEERS[p].name} | {r['error']} | | | | | |")
            continue
        ceiling = r["stored_bytes"] / 1e6 / best if best else float("nan")
        lines.append(f"| {PEERS[p].name} | {r['seconds']} | {r['stored_bytes'] / 1e6:,.0f} | {ceiling:.2f} | "
                     f"{r['seconds'] / ceiling:.2f} | {r.get('cpu_s_per_GB', '')} | "
                     f"{r.get('peak_rss_beyond_result_MB', '')} |")
    return lines + [""]


def versions(server: Any) -> dict[str, str]:
    return {"seaweedfs": server.version, **harness.package_versions((
        "nvckpt", "torch", "boto3", "botocore", "s3transfer", "obstore", "s3fs", "aiobotocore", "fsspec",
        "s3torchconnector", "s3torchconnectorclient", "safetensors"))}


def markdown(doc: dict[str, Any]) -> str:
    h = doc["hardware"]
    lines = [f"# Object storage benchmark ({doc['date']})", "",
             f"Command: `{doc['command']}`  ",
             f"Hardware: {h['cpu']}, {h['cores']} cores, {h['memory_MB']} MB, {h['machine']}, Linux {h['kernel']}, "
             f"Python {h['python']}  ",
             "Server: SeaweedFS `weed mini` on 127.0.0.1 (same machine, same cores: its CPU bounds every PUT)  ",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()) + "  ",
             f"Data: {doc['data']['description']}; nvckpt file {doc['data']['file_bytes'] / 1e6:,.0f} MB, "
             f"raw tensors {doc['data']['raw_bytes'] / 1e6:,.0f} MB", "",
             f"Part size {PART // MiB} MiB, range size {RANGE // MiB} MiB, {CONCURRENCY} in flight, memory chunks "
             f"{CHUNK // MiB} MiB.  Medians of {doc['reps']} interleaved runs, each in its own process.  CPU: the "
             "client process's user + system seconds per GB moved.  Peak RSS: above the process's RSS before the "
             "operation (the payload, or the destination buffer, already allocated).", ""]
    raw = doc.get("raw")
    if raw:
        lines += ["## Raw ceilings: the checkpoint file's bytes", "",
                  "GET ... fresh: into memory allocated within the clock (first touched by the transfer, as a "
                  "load's result is); the other GETs write into a buffer allocated and zeroed before it.", ""]
        lines += raw_table(raw)
    peers = doc.get("peers")
    if peers:
        lines += ["## Peers: the whole training state (MB/s of raw tensor bytes)", "",
                  "| route | save s | save MB/s | save CPU s/GB | save peak MB | stored MB | load s | load MB/s | "
                  "load CPU s/GB | load peak beyond the result MB | one 4 MiB tensor s | its requests |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p, ops in peers.items():
            s, l, t = ops.get("save", {}), ops.get("load", {}), ops.get("tensor", {})
            req = t.get("requests")
            lines.append(
                f"| {PEERS[p].name} | {s.get('seconds', s.get('error', ''))} | {s.get('MB_per_s', '')} | "
                f"{s.get('cpu_s_per_GB', '')} | {s.get('peak_rss_MB', '')} | {s.get('stored_bytes', 0) / 1e6:,.0f} | "
                f"{l.get('seconds', l.get('error', ''))} | {l.get('MB_per_s', '')} | {l.get('cpu_s_per_GB', '')} | "
                f"{l.get('peak_rss_beyond_result_MB', '')} | {t.get('seconds', t.get('error', ''))} | "
                f"{', '.join(f'{k} {v}' for k, v in req.items()) if req else 'not counted'} |")
        floor = doc.get("tensor_floor", {})
        if floor:
            lines += ["", "Floor for one 4 MiB tensor (one ranged GET of its bytes): " + ", ".join(
                f"{RAW_CLIENTS[c].name} {r.get('seconds', r.get('error'))} s" for c, r in floor.items()) + "."]
        lines.append("")
    if doc.get("link"):
        lines += link_lines(doc["link"])
    faults = doc.get("faults")
    if faults:
        lines += ["## Faults (through nvckpt.testing.faultproxy)", "",
                  "Throttle: three 503 SlowDown answers; reset: three connections reset 1 MiB into a part or a "
                  "ranged answer; server killed 4 MiB into the third part, then restarted; source fails: the "
                  "memory chunks raise after 100 MiB; stall: from the third request on, the proxy accepts and never "
                  f"answers (waited up to {doc['stall_cap']} s).  'open' is the number of multipart uploads left "
                  "open at that key afterwards, 'visible' whether an object appeared there.", "",
                  "| client | scenario | outcome | seconds | requests seen | open | visible |", "|---|---|---|---|---|---|---|"]
        for c, scenarios in faults.items():
            for name, r in scenarios.items():
                if not isinstance(r, dict):
                    lines.append(f"| {RAW_CLIENTS[c].name} | {name} | {r} | | | | |")
                    continue
                outcome = "ok" + ("" if r.get("exact", True) else " (WRONG BYTES)") if not r.get("error") else r["error"]
                req = ", ".join(f"{k}: {v}" for k, v in (r.get("requests") or {}).items())
                lines.append(f"| {RAW_CLIENTS[c].name} | {name} | {outcome.replace('|', '/')} | {r.get('seconds')} | "
                             f"{req} | {r.get('open_uploads', '')} | {r.get('object_visible', '')} |")
        lines.append("")
    for note in doc.get("notes", []):
        lines += [f"Note: {note}", ""]
    return "\n".join(lines) + "\n"


def raw_table(raw: dict[str, Any]) -> list[str]:
    ops = [op for op in RAW_OPS if any(op in r for r in raw.values())]
    head = "| client | " + " | ".join(f"{RAW_OP_NAMES[op]} MB/s | CPU s/GB | peak MB" for op in ops) + " |"
    lines = [head, "|---" * (1 + 3 * len(ops)) + "|"]
    for c, got in raw.items():
        cells = []
        for op in ops:
            r = got.get(op, {})
            cells += ["error" if "error" in r else f"{r.get('MB_per_s', '')}", f"{r.get('cpu_s_per_GB', '')}",
                      f"{r.get('peak_rss_MB', '')}"]
        lines.append(f"| {RAW_CLIENTS[c].name} | " + " | ".join(cells) + " |")
    return lines + [""]


def merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The earlier results with this run's rows put in (raw clients and peers by name, other parts whole), and
    which run each row comes from (``row_runs``, said in a note)."""
    out = dict(old)
    if "raw" in new and "peers" in new:  # the side-by-side tables are this run's: so is the header
        out.update({k: new[k] for k in ("date", "command", "hardware", "reps", "data", "settings", "versions")
                    if k in new})
    for part in ("raw", "peers", "tensor_floor", "faults"):
        if part in new:
            out[part] = {**old.get(part, {}), **new[part]}
    if "link" in new:  # one link rate's rows: replaced whole
        out["link"] = new["link"]
    out["runs"] = old.get("runs", [{"date": old["date"], "command": old["command"]}]) + [
        {"date": new["date"], "command": new["command"], "load_average": new.get("load_average")}]
    row_runs = dict(old.get("row_runs") or {row: old["date"] for row in _rows(old)})
    row_runs.update({row: new["date"] for row in _rows(new)})
    out["row_runs"] = row_runs
    runs = {r["date"]: r for r in out["runs"]}
    by_run: dict[str, list[str]] = {}
    for row, date in sorted(row_runs.items()):
        by_run.setdefault(date, []).append(row)
    said = []
    for date, rows in sorted(by_run.items(), reverse=True):
        run = runs.get(date, {})
        load = f", load average {run['load_average']}" if run.get("load_average") else ""
        said.append(f"{', '.join(rows)} from the run of {date} (`{run.get('command', '?')}`{load})")
    out["notes"] = [n for n in old.get("notes", []) if not n.startswith("rows ")] + ["rows " + "; ".join(said)]
    return out


def _rows(doc: dict[str, Any]) -> list[str]:
    """The names of a result's rows that a partial run may replace."""
    return ([f"{part} {name}" for part in ("raw", "peers", "faults") for name in doc.get(part, {})]
            + (["link"] if doc.get("link") else []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--parts", default="raw,peers,tensor,faults")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--link-mbit", type=int, default=1000,
                    help="the link part's rate, Mbit/s, of the S3 port's traffic (needs root: tc on loopback)")
    ap.add_argument("--fault-clients", default="boto3,obstore,s3fs,crt")
    ap.add_argument("--stall-cap", type=float, default=200.0)
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "nvckpt-bench-s3"))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--merge", action="store_true",
                    help="update the rows this run measures in the results already there (the others are kept, "
                         "and a note says which rows came from which run)")
    args = ap.parse_args(argv)
    if args.worker:
        result = worker(json.loads(args.worker))
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # a client thread still stuck on a stalled server must not keep the process alive

    from nvckpt.testing.seaweedfs import S3Server

    parts = args.parts.split(",")
    os.makedirs(args.work, exist_ok=True)
    file = checkpoint_file(args.work, args.layers, args.dim, args.steps)
    import nvckpt
    from nvckpt.tools.info import describe

    info = describe(file)
    doc: dict[str, Any] = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": harness.command_line(__file__, sys.argv[1:] if argv is None else argv, python="python"),
        "hardware": harness.hardware(), "reps": args.reps, "stall_cap": args.stall_cap,
        "data": {"description": f"transformer of {args.layers} layers, width {args.dim}, trained {args.steps} AdamW "
                                f"steps (bf16 weights, fp32 master, Adam moments), saved by nvckpt {nvckpt.__version__} "
                                f"(portable codec)",
                 "file_bytes": os.path.getsize(file), "raw_bytes": info["loaded_bytes"]},
        "settings": {"part_MiB": PART // MiB, "range_MiB": RANGE // MiB, "concurrency": CONCURRENCY,
                     "chunk_MiB": CHUNK // MiB},
    }
    with S3Server(root=None) as server:
        doc["versions"] = versions(server)
        t0 = time.time()
        if "raw" in parts:
            doc["raw"] = run_raw(server, file, args.reps)
        if "peers" in parts or "tensor" in parts:
            doc["peers"] = run_peers(server, file, args.reps, args.peers.split(","))
            doc["tensor_floor"] = tensor_floor(server, file)
        if "link" in parts:
            doc["link"] = run_link(server, file, args.reps, args.peers.split(","), args.link_mbit)
        if "faults" in parts:
            doc["faults"] = run_faults(server, file, args.stall_cap, args.fault_clients.split(","))
        if "stalls" in parts:  # the stall probes alone, with a read timeout only
            doc["faults"] = run_faults(server, file, args.stall_cap, args.fault_clients.split(","), only_stalls=True,
                                       stall_timeouts=(20.0,))
        doc["run_seconds"] = round(time.time() - t0)
    doc["load_average"] = [round(x, 2) for x in os.getloadavg()]
    os.makedirs(args.out, exist_ok=True)
    if args.merge and os.path.exists(os.path.join(args.out, "bench_s3.json")):
        doc = merged(json.load(open(os.path.join(args.out, "bench_s3.json"))), doc)
    text = harness.write_results(args.out, "bench_s3", doc, lambda: markdown(doc), echo=True)
    return 0 if text is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
