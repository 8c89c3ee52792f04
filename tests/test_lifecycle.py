"""Saves at the end of a process and in a real job: exit, SIGTERM, cancellation, leftovers, permissions.

The process-level cases run a child Python (the behaviour is the interpreter's shutdown and its signals)."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nvckpt
from conftest import forked_exit_code

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(code: str, *, wait: bool = True, timeout: float = 120) -> subprocess.Popen | subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # As a program run from a terminal: a test run started in the background (`nohup ... &`) ignores SIGINT, and
    # a child would inherit that and let Ctrl-C pass unseen.
    code = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n" + textwrap.dedent(code)
    args = [sys.executable, "-c", code]
    if wait:
        return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# A save of several seconds: 64 MiB in 4 KiB chunks, zstd level 19, one encoder thread.
SLOW_SAVE = ("nvckpt.{fn}({{'w': torch.arange(1 << 24, dtype=torch.float32)}}, {path!r}, chunk_size=4096, codec='zstd', "
             "zstd_level=19, workers=1{extra})")


@pytest.mark.slow
def test_pending_async_save_completes_at_interpreter_exit(tmp_path):
    path = str(tmp_path / "a.nvckpt")
    done = child(f"""
        import torch, nvckpt
        {SLOW_SAVE.format(fn='async_save', path=path, extra='')}
        # the script ends here, without waiting for the future
    """)
    assert done.returncode == 0, done.stderr
    assert "finishing 1 async save(s) before exit" in done.stderr
    assert torch.equal(nvckpt.load(path)["w"], torch.arange(1 << 24, dtype=torch.float32))
    assert not glob.glob(str(tmp_path / ".*nvckpt-tmp"))


@pytest.mark.slow
def test_async_save_at_exit_after_an_exception_and_sys_exit(tmp_path):
    for ending in ("raise RuntimeError('training crashed')", "import sys; sys.exit(3)"):
        path = str(tmp_path / "b.nvckpt")
        done = child(f"""
            import torch, nvckpt
            {SLOW_SAVE.format(fn='async_save', path=path, extra='')}
            {ending}
        """)
        assert done.returncode in (1, 3), done.stderr
        assert nvckpt.load(path)["w"].numel() == 1 << 24
        os.unlink(path)


# The disk fills up in the save's thread, after the call has returned (one line: it goes into dedented code).
FULL_DISK = ("import nvckpt.io.sink as _sink; _sink.FileSink.__init__ = lambda self, *a, **k: "
             "(_ for _ in ()).throw(OSError(28, 'No space left on device'))")


@pytest.mark.slow
@pytest.mark.parametrize("after", ["", "time.sleep(1)  # it has failed by the exit: still not lost silently"])
def test_failed_async_save_at_exit_is_one_line_and_a_non_zero_exit(tmp_path, after):
    path = str(tmp_path / "c.nvckpt")
    done = child(f"""
        import time, torch, nvckpt
        {FULL_DISK}
        f = nvckpt.async_save({{'w': torch.ones(3)}}, {path!r})
        {after}
    """)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.startswith("nvckpt: error:")]
    assert len(lines) == 1 and path in lines[0] and "Traceback" not in done.stderr


def _wait_for_temporary(folder, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if glob.glob(os.path.join(folder, ".*nvckpt-tmp")):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("the save never started")


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["save", "async_save"])
def test_sigterm_lets_a_save_finish_within_its_grace_then_exits_143(tmp_path, fn):
    path = str(tmp_path / "d.nvckpt")
    proc = child(f"""
        import time, torch, nvckpt
        {SLOW_SAVE.format(fn=fn, path=path, extra=', preemption_grace=120')}
        print("returned", flush=True)
        time.sleep(60)  # training would go on here
    """, wait=False)
    _wait_for_temporary(str(tmp_path), proc)
    if fn == "async_save":
        assert proc.stdout.readline().strip() == "returned"  # the call is over; the save runs on
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, err  # the signal's own default action, after the save
    assert "SIGTERM: letting 1 save(s) finish" in err
    assert nvckpt.load(path)["w"].numel() == 1 << 24
    assert not glob.glob(str(tmp_path / ".*nvckpt-tmp"))


@pytest.mark.slow
def test_convert_that_finishes_its_file_after_sigterm_exits_0(tmp_path):
    """For `nvckpt convert` the file is the whole job: SIGTERM while it is written lets it finish, and then the
    command ends as it would have (exit 0, the report printed), not with 143 for a complete file."""
    src, dst = tmp_path / "s.nvckpt", tmp_path / "d.nvckpt"
    nvckpt.save({"w": torch.arange(1 << 22, dtype=torch.float32)}, src, codec="raw")
    # Each block written takes a second longer (the disk is slow): the signal surely comes mid-save.
    proc = child(f"""
        import sys, time
        import nvckpt.io.sink as sink
        write = sink.FileSink._write_all
        sink.FileSink._write_all = lambda self, *a: (time.sleep(1.0), write(self, *a))[1]
        from nvckpt.cli import main
        sys.exit(main(["convert", "--codec", "zstd", {str(src)!r}, {str(dst)!r}]))
    """, wait=False)
    _wait_for_temporary(str(tmp_path), proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "SIGTERM: letting 1 save(s) finish" in err and "written in full" in err and str(dst) in out
    assert torch.equal(nvckpt.load(dst)["w"], torch.arange(1 << 22, dtype=torch.float32))


@pytest.mark.slow
def test_convert_whose_sigterm_watchdog_wakes_after_the_save_still_exits_0(tmp_path):
    """On a busy machine the watchdog thread may wake only after the command has finished its file and left
    its job: the command then still completes (exit 0, said so), as decided when the signal came (seen in CI:
    killed with 143 after a complete file)."""
    src, dst = tmp_path / "s.nvckpt", tmp_path / "d.nvckpt"
    nvckpt.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, src, codec="raw")
    proc = child(f"""
        import sys, time
        import nvckpt.io.sink as sink
        import nvckpt.session.lifecycle as lifecycle
        write = sink.FileSink._write_all
        sink.FileSink._write_all = lambda self, *a: (time.sleep(1.0), write(self, *a))[1]
        watchdog = lifecycle._watchdog
        lifecycle._watchdog = lambda *a: (time.sleep(8.0), watchdog(*a))[1]
        from nvckpt.cli import main
        sys.exit(main(["convert", "--codec", "zstd", {str(src)!r}, {str(dst)!r}]))
    """, wait=False)
    _wait_for_temporary(str(tmp_path), proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "written in full" in err and str(dst) in out
    assert torch.equal(nvckpt.load(dst)["w"], torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.slow
def test_sigterm_past_the_grace_cancels_the_save_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "e.nvckpt"
    nvckpt.save({"old": torch.arange(5)}, path)
    old = path.read_bytes()
    proc = child(f"""
        import time, torch, nvckpt
        {SLOW_SAVE.format(fn='save', path=str(path), extra=', preemption_grace=0')}
    """, wait=False)
    _wait_for_temporary(str(tmp_path), proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, err
    assert "cancelling the save" in err
    assert path.read_bytes() == old
    assert not glob.glob(str(tmp_path / ".*nvckpt-tmp"))


@pytest.mark.slow
def test_sigterm_past_the_grace_runs_no_user_code_before_the_exit(tmp_path):
    """The cancelled async_save does not wake a result() waiting in the main thread: its CancelledError would
    run the script's own except clause (or print a half traceback) before the default action ends it."""
    path = tmp_path / "g.nvckpt"
    proc = child(f"""
        import time, torch, nvckpt
        f = {SLOW_SAVE.format(fn='async_save', path=str(path), extra=', preemption_grace=0.2')}
        try:
            f.result()
        except BaseException as exc:
            print("HANDLER", type(exc).__name__, flush=True)
        time.sleep(30)
    """, wait=False)
    _wait_for_temporary(str(tmp_path), proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, err
    assert "HANDLER" not in out and "Traceback" not in err and "cancelling the save" in err
    assert not glob.glob(str(tmp_path / ".*nvckpt-tmp"))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads each thread's signal mask from /proc")
def test_nvckpt_threads_leave_sigterm_and_sigint_to_the_main_thread(tmp_path):
    """The kernel gives a process's SIGTERM to any thread that does not block it; Python runs the handler in
    the main thread only, and a main thread asleep in C (time.sleep) is not woken when another thread took
    the signal: the grace then began a minute late, after the save had ended (a flaky test here)."""
    path = str(tmp_path / "m.nvckpt")
    done = child(f"""
        import threading, time, torch, nvckpt
        f = {SLOW_SAVE.format(fn='async_save', path=path, extra='')}
        time.sleep(1)  # the file is being written: its I/O and coding threads run
        def blocked(t):
            with open(f"/proc/self/task/{{t.native_id}}/status") as s:
                mask = int(next(line for line in s if line.startswith("SigBlk:")).split()[1], 16)
            return [bool(mask >> (n - 1) & 1) for n in (15, 2)]
        for t in threading.enumerate():
            print(t.name, *blocked(t))
        f.result()
    """)
    assert done.returncode == 0, done.stderr
    masks = dict((name, (term == "True", intr == "True")) for name, term, intr in
                 (line.rsplit(" ", 2) for line in done.stdout.splitlines()))
    assert masks.pop("MainThread") == (False, False)
    assert "nvckpt-async-save" in masks and any(n.startswith("nvckpt-io") for n in masks), masks
    assert all(masks[n] == (True, True) for n in masks if n.startswith("nvckpt")), masks


@pytest.mark.slow
def test_sigterm_without_a_save_is_the_default_action(tmp_path):
    proc = child("""
        import time, torch, nvckpt
        nvckpt.save({'w': torch.ones(2)}, %r)  # installs the handler
        print('ready', flush=True)
        time.sleep(60)
    """ % str(tmp_path / "f.nvckpt"), wait=False)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM


@pytest.mark.slow
def test_a_crashed_saves_temporary_file_is_reported_on_the_next_save(tmp_path):
    path = tmp_path / "g.nvckpt"
    proc = child(f"""
        import torch, nvckpt
        {SLOW_SAVE.format(fn='save', path=str(path), extra='')}
    """, wait=False)
    _wait_for_temporary(str(tmp_path), proc)
    proc.kill()  # SIGKILL: nothing can clean up
    proc.communicate(timeout=30)
    [left] = glob.glob(str(tmp_path / ".*nvckpt-tmp"))
    with pytest.warns(nvckpt.LeftoverTemporaryWarning, match="nvckpt recover") as caught:
        nvckpt.save({"w": torch.ones(2)}, path)
    assert os.path.basename(left) in str(caught[0].message)
    assert os.path.exists(left)  # reported, never deleted: recover may still want it


def test_a_save_in_progress_is_not_a_leftover(tmp_path):
    from nvckpt.io.atomic import AtomicReplace, leftover_temporaries

    target = str(tmp_path / "h.nvckpt")
    out = AtomicReplace(target)
    try:
        assert leftover_temporaries(target) == []
    finally:
        out.abort()


def test_cancelled_async_save_reports_cancelled(tmp_path):
    path = tmp_path / "i.nvckpt"
    future = nvckpt.async_save({"w": torch.arange(1 << 22, dtype=torch.float32)}, path, chunk_size=4096, codec="zstd")
    assert future.cancel()
    with pytest.raises(Exception) as info:
        future.result(timeout=60)
    assert type(info.value).__name__ == "CancelledError"
    assert "was cancelled" in str(info.value) and "not changed" in str(info.value)  # not an empty message
    assert future.cancelled() and not path.exists()
    assert not glob.glob(str(tmp_path / ".*nvckpt-tmp"))  # result() raised once the thread had cleaned up
    assert future.cancel()  # already cancelled: True, as for any concurrent.futures.Future


def test_a_true_cancel_makes_the_future_cancelled_at_once(tmp_path):
    # concurrent.futures' contract: after cancel() returns True, cancelled() and done() are True.
    future = nvckpt.async_save({"w": torch.arange(1 << 22, dtype=torch.float32)}, tmp_path / "c.nvckpt",
                               chunk_size=4096, codec="zstd", zstd_level=19, workers=1)
    assert future.cancel()
    assert future.cancelled() and future.done() and not future.running()
    called = []
    future.add_done_callback(called.append)
    assert called == [future]
    with pytest.raises(Exception) as info:
        future.exception(timeout=60)
    assert type(info.value).__name__ == "CancelledError" and "was cancelled" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == []


def test_cancel_of_a_stream_save_is_false_once_every_chunk_is_written():
    # A stream keeps what was written: cancel() stops the save before its index, or it is too late (False).
    import io
    import threading

    at_footer, go_on = threading.Event(), threading.Event()

    class Stream(io.BytesIO):
        def write(self, data):
            if bytes(data).endswith(b"NVCKEND\n"):
                at_footer.set()
                go_on.wait(10)
            return super().write(data)

    out = Stream()
    future = nvckpt.async_save({"w": torch.randn(1000)}, out)
    assert at_footer.wait(10)
    assert not future.cancel()
    go_on.set()
    result = future.result(timeout=10)
    assert not future.cancelled() and result.file_bytes == len(out.getvalue())
    out.seek(0)
    assert nvckpt.load(out)["w"].shape == (1000,)


def test_an_async_saves_relative_path_is_the_callers_folder(tmp_path, monkeypatch):
    # The path is resolved at the call: a chdir while the save runs must not move the file.
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    future = nvckpt.async_save({"w": torch.arange(1 << 20, dtype=torch.float32)}, "ckpt.nvckpt", chunk_size=4096,
                               codec="zstd", workers=1)
    os.chdir(tmp_path / "elsewhere")
    result = future.result(timeout=60)
    assert result.path == str(tmp_path / "run" / "ckpt.nvckpt")
    assert os.listdir(tmp_path / "run") == ["ckpt.nvckpt"] and os.listdir(tmp_path / "elsewhere") == []


def test_a_lazy_save_copies_sets_at_the_call(tmp_path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tags = {1, 2}
    future = nvckpt.async_save({"model": model.state_dict(), "tags": tags}, tmp_path / "s.nvckpt", fence=opt)
    tags.add(3)
    future.result(timeout=60)
    assert nvckpt.load(tmp_path / "s.nvckpt")["tags"] == {1, 2}


@pytest.mark.parametrize("fn", [nvckpt.save, nvckpt.async_save])
def test_a_bytes_path_or_another_object_is_refused_with_a_clear_error(tmp_path, fn):
    with pytest.raises(TypeError, match="os.fsdecode"):
        fn({"w": torch.ones(1)}, os.fsencode(str(tmp_path / "b.nvckpt")))
    with pytest.raises(TypeError, match="not int"):
        fn({"w": torch.ones(1)}, 123)
    assert os.listdir(tmp_path) == []


def test_the_leftover_warning_names_the_callers_line(tmp_path):
    import warnings

    (tmp_path / ".x.nvckpt.0123abcd.nvckpt-tmp").write_bytes(b"junk")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nvckpt.save({"w": torch.ones(2)}, tmp_path / "x.nvckpt")
    (w,) = [w for w in caught if issubclass(w.category, nvckpt.LeftoverTemporaryWarning)]
    assert w.filename == __file__


@pytest.mark.slow
def test_a_failed_async_save_at_exit_still_runs_atexit_handlers_and_flushes_files(tmp_path):
    log = tmp_path / "train.log"
    done = child(f"""
        import atexit, torch, nvckpt
        log = open({str(log)!r}, "w")  # buffered, never closed: the interpreter flushes it at its end
        log.write("epoch 10 done\\n")
        atexit.register(lambda: print("handler ran", flush=True))
        {FULL_DISK}
        nvckpt.async_save({{"w": torch.ones(2)}}, {str(tmp_path / "c.nvckpt")!r})
    """)
    assert done.returncode == 1 and "handler ran" in done.stdout
    assert done.stderr.strip().splitlines()[-1].startswith("nvckpt: error: the async save to")
    assert log.read_text() == "epoch 10 done\n"


def test_ctrl_c_while_the_exit_waits_for_an_async_save_is_an_interrupted_exit(tmp_path):
    """Ctrl-C while the interpreter waits at its exit for a pending async_save: the save is cancelled (the old
    file stays, no temporary file), the message says so, the program's atexit handlers run, and the process
    ends as an interrupted one does (killed by SIGINT: 130 in a shell).  Before: SIGABRT ("terminate called
    without an active exception") after Python's "Exception ignored" traceback, or exit status 0."""
    path = tmp_path / "h.nvckpt"
    nvckpt.save({"old": torch.arange(5)}, path)
    old = path.read_bytes()
    proc = child(f"""
        import atexit, torch, nvckpt
        atexit.register(lambda: print("handler ran", flush=True))
        {SLOW_SAVE.format(fn='async_save', path=str(path), extra='')}
        print("returned", flush=True)
    """, wait=False)
    assert proc.stdout.readline().strip() == "returned"
    assert "finishing 1 async save(s) before exit" in proc.stderr.readline()  # the interpreter waits now
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, err)
    assert f"interrupted: the async save to {path} was cancelled (the file there is unchanged)" in err
    assert "Traceback" not in err and "Exception ignored" not in err and "terminate called" not in err, err
    assert "handler ran" in out
    assert path.read_bytes() == old
    assert not glob.glob(str(tmp_path / ".*nvckpt-tmp"))


@pytest.mark.slow
def test_the_programs_atexit_handlers_run_after_the_pending_async_save_is_done(tmp_path):
    """A handler registered after the async_save call (one that uploads the checkpoint, say) still runs once the
    file is complete, as do handlers registered before it."""
    path = str(tmp_path / "u.nvckpt")
    done = child(f"""
        import atexit, torch, nvckpt
        def upload(when):
            print(when, nvckpt.load({path!r})["w"].numel(), flush=True)
        atexit.register(upload, "before")
        {SLOW_SAVE.format(fn='async_save', path=path, extra='')}
        atexit.register(upload, "after")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["after", str(1 << 24), "before", str(1 << 24)], done.stdout


@pytest.mark.slow
def test_a_failed_async_save_at_exit_runs_each_atexit_handler_once(tmp_path):
    done = child(f"""
        import atexit, torch, nvckpt
        atexit.register(print, "registered before", flush=True)
        {FULL_DISK}
        nvckpt.async_save({{"w": torch.ones(2)}}, {str(tmp_path / "c.nvckpt")!r})
        atexit.register(print, "registered after", flush=True)
    """)
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == ["registered after", "registered before"], done.stdout


@pytest.mark.slow
def test_an_async_save_started_after_the_main_thread_ended_is_finished_at_exit(tmp_path):
    """The training loop in a thread of its own, the main thread's script over: the interpreter's thread
    shutdown has begun (concurrent.futures' pools take no new work) when the save starts, and it completes."""
    path = str(tmp_path / "t.nvckpt")
    done = child(f"""
        import threading, time, torch, nvckpt
        def train():
            time.sleep(1)  # the main thread has ended by now; the interpreter waits for this thread
            {SLOW_SAVE.format(fn='async_save', path=path, extra='')}
        threading.Thread(target=train).start()
    """)
    assert done.returncode == 0, done.stderr
    assert "finishing 1 async save(s) before exit" in done.stderr
    assert torch.equal(nvckpt.load(path)["w"], torch.arange(1 << 24, dtype=torch.float32))
    assert not glob.glob(str(tmp_path / ".*nvckpt-tmp"))


def test_async_save_copies_its_metadata_and_tree_at_the_call(tmp_path):
    meta = {"run": "a", "nested": {"lr": [1e-3]}}
    tree = {"w": torch.ones(3), "cfg": {"layers": [1, 2]}}
    future = nvckpt.async_save(tree, tmp_path / "j.nvckpt", metadata=meta)
    meta["run"] = "changed"
    meta["nested"]["lr"].append(9)
    tree["cfg"]["layers"].append(3)
    tree["extra"] = 1
    future.result(timeout=60)
    with nvckpt.open(tmp_path / "j.nvckpt") as ck:
        assert ck.metadata() == {"run": "a", "nested": {"lr": [1e-3]}}
        assert ck.load()["cfg"] == {"layers": [1, 2]} and "extra" not in ck.load()


@pytest.mark.parametrize("mode", [0o640, 0o6750])
def test_a_replaced_file_keeps_its_mode(tmp_path, mode):
    """As torch.save (which writes in place), setuid and setgid too: the bits chown clears are set after it."""
    path = tmp_path / "k.nvckpt"
    nvckpt.save({"w": torch.ones(2)}, path)
    os.chmod(path, mode)
    nvckpt.save({"w": torch.zeros(2)}, path)
    assert os.stat(path).st_mode & 0o7777 == mode


def test_a_write_protected_file_is_not_replaced(tmp_path, monkeypatch):
    """torch.save cannot open a 0444 file that is not root's to override, and nvckpt does not rename over it
    either: PermissionError at the call (also for async_save), the file unchanged."""
    path = tmp_path / "ro.nvckpt"
    nvckpt.save({"w": torch.ones(2)}, path)
    os.chmod(path, 0o444)
    if os.geteuid() == 0:  # root may write anything, as torch.save may: stand in for another user
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p) == str(path) and mode == os.W_OK
                            else real(p, mode, **kw))
    before = path.read_bytes()
    for save in (nvckpt.save, nvckpt.async_save):
        with pytest.raises(PermissionError, match="write-protected"):
            save({"w": torch.zeros(2)}, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ro.nvckpt"]
    with pytest.raises(FileNotFoundError):  # async_save: a missing folder at the call too, as save
        nvckpt.async_save({"w": torch.zeros(2)}, tmp_path / "missing" / "x.nvckpt")


def test_a_new_file_honours_the_umask_as_torch_save_does(tmp_path):
    old = os.umask(0o002)
    try:
        nvckpt.save({"w": torch.ones(2)}, tmp_path / "l.nvckpt")
        torch.save({"w": torch.ones(2)}, tmp_path / "l.pt")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "l.nvckpt").st_mode & 0o777 == os.stat(tmp_path / "l.pt").st_mode & 0o777 == 0o664


def test_a_symlinked_target_is_written_through(tmp_path):
    real = tmp_path / "store" / "real.nvckpt"
    real.parent.mkdir()
    nvckpt.save({"w": torch.ones(2)}, real)
    link = tmp_path / "latest.nvckpt"
    link.symlink_to(real)
    nvckpt.save({"w": torch.full((2,), 7.0)}, link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert torch.equal(nvckpt.load(real)["w"], torch.full((2,), 7.0))
    assert sorted(os.listdir(tmp_path)) == ["latest.nvckpt", "store"]


def test_lazy_async_save_on_cpu_holds_the_values_at_the_call_and_the_step_waits(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": [1]}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    future = nvckpt.async_save(state, tmp_path / "lazy.nvckpt", fence=opt, metadata={"m": [1]})
    assert future.blocked_seconds < 0.5
    state["epoch"].append(2)  # the containers were copied at the call
    model(torch.randn(8, 64)).sum().backward()
    opt.step()  # the pre-hook waits until the save has read the tensors
    future.result(timeout=60)
    assert len(opt._optimizer_step_pre_hooks) == 1  # spent, removed by the next lazy save
    waited = future.fence_wait_seconds
    opt.step()  # a later step does not wait again
    assert future.fence_wait_seconds == waited
    nvckpt.async_save({"w": torch.ones(2)}, tmp_path / "next.nvckpt", fence=opt).result(timeout=60)
    assert len(opt._optimizer_step_pre_hooks) == 1  # the first one is gone, the new one waits for its step
    loaded = nvckpt.load(tmp_path / "lazy.nvckpt")
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected.items())
    assert loaded["epoch"] == [1] and int(loaded["optimizer"]["state"][0]["step"]) == 1


def test_lazy_save_copies_at_the_call_what_the_forward_changes(tmp_path, monkeypatch):
    """BatchNorm's running statistics change in the next forward, which the step pre-hook does not hold
    back: a lazy save copies the tensors its optimizer does not own (small ones) at the call, views of one
    storage sharing their copy; the optimizer's own are read lazily (not copied)."""
    import nvckpt.session.async_save as save_mod
    from nvckpt.session import fence

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(16, 8)).sum().backward()
    opt.step()
    flat = torch.arange(12.0)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "a": flat[:6], "b": flat[4:]}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    session = save_mod.SaveSession
    slow = lambda *a, **k: (time.sleep(0.3), session(*a, **k))[1]  # the save's thread reads late
    monkeypatch.setattr(save_mod, "SaveSession", slow)
    future = nvckpt.async_save(state, tmp_path / "bn.nvckpt", fence=opt)
    model(torch.randn(16, 8)).sum().backward()  # updates running_mean / running_var / num_batches_tracked
    flat.mul_(-1)
    opt.step()
    assert future.fence_wait_seconds > 0.1  # the step waited for the late read, and the future says so
    future.result(timeout=60)
    loaded = nvckpt.load(tmp_path / "bn.nvckpt")
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected.items())
    assert loaded["a"].tolist() == list(range(6)) and loaded["b"].tolist() == list(range(4, 12))
    assert loaded["a"].untyped_storage().data_ptr() == loaded["b"].untyped_storage().data_ptr()
    owned = fence.owned_storages([opt])
    assert model[0].weight.untyped_storage().data_ptr() in owned


def test_a_forked_child_does_not_wait_for_its_parents_lazy_save(tmp_path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    future = nvckpt.async_save({"m": model.state_dict(), "w": torch.zeros(1 << 20)}, tmp_path / "f.nvckpt", fence=opt)
    pid = os.fork()
    if pid == 0:  # the child: its step must not wait for a read no thread of its own will finish
        code = 1
        try:
            # Gradients set by hand: torch refuses backward() in a forked child once the parent's autograd
            # has started its device threads (a GPU machine where an earlier test ran backward on CUDA).
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
            code = 0
        finally:
            os._exit(code)
    assert forked_exit_code(pid, 30, "the forked child hung in optimizer.step()") == 0
    future.result(timeout=60)


def test_a_fence_must_be_an_optimizer(tmp_path):
    with pytest.raises(TypeError, match="fence must be a torch.optim.Optimizer"):
        nvckpt.async_save({"w": torch.ones(2)}, tmp_path / "x.nvckpt", fence=object())
    with pytest.raises(TypeError, match="empty list"):
        nvckpt.async_save({"w": torch.ones(2)}, tmp_path / "x.nvckpt", fence=[])


@pytest.mark.slow
def test_saves_to_one_path_publish_in_the_order_they_were_called(tmp_path):
    """A periodic async_save still writing, then a final save: the file ends with the final state (the
    older save waits for nothing; the later one waits before its rename for the earlier one to end)."""
    path = tmp_path / "o.nvckpt"
    slow = nvckpt.async_save({"step": 1, "w": torch.arange(1 << 22, dtype=torch.float32)}, path, chunk_size=4096,
                             codec="zstd", zstd_level=10, workers=1)
    nvckpt.save({"step": 2}, path)
    assert slow.done() and nvckpt.load(path)["step"] == 2
    futures = [nvckpt.async_save({"step": i, "w": torch.full((300, 300), float(i))}, path) for i in range(5)]
    for f in futures:
        f.result(timeout=60)
    assert nvckpt.load(path)["step"] == 4


def test_a_cancelled_or_failed_earlier_save_does_not_hold_up_later_ones(tmp_path):
    path = tmp_path / "c.nvckpt"
    first = nvckpt.async_save({"w": torch.arange(1 << 22, dtype=torch.float32)}, path, chunk_size=4096, codec="zstd",
                              zstd_level=10, workers=1)
    assert first.cancel()
    with pytest.raises(nvckpt.UnsupportedObjectError):
        nvckpt.save({"bad": object()}, path)
    nvckpt.save({"step": 3}, path)
    assert first.cancelled() and nvckpt.load(path) == {"step": 3}


def test_a_save_that_just_created_its_temporary_file_is_not_a_leftover(tmp_path):
    """The temporary file exists a moment before its writer locks it: an empty, new, unlocked one is asked
    about again before it is reported; one still unlocked then (a crash right after creating it) is."""
    import fcntl
    import threading

    from nvckpt.io import atomic

    target = str(tmp_path / "s.nvckpt")
    starting = atomic.temporary_name(os.path.realpath(target))
    open(starting, "wb").close()
    fd = os.open(starting, os.O_RDONLY)
    timer = threading.Timer(0.06, lambda: fcntl.flock(fd, fcntl.LOCK_EX))  # its writer locks it late
    timer.start()
    try:
        assert atomic.leftover_temporaries(target) == []
    finally:
        timer.join()
        os.close(fd)
    assert atomic.leftover_temporaries(target) == [starting]  # nobody locks it: a leftover after all
    # The writer's lock waits out another save's momentary shared lock instead of going without.
    probe = os.open(starting, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH)
    threading.Timer(0.05, os.close, (probe,)).start()
    held = atomic._lock(starting)
    try:
        assert atomic.leftover_temporaries(target) == []
    finally:
        os.close(held)


def test_this_processs_save_is_never_its_own_leftover_even_before_it_locks(tmp_path):
    """A save's temporary file is created, and may be written, a moment before its lock is taken; a save to
    the same path in this process that looks then does not report it (CI once saw an async save's file
    reported by the save called after it). Once renamed or removed it is forgotten: a file left behind
    by a save whose removal failed is a leftover like any other."""
    from nvckpt.io import atomic

    target = str(tmp_path / "w.nvckpt")
    seen = []

    def create(tmp: str) -> None:
        with open(tmp, "xb") as f:
            f.write(b"\0" * 4096)  # written, not yet locked, too old to be "starting"
        os.utime(tmp, (0, 0))
        seen.append(atomic.leftover_temporaries(target))

    out = atomic.AtomicReplace(target, create)
    assert seen == [[]] and out.tmp in atomic.WRITING
    out.commit()
    assert out.tmp not in atomic.WRITING and os.path.getsize(target) == 4096
    failed = atomic.AtomicReplace(target, create)
    os.link(failed.tmp, failed.tmp + ".kept")  # what a removal that failed would leave
    failed.abort()
    os.rename(failed.tmp + ".kept", failed.tmp)
    assert atomic.leftover_temporaries(target) == [failed.tmp]


def test_a_fifo_target_is_written_through_not_replaced(tmp_path):
    """As torch.save: a FIFO (or a device such as /dev/null) at the target is written into; a rename would
    replace the node itself (as root, /dev/null with a regular file)."""
    import threading

    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    got = []
    def read() -> None:
        with open(fifo, "rb") as f:
            got.append(f.read())

    reader = threading.Thread(target=read)
    reader.start()
    nvckpt.save({"w": torch.arange(10.0)}, fifo)
    reader.join(timeout=60)
    import io
    import stat

    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert nvckpt.load(io.BytesIO(got[0]))["w"].tolist() == list(range(10))
    from nvckpt.io.atomic import AtomicReplace

    with pytest.raises(OSError, match="not a regular file"):
        AtomicReplace(fifo)  # convert, recover: never replace it either


def test_cancel_is_true_only_while_it_can_still_stop_the_save(tmp_path, monkeypatch):
    """cancel() before the final rename stops the save (the old file stays); at the rename it is too late:
    it returns False and the save completes (before, it returned True and the file was replaced anyway)."""
    import threading

    from nvckpt.io import atomic

    path = tmp_path / "k.nvckpt"
    nvckpt.save({"old": 1}, path)
    at_rename, go_on = threading.Event(), threading.Event()
    real = atomic.os.replace

    def slow_replace(src, dst):
        at_rename.set()
        go_on.wait(30)
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", slow_replace)
    late = nvckpt.async_save({"new": 2}, path)
    assert at_rename.wait(30)
    assert not late.cancel()  # at the rename
    go_on.set()
    assert late.result(timeout=30).path and not late.cancelled() and nvckpt.load(path) == {"new": 2}
    # (a cancel in time, before the rename: test_cancelled_async_save_reports_cancelled)


@pytest.mark.slow
def test_a_failed_async_save_whose_error_was_seen_is_not_reported_at_exit(tmp_path):
    path = str(tmp_path / "c.nvckpt")
    done = child(f"""
        import torch, nvckpt
        {FULL_DISK}
        f = nvckpt.async_save({{'w': torch.ones(3)}}, {path!r})
        try:
            f.result()
        except OSError:
            print("seen", flush=True)
        del f  # looked at, then dropped
    """)
    assert done.returncode == 0 and done.stdout.strip() == "seen" and "nvckpt: error" not in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_does_not_inherit_the_parents_saves(tmp_path):
    """A DataLoader worker forked while an async_save runs has none of its parent's save threads: it must
    neither wait for the parent's save at its exit nor for its turn at the same path, and an open
    checkpoint's reads work in it (its decode threads stayed in the parent)."""
    path, other = str(tmp_path / "a.nvckpt"), str(tmp_path / "b.nvckpt")
    done = child(f"""
        import multiprocessing as mp, sys, time, torch, nvckpt
        nvckpt.save({{"v": torch.arange(1 << 18, dtype=torch.float32)}}, {other!r}, chunk_size=16 << 10)
        f = nvckpt.open({other!r})
        f.get_tensor("v")  # the parent's decode threads exist now
        future = {SLOW_SAVE.format(fn='async_save', path=path, extra='')}

        def idle():
            pass

        def same_path():
            nvckpt.save({{"child": 1}}, {path!r})

        def read():
            torch.set_num_threads(1)  # as a DataLoader worker does (OpenMP's threads do not survive a fork)
            assert torch.equal(f.get_tensor("v"), torch.arange(1 << 18, dtype=torch.float32))

        ctx = mp.get_context("fork")
        for target in (idle, same_path, read):
            p = ctx.Process(target=target)
            t = time.monotonic()
            p.start()
            p.join(30)
            if p.is_alive():
                p.kill()
                sys.exit(f"{{target.__name__}}: the child hung")
            assert p.exitcode == 0, (target.__name__, p.exitcode)
            assert not future.done(), "the parent's save ended before the children were tested"
        future.result()
    """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "finishing" not in done.stderr.split("finishing 1 async save(s) before exit")[0]  # only the parent's
    assert torch.equal(nvckpt.load(path)["w"], torch.arange(1 << 24, dtype=torch.float32))


def test_a_cancel_wakes_whoever_waits_on_the_future(tmp_path):
    # concurrent.futures.wait / as_completed waiting in another thread must see the cancel at once.
    import concurrent.futures as cf
    import threading

    future = nvckpt.async_save({"w": torch.arange(1 << 22, dtype=torch.float32)}, tmp_path / "w.nvckpt",
                               chunk_size=4096, codec="zstd", zstd_level=19, workers=1)
    woke: list[float] = []

    def waiter():
        t0 = time.monotonic()
        done, _ = cf.wait([future], timeout=30)
        woke.append(time.monotonic() - t0 if future in done else float("inf"))

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.2)  # the waiter is waiting
    assert future.cancel()
    thread.join(30)
    assert woke and woke[0] < 5
    assert list(cf.as_completed([future], timeout=5)) == [future]


@pytest.mark.slow
@pytest.mark.parametrize("lazy", [False, True], ids=["plain", "lazy"])
def test_a_failed_async_save_does_not_keep_its_snapshot_alive(tmp_path, monkeypatch, lazy):
    """A failed save's future holds its exception, and a traceback would keep the frames of the save's thread
    (their locals and their functions' closures: the session and its snapshot of the state): keeping the
    future (a list of pending saves) must not keep a copy of the state in memory.  The stack stays as text."""
    import gc

    from nvckpt.io.target import AtomicFile
    from nvckpt.session.save import SaveSession

    class FullDisk(AtomicFile):  # a disk that is full at the save's first write
        def open_sink(self, options):
            sink = super().open_sink(options)

            def no_space(*_):
                raise OSError(28, "No space left on device")

            sink.write = sink.write_many = no_space
            return sink

    def sessions():  # (isinstance asks each object its __class__)
        gc.collect()
        return {id(o) for o in gc.get_objects() if type(o) is SaveSession}

    before = sessions()  # sessions other tests' objects still hold are not this save's
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model.state_dict(), "w": torch.zeros(1 << 16)}
    future = nvckpt.async_save(state, FullDisk(str(tmp_path / "f.nvckpt")), **({"fence": opt} if lazy else {}))
    exc = future.exception(timeout=60)
    assert isinstance(exc, OSError)
    if sys.version_info >= (3, 11):  # the thread's stack, as text
        assert "in no_space" in "".join(exc.__notes__) and "async save thread" in "".join(exc.__notes__)
    future._ended.wait(10)
    assert not sessions() - before, "the failed save's session (and its snapshot) is still referenced"
    assert not list(tmp_path.iterdir()), "the failed save left its temporary file"
    assert "No space left" in str(future.exception())


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64]),
       n=st.integers(0, 64), start=st.integers(0, 90), step=st.integers(1, 3), as_bytes=st.booleans())
def test_the_lazy_calls_storage_pointer_is_the_storages(dtype, n, start, step, as_bytes):
    """A lazy call tells owned tensors from others by their storage's address, computed from the tensor's
    own (data_ptr minus its offset) rather than by making each storage object: the same number, for views at
    any offset and stride, of any dtype, empty ones included (whose data_ptr() is 0 at any offset)."""
    from nvckpt.session import fence

    base = torch.zeros(n + 16, dtype=dtype)
    t = base[start::step]
    if as_bytes and dtype != torch.bool:
        t = base.view(torch.uint8)[start::step]
    assert fence.storage_ptr(t) == t.untyped_storage().data_ptr()


@settings(max_examples=40, deadline=None)
@given(dtypes=st.lists(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8,
                                        torch.bool, torch.complex64]), min_size=1, max_size=6),
       sizes=st.lists(st.integers(0, 300), min_size=6, max_size=6),
       views=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40), st.integers(1, 3)), max_size=8),
       large=st.booleans())
def test_a_lazy_calls_small_copies_hold_the_values_at_the_call(dtypes, sizes, views, large):
    """The small tensors no fence owns are gathered into one buffer at the call and made into a storage each
    in the save's thread: the values at the call, in place in the containers (lists, tuples, dicts), views
    of one storage sharing one copy and no two storages one, and tensors the fence owns or too large ones
    left as they are."""
    from nvckpt.session import fence

    bases = [(torch.arange(sizes[i % 6], dtype=torch.float64) - 7).to(dt) for i, dt in enumerate(dtypes)]
    param = torch.nn.Parameter(torch.ones(5))
    opt = torch.optim.SGD([param], lr=0.1)
    tree = {"bases": list(bases), "views": tuple(bases[b % len(bases)][start::step] for b, start, step in views),
            "owned": param.detach(), "param": param, "n": 3}
    if large:
        tree["large"] = torch.zeros((fence.UNFENCED_COPY_BYTES // 4) + 1)
    expected = {"bases": [b.clone() for b in tree["bases"]], "views": [v.clone() for v in tree["views"]]}
    skeleton, copies = fence.copy_unfenced(tree, [opt], lambda device: 1 << 30)
    for b in bases:
        if b.numel():
            b.view(torch.uint8).fill_(0xA5)  # the caller changes them right after the call
    assert copies is not None
    got = copies.finish(skeleton)
    def raw(t: torch.Tensor) -> bytes:  # bit-exact (NaN payloads too)
        return torch.empty(t.shape, dtype=t.dtype).copy_(t).view(torch.uint8).numpy().tobytes() if t.dim() else \
            t.reshape(1).view(torch.uint8).numpy().tobytes()

    triples = [*zip(got["bases"], expected["bases"], tree["bases"]), *zip(got["views"], expected["views"], tree["views"])]
    for t, e, o in triples:
        assert t.dtype == e.dtype and t.shape == e.shape and t.stride() == o.stride() and raw(t) == raw(e)
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    for (b, *_), v in zip(views, got["views"]):
        assert ptr(v) == ptr(got["bases"][b % len(bases)]), "a view has a storage of its own"
    nonempty = [ptr(b) for b in got["bases"] if b.untyped_storage().nbytes()]
    assert len(set(nonempty)) == len(nonempty), "two storages share one copy"
    assert got["owned"] is tree["owned"] and got["param"] is param and got["n"] == 3
    if large:
        assert got["large"] is tree["large"]


def test_a_lazy_saves_thread_plans_only_after_the_call_returned(tmp_path, monkeypatch):
    """Planning holds the GIL for milliseconds at a time: the save's thread starts it once the call is done
    (its step pre-hook, the call's last act, is then in place), so the caller's last lines never wait for it."""
    import nvckpt.session.async_save as save_mod

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    session = save_mod.SaveSession

    def planning(*a, **k):
        seen.append(len(opt._optimizer_step_pre_hooks))
        return session(*a, **k)

    monkeypatch.setattr(save_mod, "SaveSession", planning)
    for i in range(5):
        nvckpt.async_save({"m": model.state_dict()}, tmp_path / f"p{i}.nvckpt", fence=opt).result(timeout=60)
    assert seen == [1] * 5


@pytest.mark.slow
@pytest.mark.slow
def test_cancel_returns_when_a_done_callback_asks_for_the_outcome(tmp_path):
    """cancel() ran the done-callbacks under the lock that the save's thread takes before its rename: a callback
    calling exception() (a common logging pattern) waited for that thread, and both waited for good."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import time, torch, nvckpt
        import nvckpt.io.sink as sink
        close = sink.FileSink.close
        def slow_close(self, *a, **k):  # a slow final fsync (a network filesystem)
            time.sleep(0.5)
            return close(self, *a, **k)
        sink.FileSink.close = slow_close
        path = {str(tmp_path / "ck.nvckpt")!r}
        nvckpt.save({{"old": 1}}, path)
        f = nvckpt.async_save({{"x": torch.randn(1000)}}, path)
        seen = []
        def log(fut):
            try:
                seen.append(repr(fut.exception()))
            except BaseException as exc:
                seen.append(type(exc).__name__)
        f.add_done_callback(log)
        time.sleep(0.2)  # the items are written: the thread is in its final close
        print(f.cancel(), seen, nvckpt.load(path))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "['CancelledError']", "{'old':", "1}"]
