"""The GPU loader's read stage on the host stand-in (HostBackend): which bytes it reads, how many reads are in
flight, that checks and uploads do not hold the reads up, errors that name the chunk or the file, and the
device-read path (KvikIO's place, here HostDeviceReads), all bit-exact against the saved state."""

from __future__ import annotations

import errno
import os
import threading
import time
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nvckpt
from conftest import assert_tree_equal, small_training_state
from nvckpt.engines.gpu.decode import read_schedule
from nvckpt.errors import ChecksumError, TruncatedError, UnsupportedFeatureError
from nvckpt.io import gds
from nvckpt.io.ranges import LOCAL
from nvckpt.io.source import DirectReads, LocalFile
from nvckpt.options import GpuLoadOptions
from nvckpt.read.reader import ChunkReader
from nvckpt.testing.host import HostBackend

KiB = 1 << 10


def options(device_reads: bool = False, **kw) -> GpuLoadOptions:
    """The loader on the host stand-in with small reads, so that a small file takes many of them."""
    base = dict(read_span_bytes=64 * KiB, decode_batch_bytes=256 * KiB, read_buffers=4, read_threads=2,
                piece_bytes=16 * KiB, backend=HostBackend(device_reads=device_reads),
                read_path="kvikio" if device_reads else "o_direct")
    base.update(kw)
    return GpuLoadOptions(**base)


def mixed_precision_state() -> dict:
    """A mixed-precision training state: bf16 weights, their fp32 master copy, AdamW's moments, plus a
    tensor large enough for many chunks."""
    torch.manual_seed(3)
    state = small_training_state()
    master = torch.randn(400, 640) * 0.02
    state["weights_bf16"] = master.to(torch.bfloat16)
    state["master_fp32"] = master
    state["exp_avg"] = torch.randn(400, 640) * 1e-4
    state["exp_avg_sq"] = torch.rand(400, 640) * 1e-8
    return state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    state = mixed_precision_state()
    path = tmp_path_factory.mktemp("gpuread") / "state.nvckpt"
    nvckpt.save(state, path, chunk_size=32 * KiB)
    return path, state


# -- the schedule -------------------------------------------------------------------------------------
@st.composite
def layouts(draw, aligned=False):
    """Chunks back to back with gaps, a subset of them wanted (as keys= or a row range wants them);
    ``aligned``: each starting on a page, as the GPU engine writes them."""
    n = draw(st.integers(1, 60))
    items, at = [], draw(st.integers(0, 3 * 4096))
    for _ in range(n):
        if aligned:
            at = -(-at // 4096) * 4096
        length = draw(st.integers(1, 50_000))
        if draw(st.booleans()):
            items.append(types.SimpleNamespace(offset=at, stored_length=length))
        at += length + draw(st.sampled_from([0, 0, 7, 4096, 100_000]))
    return items


@settings(max_examples=150, deadline=None)
@given(st.booleans().flatmap(lambda a: st.tuples(st.just(a), layouts(a))),
       st.sampled_from([4096, 64 * KiB, 1 << 20]), st.sampled_from([0, 4096, 1 << 20]))
def test_read_schedule_covers_every_wanted_byte_once(layout, span, gap):
    aligned, items = layout
    spans = read_schedule(items, GpuLoadOptions(read_span_bytes=span, max_gap=gap), LOCAL)
    assert sum(len(s.items) for s in spans) == len(items)  # every chunk in exactly one read
    assert [it for s in spans for it in s.items] == items  # in file order
    for s in spans:
        assert s.start % 4096 == 0 and s.length % 4096 == 0  # O_DIRECT
        for it in s.items:  # each chunk whole in its read
            assert s.start <= it.offset and it.offset + it.stored_length <= s.start + s.length
        if len(s.items) > 1:  # a read grows past the span size only to hold one large chunk
            assert s.length <= span
        gaps = [b.offset - (a.offset + a.stored_length) for a, b in zip(s.items, s.items[1:])]
        assert all(0 <= g <= max(gap, LOCAL.max_gap) for g in gaps)  # only short gaps read through
        assert s.length < sum(it.stored_length for it in s.items) + sum(gaps) + 2 * 4096
    for a, b in zip(spans, spans[1:]):
        shared = a.start + a.length - b.start
        assert shared <= (0 if aligned else 4096)  # no byte read twice, but a page two chunks share


# -- loads, bit-exact, on both read paths -----------------------------------------------------------
@pytest.mark.parametrize("device_reads", [False, True])
def test_load_get_tensor_and_keys_subset_are_bit_exact(saved, device_reads):
    path, state = saved
    opts = options(device_reads)
    assert_tree_equal(nvckpt.load(path, gpu=opts), state)
    with nvckpt.open(path, gpu=opts) as ck:
        assert torch.equal(ck.get_tensor("exp_avg"), state["exp_avg"])
        last = ck.stats()["last_gpu_load"]
        assert last["read_path"] == ("host-device" if device_reads else last["read_path"])
        assert last["read_path"] in (("host-device",) if device_reads else ("o_direct", "buffered"))
        assert last["bytes_read"] >= last["stored_bytes"] and last["reads"] == last["spans"] > 3, last
        for key in ("read_seconds", "read_busy_seconds", "check_seconds", "decode_seconds", "read_GBps"):
            assert last[key] is not None and last[key] >= 0, key
    with nvckpt.open(path) as ck:  # what a keys= subset needs: its chunks, no others
        wanted = [ck.file.entry(k) for k in ("exp_avg", "exp_avg_sq")]
        needed = sum(e.stored_bytes for e in wanted)
        others = sum(e.stored_bytes for e in ck.index.tensors if e.chunks is not None) - needed
    with nvckpt.open(path, gpu=opts) as ck:
        before = ck.bytes_read
        got = ck.load(["exp_avg", "exp_avg_sq"])
        read = ck.bytes_read - before
    assert torch.equal(got["exp_avg"], state["exp_avg"])
    assert torch.equal(got["exp_avg_sq"], state["exp_avg_sq"])
    assert needed <= read < needed + others / 4


def test_auto_takes_device_reads_only_where_they_are_gpudirect(saved, monkeypatch):
    path, state = saved
    with nvckpt.open(path, gpu=options(True, read_path="auto")) as ck:
        assert torch.equal(ck["master_fp32"], state["master_fp32"])
        assert ck.stats()["last_gpu_load"]["read_path"] in ("o_direct", "buffered")  # a compat-mode stand-in
    monkeypatch.setattr("nvckpt.testing.host.HostDeviceReads.mode", gds.GDS)
    with nvckpt.open(path, gpu=options(True, read_path="auto")) as ck:
        assert torch.equal(ck["master_fp32"], state["master_fp32"])
        assert ck.stats()["last_gpu_load"]["read_path"] == gds.GDS


def test_auto_loads_through_the_pinned_path_where_device_reads_fail_to_open(saved, monkeypatch):
    path, state = saved

    def refuse(self, source, required):
        raise OSError(errno.EOPNOTSUPP, "cuFile: the filesystem does not support GPUDirect Storage")

    monkeypatch.setattr(HostBackend, "device_reads", refuse)
    with nvckpt.open(path, gpu=options(True, read_path="auto")) as ck:
        assert torch.equal(ck["exp_avg"], state["exp_avg"])
        last = ck.stats()["last_gpu_load"]
    assert last["read_path"] in ("o_direct", "buffered") and "GPUDirect" in last["device_reads_error"]
    with nvckpt.open(path, gpu=options(True, read_path="kvikio")) as ck:  # asked for: the error itself
        with pytest.raises(OSError, match="GPUDirect"):
            ck["exp_avg"]


def test_kvikio_read_path_without_device_reads_is_a_clear_error(saved):
    path, _ = saved
    with nvckpt.open(path, gpu=options(False, read_path="kvikio")) as ck:
        with pytest.raises(UnsupportedFeatureError, match="device_reads"):
            ck["exp_avg"]
    with pytest.raises(ValueError, match="read_path must be one of"):
        GpuLoadOptions(read_path="gds")


# -- concurrency ------------------------------------------------------------------------------------------
class _Gauge:
    def __init__(self):
        self.lock = threading.Lock()
        self.now = self.max = self.calls = 0


@pytest.mark.parametrize("device_reads", [False, True])
def test_reads_in_flight_stay_within_the_threads_and_buffers(saved, monkeypatch, device_reads):
    path, state = saved
    gauge = _Gauge()
    real = os.preadv

    def slow_preadv(fd, buffers, offset):
        with gauge.lock:
            gauge.now += 1
            gauge.calls += 1
            gauge.max = max(gauge.max, gauge.now)
        try:
            time.sleep(0.002)
            return real(fd, buffers, offset)
        finally:
            with gauge.lock:
                gauge.now -= 1

    opts = options(device_reads, read_threads=3, read_buffers=5)
    with nvckpt.open(path, gpu=opts) as ck:
        monkeypatch.setattr(os, "preadv", slow_preadv)
        got = ck.load()
        last = ck.stats()["last_gpu_load"]
    assert_tree_equal(got, state)
    assert gauge.calls >= last["spans"] > 10
    assert 2 <= gauge.max <= 3  # several reads at once, never more than the read threads
    assert 2 <= last["reads_in_flight_max"] <= 3
    assert last["read_buffers"] <= 5


@pytest.mark.parametrize("device_reads", [False, True])
def test_a_slow_check_does_not_hold_up_the_next_reads(saved, monkeypatch, device_reads):
    """One read thread: while the first span's checksums are being checked, later spans are read."""
    path, state = saved
    reads_meanwhile = []
    real_verify = ChunkReader.verify
    first = threading.Event()

    def slow_verify(self, entry, i, stored):
        if not first.is_set():
            first.set()
            deadline = time.monotonic() + 10
            while reads_done() < 3 and time.monotonic() < deadline:
                time.sleep(0.005)
            reads_meanwhile.append(reads_done())
        return real_verify(self, entry, i, stored)

    done = [0]
    real_preadv = os.preadv

    def counting_preadv(fd, buffers, offset):
        n = real_preadv(fd, buffers, offset)
        done[0] += 1
        return n

    def reads_done():
        return done[0]

    monkeypatch.setattr(ChunkReader, "verify", slow_verify)
    with nvckpt.open(path, gpu=options(device_reads, read_threads=1, read_buffers=4)) as ck:
        monkeypatch.setattr(os, "preadv", counting_preadv)
        assert_tree_equal(ck.load(), state)
    assert reads_meanwhile and reads_meanwhile[0] >= 3


def test_a_buffer_is_read_into_again_only_after_its_upload(saved, monkeypatch):
    """Uploads are not waited for on the loader's thread, but a buffer whose copy has not finished (its
    event not ready) is never handed to a reader."""
    path, state = saved
    pending: dict[int, int] = {}  # event -> address of the buffer it copies from
    polls: dict[int, int] = {}
    real_upload = HostBackend.upload_async

    def upload_async(self, dst, src):
        real_upload(self, dst, src)
        event = object()
        pending[id(event)] = src.data_ptr()
        polls[id(event)] = 0
        return event

    def ready(self, event):  # every copy "runs" for a few polls
        if event is None or id(event) not in pending:
            return True
        polls[id(event)] += 1
        return polls[id(event)] > 2

    def wait(self, event):
        if event is not None:
            pending.pop(id(event), None)

    overwritten = []
    real_read = DirectReads.read

    def read(self, start, length, need, buf):
        at = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        if at in pending.values():
            overwritten.append(start)
        return real_read(self, start, length, need, buf)

    monkeypatch.setattr(HostBackend, "upload_async", upload_async)
    monkeypatch.setattr(HostBackend, "ready", ready)
    monkeypatch.setattr(HostBackend, "wait", wait)
    monkeypatch.setattr(DirectReads, "read", read)
    with nvckpt.open(path, gpu=options(False, read_buffers=3)) as ck:
        assert_tree_equal(ck.load(), state)
        assert ck.stats()["last_gpu_load"]["spans"] > 10
    assert not overwritten  # (copies still running at the end are waited for by finish())


# -- errors ----------------------------------------------------------------------------------------------
def corrupt(path, name, chunk, out):
    with nvckpt.open(path) as ck:
        c = ck.file.entry(name).chunks[chunk]
    data = bytearray(path.read_bytes())
    data[c.offset + c.stored_length // 2] ^= 0x10
    out.write_bytes(bytes(data))
    return c


@pytest.mark.parametrize("device_reads", [False, True])
def test_a_corrupt_chunk_is_named_on_either_read_path(saved, tmp_path, device_reads):
    path, _ = saved
    bad = tmp_path / "bad.nvckpt"
    c = corrupt(path, "exp_avg", 5, bad)
    with pytest.raises(ChecksumError) as info:
        nvckpt.load(bad, gpu=options(device_reads))
    assert (info.value.tensor, info.value.chunk, info.value.offset) == ("exp_avg", 5, c.offset)
    assert str(bad) in str(info.value)


@pytest.mark.parametrize("device_reads", [False, True])
def test_an_io_error_or_short_read_names_the_file(saved, monkeypatch, device_reads):
    path, _ = saved
    with nvckpt.open(path) as ck:
        c = ck.file.entry("exp_avg").chunks[3]
    real = os.preadv

    def eio(fd, buffers, offset):
        if offset <= c.offset < offset + memoryview(buffers[0]).nbytes:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    def eof(fd, buffers, offset):
        return 0 if offset <= c.offset < offset + memoryview(buffers[0]).nbytes else real(fd, buffers, offset)

    with nvckpt.open(path, gpu=options(device_reads)) as ck:
        monkeypatch.setattr(os, "preadv", eio)
        with pytest.raises(OSError) as info:
            ck.load()
        assert info.value.errno == errno.EIO and info.value.filename == str(path)
        assert "bytes at" in str(info.value)
        monkeypatch.setattr(os, "preadv", eof)
        with pytest.raises(TruncatedError) as short:
            ck.load()
        assert str(path) in str(short.value)
        monkeypatch.setattr(os, "preadv", real)
        assert torch.equal(ck["exp_avg"], saved[1]["exp_avg"])  # the file is still readable after both


# -- KvikIO's reads (no GPU here: its faults through a stand-in CuFile) ----------------------------------
class _FakeKvikio:
    """KvikIO's surface that KvikioReads uses, reading host memory (the real one needs libcuda)."""

    def __init__(self, fault=None, compat=True, gds_available=True):
        self.fault = fault
        self.cufile_driver = types.SimpleNamespace(get={"is_gds_available": gds_available}.get)
        self.settings = {"num_threads": 1}
        self.defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: compat, get=self.settings.get,
                                              set=self.settings.__setitem__)
        outer = self

        class CuFile:
            def __init__(self, path, flags):
                self.fd = os.open(path, os.O_RDONLY)

            def pread(self, buf, size, offset):
                if outer.fault == "eio":
                    raise RuntimeError("cuFile error: Input/output error")
                data = os.pread(self.fd, size, offset)
                if outer.fault == "short":
                    data = data[: len(data) // 2]
                if data:
                    buf.numpy()[: len(data)] = np.frombuffer(data, dtype=np.uint8)
                return types.SimpleNamespace(get=lambda: len(data))

            def close(self):
                os.close(self.fd)

        self.CuFile = CuFile


@pytest.mark.parametrize("fault", [None, "eio", "short"])
def test_kvikio_reads_fill_buffers_and_report_faults(tmp_path, monkeypatch, fault):
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    p = tmp_path / "f.bin"
    data = os.urandom(3 * 4096 + 100)
    p.write_bytes(data)
    src = LocalFile(p)
    kvikio = _FakeKvikio(fault)
    reads = gds.KvikioReads(src, kvikio)
    assert reads.mode == gds.COMPAT
    assert kvikio.settings["num_threads"] == gds.KVIKIO_THREADS  # KvikIO's default of one thread raised
    buf = torch.zeros(2 * 4096, dtype=torch.uint8)
    try:
        if fault is None:
            reads.read(4096, 2 * 4096, 2 * 4096, buf)
            assert bytes(buf.numpy()) == data[4096: 3 * 4096]
            reads.read(3 * 4096, 4096, 100, buf)  # the file's tail: cut at its end
            assert bytes(buf[:100].numpy()) == data[3 * 4096:]
        elif fault == "eio":
            with pytest.raises(OSError, match="KvikIO read of 8192 bytes at 4096") as info:
                reads.read(4096, 2 * 4096, 2 * 4096, buf)
            assert info.value.filename == str(p) and info.value.errno == errno.EIO
        else:
            with pytest.raises(TruncatedError, match="file ended"):
                reads.read(4096, 2 * 4096, 2 * 4096, buf)
    finally:
        reads.close()
        src.close()
    src = LocalFile(p)
    reads = gds.KvikioReads(src, _FakeKvikio(compat=False))
    assert reads.mode == gds.GDS
    reads.close()
    reads = gds.KvikioReads(src, _FakeKvikio(compat=False, gds_available=False))  # cuFile's own compat mode
    assert reads.mode == gds.COMPAT
    reads.close()
    src.close()


def test_kvikio_required_but_missing_is_one_clear_line(tmp_path, monkeypatch):
    p = tmp_path / "f.bin"
    p.write_bytes(b"x" * 10)
    monkeypatch.setattr(gds, "_kvikio", None)
    monkeypatch.setitem(__import__("sys").modules, "kvikio", None)  # an import that fails
    src = LocalFile(p)
    try:
        assert gds.open_kvikio_reads(src, required=False) is None
        with pytest.raises(UnsupportedFeatureError, match="pip install kvikio-cu12") as info:
            gds.open_kvikio_reads(src, required=True)
        assert "\n" not in str(info.value)
    finally:
        src.close()
