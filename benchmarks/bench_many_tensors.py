#!/usr/bin/env python3
"""States of very many small tensors: open and load of nvckpt against torch.load (issue 52's targets for a
million tensors: open in 2 s and 300 MB, load in 3x torch.load's time).

The state is ``{"m<i // 1000>.p<i % 1000>": torch.full((1 + i % 4,), float(i))}`` (float32, 1-4 elements),
saved once by ``nvckpt.save`` and ``torch.save``.  Each measurement runs in a fresh process (torch imported
before the clock starts): wall and CPU seconds (CPU is what a loaded shared machine still tells apart) and the
peak resident memory it added (Linux: VmHWM reset through /proc/self/clear_refs).  JSON and a markdown table under --out.

    python3 benchmarks/bench_many_tensors.py --n 100000 1048576 --torch-upto 100000 --out benchmarks/results
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

_MEASURE = r"""
import json, sys, time, torch, nvckpt
import nvckpt.session.load  # (imports are not what is measured)
mode, path = sys.argv[1], sys.argv[2]
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from here
r0 = status("VmRSS")
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
                  "peak_mb": (status("VmHWM") - r0) / 1024}))
"""


def make(n: int, workdir: str, torch_file: bool) -> tuple[str, str]:
    import torch

    import nvckpt

    path, tpath = os.path.join(workdir, f"many_{n}.nvckpt"), os.path.join(workdir, f"many_{n}.pt")
    state = {f"m{i // 1000}.p{i % 1000}": torch.full((1 + i % 4,), float(i)) for i in range(n)}
    if not os.path.exists(path):
        nvckpt.save(state, path)
    if torch_file and not os.path.exists(tpath):
        torch.save(state, tpath + ".part")
        os.replace(tpath + ".part", tpath)
    return path, tpath


def measure(mode: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, mode, path], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(result: dict, name: str) -> str:
    lines = [f"# {name}", "", f"{result['date']}, {result['hardware']}, Python {result['python']}, "
             f"torch {result['torch']}: `{result['command']}`. Wall and CPU seconds, peak RSS added (MB); a fresh "
             "process each, torch and nvckpt imported first; open is `nvckpt.open(path)` and `.keys()`. loadavg: the "
             "machine's 1-minute load average before the row; on shared cores compare CPU seconds.", "",
             "| tensors | file MB | loadavg | open s (cpu) | open MB | load s (cpu) | load MB | torch.load s (cpu) "
             "| torch.load MB | load / torch.load (cpu) |", "|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r: dict, mode: str) -> str:
        m = r.get(mode)
        return "-- | --" if m is None else f"{m['wall_s']:.2f} ({m['cpu_s']:.2f}) | {m['peak_mb']:.0f}"

    for r in result["rows"]:
        lines.append(f"| {r['tensors']:,} | {r['file_mb']:.0f} | {r['loadavg']} | {cell(r, 'open')} | {cell(r, 'load')} "
                     f"| {cell(r, 'torch.load')} | {r.get('load_over_torch_cpu', '--')} |")
    lines += ["", "Targets (issue 52) for 1,048,576 tensors: open and keys() in at most 2 s and 300 MB; load in at most "
              "3x torch.load's time for the same state."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[100_000, 1 << 20])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["open", "load", "torch.load"],
                    help="what to measure (torch.load of a million tensors takes minutes)")
    ap.add_argument("--torch-upto", type=int, default=None,
                    help="measure torch.load only for states of at most this many tensors")
    ap.add_argument("--out", default=".")
    ap.add_argument("--workdir", default="/tmp/nvckpt-many")
    ap.add_argument("--name", default="bench_many_tensors")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.workdir, exist_ok=True)
    import torch

    rows = []
    for n in args.n:
        modes = [m for m in args.modes if m != "torch.load" or args.torch_upto is None or n <= args.torch_upto]
        path, tpath = make(n, args.workdir, "torch.load" in modes)
        for rep in range(args.reps):
            load_before = os.getloadavg()[0]
            row = {"tensors": n, "rep": rep, "file_mb": os.path.getsize(path) / 1e6,
                   "torch_file_mb": os.path.getsize(tpath) / 1e6 if "torch.load" in modes else None,
                   "loadavg": round(load_before, 1)}
            for mode, p in (("open", path), ("load", path), ("torch.load", tpath)):
                if mode in modes:
                    row[mode] = {k: round(v, 3) for k, v in measure(mode, p).items()}
            if "load" in row and "torch.load" in row:
                row["load_over_torch_cpu"] = round(row["load"]["cpu_s"] / row["torch.load"]["cpu_s"], 2)
                row["load_over_torch_wall"] = round(row["load"]["wall_s"] / row["torch.load"]["wall_s"], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": harness.command_line(__file__, sys.argv[1:]),
              "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)",
              "python": platform.python_version(), "torch": torch.__version__, "rows": rows}
    if harness.write_results(args.out, args.name, result, lambda: markdown(result, args.name)) is None:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
