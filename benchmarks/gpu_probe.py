#!/usr/bin/env python3
"""Probe nvCOMP 6 (Python API), nvckpt's GPU backend, and the device's copy and disk speeds.

Runs on the lent GPU machine after `bash .gpu/setup.sh` (tools/device_bundle.py):

    bash .gpu/setup.sh && export PYTHONPATH=/tmp/site:$PWD && python3 tools/gpu_probe.py [SECTION ...]

With no SECTION, all run, in order: env api_facts ans_modes encode_out backend_ans
fp8 zstd throughput gil copies disk.  Writes $OUT/probe.json (one entry per
section; a failing section records its traceback and the others still run)
and, from `zstd`, $OUT/zstd_sample.msgpack (GPU-written zstd RAW frames with
the bytes they must decode to, for a check on another machine).

Data: all-MiniLM-L6-v2 rounded to bf16 (/tmp/data/minilm_bf16.safetensors).
"""
from __future__ import annotations

import gc
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/probe_out")
DATA = os.environ.get("NVCKPT_MINILM", "/tmp/data/minilm_bf16.safetensors")
MiB = 1 << 20
GB = 1e9
results: dict = {}
SECTIONS: list = []


def dump() -> None:
    harness.write_results(OUT, "probe", results)


def probe(fn):
    SECTIONS.append(fn)
    return fn


def run_section(fn, ctx) -> None:
    name = fn.__name__
    t0 = time.perf_counter()
    res: dict = {}
    results[name] = res
    try:
        fn(res, ctx)
    except Exception as exc:  # record and go on
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-3000:]
        print(f"[{name}] FAILED: {res['error']}", flush=True)
    res["section_seconds"] = round(time.perf_counter() - t0, 3)
    print(f"[{name}] {json.dumps({k: v for k, v in res.items() if k != 'traceback'}, default=str)[:2500]}", flush=True)
    dump()


def chunks_of(buf: torch.Tensor, size: int, k: int = 1) -> list[torch.Tensor]:
    n = buf.numel() - buf.numel() % k
    return [buf[s: min(s + size, n)] for s in range(0, n, size)]


def ev_time(fn, stream, reps=5, warm=1):
    """Median milliseconds of fn() between CUDA events on `stream` (fn leaves its work on it)."""
    times = []
    for r in range(warm + reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        if r >= warm:
            times.append(a.elapsed_time(b))
    return statistics.median(times), times


def stage(batch, sizes, dev):
    """Compressed chunks -> one contiguous torch buffer at 16-aligned offsets (as a loader stages them)."""
    offs, p = [], 0
    for n in sizes:
        offs.append(p)
        p += -(-n // 16) * 16
    buf = torch.empty(p, dtype=torch.uint8, device=dev)
    for i, n in enumerate(sizes):
        buf[offs[i]: offs[i] + n].copy_(batch.buffer[batch.offsets[i]: batch.offsets[i] + batch.sizes()[i]])
    return buf, [buf[o: o + n] for o, n in zip(offs, sizes)]


class Ctx:
    pass


# ----------------------------------------------------------------------------------
@probe
def env(r, c):
    t0 = time.perf_counter()
    import nvidia.nvcomp as nv
    r["nvcomp_import_s"] = round(time.perf_counter() - t0, 3)
    r["nvcomp_version"] = nv.__version__
    r["nvcomp_cuda_version"] = nv.__cuda_version__
    r["torch"] = torch.__version__
    r["gpu"] = torch.cuda.get_device_name(0)
    r["python"] = sys.version.split()[0]
    try:
        import zstandard
        r["zstandard"] = zstandard.__version__ + " " + zstandard.backend
    except Exception as exc:
        r["zstandard"] = f"missing: {exc}"


@probe
def api_facts(r, c):
    nv, s, dev = c.nv, c.s, c.dev
    for label, kw in [("ans_f2", dict(algorithm="ANS", data_type="<f2")), ("ans_f4", dict(algorithm="ANS", data_type="<f4")),
                      ("ans_f1", dict(algorithm="ANS", data_type="|f1")), ("ans_u1", dict(algorithm="ANS", data_type="|u1")),
                      ("zstd", dict(algorithm="Zstd"))]:
        codec = nv.Codec(bitstream_kind=nv.BitstreamKind.RAW, cuda_stream=s.cuda_stream, device_id=0, **kw)
        p1 = torch.empty(MiB, dtype=torch.uint8, device=dev)
        p16 = torch.empty(16 * MiB, dtype=torch.uint8, device=dev)
        r[label] = {
            "comp_alignment": codec.get_required_compression_alignment(),
            "decomp_alignment": codec.get_required_decompression_alignment(),
            "max_comp_1MiB": codec.get_max_comp_buffer_size(nv.as_array(p1)),
            "max_comp_16MiB": codec.get_max_comp_buffer_size(nv.as_array(p16)),
        }


@probe
def ans_modes(r, c):
    nv, s, dev, W = c.nv, c.s, c.dev, c.W
    chunks = chunks_of(W, MiB, 2)
    raw = sum(x.numel() for x in chunks)
    for label, view, dt in [("u8view_f2", torch.uint8, "<f2"), ("f16view_f2", torch.float16, "<f2"),
                            ("u8view_none", torch.uint8, None), ("u8view_u1", torch.uint8, "|u1")]:
        kw = dict(algorithm="ANS", bitstream_kind=nv.BitstreamKind.RAW, cuda_stream=s.cuda_stream, device_id=0)
        if dt:
            kw["data_type"] = dt
        codec = nv.Codec(**kw)
        src = nv.as_arrays([x.view(view) for x in chunks], s.cuda_stream)
        enc = codec.encode(src)
        sizes = list(enc.buffer_sizes)
        dst_t = torch.empty(raw, dtype=torch.uint8, device=dev)
        dec = codec.decode(enc, out=nv.as_arrays(chunks_of(dst_t, MiB, 2), s.cuda_stream))
        dsizes = list(dec.buffer_sizes)
        torch.cuda.synchronize()
        r[label] = {"ratio": round(raw / sum(sizes), 4), "exact": bool(torch.equal(dst_t, W[:raw])),
                    "dec_sizes_ok": dsizes == [x.numel() for x in chunks]}
        del enc, dec, src
    codec = nv.Codec(algorithm="ANS", data_type="<f2", bitstream_kind=nv.BitstreamKind.RAW, cuda_stream=s.cuda_stream)
    enc = codec.encode(nv.as_arrays(chunks_of(W, 64 << 10, 2), s.cuda_stream))
    r["u8view_f2_64KiB_ratio"] = round(raw / sum(enc.buffer_sizes), 4)


@probe
def encode_out(r, c):
    """encode(out=) into torch memory: sizes, determinism, unwritten bytes."""
    nv, s, dev, W = c.nv, c.s, c.dev, c.W
    codec = nv.Codec(algorithm="ANS", data_type="<f2", bitstream_kind=nv.BitstreamKind.RAW, cuda_stream=s.cuda_stream)
    chunks = chunks_of(W, MiB, 2)[:8]
    cap = -(-codec.get_max_comp_buffer_size(nv.as_array(chunks[0])) // 16) * 16
    offs = [i * cap for i in range(len(chunks))]
    src = nv.as_arrays(chunks, s.cuda_stream)
    outs, sizes = [], []
    for fill in (0x00, 0xFF, 0x00):
        out = torch.full((cap * len(chunks),), fill, dtype=torch.uint8, device=dev)
        dst = nv.as_arrays(out, offs, [cap] * len(chunks), s.cuda_stream)
        res = codec.encode(src, out=dst)
        r["returns_out_object"] = res is dst
        sizes.append(list(res.buffer_sizes))
        outs.append(out)
        del res, dst
    r["sizes_equal"] = sizes[0] == sizes[1] == sizes[2]
    diff_fill = diff_same = 0
    first = None
    for i, n in enumerate(sizes[0]):
        a, b, z = (o[offs[i]: offs[i] + n] for o in outs)
        d = (a != b).nonzero()
        diff_fill += d.numel()
        if d.numel() and first is None:
            first = (i, int(d[0]), n)
        diff_same += int((a != z).sum())
    r["bytes_differing_prefill_00_vs_ff"] = diff_fill
    r["bytes_differing_two_encodes_same_prefill"] = diff_same
    r["first_difference(chunk,byte,size)"] = first
    ref = codec.encode(src)
    ref_host = ref.cpu()
    import numpy as np
    same = []
    for i in range(len(chunks)):
        b = np.array(ref_host[i], copy=True).view(np.uint8).reshape(-1)
        a = outs[0][offs[i]: offs[i] + sizes[0][i]].cpu().numpy()
        same.append(int((a != b).sum()) if a.size == b.size else f"size {a.size} vs {b.size}")
    r["bytes_differing_vs_nvcomp_owned"] = same
    r["ref_dtype"] = str(ref_host[0].dtype)
    try:
        small = torch.empty(MiB * len(chunks), dtype=torch.uint8, device=dev)
        codec.encode(src, out=nv.as_arrays(small, [i * MiB for i in range(len(chunks))], [MiB] * len(chunks), s.cuda_stream))
        r["capacity_raw_size"] = "ok"
    except Exception as exc:
        r["capacity_raw_size"] = f"{type(exc).__name__}: {exc}"
    torch.cuda.synchronize()


@probe
def backend_ans(r, c):
    nb, dev, W = c.nb, c.dev, c.W
    for form in ("span",):  # the one-wrapper-per-chunk "list" form measured 17 us/chunk slower and was removed
        g = nb.GpuCodec("ans", "<f2")
        chunks = chunks_of(W, MiB, 2)
        ok = 0
        for it in range(30 if form == "span" else 3):
            b = g.encode(chunks)
            sizes = b.sizes()
            buf, pays = stage(b, sizes, dev)
            del b
            dst = torch.full((W.numel(),), 0x5A, dtype=torch.uint8, device=dev)
            g.decode(pays, chunks_of(dst, MiB, 2))
            del buf, pays
            gc.collect()
            ok += bool(torch.equal(dst, W))
        r[f"{form}_exact"] = f"{ok}/{30 if form == 'span' else 3}"
        r[f"{form}_ratio_1MiB"] = round(W.numel() / sum(sizes), 4)
    g = nb.GpuCodec("ans", "<f2")
    chunks = chunks_of(W, MiB, 2)
    b1 = g.encode(chunks[:20])
    b2 = g.encode(chunks[20:40])
    s1, s2 = b1.sizes(), b2.sizes()
    dst = torch.empty(40 * MiB, dtype=torch.uint8, device=dev)
    _, p1 = stage(b1, s1, dev)
    _, p2 = stage(b2, s2, dev)
    g.decode(p1 + p2, chunks_of(dst, MiB))
    r["two_in_flight_exact"] = bool(torch.equal(dst, W[: 40 * MiB]))
    # chunks from separate allocations in one batch (span over several tensors)
    parts = [W[i * MiB: (i + 1) * MiB].clone() for i in range(6)]
    b = g.encode(parts)
    _, pays = stage(b, b.sizes(), dev)
    outs = [torch.empty(MiB, dtype=torch.uint8, device=dev) for _ in range(6)]
    g.decode(pays, outs)
    r["separate_allocations_exact"] = all(torch.equal(o, p) for o, p in zip(outs, parts))
    # odd chunking: rows of 14 bytes -> chunk starts 4-aligned only (backend stages them)
    per = (MiB // 14) * 14
    odd = chunks_of(W[: 20 * per], per)
    b = g.encode(odd)
    sz = b.sizes()
    _, pays = stage(b, sz, dev)
    base = torch.empty(20 * per + 2, dtype=torch.uint8, device=dev)
    dst = base[2:]
    g.decode(pays, chunks_of(dst, per))
    r["odd_chunks_exact"] = bool(torch.equal(dst, W[: 20 * per]))
    # mixed sizes in one batch (last chunk small)
    mixed = [W[:MiB], W[MiB: MiB + 4096], W[2 * MiB: 2 * MiB + 2], W[3 * MiB: 3 * MiB + 16 * MiB]]
    b = g.encode(mixed)
    sz = b.sizes()
    r["mixed_sizes"] = sz
    _, pays = stage(b, sz, dev)
    outs = [torch.empty(m.numel(), dtype=torch.uint8, device=dev) for m in mixed]
    g.decode(pays, outs)
    r["mixed_exact"] = all(torch.equal(o, m) for o, m in zip(outs, mixed))
    for label, n in (("short_destination", per - 2), ("long_destination", per + 2)):
        try:
            g.decode([_first(odd, g, dev)], [torch.empty(n, dtype=torch.uint8, device=dev)])
            r[label] = "no error"
        except Exception as exc:
            r[label] = f"{type(exc).__name__}: {str(exc)[:200]}"
    torch.cuda.synchronize()
    r["context_ok_after"] = bool(torch.equal(W[:16], W[:16].clone()))


def _first(odd, g, dev):
    b = g.encode(odd[:1])
    _, pays = stage(b, b.sizes(), dev)
    return pays[0]


@probe
def fp8(r, c):
    from safetensors.torch import load_file
    nb, dev = c.nb, c.dev
    sd = load_file(DATA, device="cuda")
    parts = []
    for k in c.names:
        t = sd[k].float()
        amax = t.abs().max().clamp(min=1e-12)
        parts.append((t * (448.0 / amax)).to(torch.float8_e4m3fn).reshape(-1).view(torch.uint8))
    del sd
    F8 = torch.cat(parts)
    r["bytes"] = F8.numel()
    for dt in ("|f1", "|u1"):
        g = nb.GpuCodec("ans", dt)
        b = g.encode(chunks_of(F8, MiB))
        sz = b.sizes()
        _, pays = stage(b, sz, dev)
        dst = torch.empty_like(F8)
        g.decode(pays, chunks_of(dst, MiB))
        r[dt] = {"ratio": round(F8.numel() / sum(sz), 4), "exact": bool(torch.equal(dst, F8))}
    b = nb.GpuCodec("zstd").encode(chunks_of(F8, MiB))
    r["zstd_ratio"] = round(F8.numel() / sum(b.sizes()), 4)


@probe
def zstd(r, c):
    import msgpack
    import zstandard
    nb, dev, W = c.nb, c.dev, c.W
    g = nb.GpuCodec("zstd", shuffle=2)
    chunks = chunks_of(W, MiB, 2)
    b = g.encode(chunks)
    sz = b.sizes()
    r["ratio_shuffled_1MiB"] = round(W.numel() / sum(sz), 4)
    buf, pays = stage(b, sz, dev)
    dst = torch.empty_like(W)
    g.decode(pays, chunks_of(dst, MiB, 2))
    r["gpu_roundtrip_exact"] = bool(torch.equal(dst, W))
    frames = [p.cpu().numpy().tobytes() for p in pays]
    wcpu = W.cpu().numpy()
    ok, fcs, t0 = 0, set(), time.perf_counter()
    dctx = zstandard.ZstdDecompressor()
    for i, frame in enumerate(frames):
        fcs.add(zstandard.frame_content_size(frame))
        n = chunks[i].numel()
        planes = wcpu[i * MiB: i * MiB + n].reshape(-1, 2).T.copy().tobytes()
        ok += dctx.decompress(frame, max_output_size=n) == planes
    r["cpu_zstandard_decodes"] = f"{ok}/{len(frames)}"
    r["cpu_decode_1thread_GBps"] = round(W.numel() / (time.perf_counter() - t0) / GB, 3)
    r["frame_magic"] = frames[0][:4].hex()
    r["frame_content_sizes"] = sorted(str(x) for x in fcs)[:5]
    sample = [{"frame": frames[i], "elements": wcpu[i * MiB: i * MiB + chunks[i].numel()].tobytes(), "elementsize": 2}
              for i in range(3)]
    with open(os.path.join(OUT, "zstd_sample.msgpack"), "wb") as f:
        f.write(msgpack.packb(sample, use_bin_type=True))
    for level in (1, 19):
        cctx = zstandard.ZstdCompressor(level=level)
        cf = [cctx.compress(wcpu[i * MiB: (i + 1) * MiB].reshape(-1, 2).T.copy().tobytes()) for i in range(8)]
        hb = torch.cat([torch.frombuffer(bytearray(x), dtype=torch.uint8) for x in cf]).to(dev)
        offs, p = [], 0
        for x in cf:
            offs.append(p)
            p += len(x)
        dst = torch.empty(8 * MiB, dtype=torch.uint8, device=dev)
        g.decode([hb[o: o + len(x)] for o, x in zip(offs, cf)], chunks_of(dst, MiB, 2))
        r[f"cpu_level{level}_gpu_decode_exact"] = bool(torch.equal(dst, W[: 8 * MiB]))
    b = nb.GpuCodec("zstd").encode(chunks)
    r["ratio_plain_1MiB"] = round(W.numel() / sum(b.sizes()), 4)


def thr(label, codec, chunk, r, data, dev, reps=5):
    chunks = chunks_of(data, chunk, codec.itemsize)
    holder = {}

    def enc():
        holder["b"] = codec.encode(chunks)
        holder["b"].sizes()
    ms, all_ms = ev_time(enc, codec.stream, reps=reps)
    b = holder.pop("b")
    sz = b.sizes()
    buf, pays = stage(b, sz, dev)
    del b
    dst = torch.empty_like(data)
    outs = chunks_of(dst, chunk, codec.itemsize)
    dms, dall = ev_time(lambda pays=pays: codec.decode(pays, outs), codec.stream, reps=reps)  # bound now: del'd below
    r[label] = {"chunks": len(chunks), "ratio": round(data.numel() / sum(sz), 4),
                "encode_GBps": round(data.numel() / ms / 1e6, 1), "decode_GBps": round(data.numel() / dms / 1e6, 1),
                "encode_ms": [round(x, 2) for x in all_ms], "decode_ms": [round(x, 2) for x in dall],
                "exact": bool(torch.equal(dst, data))}
    del buf, pays, dst


@probe
def throughput(r, c):
    nb, dev, BIG = c.nb, c.dev, c.BIG
    r["bytes"] = BIG.numel()
    thr("ans_f2_1MiB_span", nb.GpuCodec("ans", "<f2"), MiB, r, BIG, dev)
    thr("ans_f2_4MiB_span", nb.GpuCodec("ans", "<f2"), 4 * MiB, r, BIG, dev)
    thr("ans_f2_256KiB_span", nb.GpuCodec("ans", "<f2"), 256 << 10, r, BIG, dev)
    thr("ans_f2_64KiB_span", nb.GpuCodec("ans", "<f2"), 64 << 10, r, BIG, dev, reps=3)
    thr("ans_u1_1MiB_span", nb.GpuCodec("ans", "|u1"), MiB, r, BIG, dev, reps=3)
    thr("zstd_shuffle2_1MiB_512MiB", nb.GpuCodec("zstd", shuffle=2), MiB, r, BIG[: 512 * MiB], dev, reps=2)
    g = nb.GpuCodec("ans", "<f2")
    part = BIG[: 1 << 30]

    def batches(size):
        for st in range(0, part.numel(), size):
            g.encode(chunks_of(part[st: st + size], MiB, 2)).sizes()
    for bs in (16 * MiB, 64 * MiB, 256 * MiB):
        ms, _ = ev_time(lambda: batches(bs), g.stream, reps=3)
        r[f"ans_f2_1MiB_batches_of_{bs // MiB}MiB_encode_GBps"] = round(part.numel() / ms / 1e6, 1)
    # host time of one encode call (no wait) for 256 chunks
    ch = chunks_of(part[: 256 * MiB], MiB, 2)
    g.encode(ch).sizes()
    t0 = time.perf_counter()
    b = g.encode(ch)
    r["host_ms_encode_call_256_chunks"] = round((time.perf_counter() - t0) * 1e3, 2)
    b.sizes()
    dst = torch.empty_like(BIG)
    ms, _ = ev_time(lambda: nb._shuffle_batch(dst, [i * MiB for i in range(2048)], chunks_of(BIG, MiB), 2, False), c.s)
    r["byteshuffle_2GiB_GBps"] = round(BIG.numel() / ms / 1e6, 1)


@probe
def gil(r, c):
    """Does a busy Python thread slow the encode thread down?"""
    g = c.nb.GpuCodec("ans", "<f2")
    chunks = chunks_of(c.BIG, MiB)
    g.encode(chunks).sizes()
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1
    for label, interval in (("default_switch", None), ("switch_0.5ms", 0.0005)):
        old = sys.getswitchinterval()
        if interval:
            sys.setswitchinterval(interval)
        stop.clear()
        th = threading.Thread(target=spin, daemon=True)
        th.start()
        time.sleep(0.05)
        t0 = time.perf_counter()
        b = g.encode(chunks)
        t1 = time.perf_counter()
        b.sizes()
        t2 = time.perf_counter()
        stop.set()
        th.join()
        sys.setswitchinterval(old)
        r[label] = {"encode_call_ms": round((t1 - t0) * 1e3, 2), "sizes_wait_ms": round((t2 - t1) * 1e3, 2)}
    t0 = time.perf_counter()
    b = g.encode(chunks)
    t1 = time.perf_counter()
    b.sizes()
    r["no_contention"] = {"encode_call_ms": round((t1 - t0) * 1e3, 2), "sizes_wait_ms": round((time.perf_counter() - t1) * 1e3, 2)}


@probe
def copies(r, c):
    s = c.s
    n = 1 << 30
    d = torch.empty(n, dtype=torch.uint8, device=c.dev).random_(0, 255)
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    c.pinned = h
    ms, _ = ev_time(lambda: h.copy_(d, non_blocking=True), s)
    r["d2h_pinned_1GiB_GBps"] = round(n / ms / 1e6, 1)
    ms, _ = ev_time(lambda: d.copy_(h, non_blocking=True), s)
    r["h2d_pinned_1GiB_GBps"] = round(n / ms / 1e6, 1)

    def pieces():
        for o in range(0, n, 16 * MiB):
            h[o: o + 16 * MiB].copy_(d[o: o + 16 * MiB], non_blocking=True)
    ms, _ = ev_time(pieces, s)
    r["d2h_pinned_16MiB_pieces_GBps"] = round(n / ms / 1e6, 1)
    hp = torch.empty(256 * MiB, dtype=torch.uint8)
    ms, _ = ev_time(lambda: hp.copy_(d[: 256 * MiB]), s, reps=3)
    r["d2h_pageable_256MiB_GBps"] = round(256 * MiB / ms / 1e6, 1)
    r["pinned_ptr_mod_4096"] = h.data_ptr() % 4096


@probe
def disk(r, c):
    r["df"] = subprocess.run(["df", "-h", os.getcwd(), "/tmp"], capture_output=True, text=True).stdout
    r["mounts"] = subprocess.run(["sh", "-c", "grep -E ' / | /tmp ' /proc/mounts; uname -r"], capture_output=True, text=True).stdout
    path = os.path.join(os.getcwd(), "probe_disk.bin")
    total, block = 4 << 30, 16 * MiB
    h = getattr(c, "pinned", None)
    if h is None:
        h = torch.empty(block, dtype=torch.uint8, pin_memory=True)
    mv = memoryview(h[:block].numpy())

    def direct_write(threads: int) -> float:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        t0 = time.perf_counter()
        nblocks = total // block

        def worker(k):
            for i in range(k, nblocks, threads):
                assert os.pwrite(fd, mv, i * block) == block
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
        try:
            r[f"odirect_write_16MiB_{threads}thr_fsync_GBps"] = round(direct_write(threads), 3)
        except Exception as exc:
            r[f"odirect_write_16MiB_{threads}thr_fsync_GBps"] = f"{type(exc).__name__}: {exc}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, block)
        t0 = time.perf_counter()
        for i in range(total // block):
            os.preadv(fd, [buf], i * block)
        r["odirect_read_16MiB_GBps"] = round(total / (time.perf_counter() - t0) / GB, 3)
        os.close(fd)
    except Exception as exc:
        r["odirect_read_16MiB_GBps"] = f"{type(exc).__name__}: {exc}"
    try:
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for i in range((2 << 30) // block):
                f.write(mv)
            os.fsync(f.fileno())
        r["buffered_write_16MiB_fsync_GBps"] = round((2 << 30) / (time.perf_counter() - t0) / GB, 3)
    except Exception as exc:
        r["buffered_write_16MiB_fsync_GBps"] = f"{type(exc).__name__}: {exc}"
    os.unlink(path)


def main() -> None:
    from safetensors.torch import load_file

    want = set(sys.argv[1:])
    unknown = want - {f.__name__ for f in SECTIONS}
    if unknown:
        sys.exit(f"unknown sections {sorted(unknown)}; known: {[f.__name__ for f in SECTIONS]}")
    c = Ctx()
    c.dev = torch.device("cuda", 0)
    torch.cuda.set_device(c.dev)
    import nvidia.nvcomp as nv
    from nvckpt.codecs.nvcomp import device as nb
    c.nv, c.nb = nv, nb
    sd = load_file(DATA, device="cuda")
    c.names = sorted(k for k, v in sd.items() if v.dtype == torch.bfloat16)
    c.W = torch.cat([sd[k].reshape(-1).view(torch.uint8) for k in c.names])  # bf16 bytes, 45 MB
    del sd
    results["data"] = {"bf16_tensors": len(c.names), "bytes": c.W.numel()}
    c.s = torch.cuda.current_stream()
    c.BIG = None
    for fn in SECTIONS:
        if want and fn.__name__ not in want:
            continue
        if fn.__name__ in ("throughput", "gil") and c.BIG is None:
            c.BIG = c.W.repeat((2 << 30) // c.W.numel() + 1)[: 2 << 30]
        if fn.__name__ == "copies":
            c.BIG = None
            gc.collect()
            torch.cuda.empty_cache()
        torch.cuda.synchronize()
        run_section(fn, c)


if __name__ == "__main__":
    t0 = time.perf_counter()
    try:
        main()
    finally:
        results["total_seconds"] = round(time.perf_counter() - t0, 1)
        dump()
        print("probe done in", results["total_seconds"], "s", flush=True)
