"""The device memory nvckpt holds stays within GpuSaveOptions.memory_budget across saves and modes, and is all
given back when the saves end or fail (nvckpt.engines.gpu.memory.DEVICE_MEMORY).

Run on the host stand-in: a GpuEngine over a HostBackend with a simulated device capacity (its default budget
follows from it, as a GPU's does), whose "device" buffers (batch outputs, scratch) are counted while alive.
The same on a real GPU at 3 GB free is in test_gpu.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import nvckpt
from conftest import assert_tree_equal
from nvckpt.engines.gpu.engine import GpuEngine
from nvckpt.engines.gpu.memory import DEVICE_MEMORY, DeviceMemory
from nvckpt.options import GpuSaveOptions, default_memory_budget
from nvckpt.testing.host import HostBackend

KiB, MiB = 1 << 10, 1 << 20
CPU = torch.device("cpu")
CAPACITY = 50 * MiB  # the simulated device: its default budget is 2 % of it, 1 MiB
BUDGET = default_memory_budget(CAPACITY)


class SlowDevice(HostBackend):
    """The host stand-in whose encodes take a moment (as a GPU's batches do), so that saves overlap; ``fail_at``:
    the encode call (counted over all saves) that raises, as a device error would."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__(memory_total=CAPACITY)
        self.calls = 0
        self.fail_at = fail_at

    def encode(self, batch, sources):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("simulated device failure in an encode")
        time.sleep(0.005)
        return super().encode(batch, sources)


def options(dev: HostBackend) -> dict:
    return {"chunk_size": 64 * KiB, "engine": GpuEngine(backend=dev),
            "gpu": GpuSaveOptions(slot_bytes=128 * KiB, pinned_slots=2)}


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))  # 3 MiB of parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    return model, opt


def state_of(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def expected(state: dict) -> dict:
    return {"model": {k: v.clone() for k, v in state["model"].items()},
            "optim": {"state": {k: {n: v.clone() for n, v in s.items()} for k, s in state["optim"]["state"].items()}}}


@pytest.fixture
def account():
    """The process's account for the simulated device, every grant given back before and after."""
    assert DEVICE_MEMORY.held(CPU) == 0
    DEVICE_MEMORY.reset_peak(CPU)
    yield DEVICE_MEMORY
    assert DEVICE_MEMORY.held(CPU) == 0, "device memory still held after every save ended"


def within_budget(account: DeviceMemory, dev: HostBackend) -> None:
    assert dev.peak <= BUDGET, f"the engines held {dev.peak} bytes of device buffers at once, budget {BUDGET}"
    assert 0 < account.peak(CPU) <= BUDGET
    assert dev.live == 0  # every device buffer freed
    gone_at_lease_end(dev)


def gone_at_lease_end(dev: HostBackend) -> None:
    """Every engine's buffers were gone when its backend's last lease ended: where a CUDA backend hands its
    private pool back to the device, a buffer still alive would stay behind in torch's cache."""
    assert dev.leases == 0 and dev.left_at_lease_end, "no engine ran, or a lease was never ended"
    assert not any(dev.left_at_lease_end), f"bytes of device buffers alive at lease ends: {dev.left_at_lease_end}"


@pytest.mark.parametrize("first", ["lazy", "plain"])
def test_a_lazy_and_a_plain_async_save_at_once_stay_within_one_budget(tmp_path, account, first):
    dev = SlowDevice()
    model, opt = trained()
    state = state_of(model, opt)
    want = expected(state)
    fence = {"lazy": {"fence": opt}, "plain": {}}
    second = "plain" if first == "lazy" else "lazy"
    a = nvckpt.async_save(state, tmp_path / "a.nvckpt", **options(dev), **fence[first])
    b = nvckpt.async_save(state, tmp_path / "b.nvckpt", **options(dev), **fence[second])
    a.result(timeout=120)
    b.result(timeout=120)
    within_budget(account, dev)
    for name in ("a", "b"):
        got = nvckpt.load(tmp_path / f"{name}.nvckpt")
        assert_tree_equal(got["model"], want["model"])


def test_back_to_back_saves_of_every_mode_give_everything_back(tmp_path, account):
    dev = SlowDevice()
    model, opt = trained()
    small = {"w": torch.randn(64, 256)}  # 64 KiB: within half the budget, a plain async_save copies it
    futures = []
    for i, (obj, kw) in enumerate([(state_of(model, opt), {"fence": opt}), (small, {}),
                                   (state_of(model, opt), {}), (small, {"fence": opt})]):
        futures.append(nvckpt.async_save(obj, tmp_path / f"{i}.nvckpt", **options(dev), **kw))
        opt.step()  # waits for a lazy save's reads
    nvckpt.save(state_of(model, opt), tmp_path / "sync.nvckpt", **options(dev))
    for f in futures:
        f.result(timeout=120)
    assert "read-ahead" not in futures[1].snapshot.values()  # the small state was copied, within the budget
    within_budget(account, dev)


def test_a_snapshot_takes_no_room_the_budget_lacks(tmp_path, account):
    """A plain async_save copies a state within half the budget only if the account has the room: here a
    lazy save's engine holds the budget, so the state is read ahead instead (no copy beside it)."""
    dev = SlowDevice()
    model, opt = trained()
    small = {"w": torch.randn(64, 256)}
    with account.take_copy(CPU, BUDGET // 2, BUDGET):  # another save's copy holds half the budget
        f = nvckpt.async_save(small, tmp_path / "s.nvckpt", **options(dev))
        assert f.snapshot == {"cpu": "read-ahead"}
        f.result(timeout=60)
    assert account.peak(CPU) <= BUDGET
    assert_tree_equal(nvckpt.load(tmp_path / "s.nvckpt"), small)


@pytest.mark.parametrize("fail_at", [1, 2])
@pytest.mark.parametrize("mode", ["lazy", "plain", "small"])
def test_a_failed_save_gives_its_device_memory_back(tmp_path, account, mode, fail_at):
    dev = SlowDevice(fail_at=fail_at)
    model, opt = trained()
    obj = {"w": torch.randn(128, 1024)} if mode == "small" else state_of(model, opt)
    with pytest.raises(RuntimeError, match="simulated device failure"):  # at the call where it waits for the read
        f = nvckpt.async_save(obj, tmp_path / "f.nvckpt", **options(dev), **({"fence": opt} if mode == "lazy" else {}))
        f.result(timeout=60)
    assert account.held(CPU) == 0
    assert not (tmp_path / "f.nvckpt").exists()
    nvckpt.async_save(obj, tmp_path / "g.nvckpt", **options(dev)).result(timeout=60)  # the next save has room
    within_budget(account, dev)


class ProbeFails(HostBackend):
    """The host stand-in whose question for nvCOMP's bound fails, as its probe allocation does on a full device."""

    def capacity(self, pipeline, length):
        raise RuntimeError("simulated out of memory in nvCOMP's probe")


def test_a_save_that_fails_before_it_takes_device_memory_ends_its_lease(tmp_path, account):
    dev = ProbeFails(memory_total=CAPACITY)
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        nvckpt.save({"w": torch.randn(256, 256)}, tmp_path / "f.nvckpt", **options(dev))
    assert dev.leases == 0 and dev.left_at_lease_end == [0]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_stager_and_writer_beside_a_lazy_save(tmp_path, account):
    import torch.distributed.checkpoint as dcp

    import nvckpt.dcp

    dev = SlowDevice()
    model, opt = trained()
    lazy = nvckpt.async_save(state_of(model, opt), tmp_path / "lazy.nvckpt", **options(dev), fence=opt)
    state = state_of(model, opt)
    want = expected(state)
    writer = nvckpt.dcp.Writer(tmp_path / "dcp", engine=GpuEngine(backend=dev), chunk_size=64 * KiB,
                               gpu=GpuSaveOptions(slot_bytes=128 * KiB, pinned_slots=2))
    future = dcp.async_save(state, storage_writer=writer, async_stager=nvckpt.dcp.Stager(), no_dist=True)
    opt.step()
    future.result(timeout=120)
    lazy.result(timeout=120)
    within_budget(account, dev)
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}}
    dcp.load(got, storage_reader=nvckpt.dcp.Reader(tmp_path / "dcp"), no_dist=True)
    assert_tree_equal(got["model"], want["model"])


# -- the account itself ---------------------------------------------------------------------
def test_copies_take_at_most_half_the_budget_and_engines_the_rest():
    acc = DeviceMemory()
    a = acc.take_copy(CPU, 300, 1000)
    assert acc.take_copy(CPU, 201, 1000) is None  # copies together over half the budget
    b = acc.take_copy(CPU, 200, 1000)
    work = acc.take_work(CPU, want=1000, need=100, budget=1000)
    assert work.nbytes == 500 and acc.held(CPU) == 1000  # what is left, not more
    assert acc.take_copy(CPU, 1, 1000) is None
    for g in (a, b, work, work):  # releasing twice gives back once
        g.release()
    assert acc.held(CPU) == 0 and acc.peak(CPU) == 1000


def test_an_engine_waits_for_room_and_gets_it_when_another_gives_it_back():
    acc = DeviceMemory()
    first = acc.take_work(CPU, want=1000, need=100, budget=1000)
    got = []
    waiter = threading.Thread(target=lambda: got.append(acc.take_work(CPU, want=1000, need=100, budget=1000)))
    waiter.start()
    time.sleep(0.3)
    assert not got  # no room: it waits
    first.release()
    waiter.join(5)
    assert got and got[0].nbytes == 1000
    got[0].release()
    stop = threading.Event()
    stop.set()
    with acc.take_work(CPU, want=1000, need=1000, budget=1000):
        with pytest.raises(RuntimeError, match="stopped while waiting"):
            acc.take_work(CPU, want=1000, need=100, budget=1000, stop=stop)


def test_a_budget_that_the_saves_own_copy_leaves_too_small_is_a_clear_error():
    acc = DeviceMemory()
    owner = object()
    with acc.take_copy(CPU, 500, 1000, owner):
        with pytest.raises(ValueError, match="memory_budget 1000 leaves 500 bytes beside this save's copy"):
            acc.take_work(CPU, want=1000, need=600, budget=1000, owner=owner)


# -- the loader's device buffers ---------------------------------------------------------------
class FailingDecode(HostBackend):
    """The host stand-in whose ``fail_at``-th decode call raises, as a device error would."""

    def __init__(self, fail_at: int | None = None, **kw) -> None:
        super().__init__(**kw)
        self.calls = 0
        self.fail_at = fail_at

    def decode(self, key, payloads, outs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("simulated device failure in a decode")
        return super().decode(key, payloads, outs)


@pytest.mark.parametrize("device_reads", [False, True])
@pytest.mark.parametrize("fail_at", [None, 2])
def test_a_load_has_let_go_of_its_device_buffers_when_its_lease_ends(tmp_path, device_reads, fail_at):
    from nvckpt.options import GpuLoadOptions

    model, opt = trained()
    state = state_of(model, opt)
    path = tmp_path / "s.nvckpt"
    nvckpt.save(state, path, chunk_size=16 * KiB)
    dev = FailingDecode(fail_at, device_reads=device_reads)
    opts = GpuLoadOptions(backend=dev, read_span_bytes=64 * KiB, decode_batch_bytes=128 * KiB, read_buffers=3,
                          read_path="kvikio" if device_reads else "o_direct")
    if fail_at is None:
        got = nvckpt.load(path, gpu=opts)
        assert_tree_equal(got["model"], state["model"])
        with nvckpt.open(path, gpu=opts) as ck:  # one tensor, then another: a lease each
            for name in list(ck.keys())[:2]:
                assert torch.equal(ck.get_tensor(name), ck.get_tensor(name))
    else:
        with pytest.raises(RuntimeError, match="simulated device failure"):
            nvckpt.load(path, gpu=opts)
    assert len(dev.left_at_lease_end) >= (1 if fail_at else 3)
    gone_at_lease_end(dev)
