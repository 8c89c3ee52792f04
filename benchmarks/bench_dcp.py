"""torch.distributed.checkpoint storage: nvckpt.dcp.Writer/Reader against FileSystemWriter/Reader, plain and
with DCP's ZStandard stream extension, side by side in one run.

    python3 benchmarks/bench_dcp.py --out OUT_DIR [--ranks 2] [--smoke]

``--ranks`` processes (spawned, gloo) share the one GPU (``--device cuda``,
the default where there is one) or the CPU.  Each rank trains the same
GPT-style transformer (seed 0, fp32 weights, fused AdamW; ``--steps``) on
token sequences of a random Markov chain, so the state is that of a real
short run, then keeps its FSDP2-style Shard(0) rows (``torch.chunk`` of dim 0)
of the weights and both Adam moments as DTensors on a 1-d mesh: that is the
state DCP plans and saves.  No DTensor collective runs (gloo has no CUDA
reduce-scatter), only DCP's own object collectives.

Per method, in this one run: save seconds (``dcp.save``, every method ending
with fsync), bytes on disk, load seconds into the same sharding and into
Shard(1) (a column reshard: each rank needs a column strip of every stored
row shard), page cache dropped before each load where the machine allows,
every load checked bit for bit; ``dcp.async_save`` caller-blocked and total
seconds with nvckpt's stager, with DCP's default stager (thread mode), and
FileSystemWriter in process mode; the disk's buffered write+fsync and cold
read bandwidth.  Writes bench_dcp.json and bench_dcp.md to OUT_DIR.
``--smoke``: a small model and few steps on any device (runs on a CPU in CI).

``--parts reshard`` (or ``all``): resharded loads.  The state saved by ``--ranks`` ranks (Shard(0)) is loaded
at each world size of ``--load-worlds`` into every placement users meet: Shard(0) (FSDP2: world size up or
down moves row boundaries), Shard(1) (tensor parallel: a column strip of every stored row shard), Replicate
(every rank the whole state) and, at world size 4, a 2-D mesh (2 x 2: rows over one dim, columns over the
other).  Each load is timed ``--reps`` times, nvckpt.dcp.Reader and FileSystemReader interleaved, into
the same target tensors (fresh DTensors, every local piece checked bit for bit), from the page cache (the
rank files are read once before); per rank, the bytes its read calls returned (``/proc/self/io`` rchar) and
the bytes it needs (its local pieces' raw bytes).  The median and the slowest rank's seconds are reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

GB = 1e9
STATES = 4096
METHODS = ("nvckpt", "fs", "fs+zstd")
RESHARD_METHODS = ("nvckpt", "fs")


# -- helpers -------------------------------------------------------------------------------------
def drop_caches(path: str) -> bool:
    """Evict ``path`` (a file, or a checkpoint's folder) from the page cache; True if it could."""
    return harness.cache_dropped(harness.drop_page_cache([path]))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def disk_bandwidth(workdir: str, nbytes: int) -> dict[str, Any]:
    """Buffered write + fsync, then a cold read (after drop_caches), of one file in ``workdir``."""
    path = os.path.join(workdir, "bandwidth.bin")
    block = os.urandom(1 << 20) * 64  # 64 MiB of incompressible bytes
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            written += f.write(block[: min(len(block), nbytes - written)])
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    dropped = drop_caches(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    read_s = time.perf_counter() - t0
    os.unlink(path)
    return {"bytes": nbytes, "write_fsync_GBps": round(nbytes / write_s / GB, 3),
            "read_GBps": round(nbytes / read_s / GB, 3), "read_cold": dropped}


# -- the state -----------------------------------------------------------------------------------
def train_state(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, torch.Tensor], dict, float]:
    """Full fp32 weights and AdamW moments after ``args.steps`` steps (every rank computes the same)."""
    from benchmarks.bench_gpu import GPT

    torch.manual_seed(0)
    model = GPT(args.vocab, args.d_model, args.layers, max(1, args.d_model // 64), args.seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    g = torch.Generator(device=device).manual_seed(1)
    n_states = min(STATES, args.vocab)
    states = torch.randperm(args.vocab, device=device, generator=g)[:n_states]
    succ = torch.randint(0, n_states, (n_states, 4), device=device, generator=g)
    seq = torch.empty(args.batch, args.seq + 1, dtype=torch.long, device=device)
    loss = float("nan")
    for _ in range(args.steps):
        seq[:, 0] = torch.randint(0, n_states, (args.batch,), device=device, generator=g)
        for t in range(1, args.seq + 1):
            seq[:, t] = succ[seq[:, t - 1], torch.randint(0, 4, (args.batch,), device=device, generator=g)]
        batch = states[seq]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(batch[:, :-1])
        out = torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(out.detach())
    sync(device)
    names = dict(model.named_parameters())
    weights = {n: p.detach() for n, p in names.items()}
    moments = {k: {n: opt.state[p][k] for n, p in names.items()} for k in ("exp_avg", "exp_avg_sq")}
    return weights, moments, loss


def shard_state(weights: dict, moments: dict, mesh: Any, rank: int, world: int, step: int) -> dict[str, Any]:
    """The FSDP2 layout: each rank holds ``torch.chunk(t, world)[rank]`` of every tensor, as a Shard(0) DTensor."""
    from torch.distributed.tensor import DTensor, Shard

    def shard(t: torch.Tensor) -> Any:
        pieces = torch.chunk(t, world, dim=0)
        local = pieces[rank].clone() if rank < len(pieces) else t.new_empty((0,) + tuple(t.shape[1:]))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())

    return {"model": {n: shard(t) for n, t in weights.items()},
            "optim": {k: {n: shard(t) for n, t in group.items()} for k, group in moments.items()},
            "step": step}


def target_like(state: dict, mesh: Any, column: bool) -> dict:
    """Empty DTensors to load into: the saved Shard(0) layout, or Shard(1) (Replicate for vectors)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if not isinstance(node, DTensor):
            return 0 if isinstance(node, int) else node
        if not column:
            return DTensor.from_local(torch.full_like(node.to_local(), 7.0), mesh, node.placements, run_check=False,
                                      shape=node.shape, stride=node.stride())
        world = mesh.size()
        rank = mesh.get_local_rank()
        full_shape = tuple(node.shape)
        if len(full_shape) >= 2:
            cols = torch.chunk(torch.empty(full_shape[1], device="meta"), world)
            n = cols[rank].numel() if rank < len(cols) else 0
            local = torch.full((full_shape[0], n) + full_shape[2:], 7.0, dtype=node.dtype, device=node.device)
            placements = [Shard(1)]
        else:
            local = torch.full(full_shape, 7.0, dtype=node.dtype, device=node.device)
            placements = [Replicate()]
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=node.shape, stride=node.stride())

    return walk(state)


def same(loaded: dict, saved: dict, weights: dict, moments: dict, column: bool, rank: int, world: int) -> bool:
    """Bit-exact: every loaded local piece against the same piece of the full tensors."""
    full = {"model": weights, "optim": moments}
    for group in ("model", "optim"):
        flat = full[group] if group == "model" else {f"{k}/{n}": t for k, g in full[group].items() for n, t in g.items()}
        got = loaded[group] if group == "model" else {f"{k}/{n}": t for k, g in loaded[group].items() for n, t in g.items()}
        for name, t in flat.items():
            local = got[name].to_local()
            if column and t.dim() >= 2:
                pieces = torch.chunk(t, world, dim=1)
                want = pieces[rank] if rank < len(pieces) else t[:, :0]
            elif column:
                want = t
            else:
                pieces = torch.chunk(t, world, dim=0)
                want = pieces[rank] if rank < len(pieces) else t[:0]
            if local.shape != want.shape or not torch.equal(local.contiguous().view(torch.uint8),
                                                            want.contiguous().view(torch.uint8)):
                return False
    return loaded["step"] == saved["step"]


# -- one rank ---------------------------------------------------------------------------------------
def writer_for(method: str, path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    import nvckpt.dcp

    if method == "nvckpt":
        return nvckpt.dcp.Writer(path)
    if method == "fs":
        return FileSystemWriter(path)
    from torch.distributed.checkpoint._extension import ZStandard

    return FileSystemWriter(path, _extensions=[ZStandard()])


def reader_for(method: str, path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    import nvckpt.dcp

    return nvckpt.dcp.Reader(path) if method == "nvckpt" else FileSystemReader(path)


def timed(fn: Any, device: torch.device) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    sync(device)
    dist.barrier()
    return time.perf_counter() - t0


def rank_main(rank: int, world: int, args: argparse.Namespace, store: str, results: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import DeviceMesh

    import nvckpt.dcp

    mesh = DeviceMesh(device.type, list(range(world)))
    out: dict[str, Any] = {"rank": rank, "methods": {}, "async": {}, "errors": {}}

    def save_out() -> None:  # after every figure: a run killed at its time limit still reports what it measured
        tmp = os.path.join(results, f".rank{rank}.json")
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, os.path.join(results, f"rank{rank}.json"))

    t0 = time.perf_counter()
    weights, moments, loss = train_state(args, device)
    out["train_seconds"], out["loss_last"] = round(time.perf_counter() - t0, 2), loss
    state = shard_state(weights, moments, mesh, rank, world, args.steps)
    local_bytes = sum(t.to_local().numel() * t.element_size()
                      for g in (state["model"], *state["optim"].values()) for t in g.values())
    out["local_state_bytes"] = local_bytes
    save_out()
    for method in METHODS:
        path = os.path.join(args.workdir, f"ck-{method}")
        m: dict[str, Any] = {}
        out["methods"][method] = m
        try:
            m["save_s"] = timed(lambda: dcp.save(state, storage_writer=writer_for(method, path)), device)
            if rank == 0:
                m["bytes"] = harness.tree_bytes(path)
            for label, column in (("load_s", False), ("load_reshard_s", True)):
                target = target_like(state, mesh, column)
                if rank == 0:
                    m["cache_dropped"] = drop_caches(path)
                dist.barrier()
                m[label] = timed(lambda: dcp.load(target, storage_reader=reader_for(method, path)), device)
                m[label.replace("_s", "_exact")] = same(target, state, weights, moments, column, rank, world)
                del target
            if rank == 0:  # world size 1: one process loads the whole state from every rank's file
                m["cache_dropped"] = drop_caches(path) and m["cache_dropped"]
                full = {"model": {n: torch.full_like(t, 7.0) for n, t in weights.items()},
                        "optim": {k: {n: torch.full_like(t, 7.0) for n, t in g.items()} for k, g in moments.items()},
                        "step": 0}
                t0 = time.perf_counter()
                dcp.load(full, storage_reader=reader_for(method, path), no_dist=True)
                sync(device)
                m["load_world1_s"] = time.perf_counter() - t0
                m["load_world1_exact"] = full["step"] == args.steps and all(
                    torch.equal(full[g][n].view(torch.uint8), t.view(torch.uint8))
                    for g, ts in (("model", weights),) for n, t in ts.items()) and all(
                    torch.equal(full["optim"][k][n].view(torch.uint8), t.view(torch.uint8))
                    for k, ts in moments.items() for n, t in ts.items())
                del full
        except Exception as exc:  # one method failing does not stop the others
            out["errors"][method] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000]
        save_out()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    ckpt_group = dist.new_group(backend="gloo")
    # With no async_stager, DCP stages with the writer itself when it is an AsyncStager (FileSystemWriter is:
    # BlockingAsyncStager, a copy to CPU memory) and with DefaultStager (also a CPU copy) otherwise.
    cases = (("nvckpt.dcp.Writer + nvckpt.dcp.Stager (thread)", "nvckpt", "stager", AsyncCheckpointerType.THREAD),
             ("nvckpt.dcp.Writer + DCP's DefaultStager (thread)", "nvckpt", None, AsyncCheckpointerType.THREAD),
             ("FileSystemWriter, its own CPU staging (thread)", "fs", None, AsyncCheckpointerType.THREAD),
             ("FileSystemWriter, its own CPU staging (process)", "fs", None, AsyncCheckpointerType.PROCESS))
    for label, method, stager, kind in cases:
        path = os.path.join(args.workdir, "async-" + method)
        a: dict[str, Any] = {}
        out["async"][label] = a
        try:
            dist.barrier()
            t0 = time.perf_counter()
            future = dcp.async_save(state, storage_writer=writer_for(method, path), process_group=ckpt_group,
                                    async_checkpointer_type=kind,
                                    async_stager=nvckpt.dcp.Stager() if stager else None)
            a["blocked_s"] = time.perf_counter() - t0
            future.result()
            a["total_s"] = time.perf_counter() - t0
        except Exception as exc:
            out["errors"][label] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000]
        save_out()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    out["done"] = True
    save_out()
    dist.barrier()
    dist.destroy_process_group()


# -- resharded loads ------------------------------------------------------------------------------
def placements_at(world: int) -> list[tuple[str, tuple[int, ...], Any]]:
    """(label, mesh shape, placements of a 2-D tensor) users meet at ``world`` ranks; vectors follow the rows."""
    from torch.distributed.tensor import Replicate, Shard

    out = [("Shard(0)", (world,), (Shard(0),)), ("Shard(1)", (world,), (Shard(1),)),
           ("Replicate", (world,), (Replicate(),))]
    if world == 4:
        out.append(("2-D (Shard(0), Shard(1))", (2, 2), (Shard(0), Shard(1))))
    return out


def io_read_bytes() -> int:
    """Bytes this process's read calls returned so far (page cache or disk: what the reader asked for)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def reshard_main(rank: int, world: int, args: argparse.Namespace, store: str, results: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    full = torch.load(os.path.join(args.workdir, "reference.pt"), weights_only=True)
    flat = {f"model/{n}": t for n, t in full["model"].items()}
    flat.update({f"optim/{k}/{n}": t for k, g in full["optim"].items() for n, t in g.items()})
    out: dict[str, Any] = {"rank": rank, "world": world, "loads": {}}

    def target(mesh: Any, placements: tuple) -> tuple[dict, dict, int]:
        pieces, want, need = {}, {}, 0
        for name, t in flat.items():
            pl = placements if t.dim() >= len(placements) and all(
                not isinstance(p, Shard) or p.dim < t.dim() for p in placements) else tuple(
                Shard(0) if isinstance(p, Shard) else Replicate() for p in placements)
            if t.dim() == 1:  # vectors (biases, norms): row sharded where the matrices are, else replicated
                pl = tuple(Shard(0) if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in placements)
            shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, pl)
            local = torch.full(shape, 7.0, dtype=t.dtype)
            pieces[name] = DTensor.from_local(local, mesh, pl, run_check=False, shape=t.shape, stride=t.stride())
            box = t
            for d, (o, n) in enumerate(zip(offset, shape)):
                box = box.narrow(d, o, n)
            want[name] = box
            need += local.numel() * local.element_size()
        state = {"model": {}, "optim": {k: {} for k in full["optim"]}, "step": 0}
        for name, dt in pieces.items():
            parts = name.split("/")
            if parts[0] == "model":
                state["model"][parts[1]] = dt
            else:
                state["optim"][parts[1]][parts[2]] = dt
        return state, want, need

    def exact(state: dict, want: dict) -> bool:
        got = {f"model/{n}": t for n, t in state["model"].items()}
        got.update({f"optim/{k}/{n}": t for k, g in state["optim"].items() for n, t in g.items()})
        return state["step"] == args.steps and all(
            torch.equal(got[n].to_local().contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))
            for n, w in want.items())

    for label, shape, placements in placements_at(world):
        mesh = init_device_mesh("cpu", shape)
        for method in RESHARD_METHODS:
            path = os.path.join(args.workdir, f"ck-{method}")
            times, reads = [], []
            ok = True
            for rep in range(args.reps + 1):  # the first warms the page cache and DCP's code: not counted
                state, want, need = target(mesh, placements)
                dist.barrier()
                before = io_read_bytes()
                t0 = time.perf_counter()
                dcp.load(state, storage_reader=reader_for(method, path))
                dist.barrier()
                elapsed = time.perf_counter() - t0
                if rep:
                    times.append(elapsed)
                    reads.append(io_read_bytes() - before)
                ok = ok and exact(state, want)
                del state, want
            out["loads"][f"{label}|{method}"] = {"s": times, "read_bytes": reads, "need_bytes": need, "exact": ok}
            dist.barrier()
    with open(os.path.join(results, f"reshard{world}_rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def spawn(fn: Any, world: int, args: argparse.Namespace, results: str, errors: dict, tag: str) -> None:
    store = os.path.join(args.workdir, f"store-{tag}")
    ctx = mp.start_processes(fn, args=(world, args, store, results), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + args.timeout
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                errors[tag] = f"the ranks did not finish in {args.timeout} s: killed"
                break
    except Exception as exc:  # a rank died: report what the others wrote
        errors[tag] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:4000]
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)


def save_for_reshard(args: argparse.Namespace) -> dict[str, Any]:
    """The training state saved by ``args.ranks`` ranks (Shard(0)) with each reader's writer, and the full
    tensors as the reference every load is checked against; returns the bytes on disk."""
    results = os.path.join(args.workdir, "results")
    errors: dict[str, str] = {}
    spawn(save_main, args.ranks, args, results, errors, "save")
    if errors:
        raise RuntimeError(f"the save for the resharded loads failed: {errors}")
    return {m: harness.tree_bytes(os.path.join(args.workdir, f"ck-{m}")) for m in RESHARD_METHODS}


def save_main(rank: int, world: int, args: argparse.Namespace, store: str, results: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", list(range(world)))
    weights, moments, _ = train_state(args, torch.device("cpu"))
    if rank == 0:
        torch.save({"model": weights, "optim": moments}, os.path.join(args.workdir, "reference.pt"))
    state = shard_state(weights, moments, mesh, rank, world, args.steps)
    for method in RESHARD_METHODS:
        dcp.save(state, storage_writer=writer_for(method, os.path.join(args.workdir, f"ck-{method}")))
    dist.barrier()
    dist.destroy_process_group()


def reshard_table(loads: dict[int, list[dict]], saved_world: int) -> list[dict[str, Any]]:
    """One row per (world size, placement, method): median over reps of the slowest rank, bytes per rank."""
    import statistics

    rows = []
    for world, ranks in sorted(loads.items()):
        for key in ranks[0]["loads"]:
            label, method = key.split("|")
            per = [r["loads"][key] for r in ranks]
            slowest = [max(p["s"][i] for p in per) for i in range(len(per[0]["s"]))]
            rows.append({"world": world, "from": saved_world, "placement": label, "method": method,
                         "median_s": round(statistics.median(slowest), 4),
                         "min_s": round(min(slowest), 4),
                         "read_MB_per_rank": [round(statistics.median(p["read_bytes"]) / 1e6, 1) for p in per],
                         "need_MB_per_rank": [round(p["need_bytes"] / 1e6, 1) for p in per],
                         "max_read_over_need": round(max(statistics.median(p["read_bytes"]) / max(1, p["need_bytes"])
                                                         for p in per), 3),
                         "exact": all(p["exact"] for p in per)})
    return rows


def reshard_markdown(R: dict[str, Any]) -> str:
    env = R["env"]
    rows = R["reshard"]
    lines = [f"# Resharded DCP loads: nvckpt.dcp.Reader vs FileSystemReader ({env['date']})", "",
             f"- device: {env['device']}; {env['cpus']} CPUs; torch {env['torch']}; python {env['python']}; "
             f"code {env.get('code')}",
             f"- command: `{env['command']}`",
             f"- load average before / after: {R.get('loadavg_before')} / {R.get('loadavg_after')} (the machine is "
             "shared: a load above 0 means other processes took some of the cores)",
             f"- state: {R['params']:,} parameters (GPT, d_model {R['model']['d_model']}, {R['model']['layers']} "
             f"layers, vocab {R['model']['vocab']}), fp32 weights + AdamW exp_avg + exp_avg_sq after {R['steps']} "
             f"steps: {R['raw_bytes'] / 1e6:.1f} MB; saved by {R['ranks']} ranks as Shard(0) rows; bytes on disk: "
             + ", ".join(f"{NAMES[m].split(' /')[0].split(' +')[0]} {b / 1e6:.1f} MB" for m, b in R['saved_bytes'].items()),
             "- each load from the page cache (the files read before), into fresh DTensors checked bit for bit; "
             f"seconds: the slowest rank's (barriers around each load), median of {R['reps']} interleaved "
             "repetitions; read MB: what each rank's read calls returned (/proc/self/io rchar, the median), need "
             "MB: the raw bytes of its local pieces", "",
             "| ranks | placement | nvckpt s | FileSystemReader s | nvckpt / FSR | nvckpt read MB per rank "
             "| FSR read MB per rank | need MB per rank | nvckpt read / need (worst rank) | bit-exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["world"], r["placement"], r["method"]): r for r in rows}
    for (world, label, method), r in by.items():
        if method != "nvckpt":
            continue
        f = by.get((world, label, "fs"))
        if f is None:
            continue
        lines.append(f"| {r['from']} -> {world} | {label} | {r['median_s']} | {f['median_s']} | "
                     f"{r['median_s'] / f['median_s']:.2f} | {', '.join(map(str, r['read_MB_per_rank']))} | "
                     f"{', '.join(map(str, f['read_MB_per_rank']))} | {', '.join(map(str, r['need_MB_per_rank']))} | "
                     f"{r['max_read_over_need']} | {'yes' if r['exact'] and f['exact'] else 'NO'} |")
    if R.get("errors"):
        lines += ["", "## errors", ""] + [f"- {k}: `{v.splitlines()[-1]}`" for k, v in R["errors"].items()]
    return "\n".join(lines) + "\n"


def run_reshard(args: argparse.Namespace, argv: list[str]) -> int:
    results = os.path.join(args.workdir, "results")
    R: dict[str, Any] = {"env": environment(args, argv), "ranks": args.ranks, "steps": args.steps, "reps": args.reps,
                         "model": {"d_model": args.d_model, "layers": args.layers, "vocab": args.vocab},
                         "loadavg_before": harness.load_average(), "errors": {}}
    R["saved_bytes"] = save_for_reshard(args)
    reference = torch.load(os.path.join(args.workdir, "reference.pt"), weights_only=True)
    R["raw_bytes"] = sum(t.numel() * t.element_size() for g in (reference["model"], *reference["optim"].values())
                         for t in g.values())
    R["params"] = R["raw_bytes"] // 12
    del reference
    loads: dict[int, list[dict]] = {}
    for world in args.load_worlds:
        spawn(reshard_main, world, args, results, R["errors"], f"load{world}")
        try:
            loads[world] = [json.load(open(os.path.join(results, f"reshard{world}_rank{r}.json"))) for r in range(world)]
        except OSError:
            pass
    R["loadavg_after"] = harness.load_average()
    R["reshard"] = reshard_table(loads, args.ranks)
    R["per_rank"] = loads
    text = harness.write_results(args.out, "bench_dcp_reshard", R, lambda: reshard_markdown(R), echo=True)
    return 0 if text is not None and not R["errors"] and all(r["exact"] for r in R["reshard"]) else 1


# -- the run --------------------------------------------------------------------------------------
def environment(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    env = {
        "date": harness.utc_date(),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
        "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "kernel": platform.release(), "workdir_fs": harness.filesystem(args.workdir),
        "command": harness.command_line(__file__, argv),
        "code": harness.code_commit(),
    }
    if args.device == "cuda":
        env["driver"] = harness.shell("nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1")
        try:
            from nvckpt.codecs.nvcomp import device as nb

            env["nvcomp"] = nb.nvcomp_version() if nb.available() else None
        except Exception as exc:  # noqa: BLE001
            env["nvcomp"] = f"unavailable: {exc}"
    return env


def summarize(ranks: list[dict], raw_bytes: int) -> dict[str, Any]:
    """Per method: the slowest rank's seconds (every call ends in a barrier), bytes, ratio, exactness."""
    table: dict[str, Any] = {}
    for method in METHODS:
        if not any(method in r["methods"] for r in ranks):
            continue
        rows = [r["methods"].get(method, {}) for r in ranks]
        row: dict[str, Any] = {"bytes": rows[0].get("bytes")}
        for key in ("save_s", "load_s", "load_reshard_s"):
            vals = [x[key] for x in rows if key in x]
            row[key] = round(max(vals), 3) if len(vals) == len(rows) else None
        row["load_world1_s"] = round(rows[0]["load_world1_s"], 3) if "load_world1_s" in rows[0] else None
        row["load_world1_exact"] = rows[0].get("load_world1_exact")
        for key in ("load_exact", "load_reshard_exact"):
            vals = [x.get(key) for x in rows]
            row[key] = all(vals) if all(v is not None for v in vals) else None
        row["ratio"] = round(raw_bytes / row["bytes"], 4) if row["bytes"] else None
        row["save_GBps"] = round(raw_bytes / row["save_s"] / GB, 3) if row["save_s"] else None
        table[method] = row
    asyncs = {}
    for label in {k: None for r in ranks for k in r["async"]}:
        vals = [r["async"].get(label, {}) for r in ranks]
        asyncs[label] = {k: round(max(v[k] for v in vals), 4) if all(k in v for v in vals) else None
                         for k in ("blocked_s", "total_s")}
    return {"methods": table, "async": asyncs}


NAMES = {"nvckpt": "nvckpt.dcp.Writer / Reader", "fs": "FileSystemWriter / Reader",
         "fs+zstd": "FileSystemWriter + ZStandard / FileSystemReader"}


def markdown(R: dict[str, Any]) -> str:
    env, s = R["env"], R["summary"]
    lines = [f"# torch.distributed.checkpoint storage: nvckpt vs FileSystemWriter ({env['date']})", "",
             f"- device: {env['device']}; {env['cpus']} CPUs; torch {env['torch']}; nvCOMP {env.get('nvcomp')}; "
             f"python {env['python']}; workdir {env['workdir_fs']}",
             f"- command: `{env['command']}`" + ("" if R.get("complete") else " (cut short: partial results)"),
             f"- {R['ranks']} ranks (gloo) sharing the device; state: {R['params']:,} parameters, fp32 weights + AdamW "
             f"exp_avg + exp_avg_sq after {R['steps']} steps, Shard(0) DTensors: {R['raw_bytes'] / GB:.3f} GB in all",
             f"- disk: write+fsync {R['disk'].get('write_fsync_GBps')} GB/s, read {R['disk'].get('read_GBps')} GB/s "
             f"(cold: {R['disk'].get('read_cold')}); page cache dropped before loads: {R['cache_dropped']}",
             "- seconds are the slowest rank's (each call starts and ends at a barrier); world size 1: rank 0 alone "
             "loads the whole state (`no_dist=True`); every load is checked bit for bit", "",
             "| method | save s | save GB/s | bytes on disk | ratio | load s (Shard(0)) | load s (reshard to Shard(1)) "
             "| load s (world size 1) | bit-exact |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method, row in s["methods"].items():
        exact = {row["load_exact"], row["load_reshard_exact"], row["load_world1_exact"]}
        lines.append(f"| {NAMES[method]} | {row['save_s']} | {row['save_GBps']} | {row['bytes']:,} | {row['ratio']} | "
                     f"{row['load_s']} | {row['load_reshard_s']} | {row['load_world1_s']} | "
                     f"{'yes' if exact == {True} else 'NO' if False in exact else '-'} |"
                     if row["bytes"] else f"| {NAMES[method]} | failed: see errors | | | | | | | |")
    lines += ["", "| dcp.async_save | caller blocked s | total s |", "|---|---|---|"]
    for label, a in s["async"].items():
        lines.append(f"| {label} | {a['blocked_s']} | {a['total_s']} |")
    if R["errors"]:
        lines += ["", "## errors", ""] + [f"- {k}: `{v.splitlines()[-1]}`" for k, v in R["errors"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--workdir", default="/tmp/nvckpt_bench_dcp")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="a small model and few steps (any device, CI)")
    ap.add_argument("--d-model", type=int, default=1280)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--disk-bytes", type=int, default=4 << 30, help="bytes for the disk bandwidth test")
    ap.add_argument("--timeout", type=int, default=420, help="seconds before the ranks are killed")
    ap.add_argument("--parts", choices=("save", "reshard", "all"), default="save",
                    help="save: the save/load/async table; reshard: resharded loads at --load-worlds; all: both")
    ap.add_argument("--load-worlds", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 3, 4],
                    help="world sizes the resharded loads run at (comma separated)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each resharded load")
    args = ap.parse_args(argv)
    if args.smoke:
        args.d_model, args.layers, args.vocab, args.seq, args.batch, args.steps = 64, 2, 512, 32, 4, 3
        args.disk_bytes = min(args.disk_bytes, 64 << 20)
    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    results = os.path.join(args.workdir, "results")
    os.makedirs(results)
    if args.parts in ("reshard", "all"):
        if args.device != "cpu":
            raise SystemExit("--parts reshard runs on the CPU (--device cpu)")
        code = run_reshard(args, argv)
        if args.parts == "reshard":
            shutil.rmtree(args.workdir, ignore_errors=True)
            return code
        shutil.rmtree(args.workdir, ignore_errors=True)
        os.makedirs(results)
    R: dict[str, Any] = {"env": environment(args, argv), "ranks": args.ranks, "steps": args.steps,
                         "model": {"d_model": args.d_model, "layers": args.layers, "vocab": args.vocab}}
    R["disk"] = disk_bandwidth(args.workdir, args.disk_bytes)
    store = os.path.join(args.workdir, "store")
    ctx = mp.start_processes(rank_main, args=(args.ranks, args, store, results), nprocs=args.ranks, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + args.timeout
    R["errors"] = {}
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                R["errors"]["run"] = f"the ranks did not finish in {args.timeout} s: killed"
                break
    except Exception as exc:  # a rank died: report what the others wrote
        R["errors"]["run"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:4000]
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    ranks = []
    for r in range(args.ranks):
        try:
            with open(os.path.join(results, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        except OSError:
            pass
    if len(ranks) == args.ranks:
        raw = sum(r["local_state_bytes"] for r in ranks)
        R["raw_bytes"] = raw
        R["params"] = raw // 12  # fp32 weights + two fp32 moments
        R["train"] = {"seconds": [r["train_seconds"] for r in ranks], "loss_last": ranks[0]["loss_last"]}
        R["cache_dropped"] = ranks[0]["methods"].get("nvckpt", {}).get("cache_dropped")
        for r in ranks:
            for k, v in r["errors"].items():
                R["errors"][f"rank {r['rank']}: {k}"] = v
        R["complete"] = all(r.get("done") for r in ranks)
        R["summary"] = summarize(ranks, raw)
        R["per_rank"] = ranks
    text = harness.write_results(args.out, "bench_dcp", R, (lambda: markdown(R)) if "summary" in R else None,
                                 echo=True)
    if "summary" not in R:
        print(json.dumps(R, indent=1))
    shutil.rmtree(args.workdir, ignore_errors=True)
    return 0 if text is not None and not R["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
