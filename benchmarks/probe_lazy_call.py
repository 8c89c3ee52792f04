#!/usr/bin/env python3
"""Where a lazy async_save's call spends its time (a diagnostic beside bench_training).

Trains bench_training's model (514M GPT: 292 parameters, a state of 1,460 tensors of which the optimizer
owns 1,168) a few steps, then times, interleaved round-robin so that the machine's drift hits each alike,
the steps of the call: the optimizer's storages looked up, the containers copied, the walk that looks every
tensor up against them, the copies of the small tensors the optimizer does not own (each into its own pinned
buffer; into slices of one; gathered on the GPU first), and the whole ``nvckpt.async_save(fence=opt)`` call
(its save waited for outside the timing).  JSON under --out.

    python3 benchmarks/probe_lazy_call.py --out DIR [--reps 30] [--steps 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_training  # noqa: E402
import harness  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--workdir", default="/tmp/nvckpt-probe")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.workdir, exist_ok=True)
    import nvckpt
    from nvckpt.session import fence as S

    tr = bench_training.trained(args.steps)
    ck = tr.checkpoint()
    fences = [tr.opt]
    owned = S.owned_storages(fences)
    small = {}  # the storages a lazy call copies: not owned, at most UNFENCED_COPY_BYTES
    for t in bench_training.bench_gpu.flat_tensors(ck).values():
        p = S.storage_ptr(t)
        if p not in owned and t.untyped_storage().nbytes() <= S.UNFENCED_COPY_BYTES:
            small[p] = t.untyped_storage()
    srcs = [torch.empty(0, dtype=torch.uint8, device="cuda").set_(s) for s in small.values()]
    total = sum(s.nbytes() for s in small.values())
    align = 256
    offsets, at = [], 0
    for s in small.values():
        offsets.append(at)
        at += -(-s.nbytes() // align) * align

    def leaf_ptr(t):
        return S.storage_ptr(t) in owned

    def each_pinned():
        for s in srcs:
            torch.empty(s.numel(), dtype=torch.uint8, pin_memory=True).copy_(s, non_blocking=True)

    def one_pinned():
        buf = torch.empty(at, dtype=torch.uint8, pin_memory=True)
        for s, o in zip(srcs, offsets):
            buf[o: o + s.numel()].copy_(s, non_blocking=True)

    def gathered():
        g = torch.cat(srcs)
        buf = torch.empty(g.numel(), dtype=torch.uint8, pin_memory=True)
        buf.copy_(g, non_blocking=True)

    def pinned_allocs():
        for s in srcs:
            torch.empty(s.numel(), dtype=torch.uint8, pin_memory=True)

    def results():
        for t in bench_training.bench_gpu.flat_tensors(ck).values():
            if S.storage_ptr(t) in small:
                torch.empty(0, dtype=t.dtype).set_(torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8)
                                                   .untyped_storage(), t.storage_offset(), t.size(), t.stride())

    futures = []

    def call():
        futures.append(nvckpt.async_save(ck, os.path.join(args.workdir, "lazy.nvckpt"), fence=tr.opt))

    variants = {
        "owned storages": lambda: S.owned_storages(fences),
        "containers copied": lambda: S.containers(ck),
        "walk: each tensor looked up": lambda: S.containers(ck, leaf_ptr),
        "copy_unfenced (the call's walk and copies)": lambda: S.copy_unfenced(ck, fences, lambda d: 1 << 30),
        "small copies: a pinned buffer each": each_pinned,
        "small copies: pinned allocations only": pinned_allocs,
        "small copies: slices of one pinned buffer": one_pinned,
        "small copies: gathered on the GPU, one copy": gathered,
        "result tensors made (set_)": results,
        "async_save(fence=opt) call": call,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    gc.collect()
    gc.disable()  # as in the call: a collection pass would land on whichever variant made the garbage
    for rep in range(args.reps + 2):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            for f in futures:
                f.result()
            futures.clear()
            if rep >= 2:  # two warm-up rounds
                times[name].append(t1 - t0)
    out = {"small_storages": len(small), "small_bytes": total,
           "state_tensors": len(bench_training.bench_gpu.flat_tensors(ck)),
           "owned_storages": len(owned.ptrs), "reps": args.reps, "torch": torch.__version__,
           "ms": {k: {"median": round(statistics.median(v) * 1e3, 3), "min": round(min(v) * 1e3, 3),
                      "max": round(max(v) * 1e3, 3)} for k, v in times.items()}}
    print(json.dumps(out, indent=1))
    harness.write_results(args.out, "probe_lazy_call", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
