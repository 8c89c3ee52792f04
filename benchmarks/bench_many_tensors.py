#!/usr/bin/env python3
"""States of very many small tensors: open and load of nvckpt against torch.load (issue 52's targets for a
million tensors: open in 2 s and 300 MB, load in 3x torch.load's time).

The state is ``{"m<i // 1000>.p<i % 1000>": torch.full((1 + i % 4,), float(i))}`` (float32, 1-4 elements),
saved once by ``nvckpt.save`` and ``torch.save``.  Each measurement runs in a fresh process (torch imported
before the clock starts): wall and CPU seconds (CPU is what a loaded shared machine still tells apart) and the
peak resident memory it added.  JSON and a markdown table under --out.

    python3 benchmarks/bench_many_tensors.py --n 100000 1048576 --out benchmarks/results [--reps 1]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

_MEASURE = r"""
import json, resource, sys, time, torch, nvckpt
mode, path = sys.argv[1], sys.argv[2]
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
w, c = time.perf_counter(), time.process_time()
if mode == "open":
    ck = nvckpt.open(path)
    ck.keys()
elif mode == "load":
    s = nvckpt.load(path)
else:
    s = torch.load(path)
w, c = time.perf_counter() - w, time.process_time() - c
print(json.dumps({"wall_s": w, "cpu_s": c,
                  "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0) / 1024}))
"""


def make(n: int, workdir: str) -> tuple[str, str]:
    import torch

    import nvckpt

    path, tpath = os.path.join(workdir, f"many_{n}.nvckpt"), os.path.join(workdir, f"many_{n}.pt")
    if not (os.path.exists(path) and os.path.exists(tpath)):
        state = {f"m{i // 1000}.p{i % 1000}": torch.full((1 + i % 4,), float(i)) for i in range(n)}
        nvckpt.save(state, path)
        torch.save(state, tpath)
    return path, tpath


def measure(mode: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, mode, path], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[100_000, 1 << 20])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--out", default=".")
    ap.add_argument("--workdir", default="/tmp/nvckpt-many")
    ap.add_argument("--name", default="bench_many_tensors")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.workdir, exist_ok=True)
    import torch

    rows = []
    for n in args.n:
        path, tpath = make(n, args.workdir)
        for rep in range(args.reps):
            load_before = os.getloadavg()[0]
            row = {"tensors": n, "rep": rep, "file_mb": os.path.getsize(path) / 1e6,
                   "torch_file_mb": os.path.getsize(tpath) / 1e6, "loadavg": round(load_before, 1)}
            for mode, p in (("open", path), ("load", path), ("torch.load", tpath)):
                row[mode] = {k: round(v, 3) for k, v in measure(mode, p).items()}
            row["load_over_torch_cpu"] = round(row["load"]["cpu_s"] / row["torch.load"]["cpu_s"], 2)
            row["load_over_torch_wall"] = round(row["load"]["wall_s"] / row["torch.load"]["wall_s"], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)",
              "python": platform.python_version(), "torch": torch.__version__, "rows": rows}
    with open(os.path.join(args.out, args.name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# {args.name}", "", f"{result['date']}, {result['hardware']}, Python {result['python']}, "
             f"torch {result['torch']}: `{result['command']}`. Wall and CPU seconds, peak RSS added (MB); a fresh "
             "process each, torch imported first. loadavg: the machine's 1-minute load average before the row.", "",
             "| tensors | file MB | loadavg | open s (cpu) | open MB | load s (cpu) | load MB | torch.load s (cpu) "
             "| torch.load MB | load / torch.load (cpu) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, l, t = r["open"], r["load"], r["torch.load"]
        lines.append(f"| {r['tensors']:,} | {r['file_mb']:.0f} | {r['loadavg']} | {o['wall_s']:.2f} ({o['cpu_s']:.2f}) "
                     f"| {o['peak_mb']:.0f} | {l['wall_s']:.2f} ({l['cpu_s']:.2f}) | {l['peak_mb']:.0f} "
                     f"| {t['wall_s']:.2f} ({t['cpu_s']:.2f}) | {t['peak_mb']:.0f} | {r['load_over_torch_cpu']} |")
    with open(os.path.join(args.out, args.name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
