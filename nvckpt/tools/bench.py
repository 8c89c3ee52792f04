"""`nvckpt bench`: a small, honest CPU benchmark of nvckpt against torch.save and safetensors.

Every save ends with fsync (nvckpt.save does it to commit its atomic rename;
the others get one here, so that all pay the same).  Loads read files that were
just written, so they come from the page cache: this measures encoding and
decoding, not the disk.  Each figure is the best of ``repeat`` runs.  With
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
    load_s, loaded = best_of(repeat, _synced(lambda: nvckpt_load(path, device=device), device))
    exact = first_difference(obj, loaded) is None if check else None
    return Measurement(f"nvckpt ({codec}, {result.engine} engine)", result.raw_bytes, os.path.getsize(path), save_s,
                       load_s, exact)


def measure_torch(obj: Any, path: str, *, repeat: int, raw_bytes: int, check: bool = True,
                  device: str = "cpu") -> Measurement:
    save_s, _ = best_of(repeat, lambda: _fsynced(path, lambda f: torch.save(obj, f)))
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
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    save_s, _ = best_of(repeat, save)
    load_s, loaded = best_of(repeat, _synced(lambda: st.load_file(path, device=device), device))
    exact = all(first_difference(flat[k], loaded.get(k)) is None for k in flat)
    note = f"tensors only ({len(dropped)} other values dropped)" if dropped else ""
    return Measurement("safetensors", raw_bytes, os.path.getsize(path), save_s, load_s, exact, note)


def bench(obj: Any, *, repeat: int = 3, codec: str = "auto", directory: str | None = None,
          device: str = "cpu") -> list[Measurement]:
    """Measure nvckpt, torch.save and (if installed) safetensors on one state, held and loaded on ``device``."""
    obj = on_device(obj, device) if device != "cpu" else obj
    with tempfile.TemporaryDirectory(prefix="nvckpt-bench-", dir=directory) as tmp:
        rows = [measure_nvckpt(obj, os.path.join(tmp, "state.nvckpt"), repeat=repeat, codec=codec, device=device)]
        raw = rows[0].raw_bytes
        rows.append(measure_torch(obj, os.path.join(tmp, "state.pt"), repeat=repeat, raw_bytes=raw, device=device))
        st = measure_safetensors(obj, os.path.join(tmp, "state.safetensors"), repeat=repeat, raw_bytes=raw,
                                 device=device)
        if st is not None:
            rows.append(st)
        return rows


__all__ = ["bench", "Measurement", "best_of", "first_difference", "measure_nvckpt", "measure_torch"]
