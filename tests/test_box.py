"""Checkpoint.read_box: an n-d box of a stored tensor, decoding only the chunks holding its rows."""

from __future__ import annotations

import pytest
import torch

import nvckpt


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
