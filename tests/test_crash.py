"""Crash safety: SIGKILL a process in the middle of nvckpt.save, many times.

After every kill:
- the file at the final path is the complete old checkpoint or the complete
  new one, bit for bit (save writes a temporary file and renames it);
- `nvckpt.tools.recover.recover` on the temporary file left beside it
  (``.<basename>.*.nvckpt-tmp``) salvages exactly the tensors whose frames
  reached the file complete (found here by an independent walk of the frames),
  each equal to the new checkpoint's tensor, and names the ones it lost.
"""

from __future__ import annotations

import glob
import hashlib
import os
import random
import signal
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import torch
import xxhash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import nvckpt  # noqa: E402
from conftest import named_tensors  # noqa: E402
from nvckpt.tools.recover import recover  # noqa: E402

KILLS = 14
PARALLEL = 2

# Shared by this module and the writer process: the checkpoint of a given version (about 33 MB,
# tensors of several sizes, some compressible), so that the file is written in several blocks.
STATE_CODE = r"""
import torch
def make_state(version):
    g = torch.Generator().manual_seed(1000 + version)
    state = {"model": {}, "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3 * version, "params": list(range(12))}]},
             "step": version}
    for i in range(12):
        rows = 384 + 256 * i
        w = torch.randn(rows, 256, generator=g)
        state["model"][f"layer{i}.weight"] = w if i % 3 else (w * 16).round() / 16
        state["optimizer"]["state"][i] = {"exp_avg": torch.randn(rows, 256, generator=g).to(torch.bfloat16)}
    return state
"""

WRITER = r"""
import os, sys, threading, time
sys.path.insert(0, {root!r})
import nvckpt
{state_code}
path, version = sys.argv[1], int(sys.argv[2])
state = make_state(version)
real_pwrite, disk = os.pwrite, threading.Lock()
def slow_pwrite(fd, data, offset):  # a slow disk, one write at a time: kills land between writes on any machine
    with disk:
        time.sleep(0.1)
        return real_pwrite(fd, data, offset)
os.pwrite = slow_pwrite
warm = os.path.join(os.path.dirname(path), "warmup", "w.nvckpt")
os.makedirs(os.path.dirname(warm), exist_ok=True)
times = []
for _ in range(3):  # the first save pays one-time costs: time the later ones
    t = time.perf_counter()
    nvckpt.save(state, warm, chunk_size=1 << 18)
    times.append(time.perf_counter() - t)
print("ready", min(times[1:]), flush=True)
sys.stdin.readline()
nvckpt.save(state, path, chunk_size=1 << 18)
print("saved", flush=True)
time.sleep(60)
"""

namespace: dict = {}
exec(STATE_CODE, namespace)
make_state = namespace["make_state"]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def digests(obj) -> dict[str, str]:
    return {name: digest(t) for name, t in named_tensors(obj)}


def complete_tensors(path: str) -> tuple[set[str], set[str]]:
    """Walk the frames of a (truncated) file as SPEC.md 7 and 15.2 say, without nvckpt.

    Returns (names of complete tensors, names of tensors announced but not complete)."""
    with open(path, "rb") as f:
        data = f.read()
    described: dict[int, dict] = {}
    chunks: set[tuple[int, int]] = set()
    off = 24
    while off + 48 <= len(data):
        header = data[off:off + 48]
        fields = struct.unpack("<4sBBHIIIIQQQ", header)
        magic, ftype, _, _, tid, cidx, pad, hcheck, stored, _, pcheck = fields
        zeroed = header[:20] + b"\0\0\0\0" + header[24:]
        if magic != b"NVCF" or xxhash.xxh3_64_intdigest(zeroed) & 0xFFFFFFFF != hcheck:
            break
        start = off + 48 + pad
        if start + stored > len(data):
            break
        payload = data[start:start + stored]
        if xxhash.xxh3_64_intdigest(payload) == pcheck:
            if ftype == 2:
                described[tid] = msgpack.unpackb(payload, strict_map_key=False)
            elif ftype == 3:
                chunks.add((tid, cidx))
            elif ftype == 4:
                break
        off = start + stored
    complete, partial = set(), set()
    for tid, d in described.items():
        ok = all((tid, i) in chunks for i in range(d["nchunks"]))
        (complete if ok else partial).add(d["name"])
    return complete, partial


@pytest.fixture(scope="module")
def versions():
    old, new = make_state(1), make_state(2)
    return old, new, digests(old), digests(new)


def one_kill(folder: str, when: tuple[str, float], versions) -> str:
    """Save the old version, start saving the new one in a child, kill it; check; return what the kill hit.

    ``when``: ("time", f) kills f * (the child's own save time) after it starts saving;
    ("data", f) waits until the temporary file holds data, then kills f * save time later."""

    old, new, old_d, new_d = versions
    path = os.path.join(folder, "ckpt.nvckpt")
    nvckpt.save(old, path, chunk_size=1 << 18)
    code = WRITER.format(root=ROOT, state_code=STATE_CODE)
    with subprocess.Popen([sys.executable, "-c", code, path, "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as child:
        try:
            line = child.stdout.readline().split()
            assert line and line[0] == "ready", line
            seconds = float(line[1])
            child.stdin.write("go\n")
            child.stdin.flush()
            mode, fraction = when
            if mode == "data":
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not any(
                        os.path.getsize(p) for p in glob.glob(os.path.join(folder, ".ckpt.nvckpt.*.nvckpt-tmp"))
                        if os.path.exists(p)):
                    time.sleep(0.0005)
            time.sleep(fraction * seconds)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()

    # The final path: the old or the new checkpoint, complete.
    with nvckpt.open(path) as ck:
        got = {name: digest(ck.get_tensor(name)) for name in ck.keys()}
        loaded = ck.load()
    assert got in (old_d, new_d), "the checkpoint at the final path is neither the old nor the new one"
    assert loaded["step"] in (1, 2) and loaded["step"] == (1 if got == old_d else 2)

    leftovers = glob.glob(os.path.join(folder, ".ckpt.nvckpt.*.nvckpt-tmp"))
    assert len(leftovers) <= 1
    if not leftovers:
        return "renamed" if got == new_d else "before the temporary file"
    tmp = leftovers[0]
    complete, partial = complete_tensors(tmp)
    out = os.path.join(folder, "recovered.nvckpt")
    try:
        report = recover(tmp, out)
    except nvckpt.NvckptError:
        assert not complete, f"recover failed on a file with complete tensors {sorted(complete)[:3]}"
        return "empty temporary file"
    assert set(report.recovered) == complete, (sorted(set(report.recovered) ^ complete)[:5])
    assert partial <= set(report.lost), sorted(partial - set(report.lost))[:5]
    assert not set(report.recovered) & set(report.lost)
    with nvckpt.open(out) as ck:
        for name in report.recovered:
            assert digest(ck.get_tensor(name)) == new_d[name], name
    os.unlink(tmp)
    os.unlink(out)
    if not complete:
        return "temporary file with no complete tensor"
    return "temporary file, all tensors" if not partial and len(complete) == len(new_d) else "temporary file, some tensors"


@pytest.mark.slow
def test_sigkill_during_save_leaves_old_or_new_and_recover_salvages(tmp_path, versions):
    rng = random.Random(20260)
    # Half the kills at a random time of the save, half once the temporary file holds data.
    whens = [("time", rng.uniform(0.0, 1.2)) if i % 2 else ("data", rng.uniform(0.0, 0.15)) for i in range(KILLS)]
    folders = []
    for i in range(KILLS):
        folders.append(str(tmp_path / f"k{i}"))
        os.makedirs(folders[-1])
    with ThreadPoolExecutor(PARALLEL) as pool:
        hits = list(pool.map(lambda a: one_kill(a[0], a[1], versions), zip(folders, whens)))
    print("kills hit:", hits)
    # The kills must have landed in the middle of writes, not only before or after them.
    assert sum(h.startswith("temporary file") for h in hits) >= 3, hits
