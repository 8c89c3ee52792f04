"""Save and load options: frozen, validated once, passed down (no module-level tunables).

``save`` / ``async_save`` take the fields of ``SaveOptions`` as keywords, and
``open`` / ``load`` those of ``LoadOptions``; the GPU engines' knobs are the
``gpu=`` field (``GpuSaveOptions`` / ``GpuLoadOptions``).  Defaults live here
and nowhere else.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from .codecs.base import Pipeline
from .codecs.presets import check_preset
from .format.frames import check_alignment
from .plan.chunking import chunk_policy

MiB = 1 << 20
ENGINES = ("auto", "cpu", "gpu")


def _positive(owner: Any, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _is_engine(value: Any) -> bool:
    from .engines.base import is_engine

    return is_engine(value)


def _check_storage_options(value: Any) -> None:
    if value is not None and not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
        raise TypeError(f"storage_options must be a dict with str keys (the storage backend's options for a URL), "
                        f"got {type(value).__qualname__}")


@dataclass(frozen=True)
class GpuSaveOptions:
    """The GPU engine's knobs.  GPU memory: at most ``memory_budget`` (default the smaller of 1 GiB and
    2 % of the device): batches shrink to fit it, (inflight + 1) x 2 x batch_bytes <= budget, and all of it
    goes back to the device when the save ends (the engine's private pools, torch >= 2.8).  Pinned host
    memory: a save pinned_slots x slot_bytes + checksum_workers x 2 x piece_bytes (384 MiB by default);
    an async_save holds the compressed state, up to ``pinned_limit`` (default a quarter of the host's
    memory), and waits for the disk beyond it.  Pinned buffers are kept for the next save
    (``nvckpt.release_pinned_memory()`` frees them)."""

    memory_budget: int | None = None
    pinned_limit: int | None = None

    batch_bytes: int = 1024 * MiB  # output bytes of one batched encode (fixed cost ~0.4 ms per call)
    max_batch_chunks: int = 8192
    # Encoded batches ahead of the copy-out stage.  One: nvCOMP's sizes of a batch are read by synchronizing
    # its stream (holding the GIL), which with two in flight also waits for the next encode; and the
    # budget then holds batches 1.5x larger (fewer nvCOMP calls).  The copies still overlap the encodes.
    inflight: int = 1
    slot_bytes: int = 64 * MiB  # one pinned slot; must hold the largest chunk's capacity (16 MiB chunk -> ~16.1 MiB)
    pinned_slots: int = 4  # ~0.1 s of a 2.3 GB/s disk ahead of the writer is plenty; pinning costs ~0.4 s/GB once
    piece_bytes: int = 16 * MiB  # tensor-checksum staging (two pieces per worker)
    checksum_workers: int = 4  # threads hashing whole tensors (one XXH3 stream runs ~6 GB/s on the H200 host)
    hash_workers: int = 4  # threads hashing chunks
    timing: bool = False  # CUDA events around every nvCOMP call, reported in SaveResult.stats

    def __post_init__(self) -> None:
        _positive(self, "batch_bytes", "max_batch_chunks", "inflight", "slot_bytes", "pinned_slots", "piece_bytes",
                  "checksum_workers", "hash_workers")
        for name in ("memory_budget", "pinned_limit"):
            if getattr(self, name) is not None:
                _positive(self, name)


READ_PATHS = ("auto", "o_direct", "kvikio")  # GpuLoadOptions.read_path


@dataclass(frozen=True)
class GpuLoadOptions:
    """The GPU loader's knobs.  Its extra memory: pinned read_buffers x read_span_bytes (+ 2 x
    piece_bytes per verify worker); GPU at most ``memory_budget`` (default the smaller of 1 GiB and 2 %
    of the device) for the decode arena (decode_batch_bytes, shrunk to half the budget) and its staging,
    beside the tensors loaded, all of it back to the device when the load ends (as a save's).  Reads through
    KvikIO (``read_path``) use device buffers instead, from what the budget leaves beside the arena, and
    read_threads pinned buffers to check chunks on the host."""

    memory_budget: int | None = None

    read_span_bytes: int = 32 * MiB
    read_threads: int = 4
    read_buffers: int = 12  # allocated as needed; more than the reads in flight, so a busy consumer does not stall the disk
    max_gap: int = 1 * MiB  # bytes between two wanted chunks that one read may still cover (at least the source's own)
    decode_batch_bytes: int = 256 * MiB
    direct_io: bool = True
    # Where the file's bytes go first: "o_direct" (O_DIRECT reads into pinned host buffers, then copied to
    # the device), "kvikio" (KvikIO into device memory: GPUDirect Storage, or KvikIO's compatibility mode
    # where cuFile does not run here), or "auto": KvikIO where it runs GPUDirect Storage, else "o_direct".
    # The load's stats say which ran ("read_path": "gds", "kvikio-compat", "o_direct", "buffered", "source").
    read_path: str = "auto"
    # zstd chunks decode with libzstd on the host, in the reader threads: nvCOMP's Zstd decoder crashed
    # the process (SIGABRT) on a garbage frame with a valid checksum (conformance suite, H200).  A file
    # must never crash its reader, and these loads are disk-bound anyway.  True: nvCOMP, for trusted files.
    gpu_zstd: bool = False
    verify_tensors: bool = True  # check each tensor's XXH3-64 over its decoded bytes
    verify_workers: int = 4
    piece_bytes: int = 16 * MiB
    timing: bool = False
    # The device backend the GPU loader runs on (nvckpt.engines.gpu.backend.Backend), instead of the CUDA
    # device's: the host stand-in (nvckpt.testing.host.HostBackend) runs the loader's logic without a GPU.
    backend: Any = None

    def __post_init__(self) -> None:
        _positive(self, "read_span_bytes", "read_threads", "read_buffers", "decode_batch_bytes", "verify_workers",
                  "piece_bytes")
        if self.memory_budget is not None:
            _positive(self, "memory_budget")
        if type(self.max_gap) is not int or self.max_gap < 0:
            raise ValueError(f"max_gap must be a non-negative integer, got {self.max_gap!r}")
        if self.read_path not in READ_PATHS:
            raise ValueError(f"read_path must be one of {', '.join(map(repr, READ_PATHS))}, got {self.read_path!r}")


@dataclass(frozen=True)
class SaveOptions:
    """How ``save`` writes (see its docstring for each field)."""

    codec: str | Pipeline = "auto"
    metadata: dict[str, Any] | None = None
    chunk_size: Any = None  # None: the engine's own; an int (raw bytes, whole rows) or a ChunkPolicy (nvckpt.plan.chunking)
    alignment: int | None = None  # None: the engine's own (4096 on the GPU engine, 1 on the CPU engine)
    zstd_level: int = 1
    derive: bool = True  # bf16 roundings of fp32 tensors and exact copies, stored as derived (SPEC 14.2)
    derive_bf16: bool | None = None  # the former option (bf16 roundings only); when given, it wins over ``derive``
    tensor_checksums: bool | None = None  # None: yes, except in an async_save that reads the caller's tensors ahead
    engine: Any = "auto"  # "auto", "cpu", "gpu", or an Engine (nvckpt.engines.base) to run
    workers: int | None = None
    direct_io: bool = True
    preemption_grace: float = 30.0  # seconds a save may run on after SIGTERM (nvckpt.session.lifecycle)
    storage_options: dict[str, Any] | None = None  # a URL target's storage backend (endpoint, credentials, ...)
    gpu: GpuSaveOptions = field(default_factory=GpuSaveOptions)

    def __post_init__(self) -> None:
        if type(self.preemption_grace) not in (int, float) or not 0 <= self.preemption_grace < float("inf"):
            raise ValueError(f"preemption_grace must be a non-negative number of seconds, got {self.preemption_grace!r}")
        if isinstance(self.engine, str) or not _is_engine(self.engine):
            if self.engine not in ENGINES:
                raise ValueError(f"engine must be 'auto', 'cpu', 'gpu' or an nvckpt.engines.base.Engine, got "
                                 f"{self.engine!r}")
        check_preset(self.codec)
        if self.alignment is not None:
            check_alignment(self.alignment)
        if type(self.derive) is not bool or (self.derive_bf16 is not None and type(self.derive_bf16) is not bool):
            raise ValueError(f"derive must be True or False, got {self.derive!r}")
        if self.chunk_size is not None:
            chunk_policy(self.chunk_size)
        if type(self.zstd_level) is not int or not -7 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be an integer in -7..22, got {self.zstd_level!r}")
        if self.workers is not None:
            _positive(self, "workers")
        if not isinstance(self.gpu, GpuSaveOptions):
            raise TypeError(f"gpu must be a nvckpt.GpuSaveOptions, got {type(self.gpu).__qualname__}")
        _check_storage_options(self.storage_options)

    @property
    def derives(self) -> tuple[bool, bool]:
        """(look for bf16 roundings, look for exact copies): ``derive``, or the former ``derive_bf16``."""
        if self.derive_bf16 is not None:
            return self.derive_bf16, False
        return self.derive, self.derive


@dataclass(frozen=True)
class LoadOptions:
    """How ``open`` / ``load`` read (see ``open``'s docstring for each field)."""

    device: Any = None  # None: "cpu", unless map_location says otherwise
    workers: int | None = None
    untrusted: bool = False
    max_tensor_bytes: int | None = None
    max_index_memory: int | None = None  # None: no bound of its own, or UNTRUSTED_INDEX_MEMORY with untrusted=True
    storage_options: dict[str, Any] | None = None  # a URL's storage backend (endpoint, credentials, ...)
    gpu: GpuLoadOptions = field(default_factory=GpuLoadOptions)
    # torch.load's keywords, for code migrating from it (see ``open``'s docstring).
    map_location: Any = None
    weights_only: bool | None = None
    mmap: bool | None = None

    def __post_init__(self) -> None:
        if self.mmap:
            raise ValueError("mmap=True is not available: nvckpt's chunks are compressed and checksummed, so tensors "
                             "cannot be mapped from the file; nvckpt.open(path) reads tensors lazily instead")
        if self.weights_only not in (None, True, False):
            raise TypeError(f"weights_only must be a bool or None, got {self.weights_only!r}")
        if self.map_location is not None and self.device is not None:
            raise ValueError("give device= or map_location=, not both")
        for name in ("max_tensor_bytes", "max_index_memory"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}")
        if self.workers is not None:
            _positive(self, "workers")
        if not isinstance(self.gpu, GpuLoadOptions):
            raise TypeError(f"gpu must be a nvckpt.GpuLoadOptions, got {type(self.gpu).__qualname__}")
        _check_storage_options(self.storage_options)


#: The memory the decoded index of a file opened with untrusted=True may take, unless max_index_memory
#: says otherwise: the index of a checkpoint of about 4 million chunks (or tensors) fits.
UNTRUSTED_INDEX_MEMORY = 1 << 30


def index_memory_limit(options: LoadOptions) -> int | None:
    """The bound on the decoded index's memory that ``options`` ask for (None: none of nvckpt's own)."""
    if options.max_index_memory is not None:
        return options.max_index_memory
    return UNTRUSTED_INDEX_MEMORY if options.untrusted else None


T = TypeVar("T")


def options_from(cls: type[T], caller: str, keywords: dict[str, Any]) -> T:
    """``cls(**keywords)``, with the caller's name in the error for an unknown keyword."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(keywords) - known)
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword argument{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(map(repr, unknown))} (it takes {', '.join(sorted(known))})")
    return cls(**keywords)


def keyword_signature(cls: type, *leading: inspect.Parameter, returns: Any = inspect.Signature.empty) -> inspect.Signature:
    """A function signature whose keyword-only parameters are ``cls``'s fields, with their defaults."""
    params = list(leading)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.type))
    return inspect.Signature(params, return_annotation=returns)


def with_signature(cls: type, *leading: str) -> Callable[[Callable], Callable]:
    """Give a ``def f(a, b, **options)`` the signature ``f(a, b, *, <cls's fields>)`` (for help() and IDEs);
    a leading name written ``"c=None"`` (or another literal) gets that default."""
    import ast

    def wrap(fn: Callable) -> Callable:
        lead = [inspect.Parameter(n.split("=")[0], inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                  **({"default": ast.literal_eval(n.split("=", 1)[1])} if "=" in n else {}))
                for n in leading]
        fn.__signature__ = keyword_signature(cls, *lead, returns=inspect.signature(fn).return_annotation)  # type: ignore[attr-defined]
        return fn
    return wrap


__all__ = ["UNTRUSTED_INDEX_MEMORY", "index_memory_limit", "SaveOptions", "LoadOptions", "GpuSaveOptions", "GpuLoadOptions", "options_from", "with_signature"]


def default_memory_budget(device_total: int | None) -> int:
    """The GPU memory an engine may use when not told: the smaller of 1 GiB and 2 % of the device."""
    return min(1 << 30, device_total // 50) if device_total else 1 << 30


def default_pinned_limit() -> int:
    """Pinned host memory an async_save may hold: a quarter of the host's memory."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 8 << 30
