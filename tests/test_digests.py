"""Chunk checksums in the hashing helper process (nvckpt.io.digests): same digests and files as hashing in
threads, a fallback when the helper is gone, no torch in the helper, and no helper outliving its parent."""

from __future__ import annotations

import dataclasses
import gc
import io
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import xxhash

from nvckpt.codecs.presets import chooser
from nvckpt.engines.gpu.backend import HostBackend
from nvckpt.engines.gpu.encode import encode_batches
from nvckpt.engines.gpu.pinned import PINNED, shared_buffer_id
from nvckpt.io import digests
from nvckpt.io.digests import HASHER, SharedBuffer
from nvckpt.options import GpuSaveOptions
from nvckpt.plan.walk import plan_save
from nvckpt.session.save import write_items, writer_info

pytestmark = pytest.mark.skipif(not digests.shared_memory_supported(), reason="needs Linux memfd")

KiB = 1024
OPTS = GpuSaveOptions(batch_bytes=300 * KiB, slot_bytes=200 * KiB, pinned_slots=3, piece_bytes=50 * KiB)


@pytest.fixture(autouse=True)
def fresh_helper(monkeypatch):
    """Each test starts its own helper (and leaves none behind)."""
    fresh = digests.HashProcess()
    monkeypatch.setattr(digests, "HASHER", fresh)
    PINNED.release()
    yield fresh
    PINNED.release()
    gc.collect()
    fresh.close()


def state() -> dict:
    gen = torch.Generator().manual_seed(5)
    return {"w": torch.randn(300, 257, generator=gen), "b": torch.randn(1000, generator=gen).bfloat16(),
            "i": torch.arange(70000, dtype=torch.int32), "e": torch.empty(0)}


def host_save(options: GpuSaveOptions, codec: str = "auto") -> bytes:
    plan = plan_save(state(), chunk_size=32 * KiB)
    buf = io.BytesIO()
    write_items(buf, encode_batches(plan, chooser(codec, 1), HostBackend(), options), plan, alignment=4096,
                info=writer_info())
    return buf.getvalue()


def test_helper_digests_equal_xxh3_of_the_bytes(fresh_helper):
    b = SharedBuffer(1 << 20)
    data = os.urandom(1 << 20)
    b.memory[:] = data
    spans = [(0, 0), (0, 1), (7, 4093), (4096, 1 << 19), ((1 << 20) - 3, 3)] * 3
    rids = [fresh_helper.submit([(b.buffer_id, o, n, False) for o, n in spans]) for _ in range(20)]
    expected = [xxhash.xxh3_64_intdigest(data[o: o + n]) for o, n in spans]
    assert all(fresh_helper.result(r) == expected for r in rids)  # in order, many requests in flight


def test_a_zstd_chunk_that_fails_the_window_check_raises(fresh_helper):
    b = SharedBuffer(4096)
    rid = fresh_helper.submit([(b.buffer_id, 0, 100, True)])
    with pytest.raises(RuntimeError, match="SPEC 11.4"):
        fresh_helper.result(rid)
    assert fresh_helper.result(fresh_helper.submit([(b.buffer_id, 0, 10, False)])) == [xxhash.xxh3_64_intdigest(bytes(10))]


def test_engine_hashes_in_the_helper_and_writes_the_same_file(fresh_helper):
    threads = host_save(dataclasses.replace(OPTS, hash_process=False))
    before = fresh_helper._next_request
    helper = host_save(OPTS)
    assert fresh_helper._next_request > before + 3  # the groups went to the helper
    assert helper == threads


def test_slots_are_shared_with_the_helper(fresh_helper):
    host_save(OPTS)
    kept = [b for bufs in PINNED._free.values() for b in bufs]
    assert kept and all(shared_buffer_id(b) is not None for b in kept)


def test_helper_killed_mid_save_the_save_hashes_in_its_own_thread(fresh_helper):
    expected = host_save(dataclasses.replace(OPTS, hash_process=False))
    plan = plan_save(state(), chunk_size=32 * KiB)
    items = encode_batches(plan, chooser("auto", 1), HostBackend(), OPTS)
    buf = io.BytesIO()

    def killing():
        for n, item in enumerate(items):
            if n == 5:
                fresh_helper._proc.kill()
                fresh_helper._proc.wait()
            yield item

    write_items(buf, killing(), plan, alignment=4096, info=writer_info())
    assert buf.getvalue() == expected
    assert not fresh_helper.usable  # later saves hash in threads
    assert host_save(OPTS) == expected


def test_helper_ignores_sigterm_and_sigint(fresh_helper):
    b = SharedBuffer(4096)
    fresh_helper.result(fresh_helper.submit([]))  # started and serving
    time.sleep(0.3)  # its signal handlers are set before it reads the socket
    fresh_helper._proc.send_signal(signal.SIGTERM)
    fresh_helper._proc.send_signal(signal.SIGINT)
    assert fresh_helper.result(fresh_helper.submit([(b.buffer_id, 0, 4096, False)])) == [xxhash.xxh3_64_intdigest(bytes(4096))]
    assert fresh_helper._proc.poll() is None


def test_buffers_are_unmapped_in_the_helper_when_collected(fresh_helper):
    bufs = [SharedBuffer(64 * KiB) for _ in range(3)]
    fresh_helper.result(fresh_helper.submit([]))

    def mapped() -> int:
        fresh_helper.result(fresh_helper.submit([]))  # the helper has handled every message before this one
        with open(f"/proc/{fresh_helper._proc.pid}/maps") as f:
            return sum("nvckpt-chunks" in line for line in f)

    assert mapped() == 3
    del bufs
    gc.collect()
    assert mapped() == 0


def test_forked_child_does_not_use_its_parents_helper(fresh_helper, tmp_path):
    fresh_helper.result(fresh_helper.submit([]))
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child reports through its exit code)
        os._exit(0 if not digests.HASHER.usable and digests.HASHER._sock is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fresh_helper.result(fresh_helper.submit([])) == []  # the parent's helper is untouched


def test_helper_imports_no_torch_and_exits_with_its_parent(tmp_path):
    script = (
        "import sys, time\n"
        "from nvckpt.io import digests\n"
        "b = digests.SharedBuffer(4096)\n"
        "digests.HASHER.result(digests.HASHER.submit([]))\n"
        "print(digests.HASHER._proc.pid, flush=True)\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{pid}/stat") as f:  # a zombie until reaped by init counts as gone
            if f.read().split(") ")[1].startswith("Z"):
                break
        time.sleep(0.05)
    else:
        pytest.fail("the hashing helper outlived its parent")
    # and the helper itself does not import torch
    child = subprocess.run([sys.executable, "-c", "import sys, nvckpt.io.digests; print('torch' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "False", child.stderr


def test_no_memfd_means_no_helper(monkeypatch, fresh_helper):
    monkeypatch.setenv("NVCKPT_NO_HASH_PROCESS", "1")
    from nvckpt.engines.gpu.pinned import shared_host_buffer

    assert shared_host_buffer(4096, pin=False) is None
    assert host_save(OPTS) == host_save(dataclasses.replace(OPTS, hash_process=False))
    assert fresh_helper._proc is None  # never started
