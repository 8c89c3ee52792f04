#!/usr/bin/env python3
"""Planning a save of a training state of many tensors: a new layout against one saved before.

The state has the structure of bench_training's (bf16 weights, fp32 master, Adam moments and step
counts by parameter name: 1460 tensors for 24 layers) with small tensors, so that what is measured is
the host time per tensor, not bytes: the walk, the search for derived tensors, and their verification
(on CPU here), for the first save of a layout (``plan.layout`` empty) and for a later save of it.

    python3 benchmarks/bench_plan.py --out DIR [--layers 24] [--reps 15]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu  # noqa: E402  (the GPT model of the GPU benchmarks)
import harness  # noqa: E402

from nvckpt.plan import layout  # noqa: E402
from nvckpt.plan.walk import plan_save  # noqa: E402


def state(layers: int) -> dict:
    torch.manual_seed(0)
    model = bench_gpu.GPT(1000, 64, layers, 1, 32)
    names = [n for n, _ in model.named_parameters()]
    master = [p.detach().float().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    params = list(model.parameters())
    for m in master:
        m.grad = torch.randn_like(m)
    opt = torch.optim.AdamW(master)
    opt.step()
    with torch.no_grad():
        for p, m in zip(params, master):
            p.copy_(m)
    st = opt.state
    return {"model": {n: p.detach() for n, p in zip(names, params)},
            "master": {n: m.detach() for n, m in zip(names, master)},
            "optim": {"exp_avg": {n: st[m]["exp_avg"] for n, m in zip(names, master)},
                      "exp_avg_sq": {n: st[m]["exp_avg_sq"] for n, m in zip(names, master)},
                      "step": {n: st[m]["step"] for n, m in zip(names, master)}},
            "meta": {"step": 1, "lr": 1e-3}}


def once(ck: dict, fresh: bool) -> dict[str, float]:
    if fresh:
        layout.forget()
    t0 = time.perf_counter()
    plan = plan_save(ck, derive=True, copies=True, defer=True)
    t1 = time.perf_counter()
    plan.decide()
    t2 = time.perf_counter()
    assert plan.layout_reused is not fresh
    return {"plan_ms": (t1 - t0) * 1e3, "walk_ms": plan.seconds["walk"] * 1e3, "search_ms": plan.seconds["derived"] * 1e3,
            "verify_ms": (t2 - t1) * 1e3, "derived": sum(1 for t in plan.tensors if "derived" in t.entry),
            "searched": plan.searched}


def markdown(doc: dict) -> str:
    info = doc["info"]
    lines = [f"# Planning a save of {info['tensors']} tensors ({info['date']}, code {info['commit']})", "",
             f"Command: `{info['command']}`  ",
             f"Hardware: {info['cpu']}, {info['cores']} cores; Python {info['python']}, torch {info['torch']}; "
             f"median of {info['reps']}, interleaved; host milliseconds.", "",
             "| save | plan (walk + search) | walk | derived-tensor search | verify (CPU) | derived found |",
             "|---|---|---|---|---|---|"]
    for k, s in doc["summary"].items():
        lines.append(f"| {k} | {s['plan_ms']:.2f} | {s['walk_ms']:.2f} | {s['search_ms']:.2f} | {s['verify_ms']:.2f} | "
                     f"{s['derived']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ck = state(args.layers)
    ntensors = sum(len(v) for v in (ck["model"], ck["master"])) + sum(len(v) for v in ck["optim"].values())
    gc.disable()  # as async_save does while its caller waits: a collection pass is not planning's cost
    rows: dict[str, list[dict]] = {"new layout": [], "known layout": []}
    once(ck, True)  # warm-up: imports, first allocations
    for _ in range(args.reps):  # interleaved: a new layout, then a later save of it
        rows["new layout"].append(once(ck, True))
        rows["known layout"].append(once(ck, False))
    gc.enable()
    summary = {k: {m: round(statistics.median(r[m] for r in v), 2) for m in ("plan_ms", "walk_ms", "search_ms", "verify_ms")}
               | {"derived": v[0]["derived"], "searched": v[0]["searched"]} for k, v in rows.items()}
    info = {"date": harness.utc_date(), "commit": harness.code_commit(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "tensors": ntensors, "reps": args.reps,
            "command": f"python3 benchmarks/bench_plan.py --out OUT --layers {args.layers} --reps {args.reps}"}
    doc = {"info": info, "summary": summary, "rows": rows}
    if harness.write_results(args.out, "bench_plan", doc, lambda: markdown(doc), echo=True) is None:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
