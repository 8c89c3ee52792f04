"""What users call: save, load, open."""

from __future__ import annotations

import gc
import os
import platform
import threading
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from . import __version__
from .codecs import RAW, Pipeline, Zstd, portable
from .errors import NvckptError, UnsupportedCodecError
from .format.constants import DEFAULT_ALIGNMENT, DEFAULT_CHUNK_SIZE
from .format.index import TensorEntry
from .format.tree import resolve_refs
from .derive import bf16_rne
from .pipeline.container import ContainerWriter, EncodedChunk, TensorFrame, check_alignment
from .pipeline.encode_cpu import encode_cpu
from .pipeline.plan import PlannedTensor, SavePlan, plan_save
from .pipeline.reader import Reader, check_supported
from .pipeline.atomic import publish, temporary_name
from .pipeline.sink import FileSink

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
    try:
        writer = ContainerWriter(stream, plan, alignment=alignment)
        for item in items:
            writer.write(item)
        return writer.finish(info)
    finally:
        # Stop the engine now, also on an error: its threads and buffers must not live on in the traceback.
        close = getattr(items, "close", None)
        if close is not None:
            close()


class _AtomicFile:
    """Write to a temporary file beside ``path``; fsync and rename over it only on success."""

    def __init__(self, path: str, *, direct_io: bool = True) -> None:
        self.path = os.path.abspath(path)
        if os.path.isdir(self.path):
            raise IsADirectoryError(f"{path} is a directory")
        for _ in range(100):
            self.tmp = temporary_name(self.path)
            try:
                self.file = FileSink(self.tmp, direct=direct_io)
                break
            except FileExistsError:
                continue
            except BaseException:
                if os.path.exists(self.tmp):  # created, then the sink failed to start
                    os.unlink(self.tmp)
                raise
        else:
            raise FileExistsError(f"could not create a temporary file beside {path}")

    def commit(self) -> None:
        self.file.close(sync=True)
        publish(self.tmp, self.path)

    def abort(self) -> None:
        try:
            self.file.abort()
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)


def _check_save_args(codec: str | Pipeline, engine: str) -> None:
    if engine not in ("auto", "cpu", "gpu"):
        raise ValueError(f"engine must be 'auto', 'cpu' or 'gpu', got {engine!r}")
    if not isinstance(codec, Pipeline) and codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS} or a Pipeline, got {codec!r}")


class _SaveJob:
    """One save: a plan, the engine that encodes it, and the target it goes to."""

    def __init__(self, obj: Any, target: Any, *, codec: str | Pipeline, metadata: dict[str, Any] | None,
                 chunk_size: int | None, alignment: int, zstd_level: int, derive_bf16: bool,
                 tensor_checksums: bool, engine: str, workers: int | None, direct_io: bool) -> None:
        _check_save_args(codec, engine)
        check_alignment(alignment)  # before any work, as every argument
        if type(zstd_level) is not int or not -7 <= zstd_level <= 22:
            raise ValueError(f"zstd_level must be an integer in -7..22, got {zstd_level!r}")
        self.start = time.perf_counter()
        self.target = target
        self.plan = plan_save(obj, metadata=metadata, chunk_size=DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size,
                              derive_bf16=derive_bf16)
        self.gpu = _gpu_engine(self.plan, codec, engine)
        if chunk_size is None and self.gpu is not None and self.gpu.CHUNK_SIZE != DEFAULT_CHUNK_SIZE:
            self.plan.rechunk(self.gpu.CHUNK_SIZE)  # the GPU engine's own default
        self.codec, self.zstd_level, self.tensor_checksums = codec, zstd_level, tensor_checksums
        self.alignment, self.workers, self.direct_io = alignment, workers, direct_io

    def snapshot(self) -> None:
        """Copy every tensor, so the caller may change its own right away (async_save)."""
        if self.gpu is not None and hasattr(self.gpu, "snapshot"):
            self.gpu.snapshot(self.plan)
            return
        with torch.no_grad():
            for t in self.plan.tensors:
                if t.data is not None:
                    snap = torch.empty(t.data.shape, dtype=t.data.dtype, device="cpu")
                    t.data = snap.copy_(t.data)

    def items(self) -> Iterator[TensorFrame | EncodedChunk]:
        if self.gpu is not None:
            return self.gpu.encode_gpu(self.plan, codec=self.codec, zstd_level=self.zstd_level,
                                       tensor_checksums=self.tensor_checksums)
        return encode_cpu(self.plan, cpu_pipeline_chooser(self.codec, self.zstd_level), workers=self.workers,
                          tensor_checksums=self.tensor_checksums)

    def run(self, cancel: threading.Event | None = None) -> SaveResult:
        info = writer_info(self.gpu.writer_info() if self.gpu is not None else None)
        items = self.items()
        if cancel is not None:
            items = _cancellable(items, cancel)
        raw_bytes = sum(t.nbytes for t in self.plan.tensors)
        engine = "gpu" if self.gpu is not None else "cpu"
        if hasattr(self.target, "write"):
            size = write_plan(self.target, items, self.plan, alignment=self.alignment, info=info)
            return SaveResult(None, raw_bytes, size, time.perf_counter() - self.start, engine)
        out = _AtomicFile(os.fspath(self.target), direct_io=self.direct_io)
        try:
            size = write_plan(out.file, items, self.plan, alignment=self.alignment, info=info)
            if cancel is not None and cancel.is_set():
                raise CancelledError("async save cancelled; the file at the target path was not changed")
            out.commit()
        except BaseException:
            out.abort()
            raise
        return SaveResult(out.path, raw_bytes, size, time.perf_counter() - self.start, engine)


def _cancellable(items: Iterator, cancel: threading.Event) -> Iterator:
    try:
        for item in items:
            if cancel.is_set():
                raise CancelledError("async save cancelled; the file at the target path was not changed")
            yield item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()  # lets the engine release its buffers


_SAVE_DEFAULTS = dict(codec="auto", metadata=None, chunk_size=None, alignment=DEFAULT_ALIGNMENT,
                      zstd_level=1, derive_bf16=False, tensor_checksums=True, engine="auto", workers=None,
                      direct_io=True)


def save(
    obj: Any,
    target: str | os.PathLike | Any,
    *,
    codec: str | Pipeline = "auto",
    metadata: dict[str, Any] | None = None,
    chunk_size: int | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
    zstd_level: int = 1,
    derive_bf16: bool = False,
    tensor_checksums: bool = True,
    engine: str = "auto",
    workers: int | None = None,
    direct_io: bool = True,
) -> SaveResult:
    """Save a nested training state (tensors in dicts, lists, tuples, with scalars and strings).

    ``target`` is a path (written atomically: temporary file, fsync, rename)
    or a binary stream (written front to back, never seeking).
    ``codec``: "auto" (nvcomp-ans on a GPU with nvCOMP, else portable),
    "portable" (byteshuffle+zstd, readable by any zstd library), "zstd",
    "raw", "ans" (GPU only), or a ``nvckpt.codecs.Pipeline``.
    ``derive_bf16``: store a bf16 tensor that is exactly the rounding of a
    saved fp32 tensor as derived from it (zero bytes; verified bit for bit).
    ``chunk_size``: target raw bytes per chunk (default: 1 MiB on the CPU
    engine, the GPU engine's own default on the GPU).
    ``direct_io``: write with O_DIRECT where the filesystem allows it.
    """
    return _SaveJob(obj, target, codec=codec, metadata=metadata, chunk_size=chunk_size, alignment=alignment,
                    zstd_level=zstd_level, derive_bf16=derive_bf16, tensor_checksums=tensor_checksums,
                    engine=engine, workers=workers, direct_io=direct_io).run()


class SaveFuture(Future):
    """The result of ``async_save``: a concurrent.futures.Future of a SaveResult.

    ``blocked_seconds`` is how long ``async_save`` held the caller.
    ``cancel()`` also stops a save that is already running, unless it has
    reached its final rename; a cancelled save leaves the target path with
    whatever file it had before."""

    def __init__(self) -> None:
        super().__init__()
        self.blocked_seconds = 0.0
        self._stop = threading.Event()

    def cancel(self) -> bool:
        if self.done():
            return False
        self._stop.set()
        return True


def async_save(obj: Any, target: str | os.PathLike | Any, **options: Any) -> SaveFuture:
    """Start a save and return once the tensors are snapshotted.

    The caller may change its tensors as soon as this returns: the file holds
    their values at the time of the call.  Takes the options of ``save``."""
    unknown = set(options) - set(_SAVE_DEFAULTS)
    if unknown:
        raise TypeError(f"async_save() got unexpected options {sorted(unknown)}")
    start = time.perf_counter()
    # No garbage-collection pass while the caller waits: in a large process (torch,
    # a model, its optimizer) one full pass can take longer than the whole snapshot.
    collecting = gc.isenabled()
    gc.disable()
    try:
        job = _SaveJob(obj, target, **{**_SAVE_DEFAULTS, **options})
        job.snapshot()
    finally:
        if collecting:
            gc.enable()
    future = SaveFuture()
    future.set_running_or_notify_cancel()

    def work() -> None:
        try:
            result = job.run(future._stop)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    threading.Thread(target=work, name="nvckpt-async-save", daemon=False).start()
    future.blocked_seconds = time.perf_counter() - start
    return future


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
        entry, ck = self._entry, self._ck
        # A bool is an int to Python but a mask to torch (x[True] adds a dim): torch's own rules, on the whole tensor.
        if (not entry.shape or not index or entry.chunks is None or isinstance(index[0], bool)
                or not isinstance(index[0], (slice, int, list, torch.Tensor))):
            return ck._load([entry.tensor_id])[entry.tensor_id][index]
        first, rest = index[0], index[1:]
        n = entry.shape[0]
        if isinstance(first, slice):
            start, stop, step = first.indices(n)
            if step <= 0:
                raise ValueError("step must be greater than zero")  # as torch says
            rows = range(start, stop, step)
            if not rows:
                return ck._rows(entry, 0, 0)[(slice(None),) + rest]
            lo, hi = rows[0], rows[-1] + 1
            return ck._rows(entry, lo, hi)[(slice(0, hi - lo, step),) + rest]
        if isinstance(first, int) or (isinstance(first, torch.Tensor) and first.dim() == 0 and first.dtype != torch.bool):
            i = int(first)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for dimension 0 with size {n}")
            i %= n
            return ck._rows(entry, i, i + 1)[(0,) + rest]
        # Fancy indexing on dim 0: read the span it touches.
        picked = torch.as_tensor(first)
        if picked.dtype == torch.bool:
            if tuple(picked.shape) != (n,):  # a mask over several dims, or of the wrong length: torch's own rules
                return ck._load([entry.tensor_id])[entry.tensor_id][index]
            picked = picked.nonzero().reshape(-1)
        if picked.numel() == 0:
            return ck._rows(entry, 0, 0)[(picked.long(),) + rest]  # [] is a float tensor
        picked = torch.where(picked < 0, picked + n, picked)
        lo, hi = int(picked.min()), int(picked.max()) + 1
        if lo < 0 or hi > n:
            raise IndexError(f"index out of bounds for dimension 0 with size {n}")
        return ck._rows(entry, lo, hi)[(picked - lo,) + rest]


def _gpu_decoder(device: torch.device):
    """The GPU decoding engine for a CUDA device, when nvCOMP is there; else None (CPU decode, then copy)."""
    if device.type != "cuda":
        return None
    try:
        from .pipeline import decode_gpu
    except ImportError:
        return None
    return decode_gpu if decode_gpu.available() else None


class Checkpoint:
    """An open nvckpt file: lazy, random access, safe to share between threads.

    ``untrusted=True`` decodes with the hardened CPU decoders only, never
    nvCOMP (SPEC.md 20: checksums are not signatures, and nvCOMP's decoders
    assume valid input); nvcomp-ans chunks then raise UnsupportedCodecError.
    ``max_tensor_bytes``: refuse (LimitError) to materialize a tensor or slice
    larger than this, before allocating it; a small file may declare a huge
    tensor of highly compressible chunks."""

    def __init__(self, target: Any, *, device: str | torch.device = "cpu", workers: int | None = None,
                 untrusted: bool = False, max_tensor_bytes: int | None = None) -> None:
        self.device = torch.device(device)
        self.untrusted = untrusted
        self._reader = Reader(target, workers=workers, max_tensor_bytes=max_tensor_bytes)
        self._gpu = None if untrusted else _gpu_decoder(self.device)

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

    def _rows(self, entry: TensorEntry, first: int, stop: int) -> torch.Tensor:
        """Rows [first, stop) of a stored tensor on the target device, decoding only the chunks that hold them."""
        self._reader.check_size(entry, (stop - first) * (entry.nbytes // entry.shape[0] if entry.shape[0] else 0))
        if self._gpu is not None:
            return self._gpu.load_rows(self._reader, entry, first, stop, self.device)
        return self._to_device(self._reader.rows(entry, first, stop))

    def _load_data(self, entries: list[TensorEntry]) -> dict[int, torch.Tensor]:
        """Stored tensors on the target device: decoded on the GPU where it can, else on the CPU."""
        if self._gpu is not None and entries:
            return self._gpu.load_entries(self._reader, entries, self.device)
        try:
            return {e.tensor_id: self._to_device(self._reader.tensor(e)) for e in entries}
        except UnsupportedCodecError as exc:
            if self.untrusted:
                exc.reason += " (refused: the file was opened with untrusted=True, which never runs nvCOMP)"
                exc.located()
            raise

    def _load(self, tids: Iterable[int]) -> dict[int, torch.Tensor]:
        """Tensors by id, with views built on their (shared) base and derived tensors computed on the device."""
        tensors = self._reader.index.tensors
        wanted: dict[int, None] = {}

        def need(tid: int) -> None:
            e = tensors[tid]
            check_supported(e, self._reader.path)
            if e.view is not None:
                need(e.view["base"])
            elif e.derived is not None:
                need(e.derived["source"])
            wanted[tid] = None

        for tid in tids:
            need(tid)
        for tid in wanted:
            if tensors[tid].view is None:  # a view allocates nothing of its own
                self._reader.check_size(tensors[tid], tensors[tid].nbytes)
        out = self._load_data([tensors[t] for t in wanted if tensors[t].chunks is not None])
        for tid in wanted:  # bases and sources come before their users
            e = tensors[tid]
            if e.view is not None:
                out[tid] = out[e.view["base"]].as_strided(e.shape, e.view["stride"], e.view["offset"])
            elif e.derived is not None:
                out[tid] = bf16_rne(out[e.derived["source"]])
        return out

    def get_tensor(self, name: str) -> torch.Tensor:
        tid = self._reader.entry(name).tensor_id
        return self._load([tid])[tid]

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, self._reader.entry(name))

    def load(self, keys: Iterable[str] | None = None) -> Any:
        """The whole saved object (or, with ``keys``, a dict of just those tensors)."""
        if keys is not None:
            keys = list(keys)
            ids = [self._reader.entry(k).tensor_id for k in keys]
            loaded = self._load(ids)
            return {k: loaded[t] for k, t in zip(keys, ids)}
        # Every entry the tree refers to (a reference to an "internal" entry is legal, SPEC 9).
        loaded = self._load({*self._reader.index.paths.values(),
                             *(e.tensor_id for e in self._reader.index.tensors if not e.internal)})
        return resolve_refs(self._reader.index.tree, loaded.__getitem__)


def open(target: str | os.PathLike | Any, *, device: str | torch.device = "cpu", workers: int | None = None,  # noqa: A001
         untrusted: bool = False, max_tensor_bytes: int | None = None) -> Checkpoint:
    """Open a checkpoint for random access (use as a context manager).

    For files from an untrusted source: ``untrusted=True`` decodes only with
    the hardened CPU decoders (no nvCOMP; nvcomp-ans chunks are refused), and
    ``max_tensor_bytes`` refuses to materialize larger tensors (LimitError)."""
    return Checkpoint(target, device=device, workers=workers, untrusted=untrusted, max_tensor_bytes=max_tensor_bytes)


def load(target: str | os.PathLike | Any, *, device: str | torch.device = "cpu", keys: Iterable[str] | None = None,
         workers: int | None = None, untrusted: bool = False, max_tensor_bytes: int | None = None) -> Any:
    """Load a whole checkpoint, bit-exact, as the structure that was saved (other options: see ``open``)."""
    with Checkpoint(target, device=device, workers=workers, untrusted=untrusted,
                    max_tensor_bytes=max_tensor_bytes) as ck:
        return ck.load(keys)


__all__ = ["save", "async_save", "SaveFuture", "load", "open", "Checkpoint", "TensorSlice", "SaveResult", "NvckptError"]
