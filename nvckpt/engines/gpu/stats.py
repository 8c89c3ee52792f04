"""What a GPU engine run measured: GPU time of its batched nvCOMP calls, from CUDA events."""

from __future__ import annotations

from typing import Any


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
