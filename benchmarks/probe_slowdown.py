#!/usr/bin/env python3
"""What slows a training step while a background save runs (a diagnostic beside bench_training).

Trains bench_training's model at ``--free`` GB of free GPU memory and times its steps while one of these
runs in the background, the variants interleaved round-robin in one process (the machine's drift then hits
them alike), each followed by as many steps with nothing running (its paired baseline):

- ``idle``: nothing (the baseline's baseline);
- ``async``: a plain ``nvckpt.async_save`` to a file (steps while its writer runs, after the caller is released);
- ``lazy``: ``nvckpt.async_save(fence=optimizer)``;
- ``X_sampled``: variant X with bench_training's memory Sampler running beside it (a thread asking for the
  device's free memory and reading this process's RSS every 5 ms), as it runs in bench_training;
- ``async_each``: the plain save with each chunk frame written as it comes (``encode.RUN_WRITES`` off), as
  before a copy group's frames went to the file in one write;
- ``async_h1`` / ``async_8m`` / ``async_16m``: the plain save with one chunk-checksum worker
  (``GpuSaveOptions(hash_workers=1)``) / with 8 MiB chunks (half as many frames) / 16 MiB (a quarter);
- ``null``: the same save into a stream that drops what it is given (no sink copy, no disk): the engine's and
  the frame writer's host work alone;
- ``disk``: the disk alone: the same number of bytes written from pinned host memory with O_DIRECT by two
  threads, 16 MiB per pwrite (no Python between writes beyond the loop);
- ``copy``: host memory bandwidth alone: the same bytes copied by numpy between pinned memory and 16 MiB blocks;
- ``hash``: the save's chunk checksums alone: as many XXH3 calls on as many bytes as the save's chunks, in
  tasks of one batch's chunks on four threads (as the GPU engine hashes), a batch handed over at the pace the
  save's writer takes them (the disk's);
- ``hash_proc``: the same hashing in a child process (its own GIL) over shared memory, one message per batch
  each way: what the training thread would keep if the save's host work ran outside its process;
- ``gil``: a thread that holds the GIL for ~``--gil-us`` µs at a time and then sleeps 0.5 ms: the step's
  sensitivity to GIL handoffs.
- ``spinN``: N threads computing SHA-256 of one 1 MiB buffer over and over (hashlib lets go of the GIL; the
  buffer stays in each core's cache): busy cores alone, without memory traffic and with few GIL handoffs
  (whether other cores' load slows the training thread: shared SMT cores, turbo budget).

Each step is timed in two parts (as in bench_training): its launch (every kernel queued) with the training
thread's CPU time over it, and the wait for the loss; the medians of each part come with each row.

Per variant: median step time while it ran and after it, the steps counted, the allocator's retries
(cudaFree + cudaMalloc after a failed allocation: a device synchronisation each).  JSON under --out.

    python3 benchmarks/probe_slowdown.py --out DIR [--free 3] [--rounds 3] [--variants idle,async,null,disk]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_training  # noqa: E402
import harness  # noqa: E402

BLOCK = 16 << 20


class NullStream:
    """A write-only stream that drops its bytes (counts them)."""

    name = "<null>"

    def __init__(self) -> None:
        self.n = 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.n += n
        return n

    def flush(self) -> None:
        pass


def _disk(path: str, total: int, pinned: torch.Tensor, stop: threading.Event) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    view = memoryview(pinned.numpy()).cast("B")
    blocks = total // BLOCK
    nxt = [0]
    lock = threading.Lock()

    def worker() -> None:
        while not stop.is_set():
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= blocks:
                return
            at = (i * BLOCK) % (pinned.numel() - BLOCK + 1) // 4096 * 4096
            os.pwrite(fd, view[at: at + BLOCK], i * BLOCK)

    ts = [threading.Thread(target=worker) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    os.fsync(fd)
    os.close(fd)
    os.unlink(path)


def _copy(total: int, pinned: torch.Tensor, stop: threading.Event) -> None:
    src = pinned.numpy()
    dst = np.empty(BLOCK, dtype=np.uint8)
    done = 0
    while done < total and not stop.is_set():
        at = done % (src.size - BLOCK + 1)
        dst[:] = src[at: at + BLOCK]
        done += BLOCK


_HASH_CHILD = r"""
import mmap, os, struct, sys, xxhash
fd, size = int(sys.argv[1]), int(sys.argv[2])
mem = memoryview(mmap.mmap(fd, size))
rd, wr = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = rd.read(8)
    if len(head) < 8:
        break
    n, length = struct.unpack("<II", head)
    offsets = struct.unpack(f"<{n}Q", rd.read(8 * n))
    out = [xxhash.xxh3_64_intdigest(mem[o: o + length]) for o in offsets]
    wr.write(struct.pack(f"<{n}Q", *out))
    wr.flush()
"""


def _hash_runs(total: int, chunks: int, batches: int, seconds: float, pinned: torch.Tensor,
               stop: threading.Event, in_child: bool) -> None:
    """``chunks`` XXH3 digests of ``total / chunks`` bytes each, in ``batches`` runs paced over ``seconds``."""
    import subprocess
    import xxhash
    from concurrent.futures import ThreadPoolExecutor

    length = max(total // chunks, 1)
    per = max(chunks // batches, 1)
    span = pinned.numel() - length
    offsets = [(i * length) % span // 64 * 64 for i in range(chunks)]
    view = memoryview(pinned.numpy()).cast("B")
    if in_child:
        import struct

        fd = os.memfd_create("probe-hash")
        os.ftruncate(fd, pinned.numel())
        child = subprocess.Popen([sys.executable, "-c", _HASH_CHILD, str(fd), str(pinned.numel())],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,))
    else:
        pool = ThreadPoolExecutor(4)
    start = time.perf_counter()
    try:
        for b, at in enumerate(range(0, chunks, per)):
            if stop.is_set():
                break
            run = offsets[at: at + per]
            if in_child:
                child.stdin.write(struct.pack("<II", len(run), length) + struct.pack(f"<{len(run)}Q", *run))
                child.stdin.flush()
                child.stdout.read(8 * len(run))
            else:
                quarter = max(len(run) // 4, 1)
                futures = [pool.submit(lambda part: [xxhash.xxh3_64_intdigest(view[o: o + length]) for o in part],
                                       run[i: i + quarter]) for i in range(0, len(run), quarter)]
                for f in futures:
                    f.result()
            wait = start + seconds * (b + 1) * per / chunks - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
    finally:
        if in_child:
            child.stdin.close()
            child.wait()
            os.close(fd)
        else:
            pool.shutdown()


def _gil(seconds: float, hold_us: float, stop: threading.Event) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and not stop.is_set():
        t1 = time.perf_counter() + hold_us * 1e-6
        while time.perf_counter() < t1:
            pass
        time.sleep(0.0005)


def _spin(threads: int, seconds: float, stop: threading.Event) -> None:
    import hashlib

    buf = os.urandom(1 << 20)
    end = time.perf_counter() + seconds

    def worker() -> None:
        while time.perf_counter() < end and not stop.is_set():
            hashlib.sha256(buf).digest()

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def timed_step(tr) -> tuple[float, float, float]:
    """One training step: (launch wall s, the training thread's CPU s over it, whole step s)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    loss = tr.step(sync=False)
    t1, c1 = time.perf_counter(), time.thread_time()
    float(loss)
    return t1 - t0, c1 - c0, time.perf_counter() - t0


def parts(xs: list[tuple[float, float, float]]) -> dict[str, float]:
    """Medians in ms: launch, its CPU time, launch minus CPU (off a core), whole step."""
    med = lambda v: round(1000 * statistics.median(v), 3)  # noqa: E731
    return {"launch_ms": med([x[0] for x in xs]), "cpu_ms": med([x[1] for x in xs]),
            "off_cpu_ms": med([x[0] - x[1] for x in xs]), "step_ms": med([x[2] for x in xs])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--workdir", default="/tmp/nvckpt-probe")
    ap.add_argument("--free", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=30, help="training steps before the probe")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--after", type=int, default=25, help="steps timed after each variant (its paired baseline)")
    ap.add_argument("--variants", default="idle,async,lazy,null,disk,copy,gil")
    ap.add_argument("--gil-us", type=float, default=100.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.workdir, exist_ok=True)
    import nvckpt

    tr = bench_training.trained(args.steps)
    filler = bench_training.fill_gpu(tr, args.free * 1e9)  # noqa: F841 (kept alive)
    path = os.path.join(args.workdir, "probe")
    nvckpt.reserve_pinned_memory(6 << 30)
    first = nvckpt.async_save(tr.checkpoint(), path).result()  # pinned memory allocated, plans cached
    tr.step()
    total = first.file_bytes
    seconds = first.seconds
    n_chunks = int(first.stats.get("chunks") or 2000)
    n_batches = int(first.stats.get("batches") or 27)
    pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(7)
    variants = [v for v in args.variants.split(",") if v]
    rows: dict[str, list] = {v: [] for v in variants}

    def retries() -> int:
        return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))

    for rnd in range(args.rounds):
        for v in (variants if rnd % 2 == 0 else variants[::-1]):
            torch.cuda.synchronize()
            r0 = retries()
            stop = threading.Event()
            fut = thread = None
            v_name, v = v, v.removesuffix("_sampled")
            sampler = bench_training.Sampler().__enter__() if v != v_name else None  # started outside the timing
            t0 = time.perf_counter()
            if v == "async":
                fut = nvckpt.async_save(tr.checkpoint(), path)
            elif v == "async_each":
                from nvckpt.engines.gpu import encode as gpu_encode

                gpu_encode.RUN_WRITES = False  # until this save is done (below)
                fut = nvckpt.async_save(tr.checkpoint(), path)
            elif v == "async_h1":
                fut = nvckpt.async_save(tr.checkpoint(), path, gpu=nvckpt.GpuSaveOptions(hash_workers=1))
            elif v == "async_8m":
                fut = nvckpt.async_save(tr.checkpoint(), path, chunk_size=8 << 20)
            elif v == "async_16m":
                fut = nvckpt.async_save(tr.checkpoint(), path, chunk_size=16 << 20)
            elif v == "lazy":
                fut = nvckpt.async_save(tr.checkpoint(), path, fence=tr.opt)
            elif v == "null":
                fut = nvckpt.async_save(tr.checkpoint(), NullStream())
            elif v in ("disk", "copy", "gil", "hash", "hash_proc") or v.startswith("spin"):
                target = {"disk": lambda: _disk(path + ".disk", total, pinned, stop),
                          "copy": lambda: _copy(total, pinned, stop),
                          "hash": lambda: _hash_runs(total, n_chunks, n_batches, seconds, pinned, stop, False),
                          "hash_proc": lambda: _hash_runs(total, n_chunks, n_batches, seconds, pinned, stop, True),
                          "gil": lambda: _gil(seconds, args.gil_us, stop)}.get(
                    v, lambda: _spin(int(v[4:] or 1), seconds, stop))
                thread = threading.Thread(target=target)
                thread.start()
            blocked = time.perf_counter() - t0
            during: list[float] = []
            split_during: list[tuple[float, float, float]] = []
            limit = 0 if v == "idle" else 400

            def running() -> bool:
                return (fut is not None and not fut.done()) or (thread is not None and thread.is_alive())

            if v == "idle":
                for _ in range(60):
                    split_during.append(timed_step(tr))
                    during.append(split_during[-1][2])
            while running() and len(during) < limit:
                split_during.append(timed_step(tr))
                during.append(split_during[-1][2])
            background = time.perf_counter() - t0
            stop.set()
            if fut is not None:
                fut.result()
                if v == "async_each":
                    gpu_encode.RUN_WRITES = True
            if sampler is not None:
                sampler.__exit__()
            v = v_name
            if thread is not None:
                thread.join()
            split_after = [timed_step(tr) for _ in range(args.after)]
            after = [x[2] for x in split_after]
            row = {"round": rnd, "blocked_s": round(blocked, 4), "background_s": round(background, 3),
                   "steps": len(during), "step_median_s": round(statistics.median(during), 5) if during else None,
                   "after_median_s": round(statistics.median(after), 5),
                   "slowdown": round(statistics.median(during) / statistics.median(after) - 1, 4) if during else None,
                   "alloc_retries": retries() - r0,
                   "parts_during": parts(split_during) if split_during else None, "parts_after": parts(split_after)}
            rows[v].append(row)
            print(v, json.dumps(row), flush=True)
    summary = {}
    for v, rs in rows.items():
        sl = [r["slowdown"] for r in rs if r["slowdown"] is not None]
        summary[v] = {"slowdown_median": round(statistics.median(sl), 4) if sl else None, "slowdowns": sl,
                      "steps": [r["steps"] for r in rs], "alloc_retries": sum(r["alloc_retries"] for r in rs)}
        for key in ("parts_during", "parts_after"):
            got = [r[key] for r in rs if r.get(key)]
            summary[v][key] = {f: round(statistics.median(g[f] for g in got), 3) for f in got[0]} if got else None
        print(f"{v:8s} slowdown median {summary[v]['slowdown_median']} {sl} retries {summary[v]['alloc_retries']} "
              f"during {summary[v]['parts_during']} after {summary[v]['parts_after']}")
    out = {"free_GB": args.free, "file_bytes": total, "first_save_s": seconds, "variants": variants,
           "summary": summary, "rows": rows, "gil_us": args.gil_us,
           "date": harness.utc_date(), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__}
    harness.write_results(args.out, "probe_slowdown", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
