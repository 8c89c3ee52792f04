"""Chunk policies (nvckpt.plan.chunking): the default cuts whole rows; a policy of one's own lands in one class."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import pytest
import torch

import nvckpt
from conftest import assert_tree_equal, small_training_state
from nvckpt.plan.chunking import RowChunks, chunk_policy


@dataclass(frozen=True)
class FixedBytes:
    """Chunks of ``n`` bytes whatever the rows (a policy a user might write)."""

    n: int

    def ranges(self, shape, itemsize):
        total = math.prod(shape) * itemsize
        return [(at, min(self.n, total - at)) for at in range(0, total, self.n)]


def test_an_int_is_whole_rows():
    assert chunk_policy(4096) == RowChunks(4096)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_policy(0)
    with pytest.raises(ValueError, match="chunk_size"):
        nvckpt.SaveOptions(chunk_size=-5)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["cpu", "gpu-on-host"])
def test_a_policy_of_ones_own_is_what_the_file_holds(engine):
    from nvckpt.testing.host import HostBackend
    from nvckpt.engines.gpu.engine import GpuEngine

    state = small_training_state()
    buf = io.BytesIO()
    options = {} if engine == "cpu" else {"engine": GpuEngine(backend=HostBackend())}
    nvckpt.save(state, buf, chunk_size=FixedBytes(1000), **options)
    buf.seek(0)
    with nvckpt.open(buf) as ck:
        for e in ck.index.tensors:
            if e.chunks is not None and e.nbytes:
                lengths = [c.raw_length for c in e.chunks]
                assert lengths == [min(1000, e.nbytes - at) for at in range(0, e.nbytes, 1000)]
    buf.seek(0)
    assert_tree_equal(nvckpt.load(buf), state)


class Gaps:
    def __hash__(self):
        return 1

    def ranges(self, shape, itemsize):
        total = math.prod(shape) * itemsize
        return [(0, total // 2)] if total > 1 else [(0, total)]  # misses the second half


def test_a_policy_that_does_not_tile_the_bytes_is_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "x.nvckpt"
    with pytest.raises(ValueError, match="covered"):
        nvckpt.save({"w": torch.ones(100)}, path, chunk_size=Gaps())
    assert not path.exists() and list(tmp_path.iterdir()) == []
