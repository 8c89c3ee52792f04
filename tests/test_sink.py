"""FileSink's borrowed writes: bytes written from the caller's buffers (no copy), each released exactly once,
after the sink is done with it, with the file the same as if every byte had been copied."""

from __future__ import annotations

import errno
import io
import mmap
import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nvckpt
from conftest import assert_tree_equal
from nvckpt.codecs.presets import chooser
from nvckpt.engines.gpu.backend import HostBackend
from nvckpt.engines.gpu.encode import encode_batches
from nvckpt.format.frames import FrameWriter
from nvckpt.io.sink import FileSink
from nvckpt.options import GpuSaveOptions
from nvckpt.plan.walk import plan_save
from nvckpt.session.save import write_items, writer_info

KiB = 1024
BLOCK = 16 * KiB


class Lender:
    """Page-aligned source memory; a release scribbles over what it lent, so a sink that read a buffer after
    releasing it would write the scribble, not the bytes."""

    def __init__(self, size: int) -> None:
        self.mem = mmap.mmap(-1, size)
        self.view = memoryview(self.mem)
        self.released: list[int] = []
        self.outstanding = 0
        self.most = 0
        self._lock = threading.Lock()

    def lend(self, at: int, data: bytes):
        self.view[at: at + len(data)] = data
        n = len(self.released)
        self.released.append(0)
        with self._lock:
            self.outstanding += len(data)
            self.most = max(self.most, self.outstanding)

        def release(k=n, at=at, size=len(data)):
            self.released[k] += 1
            self.view[at: at + size] = b"\xee" * size
            with self._lock:
                self.outstanding -= size

        return self.view[at: at + len(data)], release


ops = st.lists(st.tuples(st.sampled_from(["copy", "borrow", "borrow_aligned", "pad"]), st.integers(1, 3 * BLOCK),
                         st.integers(0, 4095), st.booleans()), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops, st.booleans(), st.integers(1, 2))
def test_borrowed_writes_land_in_order_and_are_released_once(tmp_path_factory, script, direct, io_threads):
    path = str(tmp_path_factory.mktemp("sink") / "f")
    lender = Lender(len(script) * 4 * BLOCK)
    sink = FileSink(path, direct=direct, block_size=BLOCK, blocks=3, io_threads=io_threads)
    expect = bytearray()
    for k, (op, n, skew, flush) in enumerate(script):
        data = os.urandom(n)
        if op == "pad":  # what FrameWriter's padding does: the next payload starts at a multiple of 4 KiB
            data = bytes(-len(expect) % 4096)
            sink.write(data)
        elif op == "copy":
            sink.write(data)
        else:
            at = k * 4 * BLOCK + (0 if op == "borrow_aligned" else skew)
            view, release = lender.lend(at, data)
            sink.write_borrowed(view, release, flush=flush)
        expect += data
    sink.close()
    assert lender.released == [1] * len(lender.released)
    with open(path, "rb") as f:
        assert f.read() == bytes(expect)


def test_under_o_direct_aligned_payloads_are_borrowed_and_misaligned_ones_copied(tmp_path):
    lender = Lender(16 * BLOCK)
    sink = FileSink(str(tmp_path / "f"), direct=True, block_size=BLOCK, blocks=3, io_threads=1)
    if not sink.direct:
        sink.abort()
        pytest.skip("this filesystem refuses O_DIRECT")
    head = os.urandom(4096)
    sink.write(head)
    aligned = os.urandom(20 * 4096 + 77)
    view, release = lender.lend(0, aligned)
    sink.write_borrowed(view, release)
    assert sink.borrowed_bytes == 20 * 4096  # the tail shares a 4 KiB block with what follows: copied
    skewed = os.urandom(70 * KiB)
    view, release = lender.lend(8 * BLOCK + 100, skewed)
    sink.write_borrowed(view, release)  # the file position is not aligned now: copied
    assert sink.borrowed_bytes == 20 * 4096 and lender.released[1] == 1
    sink.close()
    assert (tmp_path / "f").read_bytes() == head + aligned + skewed
    assert lender.released == [1, 1]


def test_borrowed_bytes_not_yet_written_stay_bounded(tmp_path, monkeypatch):
    """A slow disk holds the writer back: borrowed and not yet written stays within the staging blocks' size."""
    real = os.pwritev

    def slow(fd, parts, offset):
        time.sleep(0.005)
        return real(fd, parts, offset)

    monkeypatch.setattr(os, "pwritev", slow)
    lender = Lender(64 * 100 * KiB)
    sink = FileSink(str(tmp_path / "f"), direct=False, block_size=64 * KiB, blocks=3, io_threads=2)
    expect = b""
    for k in range(100):
        data = os.urandom(64 * KiB)
        view, release = lender.lend(k * 64 * KiB, data)
        sink.write_borrowed(view, release)
        expect += data
    sink.close()
    assert lender.most <= 3 * 64 * KiB + 64 * KiB  # the limit, and the buffer being lent (counted at the call)
    assert (tmp_path / "f").read_bytes() == expect and lender.released == [1] * 100


def test_a_write_error_releases_every_borrowed_buffer_and_is_raised(tmp_path, monkeypatch):
    def full(fd, parts, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    lender = Lender(20 * 64 * KiB)
    sink = FileSink(str(tmp_path / "f"), direct=False, block_size=BLOCK, blocks=3, io_threads=1)
    with pytest.raises(OSError) as info:
        for k in range(20):
            view, release = lender.lend(k * 64 * KiB, os.urandom(64 * KiB))
            sink.write_borrowed(view, release, flush=True)
            time.sleep(0.01)
    assert info.value.errno == errno.ENOSPC
    sink.abort()
    sink.settle()
    assert lender.released == [1] * len(lender.released)


def test_abort_releases_what_was_never_sent(tmp_path):
    lender = Lender(64 * KiB)
    sink = FileSink(str(tmp_path / "f"), direct=False, block_size=BLOCK, blocks=3, io_threads=1)
    view, release = lender.lend(0, os.urandom(64 * KiB))
    sink.write_borrowed(view, release)  # pending: no flush
    sink.abort()
    assert lender.released == [1]


@pytest.mark.parametrize("borrowing", [False, True])
def test_frame_writer_releases_a_chunk_once_whatever_the_stream(tmp_path, borrowing):
    calls = []
    stream = FileSink(str(tmp_path / "f"), direct=False) if borrowing else io.BytesIO()
    w = FrameWriter(stream, [{"name": "t", "dtype": "uint8", "shape": [16]}], [[8, 8]])
    w.tensor(0)
    raw = chooser("raw", 1)("uint8")
    w.chunk(0, 0, raw, b"12345678", 8, release=lambda: calls.append("first"))
    with pytest.raises(RuntimeError, match="written twice"):
        w.chunk(0, 0, raw, b"12345678", 8, release=lambda: calls.append("again"))
    with pytest.raises(RuntimeError, match="raw length"):
        w.chunk(0, 1, raw, b"1234", 4, release=lambda: calls.append("short"))
    if borrowing:
        stream.close()
    assert calls == ["first", "again", "short"]


@pytest.mark.parametrize("direct", [True, False])
def test_the_gpu_pipeline_into_a_file_sink_borrows_its_chunks_and_writes_the_same_file(tmp_path, direct):
    """The host stand-in of the GPU engine, its chunks written from its pinned slots: the same bytes as a
    stream that copies everything, and the slots all back before the engine gives them up."""
    torch.manual_seed(0)
    state = {"w": torch.randn(300, 1000), "b": torch.randn(1000).to(torch.bfloat16), "n": torch.arange(7)}
    options = GpuSaveOptions(batch_bytes=900 * KiB, slot_bytes=600 * KiB, pinned_slots=2, piece_bytes=50 * KiB)

    def write(stream):
        plan = plan_save(state, chunk_size=128 * KiB)
        stats = {}
        items = encode_batches(plan, chooser("auto", 1), HostBackend(), options, stats=stats)
        write_items(stream, items, plan, alignment=4096, info=writer_info())
        return stats

    buf = io.BytesIO()
    write(buf)
    sink = FileSink(str(tmp_path / "f"), direct=direct, block_size=64 * KiB, blocks=3, io_threads=2)
    stats = write(sink)
    sink.close()
    assert sink.borrowed_bytes > 0.5 * stats["stored_bytes"]
    data = (tmp_path / "f").read_bytes()
    assert data == buf.getvalue()
    assert_tree_equal(nvckpt.load(io.BytesIO(data)), state)
