"""A process forked while nvckpt works in another thread (a DataLoader worker forked during an async_save)
gets nothing it waits for forever: no lock another thread held at the fork, no module half imported, and
Python's garbage collector as it was before nvckpt paused it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import nvckpt
from conftest import forked_exit_code

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_child(work) -> int:
    """Fork; the child runs ``work()`` (exit 0 if it returns True) on its one thread, as a DataLoader worker does."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            torch.set_num_threads(1)  # as a DataLoader worker (OpenMP's threads do not survive a fork)
            code = 0 if work() else 2
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()  # on the child's stderr, which the test's output shows
            code = 3
        finally:
            os._exit(code)
    return pid


# -- a module half imported at the fork ----------------------------------------------------------
_HALF_IMPORTED = textwrap.dedent("""
    import importlib.abc, importlib.util, os, sys, threading, time
    import torch, nvckpt
    SLOW = sys.argv[1]
    importing = threading.Event()

    class Slow(importlib.abc.MetaPathFinder):
        # The first import of SLOW takes a second: the fork below comes in the middle of it.
        def find_spec(self, name, path, target=None):
            if name != SLOW:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module
            def slowly(module):
                importing.set()
                time.sleep(1.0)
                run(module)
            spec.loader.exec_module = slowly
            return spec

    sys.modules.pop(SLOW, None)
    if SLOW == "zstandard._cffi":
        from nvckpt.codecs import planes
        planes._native = None  # as in a process whose saves have not coded a byte plane yet
    sys.meta_path.insert(0, Slow())
    state = {"w": torch.randn(256, 1024).to(torch.bfloat16), "i": torch.arange(1000)}
    future = nvckpt.async_save(state, "parent.nvckpt", codec="portable")  # imports SLOW in its threads
    assert importing.wait(30), "the save did not import " + SLOW
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)
        nvckpt.save(state, "child.nvckpt", codec="portable")
        ok = torch.equal(nvckpt.load("child.nvckpt")["w"], state["w"])
        os._exit(0 if ok else 2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        status = None
    future.result()
    print("hung" if status is None else f"exit {os.waitstatus_to_exitcode(status)}")
""")


@pytest.mark.parametrize("module", ["zstandard._cffi", "nvckpt.engines.cpu"])
def test_a_child_forked_while_a_save_imports_saves(tmp_path, module):
    """The async_save's threads import the CPU engine and libzstd's CFFI backend on first use (the backend under
    the planes codec's lock): a fork in the middle of it left the child a module whose import never ends (and
    that lock held), and its first save hung.  A fork now waits for nvckpt's imports to end."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _HALF_IMPORTED, module], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.split() == ["exit", "0"], (out.stdout, out.stderr[-3000:])


def test_nvckpts_threads_import_nothing_outside_the_fork_guard(tmp_path):
    """What the test above checks for two modules, for every module: in a fresh process, saves, async saves
    (lazy too), loads and opens import nothing in a thread other than the main one except inside
    ``nvckpt._fork.importing()``, which a fork waits for."""
    script = textwrap.dedent("""
        import sys, threading
        import torch
        import nvckpt._fork as fork
        # The training state and torch's own lazy imports (an optimizer's first step) in the main thread:
        # torch's imports are torch's matter; nvckpt's first use is in another thread.
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        state = {"w": torch.randn(1 << 18), "b": torch.randn(1 << 16).bfloat16(), "m": model.state_dict(),
                 "o": opt.state_dict(), "n": 3}
        outside = []
        def audit(event, args):
            if event == "import" and threading.current_thread() is not threading.main_thread() \\
                    and not fork.importing_here():
                outside.append((threading.current_thread().name, args[0]))
        sys.addaudithook(audit)
        def run():
            import nvckpt
            for codec in ("portable", "zstd", "raw", "portable-1.0"):
                nvckpt.async_save(state, f"a-{codec}.nvckpt", codec=codec).result()
                f = nvckpt.async_save(state, f"l-{codec}.nvckpt", codec=codec, fence=opt)
                opt.step()
                f.result()
                nvckpt.save(state, f"s-{codec}.nvckpt", codec=codec)
                nvckpt.load(f"a-{codec}.nvckpt")
                with nvckpt.open(f"l-{codec}.nvckpt") as ck:
                    ck.get_tensor("w")
        t = threading.Thread(target=run, name="user")
        t.start()
        t.join()
        print(sorted(set(outside)))
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


# -- locks another thread held at the fork --------------------------------------------------------
def _held_by_a_thread(lock):
    """Hold ``lock`` in another thread until the returned event is set (as a save's thread holds it)."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(60)

    threading.Thread(target=hold, daemon=True).start()
    assert taken.wait(10)
    return release


def _layout_lock():
    from nvckpt.plan import layout

    return layout._lock


def _live_staging_lock():
    from nvckpt.io import publish

    return publish._LIVE_LOCK


def _stream_position_lock():
    from nvckpt.io import source

    return source._LEFT_LOCK


def _lazy_hooks_lock():
    from nvckpt.session import async_save

    return async_save._hooks_lock


def _gc_pause_lock():
    from nvckpt import _gc

    return _gc._lock


@pytest.mark.parametrize("lock", [_layout_lock, _live_staging_lock, _stream_position_lock, _lazy_hooks_lock,
                                  _gc_pause_lock])
def test_a_child_forked_while_a_thread_holds_a_process_wide_lock_saves_and_loads(tmp_path, lock):
    """Every process-wide lock of nvckpt is one a forked child gets unlocked: the planned layouts (a save's
    plan), the live staging directories (a DCP save), the streams' positions (a load from a stream), the lazy
    saves' step hooks, the garbage collector's pause.  Before, a child forked while a save's thread held one
    hung in its first save or load."""
    import io as _io

    from nvckpt.dcp.split import write_directory

    state = {"w": torch.randn(64, 64), "n": 1}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    release = _held_by_a_thread(lock())
    try:
        def work() -> bool:
            nvckpt.save(state, tmp_path / "child.nvckpt")
            stream = _io.BytesIO()
            nvckpt.save(state, stream)
            stream.seek(0)
            ok = torch.equal(nvckpt.load(stream)["w"], state["w"])
            nvckpt.async_save(state, tmp_path / "lazy.nvckpt", fence=optimizer).result()
            write_directory({"w": state["w"]}, tmp_path / "child-dir")
            return ok and torch.equal(nvckpt.load(tmp_path / "lazy.nvckpt")["w"], state["w"])

        pid = _in_child(work)
    finally:
        release.set()
    assert forked_exit_code(pid, 60, f"the forked child hung on {lock.__name__}") == 0


def test_a_child_reads_and_closes_a_checkpoint_its_parent_was_reading_at_the_fork(tmp_path):
    """A DataLoader's dataset holds an open checkpoint and its workers fork while the parent reads from it:
    the read in flight stayed counted in the child, whose close() then waited for it forever."""
    state = {"w": torch.randn(256, 256), "v": torch.randn(1000)}
    nvckpt.save(state, tmp_path / "data.nvckpt")
    ck = nvckpt.open(tmp_path / "data.nvckpt")
    source = ck.file.source
    inside, release = threading.Event(), threading.Event()
    check = source._check_range  # called inside a read, once it is counted in flight

    def slow_check(offset: int, length: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            inside.set()
            release.wait(60)
        check(offset, length)

    source._check_range = slow_check
    reader = threading.Thread(target=lambda: source.read(0, 16), daemon=True)
    reader.start()
    try:
        assert inside.wait(10)

        def work() -> bool:
            ok = torch.equal(ck.get_tensor("w"), state["w"])
            ck.close()
            return ok

        pid = _in_child(work)
    finally:
        release.set()
        reader.join(10)
    assert forked_exit_code(pid, 30, "the forked child hung closing its parent's open checkpoint") == 0
    ck.close()


# -- the garbage collector's pause -----------------------------------------------------------------
def test_a_child_forked_while_another_thread_is_inside_a_save_collects_garbage():
    """nvckpt pauses the collector for the length of a save or load (nvckpt._gc): a child forked meanwhile
    inherited the pause, and nothing in the child ever ended it."""
    from nvckpt import _gc

    inside, release = threading.Event(), threading.Event()

    def save_in_progress() -> None:
        with _gc.paused():
            inside.set()
            release.wait(60)

    assert gc.isenabled()
    thread = threading.Thread(target=save_in_progress, daemon=True)
    thread.start()
    try:
        assert inside.wait(10) and not gc.isenabled()
        pid = _in_child(lambda: gc.isenabled() and _paused_and_resumed(_gc))
    finally:
        release.set()
        thread.join(10)
    assert forked_exit_code(pid, 30, "the forked child hung in a gc pause") == 0
    assert gc.isenabled()


def _paused_and_resumed(_gc) -> bool:
    with _gc.paused():
        if gc.isenabled():
            return False
    return gc.isenabled()


def test_a_child_forked_inside_its_own_threads_pause_ends_it_when_the_block_ends():
    """The forking thread's own pause goes on in the child and ends with its block; a caller's gc.disable()
    before the pause is kept."""
    from nvckpt import _gc

    with _gc.paused():
        pid = os.fork()
        paused = not gc.isenabled()
    if pid == 0:
        os._exit(0 if paused and gc.isenabled() else 4)
    assert forked_exit_code(pid, 30, "the forked child hung") == 0
    gc.disable()
    try:
        with _gc.paused():
            pid = os.fork()
        if pid == 0:
            os._exit(0 if not gc.isenabled() else 5)
        assert forked_exit_code(pid, 30, "the forked child hung") == 0
    finally:
        gc.enable()
