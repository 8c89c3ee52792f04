"""Cold loads of a training state to the GPU, side by side with the disk's best O_DIRECT read rate.

On one CUDA GPU, in one run:

1. a mixed-precision training state is built on the GPU (``--size`` GB of tensors: bf16 weights that are
   the roundings of an fp32 master copy, AdamW's two moments; transformer-shaped matrices);
2. it is written by every peer (nvckpt, torch.save, safetensors.torch.save_file), each file fsynced;
3. the disk's best O_DIRECT read rate of the nvckpt file is measured (several thread counts and block
   sizes, large aligned blocks);
4. every peer loads its file to the GPU with the page cache dropped first: nvckpt with its O_DIRECT
   pinned pipeline, with KvikIO (GPUDirect Storage, or KvikIO's compatibility mode) and with "auto";
   torch.load(map_location="cuda"); safetensors.torch.load_file(device="cuda"); fastsafetensors
   (if importable); each load is checked bit-exact against the state.

The page cache is dropped with ``/proc/sys/vm/drop_caches`` where the process may write it (root), and
always with ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file to be read (which evicts its clean pages
without root); the results say which worked.  Every peer runs in try/except: an error is recorded and the
run goes on; results are written after every step, so a run cut short keeps what it measured.

    python3 benchmarks/bench_gpu_load.py --out OUT_DIR [--size GB] [--skip PEER ...] [--workdir DIR]

Writes OUT_DIR/bench_gpu_load.json and OUT_DIR/bench_gpu_load.md (date, card, software, command).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import mmap
import os
import platform
import shlex
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import log  # noqa: E402

GB = 1e9
MiB = 1 << 20
PEERS = ("nvckpt", "nvckpt-kvikio", "nvckpt-auto", "torch", "safetensors", "fastsafetensors")
R: dict[str, Any] = {"loads": {}, "saves": {}, "errors": {}}
OUT = "."
DEADLINE = [float("inf")]


def dump() -> None:
    harness.write_results(OUT, "bench_gpu_load", R, markdown, title="Cold loads to the GPU")


def guarded(name: str, fn: Callable[[], Any]) -> Any:
    """Run one step; its error is recorded (with the traceback's tail) and the run goes on."""
    if time.monotonic() > DEADLINE[0]:
        R["errors"][name] = "skipped: --budget-s exhausted"
        log(f"{name}: skipped (time budget)")
        dump()
        return None
    log(f"-- {name}")
    try:
        return fn()
    except BaseException as exc:  # noqa: BLE001 - a benchmark records every failure and goes on
        if isinstance(exc, KeyboardInterrupt):
            raise
        R["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
        log(f"{name} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        return None
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        dump()


# -- the page cache ---------------------------------------------------------------------------------------
def drop_cache(paths: list[str]) -> dict[str, Any]:
    """Evict ``paths`` from the page cache (harness.drop_page_cache); what it could do goes into the results."""
    done = harness.drop_page_cache(paths)
    R.setdefault("cache_drops", []).append(done)
    return done


# -- the state ------------------------------------------------------------------------------------------
def build_state(size_gb: float, dev: torch.device) -> dict[str, Any]:
    """A mixed-precision training state of about ``size_gb`` GB: per parameter matrix a bf16 weight (the
    rounding of its fp32 master copy), the master, and AdamW's exp_avg and exp_avg_sq (fp32), 14 bytes a
    parameter; matrices shaped like a transformer's (d, d), (d, 4d), (4d, d) with d = 2048."""
    g = torch.Generator(device=dev)
    g.manual_seed(1234)
    d = 2048
    shapes = [(d, d), (d, 4 * d), (4 * d, d)]
    model, master, exp_avg, exp_avg_sq = {}, {}, {}, {}
    total, i = 0, 0
    target = size_gb * GB
    while total < target:
        shape = shapes[i % len(shapes)]
        name = f"layers.{i // len(shapes)}.{('attn', 'up', 'down')[i % 3]}.weight"
        scale = 0.02 / (1 + (i % 7) / 7)  # layers at somewhat different scales
        w = torch.randn(shape, device=dev, generator=g) * scale
        master[name] = w
        model[name] = w.to(torch.bfloat16)
        m = torch.randn(shape, device=dev, generator=g) * (scale * 1e-2)
        exp_avg[name] = m
        exp_avg_sq[name] = m.square() * torch.rand(shape, device=dev, generator=g).add_(0.5) + 1e-12
        total += w.numel() * 14
        i += 1
    torch.cuda.synchronize(dev)
    return {"model": model, "optimizer": {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
            "step": 1000}


def flat(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}/"))
    elif isinstance(tree, torch.Tensor):
        out[prefix.rstrip("/")] = tree
    return out


def same(loaded: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> bool | str:
    """Bit-exact on the GPU: every tensor, same dtype, shape and bytes, on a CUDA device."""
    if set(loaded) != set(ref):
        return f"keys differ: {sorted(set(ref) ^ set(loaded))[:5]}"
    for k, v in ref.items():
        x = loaded[k]
        if x.device.type != "cuda":
            return f"{k} on {x.device}"
        if x.dtype != v.dtype or x.shape != v.shape:
            return f"{k}: {x.dtype}{tuple(x.shape)} vs {v.dtype}{tuple(v.shape)}"
        if not torch.equal(x.view(torch.uint8) if x.dtype != torch.uint8 and x.dim() else x,
                           v.view(torch.uint8) if v.dtype != torch.uint8 and v.dim() else v):
            return f"{k}: bytes differ"
    return True


def state_bytes(ref: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ref.values())


# -- the disk -----------------------------------------------------------------------------------------------
def odirect_read(path: str, threads: int, block: int) -> float:
    """GB/s reading the whole file with O_DIRECT: ``threads`` threads, each its own aligned ``block``-byte
    buffer, taking the next block in file order."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, block) for _ in range(threads)]  # page-aligned
    nxt = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        view = memoryview(bufs[k])
        try:
            while True:
                with lock:
                    at = nxt[0]
                    nxt[0] += block
                if at >= size:
                    return
                os.preadv(fd, [view], at)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        t0 = time.perf_counter()
        ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        for b in bufs:
            b.close()
    if errors:
        raise errors[0]
    return size / seconds / GB


def measure_disk(path: str, combos: list[tuple[int, int]]) -> None:
    rows = []
    for threads, block_mib in combos:
        drop_cache([path])
        try:
            rate = odirect_read(path, threads, block_mib * MiB)
            rows.append({"threads": threads, "block_MiB": block_mib, "GBps": rate})
            log(f"O_DIRECT read {threads} threads x {block_mib} MiB: {rate:.3f} GB/s")
        except OSError as exc:
            rows.append({"threads": threads, "block_MiB": block_mib, "error": f"{type(exc).__name__}: {exc}"})
        R["odirect_read"] = {"file": os.path.basename(path), "bytes": os.path.getsize(path), "runs": rows}
        dump()
    rates = [r["GBps"] for r in rows if "GBps" in r]
    R["odirect_read"]["best_GBps"] = max(rates) if rates else None


# -- the peers ----------------------------------------------------------------------------------------------
def timed_load(name: str, path: str, load: Callable[[], dict[str, torch.Tensor]], ref: dict[str, torch.Tensor],
               extra: Callable[[], dict[str, Any]] | None = None, files: list[str] | None = None) -> None:
    drop = drop_cache(files or [path])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = load()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    row: dict[str, Any] = {"seconds": seconds, "file_bytes": os.path.getsize(path), "cache_drop": drop}
    row["GBps_file"] = row["file_bytes"] / seconds / GB
    row["GBps_state"] = state_bytes(ref) / seconds / GB
    if extra is not None:
        row.update(extra())
    row["bit_exact"] = same(got, ref)
    del got
    R["loads"][name] = row
    log(f"{name}: {seconds:.3f} s ({row['GBps_state']:.2f} GB/s of state), bit_exact={row['bit_exact']}")


def nvckpt_load(path: str, ref: dict[str, torch.Tensor], read_path: str, name: str) -> None:
    import nvckpt

    stats: dict[str, Any] = {}

    def load() -> dict[str, torch.Tensor]:
        with nvckpt.open(path, device="cuda", gpu=nvckpt.GpuLoadOptions(read_path=read_path)) as ck:
            out = flat(ck.load())
            stats.update(ck.stats().get("last_gpu_load", {}))
        return out

    def extra() -> dict[str, Any]:
        keep = ("read_path", "bytes_read", "stored_bytes", "read_seconds", "read_busy_seconds", "read_GBps",
                "reads", "reads_in_flight_max", "read_buffers", "read_buffer_bytes", "check_seconds",
                "decode_seconds", "waiting_for_reads_seconds", "seconds", "phases", "cpu_decoded_chunks")
        return {"loader": {k: stats.get(k) for k in keep if k in stats}}

    timed_load(name, path, load, ref, extra)


def nvckpt_partial(path: str, ref: dict[str, torch.Tensor], what: str) -> None:
    """A cold ``get_tensor`` of the largest tensor, or a cold ``keys=`` load of one subtree (the Adam first
    moments): only their chunks are read, so the floor is the bytes read over the best read rate."""
    import nvckpt

    largest = max(ref, key=lambda k: ref[k].numel() * ref[k].element_size()) if what == "get_tensor" else None
    want = {largest: ref[largest]} if largest else {k: v for k, v in ref.items() if k.startswith("optimizer/exp_avg/")}
    name = f"nvckpt get_tensor({largest!r})" if largest else "nvckpt keys=['optimizer/exp_avg']"
    stats: dict[str, Any] = {}

    def load() -> dict[str, torch.Tensor]:
        with nvckpt.open(path, device="cuda") as ck:
            before = ck.bytes_read
            if largest:
                out = {largest: ck.get_tensor(largest)}
            else:
                out = {f"optimizer/exp_avg/{k}": v for k, v in ck.load("optimizer/exp_avg").items()}
            torch.cuda.synchronize()
            stats.update(ck.stats().get("last_gpu_load", {}), read_bytes=ck.bytes_read - before)
        return out

    def extra() -> dict[str, Any]:
        return {"read_bytes": stats.get("read_bytes"),
                "loader": {k: stats.get(k) for k in ("read_path", "bytes_read", "read_seconds", "read_GBps",
                                                     "decode_seconds", "seconds") if k in stats}}

    timed_load(name, path, load, want, extra)


def fastsafetensors_load(path: str, ref: dict[str, torch.Tensor]) -> None:
    from fastsafetensors import fastsafe_open

    mode: dict[str, Any] = {}

    def load() -> dict[str, torch.Tensor]:
        for nogds in (False, True):
            try:
                with fastsafe_open(filenames=[path], device="cuda:0", nogds=nogds) as f:
                    out = {k: f.get_tensor(k) for k in f.keys()}
                mode["gds"] = not nogds
                return out
            except Exception as exc:  # noqa: BLE001 - GDS missing: its own pinned reads next
                if nogds:
                    raise
                mode["gds_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        raise AssertionError("unreachable")

    timed_load("fastsafetensors", path, load, {k.replace("/", "."): v for k, v in ref.items()},
               lambda: dict(mode))


# -- the report ---------------------------------------------------------------------------------------------
def environment(argv: list[str]) -> None:
    def version(mod: str) -> str | None:
        try:  # import_module: __import__("nvidia.nvcomp") gives the package nvidia, which has no version
            return getattr(importlib.import_module(mod), "__version__", "?")
        except Exception as exc:  # noqa: BLE001
            return f"not importable ({type(exc).__name__})"

    R["date"] = harness.utc_date()
    R["command"] = harness.command_line(__file__, argv)
    R["card"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    R["host"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                 "nvidia_smi": harness.shell("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"),
                 "disk": harness.shell(f"df -h {shlex.quote(R.get('workdir', '/tmp'))} | tail -1"),
                 "mount": harness.shell(f"findmnt -no SOURCE,FSTYPE,OPTIONS -T {shlex.quote(R.get('workdir', '/tmp'))}")}
    R["software"] = {"torch": torch.__version__, "cuda": torch.version.cuda, "nvckpt": version("nvckpt"),
                     "nvckpt_commit": harness.code_commit(),
                     "safetensors": version("safetensors"), "fastsafetensors": version("fastsafetensors"),
                     "kvikio": version("kvikio"), "nvcomp": version("nvidia.nvcomp")}
    try:
        from nvckpt.io.gds import kvikio_mode, kvikio_module

        k = kvikio_module(False)
        R["kvikio_mode"] = kvikio_mode(k) if k is not None else None
    except Exception as exc:  # noqa: BLE001
        R["kvikio_mode"] = f"{type(exc).__name__}: {exc}"


def markdown() -> str:
    def f(v: Any, nd: int = 2) -> str:
        return "—" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)

    disk = R.get("odirect_read", {})
    best = disk.get("best_GBps")
    lines = ["# Cold loads to the GPU", "",
             f"{R.get('date')}, {R.get('card')} ({R.get('host', {}).get('nvidia_smi')}), {R.get('host', {}).get('cpus')} CPUs; "
             f"torch {R.get('software', {}).get('torch')}, nvckpt {R.get('software', {}).get('nvckpt')} "
             f"({R.get('software', {}).get('nvckpt_commit')}), safetensors {R.get('software', {}).get('safetensors')}, "
             f"fastsafetensors {R.get('software', {}).get('fastsafetensors')}, kvikio {R.get('software', {}).get('kvikio')} "
             f"(mode: {R.get('kvikio_mode')}).", "",
             f"Command: `{R.get('command')}`", "",
             f"State: {R.get('state', {}).get('description', '—')}; {f(R.get('state', {}).get('bytes', 0) / GB)} GB "
             f"in {R.get('state', {}).get('tensors')} tensors. Filesystem: {R.get('host', {}).get('mount')}.", "",
             "Page cache dropped before every read: " + ", ".join(sorted({
                 f"drop_caches={d.get('drop_caches')}, fadvise DONTNEED={d.get('fadvise_dontneed')}"
                 for d in R.get("cache_drops", [])})) + ".", ""]
    if disk.get("runs"):
        lines += ["## The disk: O_DIRECT reads of the nvckpt file", "", "| threads | block MiB | GB/s |", "|---|---|---|"]
        for r in disk["runs"]:
            lines.append(f"| {r['threads']} | {r['block_MiB']} | {f(r.get('GBps'), 3) if 'GBps' in r else r.get('error')} |")
        lines += ["", f"Best: **{f(best, 3)} GB/s**.", ""]
    if R.get("saves"):
        lines += ["## Files", "", "| peer | file GB | save s |", "|---|---|---|"]
        for k, v in R["saves"].items():
            lines.append(f"| {k} | {f(v.get('file_bytes', 0) / GB, 3)} | {f(v.get('seconds'))} |")
        lines.append("")
    if R.get("loads"):
        lines += ["## Cold loads to the GPU", "",
                  "| peer | s | GB/s of state | GB read | × read/best-read time | read path | loader read s / GB/s | decode s | bit-exact |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for k, v in R["loads"].items():
            floor = v.get("read_bytes", v["file_bytes"]) / (best * GB) if best else None
            ld = v.get("loader", {})
            lines.append(f"| {k} | {f(v['seconds'], 3)} | {f(v['GBps_state'])} | {f(v.get('read_bytes', v['file_bytes']) / GB, 3)} | "
                         f"{f(v['seconds'] / floor) if floor else '—'} | {ld.get('read_path', v.get('gds', '—'))} | "
                         f"{f(ld.get('read_seconds'))} / {f(ld.get('read_GBps'))} | {f(ld.get('decode_seconds'), 3)} | "
                         f"{v.get('bit_exact')} |")
        lines += ["", "× read/best-read time: the load's time over (the bytes it read: its whole file, or for a "
                  "get_tensor or keys= load its chunks, / the best O_DIRECT rate); the target for nvckpt is ≤ 1.05.", ""]
    if R.get("errors"):
        lines += ["## Errors", ""] + [f"- **{k}**: `{v.splitlines()[0][:300]}`" for k, v in R["errors"].items()] + [""]
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    global OUT
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for bench_gpu_load.json and bench_gpu_load.md")
    ap.add_argument("--size", type=float, default=4.0, help="GB of state (default 4)")
    ap.add_argument("--workdir", default="/tmp/nvckpt_bench_load", help="where the files are written")
    ap.add_argument("--skip", nargs="*", default=[], choices=PEERS + ("disk",), help="peers not to run")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new step after this many seconds")
    ap.add_argument("--disk", default="1x16,4x16,8x16,4x64,16x8",
                    help="O_DIRECT read runs, THREADSxBLOCK_MiB, comma-separated")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    args = ap.parse_args(argv)
    OUT = args.out
    if args.budget_s is not None:
        DEADLINE[0] = time.monotonic() + args.budget_s
    R["workdir"] = args.workdir
    os.makedirs(args.workdir, exist_ok=True)
    environment(argv)
    dump()
    if not torch.cuda.is_available():
        R["errors"]["cuda"] = "no CUDA device"
        dump()
        return 1
    os.makedirs(args.workdir, exist_ok=True)
    dev = torch.device("cuda", 0)
    skip = set(args.skip)
    state = build_state(args.size, dev)
    ref = flat(state)
    R["state"] = {"bytes": state_bytes(ref), "tensors": len(ref), "description":
                  "synthetic mixed-precision AdamW state (bf16 weights = roundings of the fp32 master; "
                  "exp_avg, exp_avg_sq fp32; d=2048 transformer matrices)"}
    paths = {"nvckpt": os.path.join(args.workdir, "state.nvckpt"), "torch": os.path.join(args.workdir, "state.pt"),
             "safetensors": os.path.join(args.workdir, "state.safetensors")}

    def save_nvckpt() -> None:
        import nvckpt

        t0 = time.perf_counter()
        res = nvckpt.save(state, paths["nvckpt"])
        R["saves"]["nvckpt"] = {"seconds": time.perf_counter() - t0, "file_bytes": os.path.getsize(paths["nvckpt"]),
                                "ratio": res.ratio}

    def save_torch() -> None:
        t0 = time.perf_counter()
        with open(paths["torch"], "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        R["saves"]["torch"] = {"seconds": time.perf_counter() - t0, "file_bytes": os.path.getsize(paths["torch"])}

    def save_safetensors() -> None:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        save_file({k.replace("/", "."): v.contiguous() for k, v in ref.items()}, paths["safetensors"])
        fd = os.open(paths["safetensors"], os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        R["saves"]["safetensors"] = {"seconds": time.perf_counter() - t0,
                                     "file_bytes": os.path.getsize(paths["safetensors"])}

    nv_peers = {"nvckpt", "nvckpt-kvikio", "nvckpt-auto"} - skip
    if nv_peers or "disk" not in skip:
        guarded("save nvckpt", save_nvckpt)
    if "torch" not in skip:
        guarded("save torch", save_torch)
    if {"safetensors", "fastsafetensors"} - skip:
        guarded("save safetensors", save_safetensors)
    state = None  # the flat references keep the tensors for the comparisons
    if "disk" not in skip and os.path.exists(paths["nvckpt"]):
        combos = [tuple(int(x) for x in c.split("x")) for c in args.disk.split(",") if c]
        guarded("O_DIRECT read rate", lambda: measure_disk(paths["nvckpt"], combos))
    have = {k: os.path.exists(p) for k, p in paths.items()}
    if "nvckpt" not in skip and have["nvckpt"]:
        guarded("nvckpt (o_direct)", lambda: nvckpt_load(paths["nvckpt"], ref, "o_direct", "nvckpt (o_direct)"))
    if "nvckpt-kvikio" not in skip and have["nvckpt"]:
        guarded("nvckpt (kvikio)", lambda: nvckpt_load(paths["nvckpt"], ref, "kvikio", "nvckpt (kvikio)"))
    if "nvckpt-auto" not in skip and have["nvckpt"]:
        guarded("nvckpt (auto)", lambda: nvckpt_load(paths["nvckpt"], ref, "auto", "nvckpt (auto)"))
    if "nvckpt" not in skip and have["nvckpt"]:
        guarded("nvckpt get_tensor", lambda: nvckpt_partial(paths["nvckpt"], ref, "get_tensor"))
        guarded("nvckpt keys=", lambda: nvckpt_partial(paths["nvckpt"], ref, "keys"))
    if "torch" not in skip and have["torch"]:
        guarded("torch.load", lambda: timed_load(
            "torch.load", paths["torch"],
            lambda: flat(torch.load(paths["torch"], map_location="cuda", weights_only=True)), ref))
    if "safetensors" not in skip and have["safetensors"]:
        def st_load() -> dict[str, torch.Tensor]:
            from safetensors.torch import load_file

            return load_file(paths["safetensors"], device="cuda")
        guarded("safetensors", lambda: timed_load("safetensors", paths["safetensors"], st_load,
                                                  {k.replace("/", "."): v for k, v in ref.items()}))
    if "fastsafetensors" not in skip and have["safetensors"]:
        guarded("fastsafetensors", lambda: fastsafetensors_load(paths["safetensors"], ref))
    if "nvckpt" not in skip and have["nvckpt"] and time.monotonic() < DEADLINE[0]:
        # the first nvckpt load pinned its buffers; a second one says what a later load in the process costs
        guarded("nvckpt (o_direct, again)",
                lambda: nvckpt_load(paths["nvckpt"], ref, "o_direct", "nvckpt (o_direct, again)"))
    if not args.keep:
        for p in paths.values():
            if os.path.exists(p):
                os.remove(p)
    dump()
    log(f"wrote {os.path.join(OUT, 'bench_gpu_load.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
