"""Reading a checkpoint as tensors: ``Checkpoint`` (lazy, random access) and the one place tensors are
materialized from raw bytes (dtype, shape, bools, views on their base, derived tensors on the device)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from ..errors import ChecksumError, FormatError, LimitError, UnsupportedCodecError
from ..format.entry import TensorEntry
from ..format.structs import xxh3
from ..format.tree import resolve_refs
from ..options import LoadOptions, index_memory_limit
from ..plan.derived import bf16_rne
from ..plan.dtypes import to_torch
from .file import CheckpointFile, check_supported

if TYPE_CHECKING:
    from .slicing import TensorSlice


def _check_bools(entry: TensorEntry, raw: torch.Tensor, path: str) -> None:
    """SPEC 10: a bool byte is 0 or 1; anything else is undefined behaviour in torch's kernels."""
    if entry.dtype.name == "bool" and raw.numel() and bool((raw > 1).any()):
        raise FormatError("bool tensor holds a byte other than 0 and 1", path=path, tensor=entry.name)


def allocate(nbytes: int, entry: TensorEntry, path: str, device: Any = "cpu") -> torch.Tensor:
    """``nbytes`` of uint8 for ``entry``'s bytes; a failed allocation is a LimitError that says so.

    A small, valid file may declare a tensor of many GiB (highly compressible chunks): a
    plain load then allocates it, or fails here, named, instead of with torch's own error."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError) as exc:
        raise allocation_error(exc, nbytes, entry, path) from None


def allocation_error(exc: BaseException, nbytes: int, entry: TensorEntry, path: str) -> BaseException:
    """The LimitError for an allocation of ``nbytes`` that failed with ``exc`` (``exc`` itself if it is another error)."""
    if isinstance(exc, RuntimeError) and "memory" not in str(exc).lower() and "alloc" not in str(exc).lower():
        return exc
    return LimitError(f"cannot allocate {nbytes} bytes for it ({(str(exc).splitlines() or [''])[0][:160]}); "
                      "open the file with max_tensor_bytes=N to refuse such tensors before allocating",
                      path=path, tensor=entry.name)


def _typed(entry: TensorEntry, raw: torch.Tensor, shape: tuple[int, ...], path: str) -> torch.Tensor:
    """Raw bytes (1-D uint8) as a tensor of the entry's dtype and ``shape``."""
    _check_bools(entry, raw, path)
    dtype = to_torch(entry.dtype.name)
    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=raw.device)
    return raw.view(dtype).reshape(shape)


class Checkpoint:
    """An open nvckpt file: lazy, random access, safe to share between threads.

    ``untrusted=True`` decodes with the hardened CPU decoders only, never
    nvCOMP (SPEC.md 20: checksums are not signatures, and nvCOMP's decoders
    assume valid input); nvcomp-ans chunks then raise UnsupportedCodecError.
    ``max_tensor_bytes``: refuse (LimitError) to materialize a tensor or slice
    larger than this, before allocating it; a small file may declare a huge
    tensor of highly compressible chunks."""

    def __init__(self, target: Any, options: LoadOptions | None = None) -> None:
        options = options or LoadOptions()
        self.options = options
        self.device = torch.device(options.device)
        self.untrusted = options.untrusted
        self._file = CheckpointFile(target, workers=options.workers, max_tensor_bytes=options.max_tensor_bytes,
                                    max_index_memory=index_memory_limit(options))
        self._gpu = None if options.untrusted else self._gpu_backend()
        self._stats_lock = threading.Lock()
        self._stats: dict[str, Any] = {"gpu_loads": 0, "gpu_seconds": 0.0, "gpu_stored_bytes": 0}

    def _gpu_backend(self) -> Any:
        """The GPU loader's backend for a CUDA device where nvCOMP is; else None (host decode, then copy)."""
        if self.device.type != "cuda":
            return None
        from ..codecs.nvcomp import backend as nb

        if not nb.available():
            return None
        from ..engines.gpu.backend import CudaBackend

        return CudaBackend(self.device, gpu_zstd=self.options.gpu.gpu_zstd, timing=self.options.gpu.timing)

    # context manager
    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    @property
    def path(self) -> str:
        return self._file.path

    @property
    def index(self) -> Any:
        """The parsed index (nvckpt.format.index.Index: entries, tree, metadata; read-only)."""
        return self._file.index

    @property
    def file(self) -> CheckpointFile:
        """The parsed file (index, pipelines, checked chunk reads)."""
        return self._file

    @property
    def bytes_read(self) -> int:
        """Bytes read from the file so far (index included)."""
        return self._file.source.bytes_read

    def stats(self) -> dict[str, Any]:
        """What this Checkpoint's reads measured so far (bytes read; GPU loader runs, seconds, bytes)."""
        with self._stats_lock:
            return dict(self._stats, bytes_read=self.bytes_read)

    def keys(self) -> list[str]:
        return list(self._file.index.paths)

    def __contains__(self, name: object) -> bool:
        return name in self._file.index.paths

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._file.index.paths)

    def metadata(self) -> dict[str, Any]:
        return self._file.index.metadata

    def writer(self) -> dict[str, Any]:
        return self._file.index.writer

    # -- materializing ------------------------------------------------------
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device)

    def _gpu_run(self, fn: Any, *args: Any) -> Any:
        stats: dict[str, Any] = {}
        try:
            return fn(self._file, *args, self._gpu, self.options.gpu, stats)
        finally:
            with self._stats_lock:
                self._stats["gpu_loads"] += 1
                self._stats["gpu_seconds"] += stats.get("seconds", 0.0)
                self._stats["gpu_stored_bytes"] += stats.get("stored_bytes", 0)
                self._stats["last_gpu_load"] = stats

    def _host_raw(self, entry: TensorEntry, start: int, stop: int) -> torch.Tensor:
        out = allocate(stop - start, entry, self.path)
        self._file.read_into(entry, start, stop, memoryview(out.numpy()))
        return out

    def _raw_tensors(self, entries: list[TensorEntry], progress: Callable[[int], None] | None) -> dict[int, torch.Tensor]:
        """Raw bytes (1-D uint8 on the target device) of stored tensors, their tensor checksums verified."""
        if self._gpu is not None and entries:
            from ..engines.gpu.decode import decode_entries

            out = self._gpu_run(decode_entries, entries)
            if progress is not None:
                progress(sum(e.nbytes for e in entries))
            return out
        out = {}
        for e in entries:
            try:
                raw = self._host_raw(e, 0, e.nbytes)
            except UnsupportedCodecError as exc:
                if self.untrusted:
                    exc.reason += " (refused: the file was opened with untrusted=True, which never runs nvCOMP)"
                    exc.located()
                raise
            if e.checksum is not None and xxh3(raw.numpy()) != e.checksum:
                raise ChecksumError("tensor checksum does not match its decoded bytes", path=self.path, tensor=e.name)
            out[e.tensor_id] = self._to_device(raw)
            if progress is not None:
                progress(e.nbytes)
        return out

    def _rows(self, entry: TensorEntry, first: int, stop: int) -> torch.Tensor:
        """Rows [first, stop) of a stored tensor on the target device, decoding only the chunks that hold them."""
        check_supported(entry, self.path)
        row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
        shape = (max(0, stop - first),) + tuple(entry.shape[1:])
        lo, hi = first * row_bytes, max(first, stop) * row_bytes
        self._file.check_size(entry, hi - lo)
        if self._gpu is not None:
            from ..engines.gpu.decode import decode_range

            raw = self._gpu_run(decode_range, entry, lo, hi)
        else:
            raw = self._to_device(self._host_raw(entry, lo, hi))
        return _typed(entry, raw, shape, self.path)

    def _load(self, tids: Iterable[int], progress: Callable[[int], None] | None = None) -> dict[int, torch.Tensor]:
        """Tensors by id, with views built on their (shared) base and derived tensors computed on the device."""
        tensors = self._file.index.tensors
        wanted: dict[int, None] = {}

        def need(tid: int) -> None:
            e = tensors[tid]
            check_supported(e, self.path)
            if e.view is not None:
                need(e.view["base"])
            elif e.derived is not None:
                need(e.derived["source"])
            wanted[tid] = None

        for tid in tids:
            need(tid)
        for tid in wanted:
            # A view allocates nothing of its own, but it is what the caller gets: a stride-0 view of a
            # few bytes can be 64 GiB to whatever reads it (SPEC 20: the limit is on the materialized size).
            self._file.check_size(tensors[tid], tensors[tid].nbytes)
        stored = [tensors[t] for t in wanted if tensors[t].chunks is not None]
        out = {tid: _typed(tensors[tid], raw, tensors[tid].shape, self.path)
               for tid, raw in self._raw_tensors(stored, progress).items()}
        for tid in wanted:  # bases and sources come before their users
            e = tensors[tid]
            if e.view is not None:
                out[tid] = out[e.view["base"]].as_strided(e.shape, e.view["stride"], e.view["offset"])
            elif e.derived is not None:
                try:
                    out[tid] = bf16_rne(out[e.derived["source"]])
                except (RuntimeError, MemoryError) as exc:
                    raise allocation_error(exc, e.nbytes, e, self.path) from None
        return out

    # -- public reads ---------------------------------------------------------
    def get_tensor(self, name: str) -> torch.Tensor:
        tid = self._file.entry(name).tensor_id
        return self._load([tid])[tid]

    def get_slice(self, name: str) -> "TensorSlice":
        from .slicing import TensorSlice

        return TensorSlice(self, self._file.entry(name))

    def load(self, keys: Iterable[str] | None = None, *, progress: Callable[[int], None] | None = None) -> Any:
        """The whole saved object (or, with ``keys``, a dict of just those tensors).

        ``progress(n)`` is called with the raw bytes of the stored tensors as they are decoded."""
        if keys is not None:
            keys = list(keys)
            ids = [self._file.entry(k).tensor_id for k in keys]
            loaded = self._load(ids, progress)
            return {k: loaded[t] for k, t in zip(keys, ids)}
        index = self._file.index
        # Every entry the tree refers to (a reference to an "internal" entry is legal, SPEC 9).
        loaded = self._load({*index.paths.values(), *(e.tensor_id for e in index.tensors if not e.internal)}, progress)
        return resolve_refs(index.tree, loaded.__getitem__)


__all__ = ["Checkpoint"]
