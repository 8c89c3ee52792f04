"""What nvckpt keeps per process: the shared worker threads (CPU saves and loads, a checkpoint's reads) and
the buffer pools (the CPU engine's coded chunks, the file sink's write blocks). Work on them ends with the
save or file it belongs to, and a forked child gets threads and pools of its own."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

import nvckpt
from conftest import forked_exit_code


def test_a_closed_cpu_encoder_leaves_no_work_on_the_shared_threads(monkeypatch):
    # The CPU engine's threads are the process's (nvckpt._threads): a save that ends early (a full
    # disk, an error in the writer: its generator is closed) drops its queued chunks and waits for the
    # running ones, so that no task reads the tensors or the engine's buffers once the save has returned.
    import nvckpt.engines.cpu as cpu
    from nvckpt.codecs.presets import chooser
    from nvckpt.plan.walk import plan_save

    started, ended = [], []
    encode_group = cpu._encode_group

    def slow(items, buffers):
        started.append(1)
        time.sleep(0.05)
        try:
            return encode_group(items, buffers)
        finally:
            ended.append(1)

    monkeypatch.setattr(cpu, "_encode_group", slow)
    state = {f"w{i}": torch.randn(256, 1024, generator=torch.Generator().manual_seed(i)) for i in range(16)}
    items = cpu.encode_cpu(plan_save(state, chunk_size=1 << 20), chooser("portable"), workers=2)
    next(items)
    items.close()
    assert len(ended) == len(started) < 16  # the running ones were waited for, the queued ones dropped
    time.sleep(0.2)
    assert len(started) == len(ended)  # and none started later


def test_a_forked_child_loads_and_saves_on_threads_of_its_own(tmp_path):
    """The worker threads are the process's and a forked child (a DataLoader worker) has none of its
    parent's: its loads and saves start pools of their own instead of queueing work no thread runs."""
    state = {f"w{i}": torch.randn(256, 1024, generator=torch.Generator().manual_seed(i)) for i in range(4)}
    nvckpt.save(state, tmp_path / "a.nvckpt", workers=2)
    nvckpt.load(tmp_path / "a.nvckpt", workers=2)  # the parent's pool of 2 is started
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            got = nvckpt.load(tmp_path / "a.nvckpt", workers=2)
            nvckpt.save(got, tmp_path / "b.nvckpt", workers=2)
            # numpy, not torch.equal: torch's own OpenMP threads do not survive a fork (DataLoader workers
            # run with torch.set_num_threads(1) for that reason); nvckpt's must.
            code = 0 if all(np.array_equal(got[k].numpy(), v.numpy()) for k, v in state.items()) else 2
        finally:
            os._exit(code)
    assert forked_exit_code(pid, 60, "the forked child hung in load or save") == 0
    assert all(torch.equal(nvckpt.load(tmp_path / "b.nvckpt")[k], v) for k, v in state.items())


def test_closing_a_checkpoint_waits_for_its_reads_on_the_shared_threads(tmp_path, monkeypatch):
    """close() returns only once the file's own work on the shared threads has ended (its reads use the
    descriptor that close releases), not waiting for other files' work."""
    import nvckpt.read.reader as file_mod

    nvckpt.save({"a": torch.arange(1 << 20, dtype=torch.float32)}, tmp_path / "a.nvckpt", workers=2)
    ended = []
    ck = file_mod.ChunkReader(str(tmp_path / "a.nvckpt"), workers=2)

    def slow() -> None:
        time.sleep(0.3)
        ended.append(1)

    future = ck.submit(slow)
    ck.close()
    assert future.done() and ended == [1]
    with pytest.raises(nvckpt.NvckptError, match="closed"):
        ck.submit(slow)


def test_a_checkpoints_map_runs_on_the_caller_and_the_shared_threads(tmp_path):
    """ChunkReader.map: the caller and workers - 1 shared threads take the items in turn (not a task
    each), results in the items' order; the first error stops the others and is raised once they have."""
    from nvckpt.read.reader import ChunkReader

    nvckpt.save({"a": torch.arange(10.0)}, tmp_path / "a.nvckpt")
    ck = ChunkReader(str(tmp_path / "a.nvckpt"), workers=3)
    try:
        names = set()

        def double(x):
            names.add(threading.current_thread().name)
            time.sleep(0.005)
            return 2 * x

        assert ck.map(double, list(range(60))) == [2 * x for x in range(60)]
        assert threading.current_thread().name in names and len(names) == 3
        started = []

        def five(x):
            started.append(x)
            if x == 5:
                raise ValueError("five")
            time.sleep(0.01)
            return x

        with pytest.raises(ValueError, match="five"):
            ck.map(five, list(range(200)))
        n = len(started)
        time.sleep(0.1)
        assert len(started) == n < 20  # nobody took another item after the error
    finally:
        ck.close()


def test_the_cpu_engines_output_buffers_are_kept_for_the_next_save_within_their_bound(tmp_path, monkeypatch):
    # A portable save codes each chunk into a buffer of the engine's pool; the pool keeps them for the
    # next save (fresh memory costs a page fault per 4 KiB), at most its `keep` bytes, and a buffer taken
    # is never handed out twice while it is held.
    import nvckpt.engines.cpu as cpu

    pool = cpu._Buffers(keep=3 << 16)
    a, b = pool.take(1000), pool.take(1 << 16)
    assert a.nbytes == b.nbytes == 1 << 16 and a is not b
    pool.give(a)
    pool.give(b)
    assert pool.take(5) is b and pool.take(5) is a  # given back, then taken again (last in, first out)
    big = pool.take((1 << 16) + 1)
    assert big.nbytes == 1 << 17
    pool.give(a)
    pool.give(big)  # 64 + 128 KiB: within the 192 KiB kept
    pool.give(b)  # beyond it: dropped
    assert pool._kept == 3 << 16 and pool.take(5) is a and pool.take(5) is not b

    state = {f"w{i}": torch.randn(64, 4096, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
             for i in range(6)}
    # The process's pool as a first save finds it (what other tests' saves left in it would decide which
    # buffers these saves take and which they drop).
    monkeypatch.setattr(cpu, "_KEPT", cpu._Buffers(keep=64 << 20))
    nvckpt.save(state, tmp_path / "one.nvckpt", codec="portable", chunk_size=1 << 18)
    assert 0 < cpu._KEPT._kept <= 64 << 20
    # How many buffers a save holds at once depends on how its threads interleave (on a loaded machine two
    # saves of these 12 chunks held 7 and 8): topped up to 16, more than the save has chunks, the pool alone
    # decides what the second save takes.
    (size,) = cpu._KEPT._free
    while cpu._KEPT._kept < 16 * size:
        cpu._KEPT.give(np.empty(size, dtype=np.uint8))
    kept, held = cpu._KEPT._kept, {id(b) for b in cpu._KEPT._free[size]}
    nvckpt.save(state, tmp_path / "two.nvckpt", codec="portable", chunk_size=1 << 18)
    assert cpu._KEPT._kept == kept  # the second save ran on the first one's buffers and gave them back
    assert {id(b) for b in cpu._KEPT._free[size]} == held  # and allocated none
    assert (tmp_path / "one.nvckpt").read_bytes() == (tmp_path / "two.nvckpt").read_bytes()
    loaded = nvckpt.load(tmp_path / "two.nvckpt")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_child_forked_while_a_save_held_the_buffer_pools_saves(tmp_path):
    # The CPU engine's coded-chunk buffers and the file sink's write blocks are process-wide pools with a
    # lock each; a fork while another thread holds one (a save running beside a DataLoader's fork) must not
    # leave the child's copy locked forever: its first save would hang.
    import nvckpt.engines.cpu as cpu
    from nvckpt.io import sink

    state = {"w": torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)}
    with cpu._KEPT._lock, sink._POOL._lock:
        pid = os.fork()
        if pid == 0:  # the child: save, load back, exit without running the parent's test machinery
            try:
                torch.set_num_threads(1)  # as a DataLoader worker does (OpenMP's threads do not survive a fork)
                nvckpt.save(state, tmp_path / "child.nvckpt", codec="portable")
                ok = torch.equal(nvckpt.load(tmp_path / "child.nvckpt")["w"], state["w"])
                os._exit(0 if ok else 3)
            except BaseException:
                os._exit(4)
    assert forked_exit_code(pid, 30, "the forked child hung on a pool's lock") == 0


def test_a_worker_pool_is_an_executor_of_plain_futures():
    from concurrent.futures import Future, as_completed, wait

    from nvckpt._threads import WorkerPool

    gate = threading.Event()
    with WorkerPool(2, "pool-test") as pool:
        held = [pool.submit(gate.wait, 30) for _ in range(2)]
        queued = pool.submit(lambda a, b=0: a + b, 40, b=2)
        time.sleep(0.05)
        assert not queued.done()  # two threads at most, both busy
        gate.set()
        assert queued.result(10) == 42 and all(f.result(10) for f in held)
        failing = pool.submit(int, "x")
        assert isinstance(failing.exception(10), ValueError) and isinstance(failing, Future)
        assert len(wait([pool.submit(abs, -k) for k in range(20)], 10).done) == 20
        assert sorted(f.result() for f in as_completed([pool.submit(abs, -k) for k in range(5)])) == [0, 1, 2, 3, 4]
        assert list(pool.map(abs, [-1, -2, -3])) == [1, 2, 3]
        names = {t.name for t in threading.enumerate() if t.name.startswith("pool-test")}
        assert names == {"pool-test_0", "pool-test_1"}
    assert not any(t.name.startswith("pool-test") for t in threading.enumerate())  # shut down and joined
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(abs, 1)
    with pytest.raises(ValueError, match="at least 1 thread"):
        WorkerPool(0, "pool-test")


def test_a_worker_pools_shutdown_cancels_queued_work_when_asked():
    from nvckpt._threads import WorkerPool

    pool = WorkerPool(1, "pool-cancel")
    gate = threading.Event()
    running = pool.submit(gate.wait, 30)
    queued = [pool.submit(abs, -k) for k in range(3)]
    threading.Timer(0.1, gate.set).start()
    pool.shutdown(wait=True, cancel_futures=True)
    assert running.result() is True and all(f.cancelled() for f in queued)


def test_an_unreferenced_worker_pools_threads_end():
    import gc

    from nvckpt._threads import WorkerPool

    pool = WorkerPool(2, "pool-dropped")
    assert pool.submit(abs, -3).result(10) == 3
    threads = [t for t in threading.enumerate() if t.name.startswith("pool-dropped")]
    del pool
    gc.collect()
    for t in threads:
        t.join(10)
    assert threads and not any(t.is_alive() for t in threads)


def test_a_worker_pool_takes_work_at_exit_where_concurrent_futures_refuses_it():
    """Why nvckpt has its own pool: a pending async save is finished in an atexit handler, after the
    interpreter's thread shutdown, from which on concurrent.futures' pools take no new work."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import atexit
        from concurrent.futures import ThreadPoolExecutor
        from nvckpt._threads import WorkerPool
        executor, pool = ThreadPoolExecutor(2), WorkerPool(2, "pool-exit")
        assert executor.submit(abs, -1).result() == pool.submit(abs, -1).result() == 1
        def at_exit():
            try:
                executor.submit(abs, -2)
            except RuntimeError as exc:  # "... after shutdown" or "... after interpreter shutdown"
                print("concurrent.futures:", str(exc).startswith("cannot schedule new futures after"))
            print("WorkerPool:", pool.submit(abs, -2).result(10))
        atexit.register(at_exit)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["concurrent.futures: True", "WorkerPool: 2"], done.stdout
