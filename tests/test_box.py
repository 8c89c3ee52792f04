"""Checkpoint.read_box: an n-d box of a stored tensor, decoding only the chunks holding its rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nvckpt
import nvckpt.session.load as loading


@pytest.fixture
def stored(tmp_path):
    path = str(tmp_path / "box.nvckpt")
    w = torch.randn(256, 64)  # 256 B rows, 4 KiB chunks: 16 rows per chunk, 16 chunks
    x = torch.randn(32, 8)
    nvckpt.save({"w": w, "b": w.to(torch.bfloat16), "x": x, "v": x[:, 1:5], "s": torch.tensor(3.5)}, path,
                chunk_size=4096, derive_bf16=True)
    return path, w


def _chunks_read(ck: nvckpt.Checkpoint, fn) -> int:
    before = ck.bytes_read
    fn()
    return ck.bytes_read - before


def test_row_box_decodes_only_its_chunks(stored):
    path, w = stored
    with nvckpt.open(path) as ck:
        whole = _chunks_read(ck, lambda: ck.read_box("w", (0, 0), (256, 64)))
        rows = _chunks_read(ck, lambda: ck.read_box("w", (40, 0), (16, 64)))  # rows 40..55: chunks 2 and 3
        assert torch.equal(ck.read_box("w", (40, 0), (16, 64)), w[40:56])
        assert 0 < rows <= whole * 3 // 16
        # a column box costs the whole rows of its row range
        cols = _chunks_read(ck, lambda: ck.read_box("w", (40, 8), (16, 3)))
        assert cols == rows
        assert torch.equal(ck.read_box("w", (40, 8), (16, 3)), w[40:56, 8:11])
        assert torch.equal(ck.read_box("w", (0, 63), (256, 1)), w[:, 63:])
        assert ck.read_box("w", (7, 0), (0, 64)).shape == (0, 64)


def test_views_derived_and_scalars(stored):
    path, w = stored
    with nvckpt.open(path) as ck:
        x = ck.get_tensor("x")
        assert torch.equal(ck.read_box("v", (3, 1), (5, 2)), x[:, 1:5][3:8, 1:3])
        assert torch.equal(ck.read_box("b", (10, 0), (4, 64)), w.to(torch.bfloat16)[10:14])
        assert ck.read_box("s", (), ()).item() == 3.5


def test_numpy_and_tensor_integers_are_box_coordinates(stored):
    import numpy as np

    with nvckpt.open(stored[0]) as ck:
        expected = ck.read_box("w", (2, 3), (4, 5))
        assert torch.equal(ck.read_box("w", np.array([2, 3]), [np.int64(4), torch.tensor(5)]), expected)


@pytest.mark.parametrize("offsets,lengths,match", [
    ((0,), (1,), "2 dims"),
    ((0, 0), (257, 64), "outside dim 0"),
    ((0, 60), (1, 5), "outside dim 1"),
    ((-1, 0), (1, 64), "outside dim 0"),
    ((0.5, 0), (1, 64), "must be integers"),
    ((True, 0), (1, 64), "must be integers"),
])
def test_bad_boxes_are_refused(stored, offsets, lengths, match):
    with nvckpt.open(stored[0]) as ck, pytest.raises(ValueError, match=match) as info:
        ck.read_box("w", offsets, lengths)
    assert "'w'" in str(info.value)


# -- read_boxes_into: boxes decoded straight into the caller's tensors -------------------------------------------

def test_boxes_into_targets_of_any_layout(stored):
    path, w = stored
    targets = [torch.empty(256, 64), torch.empty(16, 64), torch.empty(64, 256).t(), torch.empty(100, 3)[::2],
               torch.empty(256, 64, dtype=torch.bfloat16), torch.empty(0, 64)]
    boxes = [("w", (0, 0), (256, 64)), ("w", (40, 0), (16, 64)), ("w", (0, 0), (256, 64)), ("w", (100, 9), (50, 3)),
             ("b", (0, 0), (256, 64)), ("w", (9, 0), (0, 64))]
    with nvckpt.open(path) as ck:
        assert ck.read_boxes_into([(*b, t) for b, t in zip(boxes, targets)]) == []
        for (name, o, n), t in zip(boxes[:4], targets):
            assert torch.equal(t, w[o[0]: o[0] + n[0], o[1]: o[1] + n[1]])
        assert torch.equal(targets[4], w.to(torch.bfloat16))  # derived (bf16 of w): computed from w's target
        view = torch.empty(32, 4)
        assert ck.read_boxes_into([("v", (0, 0), (32, 4), view), ("w", (0, 0), (256, 64), torch.empty(1))]) == [0, 1]


def test_derived_boxes_hold_no_copy_of_their_source(stored):
    """A derived tensor's box (bf16 weights of fp32 master weights) is computed from the source's box where that
    is decoded into a target of its own (the source's chunks read once), else from the source's rows a band at
    a time: the chunks holding the box's rows, read once."""
    path, w = stored
    b = w.to(torch.bfloat16)
    with nvckpt.open(path) as ck:
        source = _chunks_read(ck, lambda: ck.read_boxes_into([("w", (0, 0), (256, 64), torch.empty(256, 64))]))
        both = [torch.empty(256, 64), torch.empty(256, 64, dtype=torch.bfloat16)]
        assert _chunks_read(ck, lambda: ck.read_boxes_into([("w", (0, 0), (256, 64), both[0]),
                                                             ("b", (0, 0), (256, 64), both[1])])) == source
        assert torch.equal(both[0], w) and torch.equal(both[1], b)
        alone = torch.empty(256, 64, dtype=torch.bfloat16)
        rows = _chunks_read(ck, lambda: ck.read_box("w", (0, 0), (256, 64)))  # its chunks, each once
        assert _chunks_read(ck, lambda: ck.read_boxes_into([("b", (0, 0), (256, 64), alone)])) == rows
        assert torch.equal(alone, b)
        rows = _chunks_read(ck, lambda: ck.read_box("w", (40, 0), (16, 64)))
        strips = [torch.empty(16, 32, dtype=torch.bfloat16).t().t() for _ in range(2)]
        assert _chunks_read(ck, lambda: ck.read_boxes_into([("b", (40, 32 * k), (16, 32), t)
                                                             for k, t in enumerate(strips)])) == rows
        assert torch.equal(torch.cat(strips, 1), b[40:56])
        scalar = torch.empty((), dtype=torch.float32)
        assert ck.read_boxes_into([("s", (), (), scalar)]) == [] and scalar.item() == 3.5


def test_a_derived_box_checks_its_whole_source(tmp_path):
    """A derived tensor read whole from its source's bands checks the source's tensor checksum (the bands are
    hashed in order), as a load of the source would."""
    from conformance.craft import rewrite_index

    path = tmp_path / "d.nvckpt"
    w = torch.randn(64, 32)
    nvckpt.save({"w": w, "b": w.to(torch.bfloat16)}, str(path), chunk_size=1024, derive_bf16=True)

    def wrong_sum(index: dict) -> None:  # as if the decoder had given other bytes than were saved
        next(e for e in index["tensors"] if e["name"] == "w")["checksum"] ^= 1

    path.write_bytes(rewrite_index(path.read_bytes(), wrong_sum))
    with nvckpt.open(str(path)) as ck:
        assert ck.file.entry("b").derived is not None
        with pytest.raises(nvckpt.ChecksumError, match="tensor checksum"):
            ck.read_boxes_into([("b", (0, 0), (64, 32), torch.empty(64, 32, dtype=torch.bfloat16))])


def test_column_strips_of_one_tensor_read_each_chunk_once(stored):
    """Several column boxes of one stored tensor (a 2-D mesh, strided shards) decode its rows once, not once
    per box: the bytes read are those of the rows' chunks, once."""
    path, w = stored
    with nvckpt.open(path) as ck:
        rows = _chunks_read(ck, lambda: ck.read_box("w", (32, 0), (64, 64)))
        strips = [torch.empty(64, 16) for _ in range(4)]
        read = _chunks_read(ck, lambda: ck.read_boxes_into([("w", (32, 16 * k), (64, 16), t)
                                                           for k, t in enumerate(strips)]))
        assert read == rows
        assert torch.equal(torch.cat(strips, 1), w[32:96])


def test_boxes_into_a_damaged_file_raise(tmp_path):
    path = tmp_path / "d.nvckpt"
    w = torch.randn(64, 32)
    nvckpt.save({"w": w}, str(path), chunk_size=1024, codec="raw")
    with nvckpt.open(str(path)) as ck:
        c = ck.file.entry("w").chunks[3]
    data = bytearray(path.read_bytes())
    data[c.offset + 5] ^= 1
    path.write_bytes(bytes(data))
    for box in (((0, 0), (64, 32)), ((20, 0), (10, 32)), ((0, 3), (64, 4))):
        with nvckpt.open(str(path)) as ck, pytest.raises(nvckpt.ChecksumError):
            ck.read_boxes_into([("w", *box, torch.empty(box[1]))])


@pytest.fixture(scope="module")
def box_files(tmp_path_factory):
    """Files of tensors of several dtypes and shapes, cut into chunks of whole rows, of pieces of rows, and
    raw or compressed, for the property below."""
    root = tmp_path_factory.mktemp("boxes")
    g = torch.Generator().manual_seed(5)
    tensors = {"f32": torch.randn(37, 11, generator=g), "bf16": torch.randn(20, 5, 6, generator=g).to(torch.bfloat16),
               "i64": torch.randint(-9, 9, (50, 3), generator=g), "u8": torch.randint(0, 255, (9, 300), generator=g,
                                                                                       dtype=torch.uint8),
               "bool": torch.rand(13, 7, generator=g) > 0.5, "vec": torch.randn(41, generator=g)}
    # derived tensors (SPEC 14.2): a bf16 rounding of an fp32 one and an exact copy, with their own boxes
    tensors["f32_bf16"] = tensors["f32"].to(torch.bfloat16)
    tensors["i64_copy"] = tensors["i64"].clone()
    paths = []
    for codec in ("raw", "portable"):
        for chunk_size in (64, 200, 4096):
            p = str(root / f"{codec}-{chunk_size}.nvckpt")
            nvckpt.save(tensors, p, codec=codec, chunk_size=chunk_size)
            with nvckpt.open(p) as ck:
                assert all(ck.file.entry(n).derived is not None for n in ("f32_bf16", "i64_copy"))
            paths.append(p)
    return paths, tensors


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_boxes_into_any_targets_are_bit_exact(box_files, data):
    paths, tensors = box_files
    path = data.draw(st.sampled_from(paths))
    boxes, want = [], []
    for _ in range(data.draw(st.integers(1, 6))):
        name = data.draw(st.sampled_from(sorted(tensors)))
        t = tensors[name]
        offsets, lengths = [], []
        for size in t.shape:
            o = data.draw(st.integers(0, size))
            offsets.append(o)
            lengths.append(data.draw(st.integers(0, size - o)))
        expected = t
        for d, (o, n) in enumerate(zip(offsets, lengths)):
            expected = expected.narrow(d, o, n)
        layout = data.draw(st.sampled_from(["contiguous", "transposed", "strided"]))
        if layout == "transposed" and t.dim() >= 2:
            out = torch.empty(tuple(reversed(lengths)), dtype=t.dtype).permute(*reversed(range(t.dim())))
        elif layout == "strided":
            out = torch.empty((lengths[0] * 2,) + tuple(lengths[1:]), dtype=t.dtype)[::2]
        else:
            out = torch.empty(lengths, dtype=t.dtype)
        boxes.append((name, offsets, lengths, out))
        want.append(expected)
    band = data.draw(st.sampled_from([1, 300, 4 << 20]))  # rows decoded a band at a time: many bands, or one
    before, loading.BAND_BYTES = loading.BAND_BYTES, band
    try:
        with nvckpt.open(path) as ck:
            assert ck.read_boxes_into(boxes) == []
    finally:
        loading.BAND_BYTES = before
    for (_, _, _, out), expected in zip(boxes, want):
        assert torch.equal(out.view(torch.uint8) if out.dtype == torch.bool else out,
                           expected.view(torch.uint8) if expected.dtype == torch.bool else expected)
