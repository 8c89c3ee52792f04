#!/usr/bin/env python3
"""What a training job loses to checkpoints, at realistic GPU memory pressure (issue 8's benchmark).

A GPT-style transformer (benchmarks/bench_gpu.py's model: 514M parameters,
bf16 weights + fp32 master + fused AdamW moments, 7.2 GB of state) trains on the
H200; GPU memory is filled so that only a given amount stays free beyond what
the training step itself needs (1 GB, 3 GB, "plenty").  For each way of
checkpointing, a checkpoint every K steps, the run measures: the time the
caller is blocked per checkpoint; the wall time lost per checkpoint against
training without checkpoints; the step time while a background save runs
(slowdown: against the run's steps without a save, and paired per checkpoint
against the steps right after that checkpoint's save, with the same split of
the run without checkpoints as the method's noise floor); the peak extra GPU memory (torch's allocator and the device's own
free memory, sampled); the peak pinned host memory nvckpt holds; and, for
nvckpt's async saves, that the file holds the values at the call (bit for bit).
DCP runs in its thread mode (default staging) and in its process mode with
pinned shared host memory kept by one stager across checkpoints (its fastest
published setting; peak RSS holds that memory).
A second K (2 steps) shows a save that cannot finish between checkpoints (the
next checkpoint then waits for the previous one, as DCP's does).

    python3 benchmarks/bench_training.py --out DIR [--steps 150] [--levels 1,3,plenty]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import shutil
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu  # noqa: E402  (the model, its trainer and the helpers of the GPU benchmark)
import harness  # noqa: E402
from harness import log  # noqa: E402

GB = 1e9
R: dict[str, Any] = {"runs": [], "errors": []}
OUT = "."


def dump() -> None:
    harness.write_results(OUT, "bench_training", R)


def cpu_ticks() -> tuple[int, int]:
    """(steal, all) jiffies of every CPU so far (/proc/stat): the share a hypervisor gave other guests over a
    window tells a shared host's slow minutes from a save's cost (0, 0 where /proc/stat is not there)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_share(a: tuple[int, int], b: tuple[int, int]) -> float | None:
    return round((b[0] - a[0]) / (b[1] - a[1]), 4) if b[1] > a[1] else None


class Nvml:
    """The GPU's SM clock, power draw and clock-event reasons through NVML (libnvidia-ml, which the driver
    installs; called through ctypes because the device has no pynvml): whether a slow minute of the step is
    the GPU running slower (power or thermal limits) rather than a save's cost.  ``ok`` is False where NVML
    cannot be loaded; every read then returns None."""

    REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}

    def __init__(self, index: int = 0) -> None:
        import ctypes

        self._c = ctypes
        self.ok = False
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return
            self._dev = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(self._dev)) != 0:
                return
            self._reasons = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                lib.nvmlDeviceGetCurrentClocksThrottleReasons
            self._lib = lib
            self.ok = True
        except (OSError, AttributeError):
            pass

    def read(self) -> tuple[int, int, int] | None:
        """(SM clock MHz, power mW, clock-event reason bits), or None."""
        if not self.ok:
            return None
        c = self._c
        mhz, mw, bits = c.c_uint(), c.c_uint(), c.c_ulonglong()
        if (self._lib.nvmlDeviceGetClockInfo(self._dev, c.c_uint(1), c.byref(mhz))  # NVML_CLOCK_SM
                or self._lib.nvmlDeviceGetPowerUsage(self._dev, c.byref(mw)) or self._reasons(self._dev, c.byref(bits))):
            return None
        return mhz.value, mw.value, bits.value


class Sampler:
    """Samples the device's free memory and this process's RSS every few ms (peaks of a run), and the GPU's
    SM clock and power (Nvml) with the time of each sample, for the medians of a window (``gpu_window``)."""

    def __init__(self) -> None:
        self.min_free = None
        self.max_rss = 0
        self.nvml = Nvml(torch.cuda.current_device())
        self.gpu: list[tuple[float, int, int, int]] = []  # (perf_counter, MHz, mW, reason bits)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free = torch.cuda.mem_get_info()[0]
            self.min_free = free if self.min_free is None else min(self.min_free, free)
            with open("/proc/self/statm") as f:
                self.max_rss = max(self.max_rss, int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
            g = self.nvml.read()
            if g is not None:
                self.gpu.append((time.perf_counter(), *g))
            time.sleep(0.005)

    def gpu_window(self, t0: float, t1: float) -> dict[str, Any] | None:
        """Median SM clock (MHz), mean power (W) and the clock-event reasons seen between t0 and t1."""
        inside = [g for g in self.gpu if t0 <= g[0] < t1]
        if not inside:
            return None
        bits = 0
        for g in inside:
            bits |= g[3]
        return {"sm_mhz": statistics.median(g[1] for g in inside),
                "power_w": round(sum(g[2] for g in inside) / len(inside) / 1000, 1),
                "reasons": [name for bit, name in Nvml.REASONS.items() if bits & bit], "samples": len(inside)}

    def __enter__(self) -> "Sampler":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


MODEL = dict(vocab=32000, d_model=1280, layers=24, seq=512, batch=8, lr=6e-4, warmup=30)  # the 514M-parameter GPT


def trained(steps: int, **changes: Any) -> Any:
    """bench_gpu's Trainer of this benchmark's model (MODEL, with ``changes``) after ``steps`` training steps
    (also the model of probe_async.py and probe_slowdown.py)."""
    tr = bench_gpu.Trainer(argparse.Namespace(**{**MODEL, **changes}))
    for _ in range(steps):
        tr.step()
    return tr


def fill_gpu(tr: Any, free_bytes: float | None) -> torch.Tensor | None:
    """A filler so that ``free_bytes`` stay free beyond what one training step needs (None: no filler)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if free_bytes is None:
        return None
    before = torch.cuda.memory_reserved()
    tr.step()
    torch.cuda.synchronize()
    step_needs = torch.cuda.memory_reserved() - before  # the step's activations, now cached by torch
    free = torch.cuda.mem_get_info()[0]
    size = int(free - free_bytes)
    if size <= 0:
        return None
    filler = torch.empty(size, dtype=torch.uint8, device="cuda")
    R.setdefault("fill", []).append({"free_target_GB": free_bytes / GB, "step_needs_GB": step_needs / GB,
                                     "filler_GB": size / GB, "free_after_GB": torch.cuda.mem_get_info()[0] / GB})
    return filler


def expected_copy(ck: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in bench_gpu.flat_tensors(ck).items()}


def verify(path: str, expected: dict[str, torch.Tensor]) -> bool:
    import nvckpt

    with nvckpt.open(path, device="cuda") as f:
        got = bench_gpu.flat_tensors(f.load())
    return got.keys() == expected.keys() and all(bench_gpu.same_bytes(got[k].cpu(), expected[k]) for k in expected)


class DcpProcess:
    """DCP's fastest published setting: a checkpoint process (its own gloo group, so this one needs a process
    group: world size 1) fed from pinned shared host memory by a DefaultStager, kept across checkpoints so its
    pinned copies are cached, as a job that keeps its stager has them.  The call stages synchronously, so it
    returns once the state is in host memory and the caller may change it: that is its blocked time.

    Under torch 2.11 (the device's) a stager's second stage() failed (KeyError <class 'type'> in its deepcopy,
    runs 27-28, no close() called): where reuse fails, each checkpoint gets a new stager (and pays its pinned
    allocation), the previous one closed once its save is done; R["dcp_stager"] says which happened."""

    def __init__(self, dcp: Any) -> None:
        import torch.distributed as dist

        self.dcp, self.stager, self.reuse, self.old = dcp, None, True, []
        if not dist.is_initialized():
            import tempfile

            store = os.path.join(tempfile.mkdtemp(prefix="dcp-store-"), "store")  # run() empties workdir
            dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)

    def _new(self) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=True,
                                            use_async_staging=False, use_non_blocking_copy=True))

    def __call__(self, state: Any, path: str) -> Any:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        for done in [s for s, f in self.old if f.done()]:
            done.close()
        self.old = [(s, f) for s, f in self.old if not f.done()]
        if self.stager is None or not self.reuse:
            self.stager = self._new()
        save = lambda: self.dcp.async_save(state, checkpoint_id=path, async_stager=self.stager,  # noqa: E731
                                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        try:
            future = save()
        except KeyError as exc:  # staging failed before anything was handed to the checkpoint process
            if not self.reuse:
                raise
            self.reuse = False
            R["dcp_stager"] = f"a new stager per checkpoint: reusing one failed ({type(exc).__name__}: {exc})"
            self.stager = self._new()
            future = save()
        else:
            R.setdefault("dcp_stager", "one stager kept across checkpoints")
        if not self.reuse:
            self.old.append((self.stager, future))
        return future


def method(name: str, workdir: str) -> Callable[[Any, int], tuple[Any, Callable[[], None]]]:
    """start(trainer, checkpoint number) -> (a future or None, cleanup); the call's duration is the blocked time."""
    import nvckpt
    import torch.distributed.checkpoint as dcp

    def path(i: int) -> str:
        return os.path.join(workdir, f"{name}-{i}")

    if name == "torch.save":
        def start(tr: Any, i: int) -> Any:
            with open(path(i), "wb") as f:
                torch.save(tr.checkpoint(), f)
                f.flush()
                os.fsync(f.fileno())
            return None
    elif name == "dcp.async_save":
        def start(tr: Any, i: int) -> Any:
            return dcp.async_save(tr.checkpoint(), checkpoint_id=path(i), no_dist=True)
    elif name == "dcp.async_save(process)":
        process = DcpProcess(dcp)

        def start(tr: Any, i: int) -> Any:
            return process(tr.checkpoint(), path(i))
    elif name == "nvckpt.save":
        def start(tr: Any, i: int) -> Any:
            nvckpt.save(tr.checkpoint(), path(i))
            return None
    elif name == "nvckpt.async_save":
        def start(tr: Any, i: int) -> Any:
            return nvckpt.async_save(tr.checkpoint(), path(i))
    elif name == "nvckpt.async_save(fence=opt)":
        def start(tr: Any, i: int) -> Any:
            return nvckpt.async_save(tr.checkpoint(), path(i), fence=tr.opt)
    else:
        raise ValueError(name)
    return start


def _phases(result: Any) -> dict[str, Any] | None:
    """An nvckpt save's phases (SaveResult.stats) with the engine's setup and read time; None for other methods."""
    stats = getattr(result, "stats", None)
    if not stats or "phases" not in stats:
        return None
    out = dict(stats["phases"])
    for k in ("setup_seconds", "tensors_read_seconds", "pinned_bytes"):
        if k in stats:
            out[k] = round(stats[k], 6) if isinstance(stats[k], float) else stats[k]
    return out


def run(tr: Any, name: str, level: str, k: int, n_ckpt: int, base_step: float, workdir: str,
        check: bool = True, split: float = 0.7) -> tuple[dict[str, Any], tuple]:
    from nvckpt.engines.gpu.pinned import PINNED

    start = method(name, workdir) if name != "none" else None
    out: dict[str, Any] = {"method": name, "free": level, "K": k, "checkpoints": n_ckpt}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    alloc0, free0 = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    blocked, step_times_bg, step_times, step_times_idle = [], [], [], []
    # Per checkpoint interval: the steps while its save ran and the steps after it (the save's paired
    # baseline: the step time drifts over a run by more than a few %, see probe_slowdown_h200.md).
    during: list[list[float]] = [[] for _ in range(n_ckpt)]
    # Per interval, [while saving, after]: (launch wall s, launch thread-CPU s, step s) of each step.
    parts: list[list[list[tuple[float, float, float]]]] = [[[], []] for _ in range(n_ckpt)]
    after: list[list[float]] = [[] for _ in range(n_ckpt)]
    phases: list[dict[str, Any] | None] = []
    fence_waits: list[float | None] = []
    # cpu_ticks() at each interval's start and where its steps stop being "during" (steal per window)
    marks: list[list[tuple[int, int]]] = [[] for _ in range(n_ckpt)]
    tmarks: list[list[float]] = [[] for _ in range(n_ckpt)]  # perf_counter at the same points (GPU clock per window)
    expected, pending = None, None
    steps = k * n_ckpt
    # Python's full (generation 2) collections during the run: each holds the GIL, so a pass started by
    # any thread stalls the training loop; counted to tell a save's stalls from the collector's.
    gc_passes: list[float] = []
    gc_started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") == 2:
            if phase == "start":
                gc_started.append(time.perf_counter())
            elif gc_started:
                gc_passes.append(time.perf_counter() - gc_started.pop())

    gc.callbacks.append(on_gc)
    with Sampler() as s:
        t_all = time.perf_counter()
        for i in range(steps):
            if start is not None and i % k == 0:
                n = i // k
                if n == 0 and check and name.startswith("nvckpt.async"):
                    t_x = time.perf_counter()
                    expected = expected_copy(tr.checkpoint())  # outside the measured time
                    t_all += time.perf_counter() - t_x
                t0 = time.perf_counter()
                if pending is not None:  # the previous save still runs: wait for it, as DCP's next save does
                    phases.append(_phases(pending.result()))
                    fence_waits.append(getattr(pending, "fence_wait_seconds", None))
                pending = start(tr, n)
                blocked.append(time.perf_counter() - t0)
            if i % k == 0:
                marks[i // k].append(cpu_ticks())
                tmarks[i // k].append(time.perf_counter())
            t0, c0 = time.perf_counter(), time.thread_time()
            loss = tr.step(sync=False)  # every kernel of the step queued
            t1, c1 = time.perf_counter(), time.thread_time()
            float(loss)  # then wait for it, as training loops that log the loss do
            dt = time.perf_counter() - t0
            step_times.append(dt)
            n = i // k
            # The launch's wall time beside this thread's CPU time over it: the difference is time the
            # training thread was off a core: waiting for the GIL or a core, and in loss.backward(), whose
            # kernels autograd's device thread queues while this thread waits.
            parts[n][0 if (start is None and i % k < max(1, round(split * k))) or
                     (start is not None and pending is not None and not pending.done()) else 1].append(
                (t1 - t0, c1 - c0, dt))
            if start is None:  # no save: the same split as a save that runs ``split`` of the interval (noise floor)
                (during if i % k < max(1, round(split * k)) else after)[n].append(dt)
            elif pending is not None and not pending.done():
                step_times_bg.append(dt)
                during[n].append(dt)
            else:
                step_times_idle.append(dt)
                after[n].append(dt)
            if len(marks[n]) == 1 and (after[n] or i % k == k - 1):
                marks[n].append(cpu_ticks())  # the boundary: the first step after the save (or the interval's end)
                tmarks[n].append(time.perf_counter())
        if pending is not None:
            result = pending.result()
            phases.append(_phases(result))
            fence_waits.append(getattr(pending, "fence_wait_seconds", None))
            if result is not None and getattr(result, "stats", None):
                out["engine_stats"] = {k: result.stats.get(k) for k in (
                    "tensors_read_seconds", "waits", "batches", "batch_bytes", "staged_bytes", "memory_budget",
                    "pinned_bytes", "seconds")}
        if any(phases):
            out["phases"] = phases  # per checkpoint: where the save's time went before and while it read
        if name.endswith("(fence=opt)"):
            # per checkpoint: how long the optimizer's next step waited in the fence for the save's reads
            out["fence_wait_s"] = [None if w is None else round(w, 4) for w in fence_waits]
        torch.cuda.synchronize()
        wall = time.perf_counter() - t_all
        end_ticks = cpu_ticks()
        t_end = time.perf_counter()
    gc.callbacks.remove(on_gc)
    bounds = [m + [marks[j + 1][0] if j + 1 < n_ckpt and marks[j + 1] else end_ticks] for j, m in enumerate(marks)]
    out["steal_per_checkpoint"] = [{"during": steal_share(b[0], b[1]), "after": steal_share(b[1], b[2])}
                                   for b in bounds if len(b) == 3]
    tb = [m + [tmarks[j + 1][0] if j + 1 < n_ckpt and tmarks[j + 1] else t_end] for j, m in enumerate(tmarks)]
    out["gpu_per_checkpoint"] = [{"during": s.gpu_window(b[0], b[1]), "after": s.gpu_window(b[1], b[2])}
                                 for b in tb if len(b) == 3] if s.nvml.ok else None
    def split_of(xs: list[tuple[float, float, float]]) -> dict[str, float] | None:
        if not xs:
            return None
        med = lambda j: round(1000 * statistics.median(x[j] for x in xs), 3)  # noqa: E731
        return {"launch_ms": med(0), "launch_cpu_ms": med(1),
                "off_cpu_ms": round(1000 * statistics.median(x[0] - x[1] for x in xs), 3),
                "step_ms": med(2), "steps": len(xs)}

    out["launch_per_checkpoint"] = [{"during": split_of(p[0]), "after": split_of(p[1])} for p in parts]
    everything = [[x for p in parts for x in p[w]] for w in (0, 1)]
    out["launch"] = {"during": split_of(everything[0]), "after": split_of(everything[1])}
    out["gc_full_passes"] = {"count": len(gc_passes), "seconds": round(sum(gc_passes), 4),
                             "longest_s": round(max(gc_passes, default=0.0), 4)}
    out.update(
        blocked_s=[round(b, 4) for b in blocked], blocked_median_s=round(statistics.median(blocked), 4) if blocked else 0.0,
        wall_s=round(wall, 3), lost_per_checkpoint_s=round((wall - steps * base_step) / n_ckpt, 3) if start else 0.0,
        step_s_median=round(statistics.median(step_times), 4),
        step_s_while_saving_median=round(statistics.median(step_times_bg), 4) if step_times_bg else None,
        steps_while_saving=len(step_times_bg),
        # Against this run's own steps without a save running (the GPU's speed drifts over a session),
        # else against the step time measured before the runs.
        step_s_idle_median=round(statistics.median(step_times_idle), 4) if step_times_idle else None,
        slowdown_while_saving=(round(statistics.median(step_times_bg) / statistics.median(step_times_idle or [base_step]) - 1, 4)
                               if step_times_bg else None),
        # Paired: per checkpoint, its steps while saving against the steps after its save (each at least 5).
        slowdown_per_checkpoint=[round(statistics.median(d) / statistics.median(a) - 1, 4)
                                 for d, a in zip(during, after) if len(d) >= 5 and len(a) >= 5],
        extra_gpu_allocated_GB=round((torch.cuda.max_memory_allocated() - alloc0) / GB, 3),
        extra_gpu_device_GB=round((free0 - (s.min_free or free0)) / GB, 3),
        peak_rss_GB=round(s.max_rss / GB, 2), nvckpt_pinned_cached_GB=round(PINNED.cached / GB, 2),
    )
    paired = out["slowdown_per_checkpoint"]
    out["slowdown_paired"] = round(statistics.median(paired), 4) if paired else None
    if start is None:
        out["noise_split"] = split
    keep = None
    if expected is not None:
        out["snapshot"] = getattr(pending, "snapshot", None)
        keep = os.path.join(workdir, f"{name}-0")
        os.replace(keep, keep + f".{level}.{k}.verify")
        keep += f".{level}.{k}.verify"
    for entry in os.listdir(workdir):
        p = os.path.join(workdir, entry)
        if not p.endswith(".verify"):
            shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
    return out, (keep, expected)


def prefill_disk(workdir: str, gb: float) -> dict[str, float]:
    """Write ``gb`` GB of random bytes into ``workdir`` (O_DIRECT, 64 MiB per write), then delete them.

    Why: on a fresh cloud disk a block's first write can be slower than later ones (the host allocates
    it); runs 16-17 of bench_training_h200.md read as if only the saving method that ran first were
    slowed.  Run 18 prefilled 45 GB and the pattern did not hold (bench_training_h200.md): the option
    stays so that the disk's state can be ruled out again, not because it changes the result."""
    import mmap

    import numpy as np

    block = mmap.mmap(-1, 64 << 20)  # page-aligned, as O_DIRECT needs
    np.frombuffer(block, dtype=np.uint8)[:] = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    path = os.path.join(workdir, "prefill")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    blocks = max(1, int(gb * GB) // (64 << 20))
    t0 = time.perf_counter()
    try:
        try:
            fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError:  # a file system without direct I/O (EINVAL): through the page cache, then fsync
            fd = os.open(path, flags, 0o600)
        try:
            for i in range(blocks):
                os.pwrite(fd, block, i * (64 << 20))
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    seconds = time.perf_counter() - t0
    written = blocks * (64 << 20) / GB
    return {"GB": round(written, 1), "seconds": round(seconds, 1), "GB_per_s": round(written / seconds, 2)}


def profile_saves(tr: Any, n: int, workdir: str) -> None:
    """``n`` plain async_saves, the blocked call of each under cProfile: where the blocked time goes.

    On Python >= 3.12 cProfile sees every thread (sys.monitoring), so the report covers the save's own
    thread up to the moment it releases the caller; on older Pythons only the caller.  Text under OUT/."""
    import cProfile
    import io
    import pstats

    import nvckpt

    texts, rows = [], []
    for i in range(2 * n):
        lazy = i >= n  # then as many lazy ones (fence=optimizer): the call copies containers and small tensors
        pr = cProfile.Profile()
        ck = tr.checkpoint()
        t0 = time.perf_counter()
        pr.enable()
        future = nvckpt.async_save(ck, os.path.join(workdir, f"profile-{i}"), **({"fence": tr.opt} if lazy else {}))
        pr.disable()
        blocked = time.perf_counter() - t0
        result = future.result()
        rows.append({"lazy": lazy, "blocked_s": round(blocked, 4), **(_phases(result) or {})})
        out = io.StringIO()
        out.write(f"== {'lazy' if lazy else 'plain'} save {i}: blocked {blocked:.4f} s\n")
        for key, count in (("cumulative", 50), ("tottime", 30)):
            pstats.Stats(pr, stream=out).sort_stats(key).print_stats(count)
        texts.append(out.getvalue())
        log("profiled", rows[-1])
        tr.step()
    from nvckpt.plan.walk import plan_save

    for i in range(2):  # planning alone (walk, derived tensors), as a save does it
        pr = cProfile.Profile()
        pr.enable()
        plan = plan_save(tr.checkpoint(), derive=True, copies=True, chunk_size=4 << 20)
        pr.disable()
        out = io.StringIO()
        out.write(f"== plan_save {i}: {plan.seconds}\n")
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
        texts.append(out.getvalue())
        rows.append({"plan_only": True, **{k: round(v, 6) for k, v in plan.seconds.items()}})
    R["profile"] = rows
    with open(os.path.join(OUT, "bench_training_profile.txt"), "w") as f:
        f.write("\n".join(texts))
    for entry in os.listdir(workdir):
        if entry.startswith("profile-"):
            os.unlink(os.path.join(workdir, entry))


def markdown() -> str:
    e = R.get("environment", {})
    lines = [f"# What a training job loses to checkpoints ({str(e.get('gpu', 'GPU')).split(' (')[0]}, GPU memory pressure)", "",
             f"Date: {e.get('date')}. Hardware: {e.get('gpu')}, {e.get('cpus')} CPUs. Software: torch {e.get('torch')}, "
             f"nvCOMP {e.get('nvcomp')}.", "", f"Command: `{e.get('command')}`", "",
             *([f"Disk prefilled before the runs: {R['prefill_disk']['GB']} GB written and deleted in "
                f"{R['prefill_disk']['seconds']} s ({R['prefill_disk']['GB_per_s']} GB/s; see prefill_disk).", ""]
               if R.get("prefill_disk") else []),
             f"State: {R.get('state', {}).get('params', 0) / 1e6:.0f}M-parameter GPT after {R.get('state', {}).get('steps')} "
             f"AdamW steps ({R.get('state', {}).get('tokens_per_step', '?')} tokens per step), bf16 weights + fp32 master + moments = **{R.get('state', {}).get('bytes', 0) / GB:.2f} GB**; "
             f"training step {R.get('base_step_s', 0):.3f} s without checkpoints. 'free' = GPU memory left free beyond "
             "what the training step needs (a filler tensor takes the rest).", "",
             "| free | method | K | blocked s: first ckpt / later (median) | lost per ckpt s | step while saving s (slowdown vs steps without a save) | slowdown paired per checkpoint: median (each) | extra GPU GB (allocator / device) | nvckpt pinned GB / peak RSS GB | bit-exact | full GC passes (s in all) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in R["runs"]:
        if "error" in r:
            lines.append(f"| {r['free']} | {r['method']} | {r['K']} | error: {r['error'][:80]} | | | | | | | |")
            continue
        slow = "-" if r["step_s_while_saving_median"] is None else f"{r['step_s_while_saving_median']:.3f} ({100 * r['slowdown_while_saving']:+.1f} %)"
        b = r["blocked_s"]
        blocked = "-" if not b else f"{b[0]:.4f}" + (f" / {statistics.median(b[1:]):.4f}" if len(b) > 1 else "")
        each = r.get("slowdown_per_checkpoint") or []
        gcs = r.get("gc_full_passes") or {"count": 0, "seconds": 0.0}
        paired = "-" if r.get("slowdown_paired") is None else (
            f"{100 * r['slowdown_paired']:+.1f} % ({', '.join(f'{100 * x:+.1f}' for x in each)})"
            + (f" noise: steps 1-{round(r['noise_split'] * r['K'])} vs the rest" if "noise_split" in r else ""))
        lines.append(f"| {r['free']} | {r['method']} | {r['K']} | {blocked} | {r['lost_per_checkpoint_s']:.2f} | "
                     f"{slow} | {paired} | {r['extra_gpu_allocated_GB']:.2f} / {r['extra_gpu_device_GB']:.2f} | "
                     f"{r['nvckpt_pinned_cached_GB']:.2f} / {r['peak_rss_GB']:.2f} | {r.get('bit_exact_first_checkpoint', '')} | "
                     f"{gcs['count']} ({gcs['seconds']:.3f}) |")
    waits = [(r["method"], r["fence_wait_s"]) for r in R["runs"] if r.get("fence_wait_s")]
    if waits:
        lines += ["", "How long the optimizer's first step after a lazy save's call waited in the fence for the save "
                  "to read the tensors (`SaveFuture.fence_wait_seconds`), per checkpoint, s:", ""]
        for name, each in waits:
            lines.append(f"- {name}: " + ", ".join("-" if x is None else f"{x:.4f}" for x in each))
    steals = [(r["method"], r["steal_per_checkpoint"]) for r in R["runs"] if r.get("steal_per_checkpoint")]
    if steals:
        lines += ["", "CPU time the hypervisor gave other guests (steal, /proc/stat) per checkpoint interval, while its "
                  "save ran / after it (for `none`: the same split of steps), in %:", ""]
        pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
        for name, each in steals:
            lines.append(f"- {name}: " + ", ".join(f"{pct(w['during'])} / {pct(w['after'])}" for w in each))
    gpus = [(r["method"], r["gpu_per_checkpoint"]) for r in R["runs"] if r.get("gpu_per_checkpoint")]
    if gpus:
        lines += ["", "The GPU per checkpoint interval (NVML, sampled every ~5 ms), while its save ran / after it (for "
                  "`none`: the same split of steps): median SM clock MHz, mean power W, clock-event reasons seen:", ""]
        w = lambda g: "-" if g is None else f"{g['sm_mhz']:.0f} MHz {g['power_w']:.0f} W" + (  # noqa: E731
            f" ({'+'.join(g['reasons'])})" if g["reasons"] else "")
        for name, each in gpus:
            lines.append(f"- {name}: " + "; ".join(f"{w(x['during'])} / {w(x['after'])}" for x in each))
    launches = [(r["method"], r["launch"]) for r in R["runs"] if r.get("launch")]
    if launches:
        lines += ["", "Where a step's time goes, steps while a save ran / after it (for `none`: the same split), "
                  "medians in ms: the launch (every kernel of the step queued: wall, and the training thread's CPU "
                  "time over it; the difference is time it was off a core: waiting for the GIL or a core, or for "
                  "autograd's device thread, which queues the backward's kernels), then the whole step:", ""]
        w = lambda g: "-" if g is None else (f"launch {g['launch_ms']:.1f} (CPU {g['launch_cpu_ms']:.1f}, off-CPU "  # noqa: E731
                                             f"{g['off_cpu_ms']:.2f}), step {g['step_ms']:.1f}")
        for name, each in launches:
            lines.append(f"- {name}: {w(each['during'])} / {w(each['after'])}")
    if R.get("profile"):
        keys = ["blocked_s", "walk", "derived", "prepare", "thread_start", "start_engine", "setup_seconds",
                "tensors_read_seconds", "pinned_bytes"]
        lines += ["", "`nvckpt.async_save` under cProfile (OUT/bench_training_profile.txt), before the runs above, "
                  "plain then lazy (fence=optimizer); the first is the process's first async_save (it pins its host "
                  "memory). Phases in seconds (SaveResult.stats['phases'] and the engine's setup / read time):", "",
                  "| save | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for i, p in enumerate(R["profile"]):
            kind = "plan only" if p.get("plan_only") else "lazy" if p.get("lazy") else "plain"
            lines.append(f"| {i} ({kind}) | " + " | ".join(str(p.get(k, "")) for k in keys) + " |")
    if R["errors"]:
        lines += ["", "Errors: " + "; ".join(R["errors"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    global OUT
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_training_out")
    ap.add_argument("--workdir", default="/tmp/nvckpt_bench_training")
    ap.add_argument("--steps", type=int, default=150, help="training steps before the measured runs")
    ap.add_argument("--levels", default="1,3,plenty", help="GB left free (comma separated; 'plenty' = no filler)")
    ap.add_argument("--k", type=int, default=100, help="steps between checkpoints (the save finishes between them)")
    ap.add_argument("--k-short", type=int, default=2, help="steps between checkpoints where it does not (0: not run)")
    ap.add_argument("--checkpoints", type=int, default=2)
    ap.add_argument("--methods", default="none,torch.save,dcp.async_save,dcp.async_save(process),nvckpt.save,nvckpt.async_save,nvckpt.async_save(fence=opt)")
    ap.add_argument("--batch", type=int, default=MODEL["batch"],
                    help="sequences of MODEL['seq'] tokens per step (8: a step whose kernels take about as long "
                         "to queue as to run; more: a step the GPU's work bounds, as in training at scale)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--prefill-disk", type=float, default=0,
                    help="GB to write and delete in --workdir before the runs (see prefill_disk); 0: none")
    ap.add_argument("--profile", type=int, default=0,
                    help="before the runs, profile this many async_saves at the first level (OUT/bench_training_profile.txt)")
    args = ap.parse_args(argv)
    OUT = args.out
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(args.workdir, exist_ok=True)
    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    from nvckpt.codecs.nvcomp import device as nb

    R["environment"] = {"date": harness.utc_date(),
                        "gpu": f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB)",
                        "cpus": os.cpu_count(), "torch": torch.__version__, "nvcomp": nb.nvcomp_version(),
                        "python": platform.python_version(),
                        "command": harness.command_line(__file__, argv)}
    tr = trained(args.steps, batch=args.batch, **(dict(d_model=512, layers=4, vocab=8000, seq=256) if args.smoke else {}))
    base: list[float] = []
    for _ in range(20):
        t0 = time.perf_counter()
        tr.step()
        base.append(time.perf_counter() - t0)
    base_step = statistics.median(base)
    R["base_step_s"] = base_step
    R["state"] = {"params": sum(p.numel() for p in tr.params), "steps": tr.step_no,
                  "tokens_per_step": tr.args.batch * tr.args.seq,
                  "bytes": sum(t.numel() * t.element_size() for t in bench_gpu.flat_tensors(tr.checkpoint()).values())}
    log("state", R["state"], "step", round(base_step, 4))
    dump()
    methods = args.methods.split(",")
    if args.prefill_disk:
        R["prefill_disk"] = prefill_disk(args.workdir, args.prefill_disk)
        log("prefilled", R["prefill_disk"])
    for level in args.levels.split(","):
        free = None if level == "plenty" else float(level) * GB
        filler = fill_gpu(tr, free)
        if args.profile and level == args.levels.split(",")[0]:
            profile_saves(tr, args.profile, args.workdir)
            dump()
        to_verify: list[tuple[dict, str, dict]] = []
        for name in methods:
            if level == "1" and name in ("torch.save", "dcp.async_save", "dcp.async_save(process)"):
                continue  # their blocked time does not depend on free GPU memory; measured at 3 GB and plenty
            ks = [args.k] + ([args.k_short] if args.k_short and name.startswith("nvckpt.async") else [])
            for k in ks:
                try:
                    r, check = run(tr, name, level, k, args.checkpoints, base_step, args.workdir, check=k == args.k)
                    if check[0] is not None:
                        to_verify.append((r, *check))
                except Exception as exc:  # one method's failure must not lose the others
                    traceback.print_exc()
                    r = {"method": name, "free": level, "K": k, "error": f"{type(exc).__name__}: {exc}"}
                    R["errors"].append(f"{level}/{name}/K={k}: {type(exc).__name__}: {exc}")
                    torch.cuda.empty_cache()
                    tr.step()  # the step's activations allocated again, outside the next method's window (run 27
                    # read them as nvckpt.save's extra GPU memory after a failed method had emptied the cache)
                R["runs"].append(r)
                log(r)
                dump()
        del filler
        torch.cuda.empty_cache()
        for r, path, expected in to_verify:  # with the GPU memory back: load each file and compare
            try:
                r["bit_exact_first_checkpoint"] = verify(path, expected)
            except Exception as exc:
                r["bit_exact_first_checkpoint"] = f"{type(exc).__name__}: {exc}"
            os.unlink(path)
            log("verified", r["method"], r["free"], r["K"], r["bit_exact_first_checkpoint"])
        dump()
    return 0 if harness.write_results(OUT, "bench_training", R, markdown, echo=True) is not None else 1


if __name__ == "__main__":
    sys.exit(main())
