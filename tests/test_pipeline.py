"""The save and load pipelines on CPU: scheduling, bounded buffers, backpressure and error paths.

The GPU engines (nvckpt.engines.gpu.encode / decode) run here on the host
backend (HostBackend, the host codecs in host memory): the same planners, slot
pools, threads and ordering as on a GPU, only the batched calls differ.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import threading
import time
import types
from concurrent.futures import CancelledError

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nvckpt
from conftest import assert_tensor_equal, assert_tree_equal, assert_untouched, small_training_state
from nvckpt.codecs.presets import chooser
from nvckpt.testing.host import HostBackend
from nvckpt.engines.gpu.decode import decode_entries, decode_range
from nvckpt.engines.gpu.encode import encode_batches
from nvckpt.engines.items import EncodedChunk, TensorReady
from nvckpt.errors import ChecksumError
from nvckpt.options import GpuLoadOptions, GpuSaveOptions
from nvckpt.tensors.dtypes import to_torch
from nvckpt.plan.walk import plan_save
from nvckpt.read.reader import ChunkReader as Reader
from nvckpt.session.save import write_items, writer_info
from nvckpt.engines.gpu import batching
from nvckpt.engines.gpu.pinned import PINNED
from nvckpt.engines.gpu.batching import (
    ChunkJob,
    SlotPool,
    copy_groups,
    first_use_order,
    plan_batches,
    size_class,
)
from nvckpt.io.sink import FileSink

KiB = 1 << 10


# -- planners -----------------------------------------------------------------------------------

def cap_of(key, n):
    return n + n // 16 + 32


def jobs_of(sizes_by_tensor, key_of=lambda tid: "k"):
    jobs = []
    for tid, sizes in enumerate(sizes_by_tensor):
        start = 0
        for i, n in enumerate(sizes):
            jobs.append(ChunkJob(tid, i, start, n, key_of(tid)))
            start += n
    return jobs


def test_plan_batches_bounds_and_covers_every_chunk():
    sizes = [[4096] * 7 + [700], [30], [4096] * 3, [12, 12], [2000] * 5 + [100]]
    jobs = jobs_of(sizes, key_of=lambda tid: "a" if tid % 2 else "b")
    batches = plan_batches(jobs, cap_of, batch_bytes=3 * cap_of(None, 4096), max_chunks=4)
    got = [j for b in batches for j in b.jobs]
    assert sorted(got, key=lambda j: (j.tensor_id, j.chunk_index)) == jobs  # each chunk exactly once
    for b in batches:
        assert len({j.key for j in b.jobs}) == 1 and b.key == b.jobs[0].key
        assert len({size_class(j.length) for j in b.jobs}) == 1
        assert b.capacity == max(cap_of(None, j.length) for j in b.jobs)
        assert b.out_bytes <= 3 * cap_of(None, 4096) and len(b.jobs) <= 4
    # A tensor's full-size chunks keep their order in the file.
    first = [(j.tensor_id, j.chunk_index) for b in batches for j in b.jobs if j.tensor_id == 0 and j.length == 4096]
    assert first == [(0, i) for i in range(7)]
    assert first_use_order(batches)[0] == 0 and sorted(first_use_order(batches)) == list(range(len(sizes)))


def test_plan_batches_rejects_a_chunk_larger_than_a_batch():
    with pytest.raises(ValueError, match="more than a batch"):
        plan_batches(jobs_of([[5000]]), cap_of, batch_bytes=4096, max_chunks=8)


def _check_runs(runs, cap, lengths, slot):
    assert runs[0].first == 0 and runs[-1].stop == len(lengths)
    assert all(a.stop == b.first for a, b in zip(runs, runs[1:]))
    for r in runs:
        assert len(r.offsets) == r.stop - r.first and r.used <= slot
        ends = [r.offsets[i - r.first] + lengths[i] for i in range(r.first, r.stop)]
        assert all(e <= o for e, o in zip(ends, r.offsets[1:]))  # packed in order, never overlapping
        covered = []
        for a, b, device_at, slot_at, n in r.copies:  # each copy moves whole chunks at their device places
            assert r.first <= a < b <= r.stop and device_at == a * cap
            assert all(r.offsets[i - r.first] == slot_at + (i - a) * cap for i in range(a, b))
            assert slot_at + n == r.offsets[b - 1 - r.first] + lengths[b - 1]
            covered.extend(range(a, b))
        assert covered == list(range(r.first, r.stop))


def test_copy_groups_fit_slots_and_cover_the_batch():
    cap, slot = 1000, 2500
    lengths = [900, 10, 1000, 999, 1, 700, 1000]
    runs = copy_groups(cap, lengths, slot, max_gap=0)
    _check_runs(runs, cap, lengths, slot)
    # Packed: the slots hold the compressed bytes, not capacity x chunks.
    assert [r.used for r in runs] == [sum(lengths[r.first:r.stop]) for r in runs]
    assert len(runs) == 3
    # Small gaps share one copy (many small chunks, one copy each would cost more than the gap).
    merged = copy_groups(cap, [995, 990, 900, 10], 4000, max_gap=16)
    _check_runs(merged, cap, [995, 990, 900, 10], 4000)
    assert [(a, b) for a, b, *_ in merged[0].copies] == [(0, 3), (3, 4)]
    # A batch continues the slot the previous one ended in when its first chunk fits there.
    more = copy_groups(cap, [600, 900], slot, start=1800, max_gap=0)
    assert more[0].shares and more[0].offsets == (1800,) and not more[1].shares and more[1].offsets == (0,)
    assert not copy_groups(cap, [800], slot, start=1800)[0].shares
    assert copy_groups(cap, [], slot) == []
    with pytest.raises(ValueError):
        copy_groups(cap, [1001], slot)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.lists(st.integers(1, 64), min_size=1, max_size=40), st.integers(0, 3),
       st.integers(0, 80))
def test_copy_groups_properties(cap, raw_lengths, extra, gap):
    lengths = [min(n, cap) for n in raw_lengths]
    slot = cap * (1 + extra)
    _check_runs(copy_groups(cap, lengths, slot, max_gap=gap), cap, lengths, slot)
    start = min(gap, slot)  # a slot already filled this far
    runs = copy_groups(cap, lengths, slot, start=start, max_gap=gap)
    assert runs[0].shares == (start + lengths[0] <= slot)
    if runs[0].shares:
        assert min(runs[0].offsets) == start
    assert not any(r.shares for r in runs[1:])


def test_slot_pool():
    made = []
    pool = SlotPool(2, 64, lambda n: made.append(n) or torch.empty(n, dtype=torch.uint8))
    assert made == [64, 64] and pool.free == 2
    a, b = pool.take(), pool.take()
    assert {a, b} == {0, 1} and pool.take() is None and pool.free == 0
    pool.give(a)
    assert pool.free == 1 and pool.take() == a and pool.take() is None
    pool.give(a)
    with pytest.raises(RuntimeError):
        pool.give(a)


# -- the GPU engine's pipeline with the CPU codecs ------------------------------------------------

def mixed_state():
    torch.manual_seed(1)
    state = small_training_state()
    big = torch.randn(300, 1000)
    state["big"] = big
    state["half"] = torch.randn(257, 33).to(torch.bfloat16)
    state["ints"] = torch.randint(0, 1 << 30, (5000,))
    state["bytes"] = torch.randint(0, 3, (10_000,), dtype=torch.uint8)
    state["flags"] = torch.rand(999) > 0.5
    state["tied"] = [big, big]
    state["view"] = state["ints"][10:20]
    state["empty"] = torch.empty(0, 3)
    state["zero_d"] = torch.tensor(2.5)
    return state


SMALL = GpuSaveOptions(batch_bytes=300 * KiB, slot_bytes=200 * KiB, pinned_slots=2, piece_bytes=50 * KiB)


def host_items(plan, backend=None, codec="auto", *, stats=None, **kw):
    return encode_batches(plan, chooser(codec, 1), backend or HostBackend(), SMALL, stats=stats, **kw)


def host_save(state, codec="auto", chunk_size=64 * KiB):
    plan = plan_save(state, chunk_size=chunk_size)
    stats = {}
    buf = io.BytesIO()
    write_items(buf, host_items(plan, codec=codec, stats=stats), plan, alignment=4096, info=writer_info())
    return buf, stats


@pytest.mark.parametrize("codec,gap,gather", [("auto", None, True), ("raw", None, True), ("auto", 0, True),
                                             ("raw", 0, True), ("auto", 0, False), ("raw", 0, False)])
def test_gpu_pipeline_with_cpu_codecs_roundtrips(codec, gap, gather, monkeypatch):
    from nvckpt.engines.gpu import encode

    if gap is not None:  # every chunk its own packed copy (on a GPU: ANS's bound leaves large gaps)
        monkeypatch.setattr(batching, "COPY_GAP", gap)
    if not gather:  # each piece copied by itself, not packed on the "device" first
        monkeypatch.setattr(encode, "gather_bytes", lambda options, budget: 0)
    state = mixed_state()
    buf, stats = host_save(state, codec)
    assert stats["chunks"] > 20 and stats["batches"] > 3
    buf.seek(0)
    assert_tree_equal(nvckpt.load(buf), state)
    buf.seek(0)
    with nvckpt.open(buf) as ck:  # every tensor carries its checksum, as on the CPU engine
        assert all(e.checksum is not None for e in ck.index.tensors if e.chunks is not None)


@pytest.mark.slow
def test_the_next_save_of_the_same_state_reuses_the_batch_plan(monkeypatch):
    """The engine's batch plan is kept for the next save with the same backend, batch size, codecs and chunks
    (a training job's checkpoints); any difference plans anew.  The files are the same either way."""
    from nvckpt.engines.gpu import encode

    planned = []
    real = encode.plan_batches
    monkeypatch.setattr(encode, "plan_batches", lambda *a, **k: planned.append(1) or real(*a, **k))
    monkeypatch.setattr(encode, "_PLANS", encode.OrderedDict())

    def save(state, chunk_size=16 * KiB, **opts):
        plan = plan_save(state, chunk_size=chunk_size)
        buf = io.BytesIO()
        options = dataclasses.replace(SMALL, **opts)
        write_items(buf, encode_batches(plan, chooser("auto", 1), HostBackend(), options), plan, alignment=4096,
                    info=writer_info())
        return buf.getvalue()

    state = mixed_state()
    first = save(state)
    assert len(planned) == 1
    assert_tree_equal(nvckpt.load(io.BytesIO(first)), state)
    state["big"].add_(1)  # new values, same tensors: the same plan
    again = save(state)
    assert len(planned) == 1
    assert_tree_equal(nvckpt.load(io.BytesIO(again)), state)
    for changed in ({"chunk_size": 8 * KiB}, {"batch_bytes": 200 * KiB}):
        size = changed.pop("chunk_size", 16 * KiB)
        assert_tree_equal(nvckpt.load(io.BytesIO(save(state, size, **changed))), state)
    grown = dict(state, extra=torch.randn(3000))
    assert_tree_equal(nvckpt.load(io.BytesIO(save(grown))), grown)
    assert len(planned) == 4  # another chunk size, batch size, tensor: each planned anew
    assert save(state) == again and len(planned) == 4  # and the first one is still kept


def test_stage_parts_packs_copies_of_byte_ranges_aligned():
    """The staging copy of the GPU engines (chunks of tensors on another device, misaligned chunks)."""
    from nvckpt.tensors.staging import stage_parts

    a, b = torch.arange(1000, dtype=torch.int32).view(torch.uint8), torch.randint(0, 255, (77,), dtype=torch.uint8)
    parts = [(a, 3, 100), (b, 0, 77), (a, 0, 4000), (b, 70, 7)]
    staged = stage_parts(parts, [0, 2, 3], 512, "cpu")
    assert len({id(buf) for buf, _, _ in staged}) == 1 and [o % 512 for _, o, _ in staged] == [0, 0, 0]
    for (base, start, n), (buf, o, m) in zip([parts[0], parts[2], parts[3]], staged):
        assert m == n and torch.equal(buf[o: o + m], base[start: start + n])
    assert [o for _, o, _ in staged] == [0, 512, 512 + 4096]  # end to end, each at the next aligned offset


def test_codecs_outlive_their_thread_for_the_next_one(monkeypatch):
    """An async_save runs in a thread of its own: the next save's thread gets the codecs the last one left,
    threads alive at once never share one, and release_codecs() drops the idle ones."""
    from nvckpt.codecs.base import DeviceOp
    from nvckpt.codecs.nvcomp import device as nb

    made = []

    class Codec:  # stands in for GpuCodec (nvCOMP is not needed to pool codecs)
        def __init__(self, *args):
            made.append(self)

    monkeypatch.setattr(nb, "GpuCodec", Codec)
    monkeypatch.setattr(nb, "_IDLE", {})
    stream = types.SimpleNamespace(cuda_stream=1234)
    op = DeviceOp("zstd", "|u1", 2, "")

    def in_thread(fn):
        got = []
        th = threading.Thread(target=lambda: got.append(fn()))
        th.start()
        th.join()
        return got[0]

    take = lambda: nb.codec_for(op, device=torch.device("cuda", 0), stream=stream)  # noqa: E731
    first = in_thread(lambda: (take(), take()))
    assert first[0] is first[1] and len(made) == 1  # one per thread and key
    assert in_thread(take) is first[0] and len(made) == 1  # the next thread's, after the first ended
    both, ready = [], threading.Barrier(2)

    def hold():
        both.append(take())
        ready.wait()  # alive together

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert both[0] is not both[1] and len(made) == 2
    other = in_thread(lambda: nb.codec_for(DeviceOp("zstd", "|u1", 4, ""), device=torch.device("cuda", 0), stream=stream))
    assert other not in both and len(made) == 3  # another key, another codec
    assert nb.release_codecs() == 3 and nb.release_codecs() == 0
    assert in_thread(take) not in made[:3]


def test_native_ans_batch_reads_sizes_and_statuses_from_its_table():
    """What nvCOMP's C API leaves in the pinned table (codecs.nvcomp.native): sizes after the three tables of
    addresses and lengths, then per-chunk statuses; a failed chunk is an error naming it."""
    from nvckpt.codecs.nvcomp.native import NativeBatch

    class Done:
        waited = 0

        def synchronize(self):
            Done.waited += 1

    table = torch.zeros(5 * 3, dtype=torch.int64)
    table[9:12] = torch.tensor([100, 7, 4096])
    assert NativeBatch(table, 3, Done(), ()).buffer_sizes == [100, 7, 4096] and Done.waited == 1
    table.view(torch.int32)[24 + 1] = 19  # nvcompErrorCannotCompress on chunk 1
    with pytest.raises(RuntimeError, match="chunk 1 of a batch of 3 .status 19"):
        NativeBatch(table, 3, Done(), ()).sizes()


def test_native_ans_only_for_the_nvcomp_major_version_it_was_matched_on(monkeypatch):
    """Another nvCOMP major version keeps the Python API: the C prototypes and type numbers are nvCOMP 6's."""
    from nvckpt.codecs.nvcomp import device as nb, native

    asked = []
    monkeypatch.setattr(native, "ans_encoder", lambda *a: asked.append(a) or "encoder")
    for version, expect in (("7.0.1", None), ("6.0.0", "encoder")):
        monkeypatch.setattr(nb, "nvcomp_version", lambda v=version: v)
        codec = types.SimpleNamespace(algorithm="ans", _native=None, data_type="<f2", device=None, stream=None)
        assert nb.GpuCodec._native_ans(codec) == expect
        assert codec._native == (False if expect is None else "encoder")
    assert len(asked) == 1
    monkeypatch.setattr(native, "ENABLED", False)
    assert nb.GpuCodec._native_ans(codec) is None


def test_gpu_pipeline_bounds_its_host_slots():
    """A writer that keeps every payload (never releases) gets an error, not more memory."""
    made = []

    class Counting(HostBackend):
        def host_buffer(self, size):
            made.append(size)
            return super().host_buffer(size)

    from nvckpt.engines.gpu.pinned import PINNED

    PINNED.release()  # no slots kept from earlier saves: this one allocates its own
    state = {"w": torch.randn(200, 1000)}
    plan = plan_save(state, chunk_size=64 * KiB)
    items = host_items(plan, Counting(), tensor_checksums=False)
    held = []
    with pytest.raises(RuntimeError, match="pinned slot"):  # an engine invariant, not an NvckptError
        for item in items:
            held.append(item)  # no release()
    assert made == [SMALL.slot_bytes] * SMALL.pinned_slots
    chunks = [i for i in held if isinstance(i, EncodedChunk)]
    assert 0 < len(chunks) < len(plan.tensors[0].chunks)


def test_gpu_pipeline_items_are_in_a_valid_order_and_closing_stops_it():
    state = mixed_state()
    plan = plan_save(state, chunk_size=64 * KiB)
    items = host_items(plan)
    announced = set()
    for n, item in enumerate(items):
        if isinstance(item, TensorReady):
            announced.add(item.tensor_id)
        else:
            assert item.tensor_id in announced
            item.release()
        if n == 40:
            break
    items.close()  # what a cancelled save does: threads stop, nothing raises
    assert not [t for t in threading.enumerate() if t.name == "nvckpt-tensor-checksums"]


def write_file(tmp_path, state, **kw):
    path = tmp_path / "f.nvckpt"
    nvckpt.save(state, path, chunk_size=32 * KiB, **kw)
    return path


SMALL_READS = GpuLoadOptions(read_span_bytes=64 * KiB, decode_batch_bytes=200 * KiB, read_buffers=3, piece_bytes=16 * KiB)


def host_load(r, entries, stats=None):
    """The GPU loader on the host backend: each tensor as its dtype and shape."""
    raw = decode_entries(r, entries, HostBackend(), SMALL_READS, stats)
    return {e.tensor_id: raw[e.tensor_id].view(to_torch(e.dtype.name)).reshape(e.shape) if e.nbytes else raw[e.tensor_id]
            for e in entries}


def host_rows(r, e, first, stop):
    row = e.nbytes // e.shape[0]
    raw = decode_range(r, e, first * row, stop * row, HostBackend(), SMALL_READS)
    return raw.view(to_torch(e.dtype.name)).reshape((stop - first,) + tuple(e.shape[1:]))


@pytest.mark.parametrize("codec", ["auto", "zstd", "raw"])
def test_gpu_loader_with_cpu_codecs(tmp_path, codec):
    state = mixed_state()
    path = write_file(tmp_path, state, codec=codec)
    with _closing(Reader(path)) as r, nvckpt.open(path) as ck:
        entries = [e for e in r.index.tensors if e.chunks is not None and e.nbytes]
        stats = {}
        loaded = host_load(r, entries, stats)
        for e in entries:
            assert_tensor_equal(loaded[e.tensor_id], ck.get_tensor(e.name), e.name)
        assert stats["spans"] > 3
        assert torch.equal(host_rows(r, r.entry("big"), 37, 211), state["big"][37:211])


class _closing:
    def __init__(self, r):
        self.r = r

    def __enter__(self):
        return self.r

    def __exit__(self, *exc):
        self.r.close()


def test_gpu_loader_reads_only_the_rows_asked_for(tmp_path):
    w = torch.randn(1000, 256)
    path = write_file(tmp_path, {"w": w})
    with _closing(Reader(path)) as r:
        e = r.entry("w")
        before = r.source.bytes_read
        rows = host_rows(r, e, 500, 517)
        assert torch.equal(rows, w[500:517])
        assert r.source.bytes_read - before < e.stored_bytes / 4


def corrupt_one_chunk(path, tensor="w", chunk=3):
    with _closing(Reader(path)) as r:
        c = r.entry(tensor).chunks[chunk]
    data = bytearray(path.read_bytes())
    data[c.offset + c.stored_length // 2] ^= 0x40
    path.write_bytes(bytes(data))
    return c


def test_gpu_loader_checks_chunks_before_decoding(tmp_path, monkeypatch):
    path = write_file(tmp_path, {"w": torch.randn(1000, 256)}, codec="zstd")  # the HostDecoder's "device" codec
    bad = corrupt_one_chunk(path, chunk=20)  # late enough that earlier decode rounds ran
    seen = []
    real = HostBackend.decode

    def spy(self, key, payloads, outs):
        seen.extend(bytes(p.numpy()) for p in payloads)
        return real(self, key, payloads, outs)

    monkeypatch.setattr(HostBackend, "decode", spy)
    with _closing(Reader(path)) as r:
        with pytest.raises(ChecksumError) as info:
            host_load(r, [r.entry("w")])
    assert info.value.tensor == "w" and info.value.chunk == 20 and info.value.offset == bad.offset
    corrupted = path.read_bytes()[bad.offset: bad.offset + bad.stored_length]
    assert seen and corrupted not in seen  # other chunks were decoded, the bad one never


def test_gpu_loader_verifies_whole_tensors(tmp_path, monkeypatch):
    """A decoder that returns wrong bytes (nvCOMP has no checksum of its own) is caught."""
    path = write_file(tmp_path, {"w": torch.randn(1000, 256)}, codec="zstd")
    real = HostBackend.decode

    def wrong(self, key, payloads, outs):
        real(self, key, payloads, outs)
        outs[0][5] ^= 1

    monkeypatch.setattr(HostBackend, "decode", wrong)
    with _closing(Reader(path)) as r:
        with pytest.raises(ChecksumError, match="tensor checksum"):
            host_load(r, [r.entry("w")])


# -- FileSink -------------------------------------------------------------------------------------

def test_file_sink_backpressure_bounds_memory(tmp_path, monkeypatch):
    """A slow disk makes the writer wait: never more than ``blocks`` staging blocks exist."""
    made = []
    real = os.pwrite

    def slow_pwrite(fd, data, offset):
        time.sleep(0.01)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    sink = FileSink(str(tmp_path / "s"), direct=False, block_size=4096, blocks=2, io_threads=1,
                    allocate=lambda n: made.append(n) or bytearray(n))
    payload = os.urandom(4096 * 20 + 123)
    start = time.perf_counter()
    for i in range(0, len(payload), 1000):
        sink.write(payload[i: i + 1000])
    submitted = time.perf_counter() - start
    sink.close()
    assert made == [4096, 4096]
    assert submitted >= 0.01 * 18  # the producer waited for the disk
    assert (tmp_path / "s").read_bytes() == payload


def test_file_sink_parallel_writes_land_in_order(tmp_path):
    payload = os.urandom((1 << 20) * 5 + 77)
    sink = FileSink(str(tmp_path / "p"), direct=True, block_size=1 << 18, blocks=6, io_threads=4)
    for i in range(0, len(payload), 100_000):
        sink.write(payload[i: i + 100_000])
    sink.close()
    assert (tmp_path / "p").read_bytes() == payload


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), max_size=30), split=st.integers(0, 30), data=st.data())
def test_file_sink_write_many_lands_as_the_writes_would(tmp_path_factory, sizes, split, data):
    """write_many of pieces (across block edges, empty ones, bytes and arrays) puts the same bytes in the
    same order as one write per piece, interleaved with plain writes."""
    folder = tmp_path_factory.mktemp("many")
    pieces = [os.urandom(n) if i % 2 else np.frombuffer(os.urandom(n), dtype=np.uint8) for i, n in enumerate(sizes)]
    block = data.draw(st.sampled_from([4096, 8192]))
    sink = FileSink(str(folder / "m"), direct=data.draw(st.booleans()), block_size=block, blocks=2, io_threads=1)
    head, tail = pieces[:split], pieces[split:]
    assert sink.write_many(head) == sum(len(memoryview(p).cast("B")) for p in head)
    for p in tail[:1]:
        sink.write(p)
    sink.write_many(tail[1:])
    sink.close()
    assert (folder / "m").read_bytes() == b"".join(bytes(memoryview(p).cast("B")) for p in pieces)


class _RecordingStream(io.BytesIO):
    """A stream with write_many that records its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.many = 0

    def write_many(self, pieces) -> int:
        self.many += 1
        return sum(self.write(p) for p in pieces)


@pytest.mark.slow
def test_the_gpu_pipeline_writes_a_copy_group_at_once_and_releases_it_after(monkeypatch):
    """Chunks of one copy group reach the stream in one write_many (the writer's thread takes the GIL about
    once per group, not per chunk), each pinned buffer is given back only once its bytes are on the stream
    (the slot is then overwritten), and the file is the same bytes as with one write per frame."""
    from nvckpt.engines.gpu import encode

    state = mixed_state()
    plan = plan_save(state, chunk_size=16 * KiB)
    released_at: list[tuple[int, int, int]] = []  # (tensor, chunk, stream length when released)

    def traced(items, stream):
        for item in items:
            if isinstance(item, EncodedChunk) and item.release is not None:
                real, key = item.release, (item.tensor_id, item.chunk_index)

                def release(real=real, key=key):
                    released_at.append((*key, len(stream.getvalue())))
                    real()

                item = item._replace(release=release)
            yield item

    def save(run: bool):
        monkeypatch.setattr(encode, "RUN_WRITES", run)
        stream = _RecordingStream()
        stats: dict = {}
        write_items(stream, traced(host_items(plan, stats=stats), stream), plan, alignment=4096, info=writer_info())
        return stream, stats

    grouped, stats = save(True)
    assert stats["chunks"] > 20 and 0 < grouped.many < stats["chunks"]
    with nvckpt.open(io.BytesIO(grouped.getvalue())) as ck:
        ends = {(e.tensor_id, i): c.offset + c.stored_length for e in ck.index.tensors if e.chunks
                for i, c in enumerate(e.chunks)}
    assert released_at and all(at >= ends[(t, i)] for t, i, at in released_at)
    released_at.clear()
    each, _ = save(False)
    assert each.many == 0 and each.getvalue() == grouped.getvalue()
    assert_tree_equal(nvckpt.load(io.BytesIO(grouped.getvalue())), state)
    plain = io.BytesIO()  # a stream without write_many: the held frames are written one by one, in order
    monkeypatch.setattr(encode, "RUN_WRITES", True)
    write_items(plain, host_items(plan), plan, alignment=4096, info=writer_info())
    assert plain.getvalue() == grouped.getvalue()


def test_full_disk_fails_the_save_and_keeps_the_old_file(old_file, monkeypatch):
    path, old_bytes = old_file
    real = os.pwrite
    written = [0]

    def full(fd, data, offset):
        if written[0] > 0:  # the first block fits, the second does not
            raise OSError(errno.ENOSPC, "No space left on device")
        written[0] += len(data)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError) as info:
        nvckpt.save({"new": torch.zeros(6_000_000)}, path, codec="raw")  # 24 MB: two blocks
    assert info.value.errno == errno.ENOSPC and "No space" in str(info.value)
    monkeypatch.undo()
    assert_untouched(path, old_bytes)


def refuse_o_direct(monkeypatch):
    real = os.open

    def no_direct(path, flags, *args, **kw):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", no_direct)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_without_o_direct_saves_and_loads_use_plain_io(tmp_path, monkeypatch):
    refuse_o_direct(monkeypatch)
    sink = FileSink(str(tmp_path / "probe"), direct=True)
    assert not sink.direct
    sink.close()
    state = {"w": torch.randn(300, 300), "i": torch.arange(10)}
    path = write_file(tmp_path, state)
    assert_tree_equal(nvckpt.load(path), state)
    with _closing(Reader(path)) as r:
        stats = {}
        loaded = host_load(r, [r.entry("w")], stats)
        assert torch.equal(loaded[r.entry("w").tensor_id], state["w"])
        assert stats["direct_reads"] == 0


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
def test_o_direct_falls_back_where_the_filesystem_refuses_it(tmp_path):
    import tempfile

    state = {"w": torch.randn(300, 300), "i": torch.arange(10)}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        sink = FileSink(os.path.join(d, "probe"), direct=True)
        sink.write(b"x" * 10)
        sink.close()
        with open(os.path.join(d, "probe"), "rb") as f:
            assert f.read() == b"x" * 10
        path = os.path.join(d, "ck.nvckpt")
        nvckpt.save(state, path)
        assert_tree_equal(nvckpt.load(path), state)


# -- async_save -----------------------------------------------------------------------------------

def test_cancelled_async_save_keeps_the_old_file(old_file, monkeypatch):
    from nvckpt.engines import cpu as encode_cpu

    path, old_bytes = old_file
    started = threading.Event()
    real = encode_cpu.encode_chunk

    def slow(pipeline, raw, buffers=None):
        started.set()
        time.sleep(0.005)
        return real(pipeline, raw, buffers)

    monkeypatch.setattr(encode_cpu, "encode_chunk", slow)  # ~1000 chunks: seconds unless cancelled
    future = nvckpt.async_save({"new": torch.randn(1000, 1000)}, path, chunk_size=4 * KiB)
    assert started.wait(10)
    assert future.cancel()
    with pytest.raises(CancelledError):
        future.result(timeout=60)
    monkeypatch.undo()
    assert_untouched(path, old_bytes)


def test_async_save_holds_the_values_at_call_time(tmp_path):
    state = small_training_state()
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    ref = {"model": state["model"], "step": torch.tensor(7)}
    start = time.perf_counter()
    future = nvckpt.async_save(ref, tmp_path / "a.nvckpt")
    call_seconds = time.perf_counter() - start
    blocked = future.blocked_seconds  # set before the call returns, and not changed by the save's thread
    with torch.no_grad():  # the caller goes on training at once
        for v in state["model"].values():
            v.add_(1.0)
        ref["step"].add_(1)
    result = future.result(timeout=60)
    assert 0 < blocked <= call_seconds and future.blocked_seconds == blocked
    assert future.snapshot == {"cpu": "host"} and result.file_bytes > 0
    loaded = nvckpt.load(tmp_path / "a.nvckpt")
    assert_tree_equal(loaded["model"], expected["model"])
    assert int(loaded["step"]) == 7


def test_read_ahead_reads_every_tensor_before_the_writer_gets_a_chunk():
    """async_save's no-copy path: once the event is set the caller may change its tensors; the file keeps the old values."""
    import copy

    state = mixed_state()
    expected = copy.deepcopy(state)  # views nested in lists change with their base: copy them all
    plan = plan_save(state, chunk_size=64 * KiB)
    read = threading.Event()
    items = encode_batches(plan, chooser("auto", 1), HostBackend(), GpuSaveOptions(batch_bytes=300 * KiB, slot_bytes=200 * KiB),
                           read_ahead=read)
    changed = []

    def training_goes_on():
        for item in items:
            if isinstance(item, EncodedChunk) and not changed:
                assert read.is_set()  # every tensor was read before the first chunk reached the writer
                with torch.no_grad():
                    for v in state.values():
                        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
                            v.mul_(-1).add_(3)
                            changed.append(v)
            yield item

    buf = io.BytesIO()
    write_items(buf, training_goes_on(), plan, alignment=4096, info=writer_info())
    assert changed
    buf.seek(0)
    assert_tree_equal(nvckpt.load(buf), expected)


class _CopiesInFlight(HostBackend):
    """A host backend whose copies out stay "running" until something waits for them, as a GPU's do (in
    order, on one stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[object, bool]] = []  # (event, does the run hold a chunk stored raw)
        self.waited: set[int] = set()

    def copy_out(self, enc, run, raw, slot, gather=False):
        super().copy_out(enc, run, raw, slot, gather)
        event = object()
        self.copies.append((event, bool(raw)))
        return event

    def wait(self, event):
        # One copy stream runs the copies in order: waiting for one is waiting for those queued before it too.
        upto = next((k for k, (e, _) in enumerate(self.copies) if e is event), None)
        if upto is not None:
            self.waited.update(id(e) for e, _ in self.copies[: upto + 1])

    def ready(self, event):
        return event is None or id(event) in self.waited


def test_read_ahead_releases_the_caller_before_the_copies_of_compressed_chunks_end():
    """The caller's tensors are read by the encodes and by the copies of chunks stored raw (copied out of
    them); copies of compressed chunks read the engine's own buffers, so the caller need not wait for them."""
    torch.manual_seed(0)
    state = {"noise": torch.randint(0, 256, (64 * KiB,), dtype=torch.uint8),  # stored raw, read first
             "w": torch.randn(64, 1024).to(torch.bfloat16)}  # compresses
    plan = plan_save(state, chunk_size=16 * KiB)
    dev = _CopiesInFlight()
    seen: dict[str, list[bool]] = {}

    class Read(threading.Event):
        def set(self):
            if not seen:
                seen["raw"] = [id(e) in dev.waited for e, raw in dev.copies if raw]
                seen["compressed"] = [id(e) in dev.waited for e, raw in dev.copies if not raw]
            super().set()

    read = Read()
    opts = GpuSaveOptions(batch_bytes=64 * KiB, slot_bytes=64 * KiB)
    items = encode_batches(plan, chooser("auto", 1), dev, opts, read_ahead=read, tensor_checksums=False)
    buf = io.BytesIO()
    write_items(buf, items, plan, alignment=64, info=writer_info())
    assert seen["raw"] and all(seen["raw"])  # every copy out of the caller's tensors was done
    assert seen["compressed"] and not all(seen["compressed"])  # the last compressed ones were still going
    buf.seek(0)
    assert_tree_equal(nvckpt.load(buf), state)


def test_read_ahead_beyond_the_pinned_limit_waits_for_the_writer():
    state = {"w": torch.randn(400, 1000)}
    plan = plan_save(state, chunk_size=64 * KiB)
    read = threading.Event()
    opts = GpuSaveOptions(batch_bytes=300 * KiB, slot_bytes=200 * KiB, pinned_slots=2, pinned_limit=400 * KiB)
    items = encode_batches(plan, chooser("raw", 1), HostBackend(), opts, read_ahead=read)
    seen_before = 0
    for item in items:
        if isinstance(item, EncodedChunk):
            if not read.is_set():
                seen_before += 1
            item.release()
    assert read.is_set() and seen_before > 0  # it had to write (release slots) before it could read everything


def test_small_staged_inputs_are_set_aside_instead_of_scratch_per_batch():
    from nvckpt.engines.gpu.encode import batch_bytes_for

    opts = GpuSaveOptions(memory_budget=1 << 30, batch_bytes=1 << 40)
    dev = HostBackend()
    alone, _ = batch_bytes_for(opts, dev, scratch=False)
    scratch, _ = batch_bytes_for(opts, dev, scratch=True)
    assert scratch * 5 <= alone * 3 + 5  # scratch per batch: 5 halves of a batch alive instead of 3
    small, _ = batch_bytes_for(opts, dev, scratch=False, staged=4 << 20)
    assert alone - (4 << 20) <= small < alone  # the staged bytes come off the room once
    large, _ = batch_bytes_for(opts, dev, scratch=False, staged=600 << 20)
    assert large == scratch  # too much to set aside: scratch per batch, as before


def test_a_save_with_a_few_staged_tensors_keeps_its_batches():
    """Non-contiguous tensors (on a GPU also tensors in host memory) are staged to the device; a few small ones
    take their own bytes of the budget, not scratch for every batch; the file holds every value."""
    big = {f"w{i}": torch.randn(256, 1024) for i in range(4)}
    opts = GpuSaveOptions(memory_budget=16 << 20, batch_bytes=1 << 40)

    def run(state):
        stats = {}
        plan = plan_save(state, chunk_size=256 << 10)
        buf = io.BytesIO()
        write_items(buf, encode_batches(plan, chooser("auto", 1), HostBackend(), opts, stats=stats), plan,
                    alignment=4096, info=writer_info())
        assert_tree_equal(nvckpt.load(io.BytesIO(buf.getvalue())), state)
        return stats

    alone = run(big)
    mixed = run({**big, "t": torch.randn(64, 48).t(), "u": torch.randn(30, 20)[:, ::2]})
    assert alone["staged_bytes"] == 0 and 0 < mixed["staged_bytes"] < 64 << 10
    assert alone["batch_bytes"] - mixed["batch_bytes"] <= mixed["staged_bytes"]
    many = run({**big, "t": torch.randn(2048, 1024).t()})  # 8 MiB to stage: scratch per batch
    assert many["staged_bytes"] == 0 and many["batch_bytes"] * 5 <= alone["batch_bytes"] * 3 + 5


def test_the_engine_refuses_a_budget_too_small_for_one_chunk():
    plan = plan_save({"w": torch.randn(512, 1024)}, chunk_size=1 << 20)
    with pytest.raises(ValueError, match="memory_budget"):
        list(encode_batches(plan, chooser("raw", 1), HostBackend(), GpuSaveOptions(memory_budget=1 << 20)))


@pytest.mark.parametrize("pinned_limit", [None, 400 * KiB])
def test_read_ahead_session_reads_before_it_opens_the_file(tmp_path, monkeypatch, pinned_limit):
    """A read-ahead save (async_save on the GPU engine, here on the host backend) reads every tensor before
    it lists leftovers, opens the temporary file or packs the index: the caller waits for the reads only.
    Beyond the pinned limit it must write while it reads, and does."""
    from nvckpt.engines.gpu.engine import GpuEngine
    from nvckpt.io.target import AtomicFile
    from nvckpt.session.save import SaveSession

    seen = []

    class Watched(AtomicFile):  # the target a save writes to, noting when the save first asks it something
        def leftovers(self):
            seen.append(session.prepared.tensors_read.is_set())
            return super().leftovers()

    state = {"w": torch.randn(400, 1000), "b": torch.randn(1000)}
    options = nvckpt.SaveOptions(chunk_size=64 * KiB, engine=GpuEngine(backend=HostBackend()),
                                 gpu=GpuSaveOptions(batch_bytes=300 * KiB, slot_bytes=200 * KiB, pinned_slots=2,
                                                    pinned_limit=pinned_limit))
    session = SaveSession(state, Watched(str(tmp_path / "r.nvckpt")), options)
    session.prepare_async(lazy=True)  # read ahead, as a lazy async_save's thread does
    assert session.prepared.tensors_read is not None and not session.prepared.caller_decides
    result = session.run()
    assert seen == [pinned_limit is None]
    assert {"walk", "derived", "start_engine"} <= result.stats["phases"].keys()
    assert_tree_equal(nvckpt.load(tmp_path / "r.nvckpt"), state)


def test_reserve_pinned_memory_tops_up_the_cache_the_engine_takes_from(monkeypatch):
    from nvckpt.engines.gpu import pinned

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(batching, "aligned_host_buffer", lambda size, pin: torch.empty(size, dtype=torch.uint8))
    PINNED.release()
    slot = SMALL.slot_bytes
    assert nvckpt.reserve_pinned_memory(3 * slot - 1, slot_bytes=slot) == 3 * slot  # whole slots
    assert nvckpt.reserve_pinned_memory(2 * slot, slot_bytes=slot) == 3 * slot  # kept ones count
    assert nvckpt.reserve_pinned_memory(5 * slot, slot_bytes=slot) == 5 * slot and PINNED.in_use == 0
    made = []

    class Counting(HostBackend):
        def host_buffer(self, size):
            made.append(size)
            return super().host_buffer(size)

    plan = plan_save(mixed_state(), chunk_size=64 * KiB)  # its slots come from the reserve: it pins nothing
    write_items(io.BytesIO(), encode_batches(plan, chooser("auto", 1), Counting(), SMALL), plan, alignment=4096,
                info=writer_info())
    assert made == [] and PINNED.cached_of(slot) == 5 and PINNED.in_use == 0
    with pytest.raises(ValueError, match="slot_bytes"):
        pinned.reserve_pinned_memory(10, slot_bytes=0)
    assert nvckpt.release_pinned_memory() == 5 * slot


def test_reserve_pinned_memory_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    PINNED.release()
    with pytest.raises(RuntimeError, match="needs CUDA"):
        nvckpt.reserve_pinned_memory(1 << 20)
    assert nvckpt.reserve_pinned_memory(0) == 0


@pytest.mark.parametrize("slots", [1, 2])
def test_slots_shared_by_small_batches_are_freed_and_reused(slots):
    """Runs of several batches share a slot; with a single slot the writer still frees it (no deadlock)."""
    opts = GpuSaveOptions(batch_bytes=40 * KiB, slot_bytes=200 * KiB, pinned_slots=slots, piece_bytes=50 * KiB)
    state = mixed_state()
    plan = plan_save(state, chunk_size=16 * KiB)
    stats = {}
    buf = io.BytesIO()
    write_items(buf, encode_batches(plan, chooser("auto", 1), HostBackend(), opts, stats=stats), plan,
                alignment=4096, info=writer_info())
    assert stats["batches"] > 20 and stats["pinned_bytes"] == slots * 200 * KiB
    buf.seek(0)
    assert_tree_equal(nvckpt.load(buf), state)


def test_read_ahead_packs_small_batches_into_few_slots():
    """Read ahead holds the whole compressed state: about its size in slots, not a slot per batch."""
    state = mixed_state()
    plan = plan_save(state, chunk_size=16 * KiB)
    opts = GpuSaveOptions(batch_bytes=40 * KiB, slot_bytes=200 * KiB, pinned_slots=2, piece_bytes=50 * KiB)
    stats = {}
    items = encode_batches(plan, chooser("auto", 1), HostBackend(), opts, stats=stats, read_ahead=threading.Event())
    write_items(io.BytesIO(), items, plan, alignment=4096, info=writer_info())
    assert stats["batches"] > 20
    assert stats["pinned_bytes"] <= stats["stored_bytes"] + 2 * 200 * KiB, stats


@pytest.mark.parametrize("who", ["engine", "other_thread"])
@pytest.mark.parametrize("pinned_limit", [None, 400 * KiB])
def test_read_ahead_reads_the_rest_while_derived_candidates_are_verified(who, pinned_limit):
    """plan_save(defer=True): the engine reads every decided tensor first and the candidates (bf16
    roundings, copies) once verified -- by another thread (async_save's caller) or by itself -- and
    no chunk reaches the writer before every tensor's storage is known."""
    from nvckpt.plan.derived import bf16_rne

    torch.manual_seed(4)
    master = {f"w{i}": torch.randn(200, 300) for i in range(3)}
    state = {"master": master, "model": {k: bf16_rne(v) for k, v in master.items()},
             "copy": master["w1"].clone(), "other": torch.randn(300, 200).to(torch.bfloat16), "ids": torch.arange(5000)}
    plan = plan_save(state, chunk_size=64 * KiB, derive=True, copies=True, defer=True)
    assert plan.undecided  # the bf16 weights and the clone
    read = threading.Event()
    opts = GpuSaveOptions(batch_bytes=300 * KiB, slot_bytes=200 * KiB, pinned_slots=2, piece_bytes=50 * KiB,
                          pinned_limit=pinned_limit)
    items = encode_batches(plan, chooser("auto", 1), HostBackend(), opts, read_ahead=read, tensor_checksums=False)
    if who == "other_thread":
        threading.Timer(0.05, plan.decide).start()

    def checked():
        for item in items:
            if isinstance(item, EncodedChunk):
                assert not plan.undecided
            yield item

    buf = io.BytesIO()
    # The writer is made once the engine hands over its first item, as a read-ahead session does.
    first = iter(checked())
    head = next(first)
    import itertools
    write_items(buf, itertools.chain([head], first), plan, alignment=4096, info=writer_info())
    buf.seek(0)
    with nvckpt.open(buf) as ck:
        kinds = {e.name: (e.derived or {}).get("function") for e in ck.index.tensors}
    assert kinds["model/w0"] == kinds["model/w2"] == "bf16_rne" and kinds["copy"] == "copy"
    assert kinds["other"] is None and kinds["master/w1"] is None
    buf.seek(0)
    assert_tree_equal(nvckpt.load(buf), state)
    assert "derived_verify" in plan.seconds


@pytest.mark.parametrize("enabled", [True, False])
def test_async_save_keeps_the_collector_off_while_its_caller_waits(tmp_path, monkeypatch, enabled):
    """A collection pass holds the GIL the save's thread needs: off while the caller waits (planning, the
    candidates, the engine's read; here a CPU save made to wait as a read-ahead one does), then as it
    was before the call, also when the call fails."""
    import gc

    from nvckpt.engines.gpu.engine import GpuEngine
    from nvckpt.session.async_save import SaveFuture

    seen = []
    wait_read = SaveFuture.wait_read

    class Watched(GpuEngine):  # the GPU engine's scheduling on the host: a state over its budget is read ahead
        def prepare_async(self, plan, options, lazy=False):
            prepared = super().prepare_async(plan, options, lazy)
            assert prepared.tensors_read is not None and prepared.caller_decides
            seen.append(gc.isenabled())
            return prepared

    options = {"engine": Watched(backend=HostBackend()), "gpu": GpuSaveOptions(memory_budget=64 * KiB), "chunk_size": 4 * KiB}
    monkeypatch.setattr(SaveFuture, "wait_read", lambda self, *a, **k: (seen.append(gc.isenabled()), wait_read(self, *a, **k))[1])
    (gc.enable if enabled else gc.disable)()
    try:
        state = {"w": torch.randn(100, 100)}
        nvckpt.async_save(state, tmp_path / "a.nvckpt", **options).result()
        assert len(seen) == 2 and not any(seen) and gc.isenabled() is enabled
        assert_tree_equal(nvckpt.load(tmp_path / "a.nvckpt"), state)
        with pytest.raises(FileNotFoundError, match="No such directory"):
            nvckpt.async_save({"w": torch.randn(10)}, tmp_path / "missing" / "b.nvckpt", **options).result()
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


@pytest.mark.parametrize("enabled", [True, False])
def test_save_and_load_pause_the_collector_and_restore_it(tmp_path, monkeypatch, enabled):
    """No collection pass inside a save or a load (nvckpt._gc: full passes over a large process cost more than
    the save of thousands of small tensors), the collector as it was afterwards, also after a failure."""
    import gc

    from nvckpt.engines import cpu

    seen = []
    host_bytes = cpu.host_bytes
    monkeypatch.setattr(cpu, "host_bytes", lambda t: (seen.append(gc.isenabled()), host_bytes(t))[1])
    (gc.enable if enabled else gc.disable)()
    try:
        state = {"w": torch.randn(100, 100), "steps": [torch.tensor(i) for i in range(50)]}
        nvckpt.save(state, tmp_path / "a.nvckpt")
        assert len(seen) == 51 and not any(seen) and gc.isenabled() is enabled
        with nvckpt.open(tmp_path / "a.nvckpt") as ck:
            monkeypatch.setattr(ck, "_load", lambda *a, **k: (seen.append(gc.isenabled()), type(ck)._load(ck, *a, **k))[1])
            assert_tree_equal(ck.load(), state)
        assert seen[-1] is False and gc.isenabled() is enabled
        with pytest.raises(FileNotFoundError):
            nvckpt.save(state, tmp_path / "missing" / "b.nvckpt")
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_collector_pauses_nest_and_overlap_across_threads():
    """Counted: the collector comes back with the end of the last pause, and only if it was on at the first."""
    import gc

    from nvckpt._gc import paused

    try:
        gc.enable()
        inner_started, outer_done = threading.Event(), threading.Event()
        states = []

        def other() -> None:
            with paused():
                inner_started.set()
                outer_done.wait(5)
                states.append(gc.isenabled())  # the first pause has ended; this one still holds
            states.append(gc.isenabled())

        with paused():
            with paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
            thread = threading.Thread(target=other)
            thread.start()
            assert inner_started.wait(5)
        assert not gc.isenabled()  # the other thread's pause goes on
        outer_done.set()
        thread.join(5)
        assert states == [False, True] and gc.isenabled()
        gc.disable()  # turned off by the program: stays off
        with paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=40), st.integers(1, 6))
def test_chunk_checksums_of_a_run_come_in_order_from_a_few_tasks(sizes, workers):
    """Property: the writer gets every chunk's XXH3-64 in order, from at most one task per hash worker."""
    from concurrent.futures import ThreadPoolExecutor

    from nvckpt.engines.gpu.encode import _Digests
    from nvckpt.format.structs import xxh3

    payloads = [memoryview(os.urandom(n)) for n in sizes]
    with ThreadPoolExecutor(workers) as pool:
        digests = _Digests(pool, [(xxh3, p) for p in payloads], workers)
        assert len(digests._futures) <= workers
        assert [digests.get(k) for k in range(len(payloads))] == [xxh3(p) for p in payloads]


@pytest.mark.parametrize("tensor_checksums", [False, True])
def test_non_contiguous_tensors_are_staged_chunk_by_chunk_not_copied_whole(tensor_checksums):
    """A transposed, sliced or strided tensor is read by the engine a chunk at a time (staged per batch, in its
    memory budget) and hashed a piece at a time, never made contiguous whole; the file holds its values bit
    for bit (rows longer than a chunk included) and, when asked, their right tensor checksums."""
    from nvckpt.plan.walk import plan_save
    from nvckpt.session.save import write_items, writer_info

    torch.manual_seed(6)
    state = {"t": torch.randn(300, 200).t(), "s": torch.randn(40, 50, 6)[:, ::2, 1:5],
             "c": torch.randn(9000)[::3], "wide": torch.randn(5000, 4).t(), "ok": torch.randn(64, 64),
             "h": torch.randn(64, 64).to(torch.bfloat16).t(), "i": torch.arange(6000).reshape(100, 60)[:, ::2]}
    assert not any(v.is_contiguous() for k, v in state.items() if k != "ok")
    made_contiguous = []

    class Spy(HostBackend):
        def flat(self, tensor):
            if not tensor.is_contiguous():
                made_contiguous.append(tuple(tensor.shape))
            return super().flat(tensor)

    plan = plan_save(state, chunk_size=16 * KiB)
    opts = GpuSaveOptions(batch_bytes=64 * KiB, slot_bytes=64 * KiB, pinned_slots=2, piece_bytes=6 * KiB + 4)
    items = encode_batches(plan, chooser("auto", 1), Spy(), opts, tensor_checksums=tensor_checksums)
    buf = io.BytesIO()
    write_items(buf, items, plan, alignment=4096, info=writer_info())
    assert made_contiguous == []
    assert_tree_equal(nvckpt.load(io.BytesIO(buf.getvalue())), state)
    with nvckpt.open(io.BytesIO(buf.getvalue())) as ck:
        sums = {e.name: e.checksum for e in ck.index.tensors}
    if tensor_checksums:  # the XXH3-64 of each tensor's C-order bytes, hashed in staged pieces
        from nvckpt.format.structs import xxh3
        from nvckpt.tensors import flat_bytes

        assert sums == {k: xxh3(flat_bytes(v).numpy().tobytes()) for k, v in state.items()}
    else:
        assert set(sums.values()) == {None}


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=0, max_size=4), st.data())
def test_byte_range_views_hold_the_range_of_the_c_order_bytes(shape, data):
    """Property: the views byte_range_views gives, concatenated, are bytes [start, end) of the tensor's
    C-contiguous layout, for any strides (sliced, transposed) and any range of whole elements."""
    from nvckpt.tensors.staging import byte_range_views
    from nvckpt.tensors import flat_bytes

    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]))
    steps = data.draw(st.lists(st.sampled_from([1, 2, 3]), min_size=len(shape), max_size=len(shape)))
    big = torch.arange(int(np.prod([s * k for s, k in zip(shape, steps)])) or 1).reshape(
        [s * k for s, k in zip(shape, steps)] or []).to(dtype)
    t = big[tuple(slice(None, None, k) for k in steps)] if shape else big
    if len(shape) >= 2 and data.draw(st.booleans()):
        t = t.transpose(0, -1)
    n, size = t.numel(), t.element_size()
    a = data.draw(st.integers(0, n - 1))
    b = data.draw(st.integers(a + 1, n))
    views = byte_range_views(t, a * size, (b - a) * size)
    assert torch.equal(torch.cat([flat_bytes(v) for v in views]), flat_bytes(t)[a * size: b * size])
