"""Load destinations (nvckpt.io.memory): huge pages advised, pages touched before a chunk is read into them."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import nvckpt
from nvckpt.io import memory


def test_prefault_writes_only_inside_the_array():
    buf = np.full(5 * memory.PAGE + 300, 7, dtype=np.uint8)
    inner = buf[100: 100 + 3 * memory.PAGE + 17]
    memory.prefault(inner)
    assert (buf[:100] == 7).all() and (buf[100 + inner.nbytes:] == 7).all()
    small = buf[-50:]
    memory.prefault(small)  # under a page: nothing to do
    assert (small == 7).all()


def test_host_empty_is_plain_uint8_memory():
    for n in (0, 1, 4095, memory.HUGE_PAGE * 3 + 5):
        t = memory.host_empty(n)
        assert t.dtype == torch.uint8 and t.shape == (n,) and t.device.type == "cpu" and t.is_contiguous()


@pytest.mark.skipif(memory._MADVISE is None, reason="no transparent huge pages here")
def test_huge_pages_advised_on_the_aligned_interior():
    t = torch.empty(6 * memory.HUGE_PAGE, dtype=torch.uint8)
    assert memory.advise_huge_pages(t.data_ptr(), t.numel())
    assert not memory.advise_huge_pages(t.data_ptr(), memory.HUGE_PAGE)  # too small to hold an aligned huge page


def test_env_turns_the_advice_off():
    code = "from nvckpt.io import memory; print(memory._MADVISE is None, memory.advise_huge_pages(0, 1 << 30))"
    out = subprocess.run([sys.executable, "-c", code], env={"NVCKPT_HUGE_PAGES": "0", "PATH": ""},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


@pytest.mark.parametrize("codec", ["raw", "portable"])
def test_loads_into_advised_memory_are_exact(tmp_path, codec):
    g = torch.Generator().manual_seed(0)
    state = {"big": torch.randn(3 * memory.HUGE_PAGE // 4 + 11, generator=g).to(torch.bfloat16),
             "w": torch.randn(1 << 20, generator=g), "odd": torch.arange(4097, dtype=torch.uint8)}
    path = tmp_path / "m.nvckpt"
    nvckpt.save(state, path, codec=codec, chunk_size=1 << 20)
    back = nvckpt.load(path)
    for k, v in state.items():
        assert torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)), k
    with nvckpt.open(path) as ck:
        rows = ck.get_slice("w")[1000:300000]
        assert torch.equal(rows, state["w"][1000:300000])
