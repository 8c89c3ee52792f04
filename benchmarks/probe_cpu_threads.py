#!/usr/bin/env python3
"""Do two threads halve the CPU engine's work here?  The portable codec's steps on a 1 MiB chunk of
MiniLM's bf16 word embeddings, 400 times in one thread and 200 times in each of two: libzstd's
frames alone, a whole chunk decode (frames, then the byte planes put back with numpy), and pure
Python (which the GIL serializes) as the floor.  A diagnostic for bench_cpu's load and save numbers.

    python3 benchmarks/probe_cpu_threads.py
"""
import os, sys, threading, time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch, bench_cpu
from nvckpt.codecs import planes
st = bench_cpu.minilm(torch.bfloat16)
t = max(st.values(), key=lambda x: x.numel())
raw = t.reshape(-1).view(torch.uint8).numpy()[: 1<<20].copy()
out = np.empty(planes.chunk_bound(raw.nbytes, 2), np.uint8)
L = planes.encode_chunk(raw, 2, True, out); enc = out[:L].copy()
def work(n, fn):
    for _ in range(n): fn()
def dec():
    dst = np.empty(raw.nbytes, np.uint8); planes.decode_frames(enc, dst)
def decj():
    dst = np.empty(raw.nbytes, np.uint8); planes.decode_chunk(enc, 2, True, dst)
def hashx():
    import xxhash; xxhash.xxh3_64_intdigest(raw)
def pyloop():
    s=0
    for i in range(20000): s+=i
for name, fn, n in (("zstd frames", dec, 200), ("decode_chunk", decj, 200), ("pure python", pyloop, 200)):
    t0=time.perf_counter(); work(2*n, fn); t1=time.perf_counter()-t0
    ths=[threading.Thread(target=work, args=(n, fn)) for _ in range(2)]
    t0=time.perf_counter(); [x.start() for x in ths]; [x.join() for x in ths]; t2=time.perf_counter()-t0
    print(f"{name}: 1 thread {t1*1e3:.0f} ms, 2 threads {t2*1e3:.0f} ms, speedup {t1/t2:.2f}x")
