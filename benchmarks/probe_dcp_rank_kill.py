"""Kills of a DCP rank during dcp.async_save (2 ranks, gloo): does the surviving rank exit?

``python3 benchmarks/probe_dcp_rank_kill.py --trials 20 [--writer nvckpt|fs]`` runs the trials (rank 1 dies
at a random moment: a timer in the first 0.6 s, or at a random chunk of its file) and reports per trial when
rank 0 saw the failure, when it left main and when it exited; a rank 0 alive 40 s after the kill counts as
stuck.  Each rank dumps its stacks (faulthandler) if still alive 35 s in, and every 2 s once it left main.
Run as a rank by the probe itself: ``probe_dcp_rank_kill.py RANK STORE DIR WRITER PG_TIMEOUT_S``."""
import datetime, faulthandler, os, subprocess, sys, time, warnings
warnings.filterwarnings("ignore")


def trials(n: int, writer: str) -> None:
    import tempfile

    stuck = 0
    for i in range(n):
        d = tempfile.mkdtemp(prefix="rank-kill-")
        procs = [subprocess.Popen([sys.executable, __file__, str(r), os.path.join(d, "store"), d, writer, "600"],
                                  stdout=open(os.path.join(d, f"out{r}"), "w"), stderr=subprocess.STDOUT)
                 for r in (0, 1)]
        procs[1].wait()
        killed = time.time()
        try:
            procs[0].wait(40)
            print(f"trial {i}: rank 0 exited {time.time() - killed:.1f} s after the kill; "
                  + open(os.path.join(d, "out0")).read().replace("\n", " | ")[:300], flush=True)
        except subprocess.TimeoutExpired:
            stuck += 1
            procs[0].kill()
            print(f"trial {i}: rank 0 STUCK (stacks in {d})", flush=True)
    print(f"{writer}: {stuck} of {n} survivors did not exit within 40 s")


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1].startswith("--"):
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--writer", choices=["nvckpt", "fs"], default="nvckpt")
    a = p.parse_args()
    trials(a.trials, a.writer)
    sys.exit(0)

import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
rank, store, root, writer_kind, timeout_s = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
faulthandler.dump_traceback_later(35, exit=False, file=open(os.path.join(root, f"stack-{rank}.txt"), "w"))
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=timeout_s))
import nvckpt, nvckpt.dcp
state = {f"w{i}": torch.randn(256, 1024) for i in range(16)}  # 16 MiB per rank
import random
mode = random.Random(os.getpid()).choice(["timer", "write"])
if writer_kind == "nvckpt":
    if rank == 1 and mode == "timer":
        import threading
        delay = random.Random(os.getpid()).uniform(0, 0.6)
        print("kill after", delay, flush=True)
        threading.Timer(delay, lambda: os._exit(9)).start()
    elif rank == 1:
        at = random.Random(os.getpid()).randint(1, 12)
        print("kill at chunk", at, flush=True)
        import nvckpt.session.save as sm
        real = sm.write_items
        def killed(stream, items, plan, **kw):
            n = [0]
            def prog(k):
                n[0] += 1
                if n[0] == at:
                    os._exit(9)
            kw["progress"] = prog
            return real(stream, items, plan, **kw)
        sm.write_items = killed
    kw = dict(storage_writer=nvckpt.dcp.Writer(os.path.join(root, "ckpt"), chunk_size=256 << 10),
              async_stager=nvckpt.dcp.Stager())
else:
    if rank == 1:
        import threading
        threading.Timer(0.05, lambda: os._exit(9)).start()
    kw = dict(storage_writer=dcp.FileSystemWriter(os.path.join(root, "ckpt")))
f = dcp.async_save(state, **kw)
try:
    f.result()
    print(f"rank {rank} saved", flush=True)
except BaseException as e:
    print(f"at {time.time():.3f}: rank {rank} save failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
import gc
t = time.time(); n = len(gc.get_objects()); c = gc.collect()
print(f"gc enabled={gc.isenabled()} objects={n} collected={c} in {time.time() - t:.3f}s frozen={gc.get_freeze_count()}", flush=True)
print(f"rank {rank} leaving main at {time.time():.3f}", flush=True)
faulthandler.cancel_dump_traceback_later()
faulthandler.dump_traceback_later(2, repeat=True, file=open(os.path.join(root, f"exit-{rank}.txt"), "w"))
