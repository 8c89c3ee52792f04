"""The one coalescing policy (nvckpt.io.ranges): which stored ranges one read covers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvckpt.io.ranges import LOCAL, Coalescing, coalesce

KiB = 1 << 10


def test_aligned_bounded_and_complete():
    offsets, lengths = [100, 5148, 12288, 300_000, 300_058], [5000, 4096, 9000, 10, 70_000]
    policy = Coalescing(max_gap=64 * KiB, max_span=32 * KiB, align=4096)
    reads = coalesce(offsets, lengths, policy)
    assert [i for r in reads for i in r.members] == list(range(5))
    for r in reads:
        assert r.start % 4096 == 0 and r.length % 4096 == 0
        for i in r.members:
            assert r.start <= offsets[i] and offsets[i] + lengths[i] <= r.start + r.length
        assert r.length <= 32 * KiB or len(r.members) == 1
    assert list(reads[0].members) == [0, 1, 2]  # adjacent chunks share one read
    assert list(reads[1].members) == [3]  # too far from the previous read, then the big one alone
    assert list(reads[2].members) == [4]


def test_local_file_reads_large_chunks_alone_and_small_ones_together():
    # small chunks 100 bytes apart, then a 16 KiB chunk (read alone, straight into its destination), then small ones
    offsets = [0, 200, 400, 600, 20_000, 40_000, 40_200]
    lengths = [100, 100, 100, 16 * KiB, 100, 100, 100]
    reads = coalesce(offsets, lengths, LOCAL)
    assert [list(r.members) for r in reads] == [[0, 1, 2], [3], [4], [5, 6]]
    assert reads[1].start == 600 and reads[1].length == 16 * KiB  # no byte outside the chunk


def test_out_of_order_ranges_start_a_new_read():
    reads = coalesce([1000, 0, 2000], [100, 100, 100], Coalescing(max_gap=4096, max_span=1 << 20))
    assert [list(r.members) for r in reads] == [[0], [1, 2]]


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 20_000)), min_size=0, max_size=40),
       st.integers(0, 10_000), st.integers(1, 100_000), st.integers(1, 50_000), st.integers(1, 8),
       st.sampled_from([1, 512, 4096]))
def test_every_range_in_exactly_one_read_within_the_bounds(gaps_and_lengths, max_gap, max_span, alone_from,
                                                          max_ranges, align):
    offsets, lengths, at = [], [], 0
    for gap, n in gaps_and_lengths:
        at += gap
        offsets.append(at)
        lengths.append(n)
        at += n
    policy = Coalescing(max_gap=max_gap, max_span=max_span, alone_from=alone_from, max_ranges=max_ranges, align=align)
    reads = coalesce(offsets, lengths, policy)
    assert [i for r in reads for i in r.members] == list(range(len(offsets)))  # in order, each once
    for r in reads:
        assert r.start % align == 0 and r.length % align == 0
        members = list(r.members)
        for i in members:
            assert r.start <= offsets[i] and offsets[i] + lengths[i] <= r.start + r.length
        if len(members) > 1:
            assert r.length <= max_span and len(members) <= max_ranges
            assert all(lengths[i] < alone_from for i in members)
            assert all(offsets[j] - (offsets[i] + lengths[i]) <= max_gap for i, j in zip(members, members[1:]))


# -- the read-ahead of a whole load over an object store (nvckpt.io.readahead) -------------------

def _file(n: int) -> bytes:
    return bytes((i * 7 + i // 251) % 256 for i in range(n))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 900)), min_size=1, max_size=40),
       st.integers(64, 1024), st.integers(1, 5), st.randoms(use_true_random=False))
def test_read_ahead_gives_each_range_its_bytes_within_its_buffers(gaps, piece, slots, rnd):
    from nvckpt._threads import WorkerPool
    from nvckpt.io.readahead import ReadAhead

    ranges, at = [], 0
    for gap, n in gaps:  # in file order, as a load's runs are
        ranges.append((at + gap, n))
        at += gap + n
    data = _file(at)

    def fetch_into(start: int, end: int, view: memoryview) -> None:
        assert end - start <= piece and view.nbytes == end - start  # GETs of at most a piece
        view[:] = data[start:end]

    pool = WorkerPool(3, "test-ahead")
    try:
        with ReadAhead(fetch_into, pool, ranges, piece=piece, slots=slots, max_gap=200) as ahead:
            order = list(range(len(ranges)))
            if rnd.random() < 0.3:  # taken out of order now and then (two decoders)
                rnd.shuffle(order)
            for i in order:
                o, n = ranges[i]
                assert bytes(ahead.take(i)) == data[o: o + n]
                ahead.done(i)
            if order == sorted(order):  # buffers of `piece` bytes: at most `slots`, whatever the ranges
                assert ahead._made <= slots
    finally:
        pool.shutdown()


def test_read_ahead_raises_a_fetch_error_from_take():
    from nvckpt._threads import WorkerPool
    from nvckpt.io.readahead import ReadAhead

    def fetch_into(start: int, end: int, view: memoryview) -> None:
        if start >= 3000:
            raise OSError(5, "GET failed", "s3://b/k")
        view[:] = bytes(end - start)

    pool = WorkerPool(2, "test-ahead")
    try:
        with ReadAhead(fetch_into, pool, [(0, 1000), (1000, 1000), (3000, 500)], piece=1000, slots=2,
                       max_gap=0) as ahead:
            assert bytes(ahead.take(0)) == bytes(1000)
            ahead.done(0)
            with pytest.raises(OSError, match="GET failed"):
                ahead.take(2)
    finally:
        pool.shutdown()
