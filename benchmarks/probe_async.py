#!/usr/bin/env python3
"""Where a plain async_save's blocked time goes, on the GPU's timeline (a diagnostic beside bench_training).

Trains bench_training's model a few steps, leaves ``--free`` GB of GPU memory free, runs warm async_saves,
then one under torch.profiler: within the blocked window, how long the copy engine moved compressed
chunks to the host, how long kernels ran, and where neither did (host-bound gaps).  JSON + text under --out.

    python3 benchmarks/probe_async.py --out DIR [--free 3] [--warm 3]
    python3 benchmarks/probe_async.py --out DIR --ab base,chunk=16,switch=0.0005,derive=0 --reps 5

``--ab``: only the blocked time of warm saves under each variant, interleaved round-robin in one process
(so that the machine's drift hits every variant alike): ``chunk=MiB`` (SaveOptions.chunk_size),
``switch=SECONDS`` (sys.setswitchinterval during the save), ``derive=0|1``, ``inflight=N``, ``native=0|1``
(nvCOMP's C API for ANS, nvckpt.codecs.nvcomp.native.ENABLED), ``halves=N`` (device memory the engine
reserves per batch alive, in halves of the batch's output: nvckpt.engines.gpu.encode._halves without scratch;
3 counts nvCOMP temporary memory of half a batch, 2 none), ``gc=0`` (Python's garbage collector off for the
whole save: what its pauses cost), ``heads=torch`` (the derived-tensor candidates' heads rounded by a torch CPU
op, as before 2026-12-02, instead of numpy); join several with ``+`` (``chunk=8+derive=0``).
Each row also has the save's peak extra GPU memory (torch's allocator, above what was allocated at the call).
``--trace`` (with ``--ab``): each row also has where the planning's host time went (the walk, the derived-tensor
candidates and their sub-steps, wall and the caller thread's CPU seconds, its page faults and context switches)
and the CUDA allocator's retries and device allocations/frees during the save: what the bimodal stall is.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import resource
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_training  # noqa: E402
import harness  # noqa: E402


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1.0
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def timeline(trace: dict, t0_us: float, t1_us: float, bins: int = 20) -> dict:
    """GPU activity in [t0, t1) (µs, the trace's clock): busy time of copies to the host and of kernels."""
    d2h, kernels, names = [], [], {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, a = ev.get("cat", ""), float(ev["ts"])
        b = a + float(ev["dur"])
        if b < t0_us or a > t1_us:
            continue
        a, b = max(a, t0_us), min(b, t1_us)
        if cat == "gpu_memcpy" and "DtoH" in ev.get("name", ""):
            d2h.append((a, b))
        elif cat == "kernel":
            kernels.append((a, b))
            key = ev.get("name", "")[:60]
            names[key] = names.get(key, 0.0) + (b - a)
    span = t1_us - t0_us
    width = span / bins
    rows = []
    for i in range(bins):
        lo, hi = t0_us + i * width, t0_us + (i + 1) * width
        clip = lambda s: [(max(a, lo), min(b, hi)) for a, b in s if b > lo and a < hi]  # noqa: E731
        rows.append({"from_ms": round((lo - t0_us) / 1e3, 1), "d2h_busy": round(_union(clip(d2h)) / width, 2),
                     "kernel_busy": round(_union(clip(kernels)) / width, 2)})
    top = sorted(names.items(), key=lambda kv: -kv[1])[:8]
    return {"window_ms": round(span / 1e3, 1), "d2h_busy_ms": round(_union(d2h) / 1e3, 1),
            "kernel_busy_ms": round(_union(kernels) / 1e3, 1), "either_busy_ms": round(_union(d2h + kernels) / 1e3, 1),
            "kernels_ms": {k: round(v / 1e3, 2) for k, v in top}, "bins": rows}


def _torch_heads(u):
    """The heads' rounding through torch's CPU ops (the code before numpy): for ``heads=torch``."""
    import numpy as np

    from nvckpt.plan.derived import bf16_rne

    return bf16_rne(torch.from_numpy(u.view(np.float32))).view(torch.int16).numpy().view("<u2")


def _variant(spec: str, base: dict) -> tuple[dict, float | None, bool, int | None, bool, bool]:
    """(async_save keywords, switch interval, native ANS, halves, garbage collection on, torch heads) of one
    --ab variant."""
    from nvckpt.options import GpuSaveOptions

    kw: dict = {}
    gpu = dict(base)
    switch, native, halves, collect, torch_heads = None, True, None, True, False
    for part in filter(None, spec.split("+")):
        if part == "base":
            continue
        key, _, value = part.partition("=")
        if key == "chunk":
            kw["chunk_size"] = int(float(value) * (1 << 20))
        elif key == "switch":
            switch = float(value)
        elif key == "derive":
            kw["derive"] = value not in ("0", "false", "no")
        elif key == "inflight":
            gpu["inflight"] = int(value)
        elif key == "native":
            native = value not in ("0", "false", "no")
        elif key == "halves":
            halves = int(value)
        elif key == "gc":
            collect = value not in ("0", "false", "no")
        elif key == "heads":
            torch_heads = value == "torch"
        else:
            raise SystemExit(f"unknown --ab variant {part!r}")
    kw["gpu"] = GpuSaveOptions(**gpu)
    return kw, switch, native, halves, collect, torch_heads


class _GcClock:
    """Time the garbage collector ran (all generations) and its gen-2 collections, from gc.callbacks."""

    def __init__(self) -> None:
        self.seconds, self.full, self._t = 0.0, 0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t
            self.full += info.get("generation") == 2


def _thread_usage() -> tuple[float, float, int, int, int]:
    """(wall, this thread's CPU seconds, minor faults, voluntary and involuntary context switches)."""
    u = resource.getrusage(resource.RUSAGE_THREAD)
    return time.perf_counter(), u.ru_utime + u.ru_stime, u.ru_minflt, u.ru_nvcsw, u.ru_nivcsw


class _Trace:
    """Wall, thread CPU, faults and switches of the planning's steps in the caller's thread, per save."""

    STEPS = [("nvckpt", "async_save"), ("nvckpt.session.save", "SaveSession.__init__"),
             ("nvckpt.session.save", "SaveSession.prepare_async"), ("nvckpt.plan.walk", "SavePlan.decide"),
             ("nvckpt.session.save", "plan_save"), ("nvckpt.plan.derived", "DerivedSearch.__init__"),
             ("nvckpt.plan.derived", "_head_addresses"), ("nvckpt.plan.derived", "_gather_heads"),
             ("nvckpt.plan.derived", "_Heads._make"), ("nvckpt.plan.derived", "_rows"),
             ("nvckpt.plan.walk", "_dedupe"), ("nvckpt.engines.gpu.snapshot", "clone_host_tensors")]
    MEMORY = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")

    def __init__(self) -> None:
        import importlib

        self.main = threading.get_ident()
        self.steps: dict[str, list[float]] = {}
        for module, name in self.STEPS:
            m = importlib.import_module(module)
            owner, attr = (getattr(m, name.split(".")[0]), name.split(".")[1]) if "." in name else (m, name)
            if hasattr(owner, attr):
                setattr(owner, attr, self._wrap(name, getattr(owner, attr)))

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            if threading.get_ident() != self.main:
                return fn(*a, **k)
            u0 = _thread_usage()
            try:
                return fn(*a, **k)
            finally:
                u1 = _thread_usage()
                acc = self.steps.setdefault(name, [0.0] * 5)
                for i in range(5):
                    acc[i] += u1[i] - u0[i]
        return timed

    def begin(self) -> None:
        self.steps = {}
        self._mem = torch.cuda.memory_stats()
        self._u = _thread_usage()

    def row(self) -> dict:
        mem = torch.cuda.memory_stats()
        u = _thread_usage()
        def usage(a) -> dict:
            return {"wall_ms": round(a[0] * 1e3, 2), "cpu_ms": round(a[1] * 1e3, 2), "faults": int(a[2]),
                    "vol_switches": int(a[3]), "invol_switches": int(a[4])}

        out = {name: usage(a) for name, a in self.steps.items()}
        out["caller_whole_save"] = usage([x - y for x, y in zip(u, self._u)])
        out["cuda_allocator"] = {k: mem.get(k, 0) - self._mem.get(k, 0) for k in self.MEMORY}
        return out


def ab(args: argparse.Namespace, save, base: dict) -> dict:
    variants = [v.strip() for v in args.ab.split(",") if v.strip()]
    parsed = {v: _variant(v, base) for v in variants}
    try:
        from nvckpt.codecs.nvcomp import native  # absent from trees older than the C-API encoder
    except ImportError:
        native = None
    from nvckpt.engines.gpu import encode
    from nvckpt.plan import derived

    for _ in range(args.warm):
        save()
    clock = _GcClock()
    trace = _Trace() if args.trace else None
    rows: dict[str, list] = {v: [] for v in variants}
    for rep in range(args.reps):
        for v in (variants if rep % 2 == 0 else variants[::-1]):
            kw, switch, use_native, halves, collect, torch_heads = parsed[v]
            old = sys.getswitchinterval()
            old_halves = encode._halves
            if halves is not None:
                encode._halves = lambda scratch, n=halves: n + 2 if scratch else n
            if switch is not None:
                sys.setswitchinterval(switch)
            if native is not None:
                native.ENABLED = use_native
            if not collect:
                gc.disable()
            numpy_heads = getattr(derived, "_rne_bits_numpy", None)
            if torch_heads and numpy_heads is not None:
                derived._rne_bits_numpy = _torch_heads
            g0, f0 = clock.seconds, clock.full
            if trace is not None:
                trace.begin()
            try:
                row, _, blocked = save(**kw)
            finally:
                gc.enable()
                sys.setswitchinterval(old)
                encode._halves = old_halves
                if numpy_heads is not None:
                    derived._rne_bits_numpy = numpy_heads
                if native is not None:
                    native.ENABLED = True
            rows[v].append({"blocked_s": round(blocked, 4), "phases": row["phases"], "chunks": row["chunks"],
                            "batches": row["batches"], "tensors_read_s": row["tensors_read_s"],
                            "setup_s": row["setup_s"], "stored_bytes": row["stored_bytes"],
                            "raw_chunks": row["stats"].get("raw_chunks"), "extra_gpu_GB": row["extra_gpu_GB"],
                            "batch_bytes": row["batch_bytes"], "gc_s": round(clock.seconds - g0, 4),
                            "gc_full": clock.full - f0})
            if trace is not None:
                rows[v][-1]["trace"] = trace.row()
                t = rows[v][-1]["trace"]
                print(v, rows[v][-1]["blocked_s"], {k: (x["wall_ms"], x["cpu_ms"], x["faults"], x["vol_switches"],
                                                        x["invol_switches"]) if "wall_ms" in x else x
                                                    for k, x in t.items()}, flush=True)
    loads: dict[str, list] = {}
    if args.load:  # each variant's file read back to the GPU from the page cache: what its chunking costs a load
        import nvckpt

        args.release()  # the filler: a load makes every tensor anew
        for rep in range(2):
            for v in variants:
                kw = parsed[v][0]
                save(**kw)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                state = nvckpt.load(args.path, device="cuda")
                torch.cuda.synchronize()
                loads.setdefault(v, []).append(round(time.perf_counter() - t0, 4))
                del state
    summary = {}
    for v, rs in rows.items():
        b = sorted(r["blocked_s"] for r in rs)
        summary[v] = {"median_blocked_s": b[len(b) // 2], "min_blocked_s": b[0], "max_blocked_s": b[-1],
                      "extra_gpu_GB": max(r["extra_gpu_GB"] for r in rs), "batch_bytes": rs[0]["batch_bytes"],
                      "chunks": rs[0]["chunks"], "batches": rs[0]["batches"], "raw_chunks": rs[0]["raw_chunks"],
                      "stored_bytes": rs[0]["stored_bytes"]}
        if v in loads:
            summary[v]["load_s"] = min(loads[v])
        print(f"{v:28s} load {min(loads[v]) if v in loads else '-'} blocked median {b[len(b) // 2]:.4f} min {b[0]:.4f} max {b[-1]:.4f} "
              f"chunks {rs[0]['chunks']} raw {rs[0]['raw_chunks']} batches {rs[0]['batches']} "
              f"stored {rs[0]['stored_bytes']} extra GPU {summary[v]['extra_gpu_GB']} GB", flush=True)
    return {"variants": variants, "reps": args.reps, "summary": summary, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--workdir", default="/tmp/nvckpt-probe")
    ap.add_argument("--free", type=float, default=3.0)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--inflight", type=int, default=None, help="GpuSaveOptions.inflight for every save (default: its default)")
    ap.add_argument("--ab", default=None, help="comma-separated variants to compare (see the module's docstring)")
    ap.add_argument("--reps", type=int, default=5, help="saves per variant with --ab")
    ap.add_argument("--trace", action="store_true", help="with --ab: the planning's steps per save (see the docstring)")
    ap.add_argument("--load", action="store_true", help="with --ab: also time a load of each variant's file to the GPU")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.workdir, exist_ok=True)
    import nvckpt
    from nvckpt.options import GpuSaveOptions

    tr = bench_training.trained(args.steps)
    filler = [bench_training.fill_gpu(tr, args.free * 1e9)]  # kept alive (args.release() lets it go)

    def release() -> None:
        filler.clear()
        torch.cuda.empty_cache()

    args.release = release
    out: dict = {"free_GB": args.free, "saves": []}
    path = os.path.join(args.workdir, "probe")
    args.path = path

    base = {} if args.inflight is None else {"inflight": args.inflight}

    def save(**kw):
        kw.setdefault("gpu", GpuSaveOptions(**base))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        alloc0 = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        fut = nvckpt.async_save(tr.checkpoint(), path, **kw)
        blocked = time.perf_counter() - t0
        res = fut.result()
        extra = torch.cuda.max_memory_allocated() - alloc0
        tr.step()
        st = res.stats
        row = {"blocked_s": round(blocked, 4), "phases": st.get("phases"), "setup_s": st.get("setup_seconds"),
               "tensors_read_s": st.get("tensors_read_seconds"), "waits": st.get("waits"),
               "batches": st.get("batches"), "chunks": st.get("chunks"), "stored_bytes": st.get("stored_bytes"),
               "raw_bytes": st.get("raw_bytes"), "gather": st.get("gather"), "batch_bytes": st.get("batch_bytes"),
               "extra_gpu_GB": round(extra / 1e9, 3)}
        row["stats"] = {k: v for k, v in st.items() if k not in row and len(json.dumps(v, default=str)) < 2000}
        return row, t0, blocked

    nvckpt.reserve_pinned_memory(6 << 30)
    if args.ab:
        out["ab"] = ab(args, save, base)
        harness.write_results(args.out, "probe_async_ab", out)
        return 0
    for i in range(args.warm):
        row, _, _ = save()
        out["saves"].append(row)
        print("warm", json.dumps(row, default=str)[:1500], flush=True)
    row, _, _ = save(gpu=GpuSaveOptions(timing=True, **base))
    out["timed"] = row
    print("timed", json.dumps(row, default=str)[:3000], flush=True)

    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()  # Python >= 3.12: every thread, so the engine's host work too
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pr.enable()
    fut = nvckpt.async_save(tr.checkpoint(), path, gpu=GpuSaveOptions(**base))
    pr.disable()  # the blocked window only
    blocked = time.perf_counter() - t0
    fut.result()
    tr.step()
    text = io.StringIO()
    text.write(f"blocked {blocked:.4f} s (under cProfile)\n")
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(45)
    pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(45)
    with open(os.path.join(args.out, "probe_async_profile.txt"), "w") as f:
        f.write(text.getvalue())

    from torch.profiler import ProfilerActivity, profile

    trace_path = os.path.join(args.workdir, "trace.json")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        mark0 = torch.cuda.Event()
        row, t0, blocked = save()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        trace = json.load(f)
    # The window: from the async_save call (the first nvckpt-side CPU event) for the blocked time.
    cpu = [ev for ev in trace["traceEvents"] if ev.get("ph") == "X" and ev.get("cat") in ("cpu_op", "cuda_runtime", "python_function")]
    start = min(float(ev["ts"]) for ev in cpu)
    out["profiled"] = row
    out["gpu_timeline"] = timeline(trace, start, start + blocked * 1e6)
    del mark0
    print("profiled", json.dumps(out["gpu_timeline"], indent=0), flush=True)
    harness.write_results(args.out, "probe_async", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
