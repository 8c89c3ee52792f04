"""What users call: save, load, open."""

from __future__ import annotations

import os
import platform
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from . import __version__
from .codecs import RAW, Pipeline, Zstd, portable
from .errors import NvckptError, UnsupportedCodecError
from .format.constants import DEFAULT_ALIGNMENT, DEFAULT_CHUNK_SIZE
from .format.index import TensorEntry
from .format.tree import TensorRef
from .pipeline.container import ContainerWriter, EncodedChunk, TensorFrame
from .pipeline.encode_cpu import encode_cpu
from .pipeline.plan import PlannedTensor, SavePlan, plan_save
from .pipeline.reader import Reader

CODECS = ("auto", "portable", "zstd", "raw", "ans")


@dataclass(frozen=True)
class SaveResult:
    """What a save wrote: sizes and time."""

    path: str | None
    raw_bytes: int
    file_bytes: int
    seconds: float
    engine: str

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.file_bytes if self.file_bytes else 1.0


def cpu_pipeline_chooser(codec: str | Pipeline, zstd_level: int) -> Callable[[PlannedTensor], Pipeline]:
    """The codec of each tensor on the CPU engine."""
    if isinstance(codec, Pipeline):
        return lambda t: codec
    if codec == "raw":
        return lambda t: RAW
    if codec == "zstd":
        zstd = Pipeline((Zstd(zstd_level),))
        return lambda t: zstd
    if codec in ("auto", "portable"):
        from . import dtypes

        return lambda t: portable(dtypes.DTYPES[t.entry["dtype"]].itemsize, zstd_level)
    if codec == "ans":
        raise UnsupportedCodecError("codec='ans' (nvcomp-ans) encodes only on a CUDA GPU with nvCOMP (pip install 'nvckpt[gpu]')")
    raise ValueError(f"codec must be one of {CODECS} or a Pipeline, got {codec!r}")


def _gpu_engine(plan: SavePlan, codec: str | Pipeline, engine: str):
    """The GPU engine module when it should run this save, else None."""
    if engine == "cpu" or isinstance(codec, Pipeline) or codec in ("raw", "zstd"):
        return None
    on_gpu = any(t.data is not None and t.data.device.type == "cuda" for t in plan.tensors)
    if engine == "auto" and not on_gpu:
        return None
    try:
        from .pipeline import encode_gpu
    except ImportError:
        encode_gpu = None
    if encode_gpu is None or not encode_gpu.available():
        if engine == "gpu" or codec == "ans":
            raise UnsupportedCodecError("the GPU engine needs CUDA and nvCOMP (pip install 'nvckpt[gpu]')")
        return None
    return encode_gpu


def writer_info(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    info = {"name": "nvckpt", "version": __version__, "torch": torch.__version__.split("+")[0],
            "python": platform.python_version()}
    info.update(extra or {})
    return info


def write_plan(stream: Any, items: Iterable[TensorFrame | EncodedChunk], plan: SavePlan, *,
               alignment: int, info: dict[str, Any]) -> int:
    writer = ContainerWriter(stream, plan, alignment=alignment)
    for item in items:
        writer.write(item)
    return writer.finish(info)


class _AtomicFile:
    """Write to a temporary file beside ``path``; fsync and rename over it only on success."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        if os.path.isdir(self.path):
            raise IsADirectoryError(f"{path} is a directory")
        folder, base = os.path.split(self.path)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".nvckpt-tmp", dir=folder)
        self.file = os.fdopen(fd, "wb", buffering=8 << 20)

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        dir_fd = os.open(os.path.dirname(self.path), os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)

    def abort(self) -> None:
        try:
            self.file.close()
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)


def save(
    obj: Any,
    target: str | os.PathLike | Any,
    *,
    codec: str | Pipeline = "auto",
    metadata: dict[str, Any] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    alignment: int = DEFAULT_ALIGNMENT,
    zstd_level: int = 1,
    derive_bf16: bool = False,
    tensor_checksums: bool = True,
    engine: str = "auto",
    workers: int | None = None,
) -> SaveResult:
    """Save a nested training state (tensors in dicts, lists, tuples, with scalars and strings).

    ``target`` is a path (written atomically: temporary file, fsync, rename)
    or a binary stream (written front to back, never seeking).
    ``codec``: "auto" (nvcomp-ans on a GPU with nvCOMP, else portable),
    "portable" (byteshuffle+zstd, readable by any zstd library), "zstd",
    "raw", "ans" (GPU only), or a ``nvckpt.codecs.Pipeline``.
    """
    if engine not in ("auto", "cpu", "gpu"):
        raise ValueError(f"engine must be 'auto', 'cpu' or 'gpu', got {engine!r}")
    if not isinstance(codec, Pipeline) and codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS} or a Pipeline, got {codec!r}")
    start = time.perf_counter()
    plan = plan_save(obj, metadata=metadata, chunk_size=chunk_size, derive_bf16=derive_bf16)
    gpu = _gpu_engine(plan, codec, engine)
    if gpu is not None:
        items = gpu.encode_gpu(plan, codec=codec, zstd_level=zstd_level, tensor_checksums=tensor_checksums)
        info = writer_info(gpu.writer_info())
    else:
        items = encode_cpu(plan, cpu_pipeline_chooser(codec, zstd_level), workers=workers, tensor_checksums=tensor_checksums)
        info = writer_info()
    raw_bytes = sum(t.nbytes for t in plan.tensors)
    if hasattr(target, "write"):
        size = write_plan(target, items, plan, alignment=alignment, info=info)
        return SaveResult(None, raw_bytes, size, time.perf_counter() - start, "gpu" if gpu else "cpu")
    out = _AtomicFile(os.fspath(target))
    try:
        size = write_plan(out.file, items, plan, alignment=alignment, info=info)
        out.commit()
    except BaseException:
        out.abort()
        raise
    return SaveResult(out.path, raw_bytes, size, time.perf_counter() - start, "gpu" if gpu else "cpu")


class TensorSlice:
    """``get_slice(name)[rows, ...]``: decodes only the chunks holding the rows asked for."""

    def __init__(self, checkpoint: "Checkpoint", entry: TensorEntry) -> None:
        self._ck = checkpoint
        self._entry = entry
        self.shape = entry.shape
        self.dtype = entry.dtype.name

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __getitem__(self, index: Any) -> torch.Tensor:
        if not isinstance(index, tuple):
            index = (index,)
        entry, reader = self._entry, self._ck._reader
        if not entry.shape or not index or entry.chunks is None or not isinstance(index[0], (slice, int, list, torch.Tensor)):
            return self._ck._to_device(reader.tensor(entry)[index])
        first, rest = index[0], index[1:]
        n = entry.shape[0]
        if isinstance(first, slice):
            start, stop, step = first.indices(n)
            if step <= 0:
                raise ValueError("step must be greater than zero")  # as torch says
            rows = range(start, stop, step)
            if not rows:
                return self._ck._to_device(reader.rows(entry, 0, 0)[(slice(None),) + rest])
            lo, hi = rows[0], rows[-1] + 1
            return self._ck._to_device(reader.rows(entry, lo, hi)[(slice(0, hi - lo, step),) + rest])
        if isinstance(first, int) or (isinstance(first, torch.Tensor) and first.dim() == 0 and first.dtype != torch.bool):
            i = int(first)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for dimension 0 with size {n}")
            i %= n
            return self._ck._to_device(reader.rows(entry, i, i + 1)[(0,) + rest])
        # Fancy indexing on dim 0: read the span it touches.
        picked = torch.as_tensor(first)
        if picked.dtype == torch.bool:
            picked = picked.nonzero().reshape(-1)
        if picked.numel() == 0:
            return self._ck._to_device(reader.rows(entry, 0, 0)[(picked,) + rest])
        picked = torch.where(picked < 0, picked + n, picked)
        lo, hi = int(picked.min()), int(picked.max()) + 1
        if lo < 0 or hi > n:
            raise IndexError(f"index out of bounds for dimension 0 with size {n}")
        return self._ck._to_device(reader.rows(entry, lo, hi)[(picked - lo,) + rest])


class Checkpoint:
    """An open nvckpt file: lazy, random access, safe to share between threads."""

    def __init__(self, target: Any, *, device: str | torch.device = "cpu", workers: int | None = None) -> None:
        self.device = torch.device(device)
        self._reader = Reader(target, workers=workers)

    # context manager
    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._reader.close()

    @property
    def path(self) -> str:
        return self._reader.path

    @property
    def index(self):
        return self._reader.index

    @property
    def bytes_read(self) -> int:
        """Bytes read from the file so far (index included)."""
        return self._reader.source.bytes_read

    def keys(self) -> list[str]:
        return list(self._reader.index.paths)

    def __contains__(self, name: object) -> bool:
        return name in self._reader.index.paths

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._reader.index.paths)

    def metadata(self) -> dict[str, Any]:
        return self._reader.index.metadata

    def writer(self) -> dict[str, Any]:
        return self._reader.index.writer

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device)

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self._reader.entry(name)
        return self._to_device(self._reader.tensor(entry))

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, self._reader.entry(name))

    def load(self, keys: Iterable[str] | None = None) -> Any:
        """The whole saved object (or, with ``keys``, a dict of just those tensors)."""
        cache: dict[int, torch.Tensor] = {}
        moved: dict[int, torch.Tensor] = {}

        def get(tid: int) -> torch.Tensor:
            if tid not in moved:
                moved[tid] = self._to_device(self._reader.tensor(self._reader.index.tensors[tid], cache))
            return moved[tid]

        if keys is not None:
            return {k: get(self._reader.entry(k).tensor_id) for k in keys}
        self._preload(get)
        return _rebuild(self._reader.index.tree, get)

    def _preload(self, get: Callable[[int], torch.Tensor]) -> None:
        for entry in self._reader.index.tensors:
            if not entry.internal:
                get(entry.tensor_id)


def _rebuild(node: Any, get: Callable[[int], torch.Tensor]) -> Any:
    if isinstance(node, TensorRef):
        return get(node.tensor_id)
    if isinstance(node, dict):
        return {k: _rebuild(v, get) for k, v in node.items()}
    if isinstance(node, tuple):
        return tuple(_rebuild(v, get) for v in node)
    if isinstance(node, list):
        return [_rebuild(v, get) for v in node]
    return node


def open(target: str | os.PathLike | Any, *, device: str | torch.device = "cpu", workers: int | None = None) -> Checkpoint:  # noqa: A001
    """Open a checkpoint for random access (use as a context manager)."""
    return Checkpoint(target, device=device, workers=workers)


def load(target: str | os.PathLike | Any, *, device: str | torch.device = "cpu", keys: Iterable[str] | None = None,
         workers: int | None = None) -> Any:
    """Load a whole checkpoint, bit-exact, as the structure that was saved."""
    with Checkpoint(target, device=device, workers=workers) as ck:
        return ck.load(keys)


__all__ = ["save", "load", "open", "Checkpoint", "TensorSlice", "SaveResult", "NvckptError"]
