"""The GPU engine's host stand-in: ``HostBackend`` runs the engine's scheduling (batches, slots, copy-out,
read spans, decode rounds) with the host codecs in plain memory, so that CI, which has no GPU, tests the
engines' logic.  ``GpuEngine(backend=HostBackend())`` is a whole GPU engine on the host."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Hashable

import numpy as np
import torch

from ..codecs.base import DecodeRejected, DeviceOp, Pipeline
from ..engines.gpu.backend import Encoded, Lease, _batch_parts, _copy_run
from ..engines.gpu.batching import Batch, SlotRun, aligned_host_buffer
from ..tensors import flat_bytes


class HostBackend:
    """The same engines with the host codecs in host memory: runs their scheduling in CI without a GPU.

    "Device" and "pinned" memory are plain host memory; work is done when issued.  ``memory_total``: the
    simulated device's capacity (its default memory budget follows from it, as a GPU's does); ``live`` and
    ``peak`` are the bytes of "device" buffers the engine holds (batch outputs, scratch), now and at most;
    ``left_at_lease_end``: ``live`` each time the last lease ended, where a CUDA backend hands its pool back
    to the device (a buffer still alive then would stay behind in torch's cache).  A load's results (``dest``)
    are the caller's, not the engine's: not counted."""

    def __init__(self, *, gpu_zstd: bool = False, timing: bool = False, memory_total: int | None = None,
                 device_reads: bool = False) -> None:
        self.device = torch.device("cpu")
        self.gpu_zstd = gpu_zstd
        self._total = memory_total
        self._device_reads = device_reads
        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0
        self.leases = 0
        self.left_at_lease_end: list[int] = []

    def _device_buffer(self, nbytes: int, zero: bool = False) -> torch.Tensor:
        """A buffer of the simulated device: counted while alive."""
        buf = (torch.zeros if zero else torch.empty)(nbytes, dtype=torch.uint8)
        with self._lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(buf, self._freed, nbytes)
        return buf

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes

    # -- both directions --
    def lease(self) -> Lease:
        with self._lock:
            self.leases += 1
        return Lease(self._end_lease)

    def _end_lease(self) -> None:
        with self._lock:
            self.leases -= 1
            if not self.leases:
                self.left_at_lease_end.append(self.live)

    def memory_total(self) -> int | None:
        return self._total

    def host_buffer(self, size: int) -> torch.Tensor:
        return aligned_host_buffer(size, pin=False)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, stream: Any) -> Any:
        dst[: src.numel()].copy_(src)
        return None

    def side_stream(self, after: Any) -> Any:
        return None

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = flat_bytes(tensor)
        return flat if flat.device.type == "cpu" else flat.cpu()

    def source(self, tensor: torch.Tensor) -> torch.Tensor:
        # As on a GPU: a non-contiguous tensor is staged chunk by chunk in encode, not copied whole.
        return tensor if tensor.device.type == "cpu" and not tensor.is_contiguous() else self.flat(tensor)

    def mark(self) -> Any:
        return None

    def caller_mark(self) -> Any:
        return None

    def wait(self, event: Any) -> None:
        pass

    def ready(self, event: Any) -> bool:
        return True

    def finish(self) -> None:
        pass

    def timing_report(self) -> dict[str, Any]:
        return {}

    # -- encode --
    def wait_for_caller(self, event: Any) -> None:
        pass

    @staticmethod
    def ordered(fn: Callable[[], Any]) -> Any:
        return fn()

    @staticmethod
    def capacity(pipeline: Pipeline, length: int) -> int:
        return length + (length >> 7) + 64  # anything longer than the chunk is stored raw anyway

    def encode(self, batch: Batch, sources: dict[int, torch.Tensor]) -> Encoded:
        cap = batch.capacity
        out = self._device_buffer(cap * len(batch.jobs), zero=True)
        parts = _batch_parts(batch, sources, self.device, lambda x: not x.is_contiguous())  # as CudaBackend._parts
        sizes = []
        view = out.numpy()
        for i, j in enumerate(batch.jobs):
            base, start, _ = parts[i]
            raw = base[start: start + j.length]
            data = memoryview(batch.key.encode(memoryview(raw.numpy()))).cast("B")
            n = data.nbytes
            if n <= cap:
                view[i * cap: i * cap + n] = data
            sizes.append(n)
        return Encoded(batch, parts, cap, out, None, sizes)

    def copy_out(self, enc: Encoded, run: SlotRun, raw: list[int], slot: torch.Tensor, gather: bool = False) -> Any:
        _copy_run(enc, run, raw, slot, non_blocking=False, gather=gather)
        return None

    # -- decode --
    def route(self, pipeline: Pipeline) -> Any:
        # Byte planes coded on the host take the route they take on a GPU (the coder in the reader threads,
        # planes put back by the "device"); other pipelines stand in for a device codec, so CI runs both paths.
        route = pipeline.device_route(self.gpu_zstd)
        if route == "raw" or (isinstance(route, tuple) and not isinstance(route, DeviceOp) and route[1] > 1):
            return route
        return pipeline

    def alloc(self, nbytes: int) -> torch.Tensor:
        return self._device_buffer(nbytes)

    @staticmethod
    def dest(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    copy = upload

    def upload_async(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        dst.copy_(src)
        return None

    fetch = upload

    def device_reads(self, source: Any, required: bool) -> Any:
        """With ``device_reads=True``: reads straight into "device" memory (``HostDeviceReads``), where a
        CUDA backend has KvikIO's, so CI runs the loader's device-read path; else None."""
        from ..errors import UnsupportedFeatureError

        if self._device_reads:
            return HostDeviceReads(source)
        if required:
            raise UnsupportedFeatureError("this backend reads into device memory only with device_reads=True")
        return None

    def unshuffle(self, dst: torch.Tensor, planes: torch.Tensor, k: int) -> None:
        n = planes.numel() // k
        dst.view(n, k).copy_(planes.view(k, n).t())

    def decode(self, key: Hashable, payloads: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        for i, (p, o) in enumerate(zip(payloads, outs)):
            data = memoryview(key.decode(memoryview(p.numpy()), o.numel())).cast("B")
            if data.nbytes != o.numel():
                raise DecodeRejected(f"chunk {i} of a batch decoded to {data.nbytes} bytes, expected {o.numel()}")
            o.numpy()[:] = np.frombuffer(data, dtype=np.uint8)


class HostDeviceReads:
    """The stand-in of KvikIO's reads (nvckpt.io.gds.KvikioReads) for HostBackend: a span read into a
    "device" buffer (a host tensor) through the source's own RangeReads, checked the same way."""

    mode = "host-device"

    def __init__(self, source: Any) -> None:
        self._reads = source.range_reads(True)

    @property
    def bytes_read(self) -> int:
        return self._reads.bytes_read

    @property
    def direct_reads(self) -> int:
        return self._reads.direct_reads

    def read(self, start: int, length: int, need: int, buf: torch.Tensor) -> torch.Tensor:
        self._reads.read(start, length, need, memoryview(buf.numpy()))
        return buf

    def close(self) -> None:
        self._reads.close()


__all__ = ["HostBackend", "HostDeviceReads"]
