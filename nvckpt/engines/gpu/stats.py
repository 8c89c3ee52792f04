"""What a GPU engine run measured: GPU time of its batched nvCOMP calls, from CUDA events."""

from __future__ import annotations

from typing import Any


def timing_report(self, timings: list[Any]) -> dict[str, Any]:
        return timing_report(timings)


class HostDevice:
    """The same engine with the CPU codecs on the CPU: runs the scheduling in CI without a GPU.

    "Device" memory and "pinned" memory are plain host memory; copies are
    immediate and events are None.
    """

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.host = self.device

    def wait_for_caller(self, event: Any) -> None:
        pass

    @staticmethod
    def capacity(pipeline: Pipeline, length: int) -> int:
        return length + (length >> 7) + 64  # anything longer than the chunk is stored raw anyway

    def host_buffer(self, size: int) -> torch.Tensor:
        return aligned_host_buffer(size, pin=False)

    def flat(self, t: PlannedTensor) -> torch.Tensor:
        flat = t.flat_bytes()
        return flat if flat.device.type == "cpu" else flat.cpu()

    def encode(self, batch: Batch, sources: dict[int, torch.Tensor]) -> _Encoded:
        cap = batch.capacity
        out = torch.zeros(cap * len(batch.jobs), dtype=torch.uint8)
        inputs, sizes = [], []
        view = out.numpy()
        for i, j in enumerate(batch.jobs):
            raw = sources[j.tensor_id][j.start: j.start + j.length]
            inputs.append(raw)
            data = memoryview(batch.key.encode(memoryview(raw.numpy()))).cast("B")
            n = data.nbytes
            if n <= cap:
                view[i * cap: i * cap + n] = data
            sizes.append(n)
        return _Encoded(batch, inputs, cap, out, None, sizes)

    def copy_out(self, enc: _Encoded, first: int, stop: int, lengths: list[int], raw: list[int],
                 slot: torch.Tensor) -> Any:
        cap = enc.capacity
        used = (stop - 1 - first) * cap + lengths[stop - 1]
        slot[:used].copy_(enc.buffer[first * cap: first * cap + used])
        for i in raw:
            n = enc.inputs[i].numel()
            slot[(i - first) * cap: (i - first) * cap + n].copy_(enc.inputs[i])
        return None

    def wait(self, event: Any) -> None:
        pass

    def ready(self, event: Any) -> bool:
        return True

    def piece_to_host(self, src: torch.Tensor, dst: torch.Tensor, stream: Any) -> Any:
        dst[: src.numel()].copy_(src)
        return None

    def side_stream(self, ready: Any) -> Any:
        return None

    def finish(self) -> None:
        pass

    def timing_report(self, timings: list[Any]) -> dict[str, Any]:
        return {}


def timing_report(timings: list[tuple]) -> dict[str, Any]:
    """GPU time of batched calls from CUDA events: (stage start, stage end, nvCOMP start, nvCOMP end, codec, bytes).

    "stage" spans everything the engine puts on the stream for a batch (zero
    fill of the output, byte-plane split, alignment copies, the nvCOMP call);
    "codec" the nvCOMP call alone.  GB/s are of uncompressed bytes."""
    per: dict[str, dict[str, float]] = {}
    for a, b, c, d, key, n in timings:
        r = per.setdefault(key, {"bytes": 0, "batches": 0, "stage_seconds": 0.0, "codec_seconds": 0.0,
                                 "largest_batch_bytes": 0, "largest_batch_codec_GBps": None})
        r["bytes"] += n
        r["batches"] += 1
        r["stage_seconds"] += a.elapsed_time(b) / 1e3
        if c is not None:
            seconds = c.elapsed_time(d) / 1e3
            r["codec_seconds"] += seconds
            if n > r["largest_batch_bytes"] and seconds > 0:  # the batch that carries the bulk of the data
                r["largest_batch_bytes"], r["largest_batch_codec_GBps"] = n, n / seconds / 1e9
    for r in per.values():
        r["stage_GBps"] = r["bytes"] / r["stage_seconds"] / 1e9 if r["stage_seconds"] else None
        r["codec_GBps"] = r["bytes"] / r["codec_seconds"] / 1e9 if r["codec_seconds"] else None
    total = sum(r["bytes"] for r in per.values())
    stage = sum(r["stage_seconds"] for r in per.values())
    codec = sum(r["codec_seconds"] for r in per.values())
    return {"gpu_stage_seconds": stage, "gpu_codec_seconds": codec, "gpu_bytes": total,
            "stage_GBps": total / stage / 1e9 if stage else None, "codec_GBps": total / codec / 1e9 if codec else None,
            "per_codec": per}


__all__ = ["timing_report"]
