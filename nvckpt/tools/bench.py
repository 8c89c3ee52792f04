"""`nvckpt bench`: a small, honest CPU benchmark of nvckpt against torch.save, safetensors and ZipNN.

Peers that are not installed (safetensors, zipnn) are left out; the order-0 entropy limit of the
byte planes is printed beside, as a yardstick for the compressing formats.

Every save ends with fsync (nvckpt.save does it to commit its atomic rename;
the others get one here, so that all pay the same).  Loads read files that were
just written and read once more (untimed), so they come from the page cache:
this measures encoding and decoding, not the disk.  Each figure is the best of ``repeat`` runs.  With
``device="cuda"`` the state lives on the GPU, nvckpt saves with its GPU engine
and every format loads back to the GPU.  The full GPU benchmark (a trained
transformer, dropped page cache, disk and PCIe limits) is
benchmarks/bench_gpu.py in the repository.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..api import load as nvckpt_load
from ..api import save as nvckpt_save
from ..io.atomic import fsync_path
from ._util import on_device


@dataclass
class Measurement:
    """One format on one state."""

    format: str
    raw_bytes: int  # distinct tensor bytes of the state
    file_bytes: int
    save_s: float
    load_s: float
    exact: bool | None  # loaded back bit for bit (None: not checked)
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.file_bytes if self.file_bytes else 1.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__, ratio=self.ratio)


def in_page_cache(path: str) -> None:
    """Read ``path`` once, untimed: nvckpt writes with O_DIRECT (a checkpoint does not evict
    the training job's page cache), so without this its first load would read the disk while the peers'
    buffered writes are still cached."""
    buf = bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """(fastest wall time, last result) of ``repeat`` calls."""
    best, result = float("inf"), None
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The path of the first place where two trees differ (types, shapes, dtypes, bits), or None."""
    where = path or "<root>"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return where
        if a.dtype != b.dtype or a.shape != b.shape:
            return where
        if a.numel() and not torch.equal(a.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
                                         b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)):
            return where
        return None
    if isinstance(a, dict) and isinstance(b, dict):  # an OrderedDict (state_dict) loads back as a dict
        if list(a) != list(b):
            return where
        for k in a:
            found = first_difference(a[k], b[k], f"{path}/{k}" if path else str(k))
            if found:
                return found
        return None
    if type(a) is not type(b):
        return where
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return where
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}/{i}" if path else str(i))
            if found:
                return found
        return None
    if isinstance(a, float) and a != a and b != b:  # NaN == NaN here
        return None
    return None if a == b else where


def _fsynced(path: str, write: Callable[[Any], None]) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def touch(tree: Any) -> Any:
    """Read one byte of every page of every CPU tensor in ``tree``: safetensors (and a memory map) return
    before reading anything, so a load is timed until its data is in memory, as nvckpt's and torch's are."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            if node.device.type == "cpu" and node.numel():
                node.detach().reshape(-1).view(torch.uint8)[::4096].sum()
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return tree


def _synced(fn: Callable[[], Any], device: str) -> Callable[[], Any]:
    if device == "cpu":
        return lambda: touch(fn())

    def run() -> Any:
        out = fn()
        torch.cuda.synchronize()
        return out
    return run


def measure_nvckpt(obj: Any, path: str, *, repeat: int, codec: str = "auto", check: bool = True,
                   device: str = "cpu") -> Measurement:
    save_s, result = best_of(repeat, lambda: nvckpt_save(obj, path, codec=codec))
    in_page_cache(path)
    load_s, loaded = best_of(repeat, _synced(lambda: nvckpt_load(path, device=device), device))
    exact = first_difference(obj, loaded) is None if check else None
    return Measurement(f"nvckpt ({codec}, {result.engine} engine)", result.raw_bytes, os.path.getsize(path), save_s,
                       load_s, exact)


def measure_torch(obj: Any, path: str, *, repeat: int, raw_bytes: int, check: bool = True,
                  device: str = "cpu") -> Measurement:
    save_s, _ = best_of(repeat, lambda: _fsynced(path, lambda f: torch.save(obj, f)))
    in_page_cache(path)
    load_s, loaded = best_of(repeat, _synced(lambda: torch.load(path, map_location=device, weights_only=True), device))
    exact = first_difference(obj, loaded) is None if check else None
    return Measurement("torch.save", raw_bytes, os.path.getsize(path), save_s, load_s, exact)


def measure_safetensors(obj: Any, path: str, *, repeat: int, raw_bytes: int, device: str = "cpu") -> Measurement | None:
    """safetensors of the flattened state (tensors only, shared ones copied), or None if not installed."""
    try:
        import safetensors.torch as st
    except ImportError:
        return None
    from .convert import flatten, unshared

    tensors, _, _, dropped = flatten(obj)
    flat, _ = unshared(tensors)

    def save() -> None:
        st.save_file(flat, path)
        fsync_path(path)

    save_s, _ = best_of(repeat, save)
    in_page_cache(path)
    if device == "cpu":
        # Like for like: nvckpt and torch.load leave every tensor in memory of its own, so safetensors' map of
        # the file is copied out (one copy from the page cache, as torch.load's read).  Only mapping it, with
        # one byte of each page read, is many times faster and leaves the tensors backed by the file: said
        # beside, not compared.
        load_s, loaded = best_of(repeat, lambda: {k: v.clone() for k, v in st.load_file(path).items()})
        mapped_s, _ = best_of(repeat, lambda: touch(st.load_file(path)))
        notes = [f"load: copied into memory of its own; mapped only: {raw_bytes / mapped_s / (1 << 20):.0f} MiB/s"]
    else:
        load_s, loaded = best_of(repeat, _synced(lambda: st.load_file(path, device=device), device))
        notes = []
    exact = all(first_difference(flat[k], loaded.get(k)) is None for k in flat)
    if dropped:
        notes.append(f"tensors only ({len(dropped)} other values dropped)")
    return Measurement("safetensors", raw_bytes, os.path.getsize(path), save_s, load_s, exact, "; ".join(notes))


def _tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [("", obj)]
    if isinstance(obj, dict):
        return [(f"{k}/{n}", t) for k, v in obj.items() for n, t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [(f"{i}/{n}", t) for i, v in enumerate(obj) for n, t in _tensors(v)]
    return []


def entropy_limit(obj: Any) -> float:
    """raw bytes / the order-0 entropy of each tensor's byte planes (byteshuffle), summed: what a coder of
    independent bytes per plane could reach at best (ZipNN and nvckpt's portable codec come close)."""
    import numpy as np

    raw = bits = 0.0
    seen: set[int] = set()
    for _, t in _tensors(obj):
        if t.numel() == 0 or id(t) in seen:
            continue
        seen.add(id(t))
        b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        k = t.element_size()
        elements = b.reshape(-1, k)
        for j in range(k):
            counts = np.bincount(elements[:, j], minlength=256).astype(np.float64)
            counts = counts[counts > 0]
            bits += -(counts * np.log2(counts / len(elements))).sum()
        raw += b.nbytes
    return raw * 8 / bits if bits else 1.0


def measure_zipnn(obj: Any, path: str, *, repeat: int, raw_bytes: int, device: str = "cpu") -> Measurement | None:
    """ZipNN (IBM's lossless model compressor, Huffman on byte groups) of each float tensor, other tensors as raw
    bytes, one file with fsync; None if zipnn is not installed.  Loaded back on the CPU (ZipNN's own)."""
    import warnings

    try:
        with warnings.catch_warnings():  # zipnn 0.5 uses torch.jit.script, which torch now deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            from zipnn import ZipNN
    except ImportError:
        return None
    import json
    import struct

    z = ZipNN(input_format="torch", threads=os.cpu_count() or 1)
    tensors = [(n, t) for n, t in _tensors(obj)]

    def save() -> None:
        parts = []
        for name, t in tensors:
            t = t.detach().cpu().contiguous()
            if t.dtype in (torch.bfloat16, torch.float16, torch.float32) and t.numel():
                parts.append((name, 1, bytes(z.compress(t.clone()))))  # ZipNN 0.5.4 reorders its input in place
            else:
                parts.append((name, 0, t.reshape(-1).view(torch.uint8).numpy().tobytes()))
        header = json.dumps([[n, c, len(b)] for n, c, b in parts]).encode()

        def write(f: Any) -> None:
            f.write(struct.pack("<Q", len(header)) + header)
            for _, _, b in parts:
                f.write(b)
        _fsynced(path, write)

    def load() -> list:
        with open(path, "rb") as f:
            data = f.read()
        n = struct.unpack_from("<Q", data)[0]
        at, out = 8 + n, []
        for name, coded, size in json.loads(data[8: 8 + n]):
            piece = data[at: at + size]
            at += size
            out.append(z.decompress(piece) if coded else piece)
        return out

    save_s, _ = best_of(repeat, save)
    in_page_cache(path)
    load_s, _ = best_of(repeat, load)
    return Measurement("ZipNN", raw_bytes, os.path.getsize(path), save_s, load_s, None, "float tensors, Huffman")


def bench(obj: Any, *, repeat: int = 3, codec: str = "auto", directory: str | None = None,
          device: str = "cpu") -> list[Measurement]:
    """Measure nvckpt, torch.save and (if installed) safetensors and ZipNN on one state, held and loaded on ``device``.
    The last row is the order-0 entropy limit of the byte planes (no times)."""
    obj = on_device(obj, device) if device != "cpu" else obj
    with tempfile.TemporaryDirectory(prefix="nvckpt-bench-", dir=directory) as tmp:
        rows = [measure_nvckpt(obj, os.path.join(tmp, "state.nvckpt"), repeat=repeat, codec=codec, device=device)]
        raw = rows[0].raw_bytes
        rows.append(measure_torch(obj, os.path.join(tmp, "state.pt"), repeat=repeat, raw_bytes=raw, device=device))
        st = measure_safetensors(obj, os.path.join(tmp, "state.safetensors"), repeat=repeat, raw_bytes=raw,
                                 device=device)
        if st is not None:
            rows.append(st)
        zn = measure_zipnn(obj, os.path.join(tmp, "state.zipnn"), repeat=repeat, raw_bytes=raw, device=device)
        if zn is not None:
            rows.append(zn)
        limit = entropy_limit(obj)
        rows.append(Measurement("order-0 entropy limit of the byte planes", raw, int(raw / limit), 0.0, 0.0, None,
                                "a bound for coders of independent bytes"))
        return rows


__all__ = ["bench", "Measurement", "best_of", "first_difference", "measure_nvckpt", "measure_torch", "measure_zipnn",
           "entropy_limit"]
