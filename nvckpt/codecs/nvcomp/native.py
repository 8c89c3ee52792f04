"""nvCOMP's batched ANS compressor through its C API (libnvcomp, ctypes): the GPU engine's encode.

Why not the Python API here: its batched ``encode`` holds the GIL for ~1 ms per call, and reading the
compressed sizes back (``buffer_sizes``) is a copy that waits behind whatever device-to-host copy is
running, with the GIL held: 0.5 ms on an idle copy engine, 4.2-4.6 ms beside a 200 MB copy (H200,
nvCOMP 6.0).  In the engine's pipeline a copy out is always running, so every batch waited for the last
one's copy and the caller's thread waited for the GIL.  Here the call releases the GIL (ctypes does),
the tables of chunk pointers and lengths are in pinned host memory that the kernels read over the bus,
and nvCOMP writes the compressed sizes and per-chunk statuses straight into pinned host memory: the host
reads them once an event says the encode is done, without a copy and without the GIL.

The streams are the bytes the Python API writes (same nvCOMP kernels and options: checked on the H200
for each data type).  The C API's data-type numbers are nvCOMP's ``nvcompType_t``, which changed between
releases, so an encoder is only used after a check at first use on each device: a test input encoded
both ways must give the same streams; otherwise (or without libnvcomp's C symbols) the caller keeps the
Python API.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np
import torch

from ..._fork import Lock, importing

ENABLED = True  # False: always nvCOMP's Python API (an escape hatch, and the A/B of benchmarks/probe_async.py)

NVCOMP_MAJOR = 6  # the prototypes below are nvCOMP 6's; another major version keeps the Python API

# nvcompType_t of nvCOMP 6.0 per ANS data-type mode, as matched against the Python API's streams on the H200.
_NVCOMP6_TYPES = {"<f4": 11, "<f2": 10, "|f1": 9, "|u1": 0}


class _Opts(ctypes.Structure):
    """nvcompBatchedANSCompressOpts_t (64 bytes in nvCOMP 5 and 6): zeroed fields are nvCOMP's defaults."""

    _fields_ = [("type", ctypes.c_int), ("data_type", ctypes.c_int), ("max_sub_chunk_count", ctypes.c_uint8),
                ("reserved", ctypes.c_char * 55)]


_lib: Any = None
_lib_lock = Lock()  # a forked child gets it unlocked (nvckpt._fork)
_checked: dict[tuple[str, int], bool] = {}  # (data type, device index) -> the native streams match


def _library() -> Any:
    """libnvcomp with the C prototypes set, or False where it cannot be had."""
    global _lib
    if _lib is None:
        with importing():  # a fork waits for the library's loading (nvckpt._fork)
            if _lib is None:
                _lib = _load()
    return _lib


def _load() -> Any:
    try:
        import nvidia.libnvcomp as wheel  # the library the Python API itself loaded

        lib = wheel.load_library() or ctypes.CDLL("libnvcomp.so.6", ctypes.RTLD_LOCAL)
        size, ptr = ctypes.c_size_t, ctypes.c_void_p
        lib.nvcompBatchedANSCompressGetTempSize.argtypes = [size, size, _Opts, ctypes.POINTER(size), size]
        lib.nvcompBatchedANSCompressAsync.argtypes = [ptr, ptr, size, size, ptr, size, ptr, ptr, _Opts, ptr, ptr]
        for f in (lib.nvcompBatchedANSCompressGetTempSize, lib.nvcompBatchedANSCompressAsync):
            f.restype = ctypes.c_int
        return lib
    except (ImportError, OSError, AttributeError):
        return False


class NativeBatch:
    """The host side of one native encode: sizes and statuses land in ``table`` (pinned) once ``event`` is done."""

    def __init__(self, table: torch.Tensor, n: int, event: Any, keep: tuple) -> None:
        self.table, self.n, self.event, self.keep = table, n, event, keep

    def sizes(self) -> list[int]:
        self.event.synchronize()  # through torch: the GIL is free meanwhile
        view = self.table.numpy()
        status = view[4 * self.n: 5 * self.n].view(np.int32)[: self.n]
        if status.any():
            bad = int(np.flatnonzero(status)[0])
            raise RuntimeError(f"nvCOMP ANS failed on chunk {bad} of a batch of {self.n} (status {int(status[bad])})")
        sizes = view[3 * self.n: 4 * self.n].tolist()
        self.keep = ()
        return sizes

    @property
    def buffer_sizes(self) -> list[int]:  # what EncodedBatch reads from the Python API's result
        return self.sizes()


class NativeAns:
    """Batched ANS compression of one data-type mode on one stream, through nvCOMP's C API."""

    def __init__(self, lib: Any, data_type: str, stream: torch.cuda.Stream) -> None:
        self.lib, self.stream = lib, stream
        self.opts = _Opts(0, _NVCOMP6_TYPES[data_type], 0)

    def encode(self, ptrs: list[int], raw_lengths: list[int], out: torch.Tensor, cap: int, keep: tuple) -> NativeBatch:
        """Compress chunk i (``raw_lengths[i]`` bytes at device address ``ptrs[i]``) into ``out[i * cap:]``,
        on the stream, after its queued work.  ``keep``: what must stay alive until the sizes were read."""
        n = len(ptrs)
        # One pinned table: source addresses, lengths, output addresses, then sizes and statuses (written by nvCOMP).
        table = torch.empty(5 * n, dtype=torch.int64, pin_memory=True)
        view = table.numpy()
        view[:n] = ptrs
        view[n: 2 * n] = raw_lengths
        view[2 * n: 3 * n] = np.arange(n, dtype=np.int64) * cap + out.data_ptr()
        view[3 * n:] = 0
        base, word = table.data_ptr(), 8
        biggest, total = max(raw_lengths), sum(raw_lengths)
        temp_bytes = ctypes.c_size_t()
        status = self.lib.nvcompBatchedANSCompressGetTempSize(n, biggest, self.opts, ctypes.byref(temp_bytes), total)
        if status:
            raise RuntimeError(f"nvCOMP ANS cannot size a batch of {n} chunks (status {status})")
        temp = torch.empty(temp_bytes.value, dtype=torch.uint8, device=out.device) if temp_bytes.value else None
        status = self.lib.nvcompBatchedANSCompressAsync(
            base, base + n * word, biggest, n, temp.data_ptr() if temp is not None else None, temp_bytes.value,
            base + 2 * n * word, base + 3 * n * word, self.opts, base + 4 * n * word, self.stream.cuda_stream)
        if status:
            raise RuntimeError(f"nvCOMP ANS could not start a batch of {n} chunks (status {status})")
        event = torch.cuda.Event()
        event.record(self.stream)
        return NativeBatch(table, n, event, (keep, temp, out))


def ans_encoder(data_type: str, device: torch.device, stream: torch.cuda.Stream,
                reference: Callable[[list[tuple[torch.Tensor, int, int]]], tuple[list[bytes], int]]) -> NativeAns | None:
    """A NativeAns for ``data_type`` on ``stream``, or None: no C API, a mode not matched for this nvCOMP, or
    streams that differ from ``reference``'s (the Python API's encode of some chunks: their streams as bytes,
    and the output capacity per chunk it used)."""
    lib = _library()
    if not lib or data_type not in _NVCOMP6_TYPES:
        return None
    native = NativeAns(lib, data_type, stream)
    key = (data_type, device.index)
    with _lib_lock:
        ok = _checked.get(key)
    if ok is None:
        ok = _same_streams(native, device, stream, reference)
        with _lib_lock:
            _checked[key] = ok
    return native if ok else None


def _same_streams(native: NativeAns, device: torch.device, stream: torch.cuda.Stream,
                  reference: Callable[[list[tuple[torch.Tensor, int, int]]], tuple[list[bytes], int]]) -> bool:
    """Encode a small test input (two chunks: smooth and noisy floats) natively and with ``reference``."""
    try:
        with torch.cuda.stream(stream):
            g = torch.Generator(device="cpu").manual_seed(0)
            values = torch.cat([torch.linspace(-3, 3, 8192), torch.randn(8192, generator=g)])
            data = values.to(device).view(torch.uint8)
            want, cap = reference([(data, 0, 32768), (data, 32768, 32768)])
            out = torch.zeros(cap * 2, dtype=torch.uint8, device=device)
            sizes = native.encode([data.data_ptr(), data.data_ptr() + 32768], [32768, 32768], out, cap, (data,)).sizes()
            got = [bytes(out[i * cap: i * cap + n].cpu().numpy()) for i, n in enumerate(sizes)]
        return got == want
    except Exception:  # noqa: BLE001 (any failure of the C path means: keep the Python API)
        return False


__all__ = ["NativeAns", "NativeBatch", "ans_encoder"]
