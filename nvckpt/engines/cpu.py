"""The CPU engine: encode chunks with the host codecs on a thread pool.

zstd and numpy release the GIL, so a small pool keeps every core busy while
the caller's thread writes frames in order.  At most ``window`` chunks are in
flight, which bounds memory to a few chunks beyond the tensor being saved.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

import torch

from ..codecs.base import Pipeline
from ..codecs.registry import RAW
from ..errors import NvckptError
from ..format.structs import xxh3
from ..plan.walk import PlannedTensor, SavePlan
from .items import EncodedChunk, TensorReady


def host_bytes(t: PlannedTensor) -> memoryview:
    """The tensor's raw bytes in CPU memory (copied from a GPU if need be)."""
    flat = t.flat_bytes()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.numpy())


def encode_chunk(pipeline: Pipeline, raw: memoryview) -> tuple[Pipeline, bytes | memoryview, int]:
    """Encode one chunk, falling back to raw where coding would not shrink it."""
    encoded = pipeline.encode(raw)
    if memoryview(encoded).nbytes >= raw.nbytes:
        pipeline, encoded = RAW, raw
    return pipeline, encoded, xxh3(encoded)


def encode_cpu(
    plan: SavePlan,
    choose: Callable[[str], Pipeline],
    *,
    workers: int | None = None,
    tensor_checksums: bool = True,
) -> Iterator[TensorReady | EncodedChunk]:
    workers = workers or os.cpu_count() or 1
    window = 4 * workers
    pending: deque[TensorReady | tuple[PlannedTensor, int, Future]] = deque()

    def drain(limit: int) -> Iterator[TensorReady | EncodedChunk]:
        while len(pending) > limit:
            item = pending.popleft()
            if isinstance(item, TensorReady):
                yield item
                continue
            t, index, future = item
            try:
                pipeline, payload, checksum = future.result()
            except NvckptError as exc:
                raise exc.located(tensor=t.name, chunk=index)
            yield EncodedChunk(t.tensor_id, index, pipeline, payload, t.chunks[index][1], checksum)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nvckpt-encode") as pool:
        try:
            for t in plan.tensors:
                if t.data is None:
                    pending.append(TensorReady(t.tensor_id))
                    continue
                with torch.no_grad():
                    raw = host_bytes(t)
                pending.append(TensorReady(t.tensor_id, xxh3(raw) if tensor_checksums else None))
                pipeline = choose(t.entry["dtype"])
                for index, (start, length) in enumerate(t.chunks):
                    future = pool.submit(encode_chunk, pipeline, raw[start : start + length])
                    pending.append((t, index, future))
                    yield from drain(window)
            yield from drain(0)
        finally:
            for item in pending:
                if not isinstance(item, TensorReady):
                    item[2].cancel()
