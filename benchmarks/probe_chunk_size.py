#!/usr/bin/env python3
"""What the GPU engine's chunk size costs and buys, on bench_training's training state (7.2 GB, 514M params).

For each chunk size (``--sizes`` in MiB), alternating, ``--reps`` times: a synchronous ``nvckpt.save`` (s, file
bytes), a plain ``async_save`` (caller blocked s, whole save s), a load to the GPU (page cache dropped first
where the process may, else from the page cache: said in the JSON), and reading 8 rows of the largest tensor
(``open`` + ``get_slice``, decoded on the GPU).  A diagnostic beside probe_slowdown's ``async_16m`` (the step's
slowdown while the save's writer runs); JSON under --out.

    python3 benchmarks/probe_chunk_size.py --out DIR [--sizes 4,16] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_training  # noqa: E402
import harness  # noqa: E402


def drop_cache(path: str) -> bool:
    """Evict ``path`` from the page cache; True if it could."""
    return harness.cache_dropped(harness.drop_page_cache([path]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--workdir", default="/tmp/nvckpt-chunks")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sizes", default="4,16")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.workdir, exist_ok=True)
    import nvckpt

    tr = bench_training.trained(args.steps)
    state = tr.checkpoint()
    biggest = max(((k, v) for k, v in state["model"].items()), key=lambda kv: kv[1].nbytes)[0]
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: dict[int, list[dict]] = {s: [] for s in sizes}
    path = os.path.join(args.workdir, "ckpt")
    nvckpt.save(state, path)  # warm: pinned memory, plans, nvCOMP
    for rep in range(args.reps):
        for mib in (sizes if rep % 2 == 0 else sizes[::-1]):
            chunk = mib << 20
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = nvckpt.save(state, path, chunk_size=chunk)
            save_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            fut = nvckpt.async_save(state, path + ".async", chunk_size=chunk)
            blocked = time.perf_counter() - t0
            async_s = fut.result().seconds
            dropped = drop_cache(path)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loaded = nvckpt.load(path, device="cuda")
            torch.cuda.synchronize()
            load_s = time.perf_counter() - t0
            del loaded
            drop_cache(path)
            t0 = time.perf_counter()
            with nvckpt.open(path, device="cuda") as ck:
                part = ck.get_slice(f"model/{biggest}")[100:108]
                torch.cuda.synchronize()
            rows_s = time.perf_counter() - t0
            assert torch.equal(part, state["model"][biggest][100:108])
            row = {"rep": rep, "file_bytes": r.file_bytes, "raw_bytes": r.raw_bytes, "ratio": round(r.ratio, 5), "chunks": r.stats.get("chunks"), "save_s": round(save_s, 3),
                   "async_blocked_s": round(blocked, 4), "async_s": round(async_s, 3), "load_s": round(load_s, 3),
                   "page_cache_dropped": dropped, "rows_s": round(rows_s, 4)}
            rows[mib].append(row)
            print(mib, json.dumps(row), flush=True)
    summary = {mib: {k: statistics.median(r[k] for r in rs) for k in ("file_bytes", "ratio", "save_s", "async_blocked_s", "async_s",
                                                                     "load_s", "rows_s")} for mib, rs in rows.items()}
    for mib, s in summary.items():
        print(f"{mib} MiB: {s}")
    out = {"date": harness.utc_date(), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__,
           "largest": biggest, "summary": summary, "rows": rows}
    harness.write_results(args.out, "probe_chunk_size", out)
    for p in (path, path + ".async"):
        if os.path.exists(p):
            os.unlink(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
