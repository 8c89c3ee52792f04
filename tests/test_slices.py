"""get_slice: same values as indexing the whole tensor, and it reads only the chunks it needs."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nvckpt
from conftest import assert_tensor_equal

ROWS, COLS = 100, 7


@pytest.fixture(scope="module")
def sliced_file(tmp_path_factory):
    """A multi-chunk float32 tensor (9 rows of 28 bytes per 256-byte chunk), plus other shapes."""
    gen = torch.Generator().manual_seed(1)
    state = {
        "x": torch.randn(ROWS, COLS, generator=gen),
        "cube": torch.randint(-1000, 1000, (30, 4, 5), generator=gen, dtype=torch.int64),
        "wide": torch.randn(6, 500, generator=gen, dtype=torch.float64),  # rows larger than a chunk
        "vec": torch.randn(50, generator=gen).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    }
    y = torch.randn(ROWS, COLS, generator=gen)
    state["y_t"] = y.t()  # views of one storage: stored as a base and two views
    state["y_row"] = y[3]
    path = tmp_path_factory.mktemp("slices") / "s.nvckpt"
    nvckpt.save(state, path, chunk_size=256, codec="auto")
    with nvckpt.open(path) as ck:  # the tensors sliced below are data tensors: slices take the chunked path
        assert len(ck.index.tensors[ck.index.paths["x"]].chunks) == 12
        assert ck.index.tensors[ck.index.paths["y_t"]].view is not None
    return SavedFile(path, state)


class SavedFile(tuple):
    """(path, state), with a short repr for hypothesis' failure reports."""

    def __new__(cls, path, state):
        return super().__new__(cls, (path, state))

    def __repr__(self) -> str:
        return f"SavedFile({self[0]})"


INDICES = [
    5, -1, -ROWS, slice(3, 50), slice(None, None, 3), slice(10, 90, 7), slice(-20, None), slice(50, 10),
    slice(0, 0), slice(None), slice(95, 1000), [3, 1, 99, -2], [7], [], torch.tensor([0, 50, 51, 8]),
    torch.tensor(4), (slice(2, 40, 3), 4), (7, slice(1, 5)), (slice(None), [0, 2]), (slice(8, 30), slice(None, None, 2)),
    (-3, -1), ..., (..., 2), (slice(4, 9), None),
]


@pytest.mark.parametrize("index", INDICES, ids=repr)
def test_slice_matches_full_indexing(sliced_file, index):
    path, state = sliced_file
    with nvckpt.open(path) as ck:
        assert_tensor_equal(ck.get_slice("x")[index], state["x"][index])


def test_bool_masks_on_dim0(sliced_file):
    path, state = sliced_file
    mask = torch.zeros(ROWS, dtype=torch.bool)
    mask[[2, 3, 40, 97]] = True
    with nvckpt.open(path) as ck:
        sl = ck.get_slice("x")
        assert_tensor_equal(sl[mask], state["x"][mask])
        assert_tensor_equal(sl[mask, 1:3], state["x"][mask, 1:3])
        assert_tensor_equal(sl[mask.tolist()], state["x"][mask])
        assert_tensor_equal(sl[torch.zeros(ROWS, dtype=torch.bool)], state["x"][torch.zeros(ROWS, dtype=torch.bool)])
        mask2d = torch.rand(ROWS, COLS, generator=torch.Generator().manual_seed(9)) > 0.5  # selects elements, not rows
        assert_tensor_equal(sl[mask2d], state["x"][mask2d])
        with pytest.raises(IndexError):
            sl[torch.ones(5, dtype=torch.bool)]  # a mask of the wrong length, as torch says


@pytest.mark.parametrize("name,index", [
    ("cube", (slice(3, 17, 2), 1, slice(None, None, 2))), ("cube", -5), ("cube", ([1, 2, 29], slice(1, 3), 4)),
    ("wide", 3), ("wide", (slice(1, 5), slice(100, 420))), ("wide", (slice(None), 499)),
    ("vec", slice(7, 33, 5)), ("scalar", ()), ("empty", slice(None)), ("y_t", (slice(1, 3), slice(10, 20))),
    ("y_row", slice(2, 5)), ("y_row", [4, 0]),
])
def test_slices_of_other_shapes(sliced_file, name, index):
    path, state = sliced_file
    with nvckpt.open(path) as ck:
        sl = ck.get_slice(name)
        assert sl.get_shape() == list(state[name].shape)
        assert_tensor_equal(sl[index], state[name][index])


def test_out_of_range_index_raises(sliced_file):
    path, _ = sliced_file
    with nvckpt.open(path) as ck:
        sl = ck.get_slice("x")
        with pytest.raises(IndexError):
            sl[ROWS]
        with pytest.raises(IndexError):
            sl[-ROWS - 1]
        with pytest.raises(IndexError):
            sl[[0, ROWS]]


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.one_of(st.none(), st.integers(-120, 120)), stop=st.one_of(st.none(), st.integers(-120, 120)),
       step=st.one_of(st.none(), st.integers(1, 12)), col=st.one_of(st.none(), st.integers(-COLS, COLS - 1)))
def test_random_row_slices(sliced_file, start, stop, step, col):
    path, state = sliced_file
    index = slice(start, stop, step) if col is None else (slice(start, stop, step), col)
    with nvckpt.open(path) as ck:
        assert_tensor_equal(ck.get_slice("x")[index], state["x"][index])


# -- bytes read ----------------------------------------------------------------------------------

BIG_ROWS, BIG_COLS = 4096, 256  # 4 MiB of float32, 1 KiB per row
CHUNK = 64 << 10  # 64 rows per chunk, 64 chunks


@pytest.fixture(scope="module", params=["raw", "auto"])
def big_file(request, tmp_path_factory):
    gen = torch.Generator().manual_seed(2)
    big = torch.randn(BIG_ROWS, BIG_COLS, generator=gen)
    path = tmp_path_factory.mktemp("big") / f"big-{request.param}.nvckpt"
    nvckpt.save({"big": big, "other": torch.randn(1000, generator=gen)}, path, chunk_size=CHUNK, codec=request.param)
    return path, big


def stored_bytes_of_rows(entry, first: int, stop: int) -> int:
    """What SPEC says a reader needs: the stored bytes of the chunks whose raw range meets rows [first, stop)."""
    row_bytes = BIG_COLS * 4
    lo, hi = first * row_bytes, stop * row_bytes
    return sum(c.stored_length for c in entry.chunks if c.raw_start < hi and c.raw_start + c.raw_length > lo)


@pytest.mark.parametrize("first,stop,nchunks", [(1000, 1010, 1), (1020, 1030, 2), (0, 1, 1), (4095, 4096, 1), (64, 192, 2)])
def test_row_slice_reads_only_its_chunks(big_file, first, stop, nchunks):
    path, big = big_file
    with nvckpt.open(path) as ck:
        entry = ck.index.tensors[ck.index.paths["big"]]
        assert len(entry.chunks) == BIG_ROWS * BIG_COLS * 4 // CHUNK
        total = entry.stored_bytes
        before = ck.bytes_read
        rows = ck.get_slice("big")[first:stop]
        read = ck.bytes_read - before
        assert_tensor_equal(rows, big[first:stop])
        expected = stored_bytes_of_rows(entry, first, stop)
        touched = [i for i, c in enumerate(entry.chunks)
                   if c.raw_start < stop * BIG_COLS * 4 and c.raw_start + c.raw_length > first * BIG_COLS * 4]
        assert len(touched) == nchunks
        print(f"rows {first}:{stop}: read {read} of {total} stored bytes ({read / total:.2%})")
        assert read == expected, (read, expected)
        assert read <= total * nchunks / 60

        before = ck.bytes_read
        one = ck.get_slice("big")[first]
        assert_tensor_equal(one, big[first])
        assert ck.bytes_read - before == stored_bytes_of_rows(entry, first, first + 1)

        before = ck.bytes_read
        assert_tensor_equal(ck.get_tensor("big"), big)
        assert ck.bytes_read - before == total  # the whole tensor: every chunk, once


def test_open_reads_only_the_index(big_file):
    path, _ = big_file
    with nvckpt.open(path) as ck:
        assert ck.bytes_read < 64 << 10  # preamble, footer, index: not a chunk


def test_get_slice_with_a_bool_index_follows_torch():
    # A Python bool is an int, but torch reads x[True] as a mask that adds a dimension;
    # get_slice used to return row 1 instead.
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    stream = io.BytesIO()
    nvckpt.save({"w": w}, stream)
    stream.seek(0)
    with nvckpt.open(stream) as ck:
        s = ck.get_slice("w")
        for index in (True, False, (True, 1)):
            assert_tensor_equal(s[index], w[index], repr(index))


def test_a_uint8_mask_in_get_slice_is_torchs_mask():
    w = torch.arange(6.0).reshape(2, 3)
    buf = io.BytesIO()
    nvckpt.save({"w": w}, buf)
    buf.seek(0)
    mask = torch.tensor([1, 0], dtype=torch.uint8)
    with nvckpt.open(buf) as f, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of uint8 masks
        assert torch.equal(f.get_slice("w")[mask], w[mask])


def test_rows_of_views_and_derived_tensors_are_read_without_building_them_whole():
    # A slice of a view of a flat buffer (or of a bf16 rounding stored as derived) built the whole base first:
    # with max_tensor_bytes a 512-byte read was refused, naming the internal "@base" entry.
    torch.manual_seed(0)
    flat = torch.randn(1000, 64)
    master = torch.randn(300, 64)
    state = {"a": flat[:500], "b": flat[500:], "t": flat[:64].t(), "master": master, "w": master.to(torch.bfloat16)}
    buf = io.BytesIO()
    nvckpt.save(state, buf, derive=True)
    buf.seek(0)
    with nvckpt.open(buf, max_tensor_bytes=64 * 1024) as f:
        assert f._file.entry("w").derived is not None and f._file.entry("a").view is not None
        assert_tensor_equal(f.get_slice("a")[0:2], flat[0:2])
        assert_tensor_equal(f.get_slice("b")[3], flat[503])
        assert_tensor_equal(f.get_slice("b")[[1, 7, 2]], flat[500:][[1, 7, 2]])
        assert_tensor_equal(f.read_box("b", (10, 5), (2, 7)), flat[510:512, 5:12])
        assert_tensor_equal(f.get_slice("w")[5:9], master[5:9].to(torch.bfloat16))
        assert_tensor_equal(f.read_box("w", (0, 0), (1, 64)), master[:1].to(torch.bfloat16))
        with pytest.raises(nvckpt.LimitError):  # a transposed view has no rows of its own: built whole (128 KB)
            f.get_slice("t")[0:1]
    buf.seek(0)
    with nvckpt.open(buf) as f:
        assert_tensor_equal(f.get_slice("t")[3:5], flat[:64].t()[3:5])
