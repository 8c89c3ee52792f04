"""What users call: save, async_save, load, open.  Thin: the options are nvckpt.options', the work the sessions'."""

from __future__ import annotations

import os
from typing import Any, Iterable

from .errors import NvckptError
from .options import LoadOptions, SaveOptions, options_from, with_signature
from .session.load import Checkpoint
from .session.save import SaveFuture, SaveResult, SaveSession, start_async
from .session.slicing import TensorSlice


@with_signature(SaveOptions, "obj", "target")
def save(obj: Any, target: str | os.PathLike | Any, **options: Any) -> SaveResult:
    """Save a nested training state (tensors in dicts, lists, tuples, with scalars and strings).

    ``target`` is a path (written atomically: temporary file, fsync, rename)
    or a binary stream (written front to back, never seeking).
    ``codec``: "auto" (nvcomp-ans on a GPU with nvCOMP, else portable),
    "portable" (byteshuffle+zstd, readable by any zstd library), "zstd",
    "raw", "ans" (GPU only), or a ``nvckpt.codecs.Pipeline``.
    ``metadata``: a JSON-like dict with str keys, stored in the index.
    ``derive_bf16``: store a bf16 tensor that is exactly the rounding of a
    saved fp32 tensor as derived from it (zero bytes; verified bit for bit).
    ``chunk_size``: target raw bytes per chunk (default: 1 MiB on the CPU
    engine, 4 MiB on the GPU engine).
    ``alignment``: large chunk payloads start at a multiple of it (power of two).
    ``zstd_level``: -7..22.  ``tensor_checksums``: store each tensor's XXH3-64.
    ``engine``: "auto" (the GPU engine for CUDA tensors where nvCOMP is), "cpu", "gpu".
    ``workers``: CPU encode threads (default: all cores).
    ``direct_io``: write with O_DIRECT where the filesystem allows it.
    ``gpu``: the GPU engine's knobs (``nvckpt.GpuSaveOptions``).
    Returns a ``SaveResult``; raises ``NvckptError`` (``UnsupportedObjectError``
    for what cannot be stored) or ``OSError``, and then leaves the target as it was.
    """
    return SaveSession(obj, target, options_from(SaveOptions, "save", options)).run()


@with_signature(SaveOptions, "obj", "target", "fence=None")
def async_save(obj: Any, target: str | os.PathLike | Any, fence: Any = None, **options: Any) -> SaveFuture:
    """Start a save; the file holds the values of the tensors at the time of the call.

    Without ``fence`` it returns once the caller may change its tensors: CPU
    tensors and a GPU state within half the engine's memory budget are copied;
    a larger GPU state is not copied but read (compressed into pinned host
    memory) by the GPU engine before this returns, in about the time the
    device-to-host copy of the compressed state takes.  With ``fence=optimizer``
    (or a list of optimizers) it returns at once: the GPU engine reads the
    tensors while the caller's next forward and backward run, and the
    optimizer's next ``step()`` waits (a step pre-hook) until they are read.
    Change the tensors in any other way only after ``future.wait_read()``.
    Takes the options of ``save``; a pending save is finished at interpreter
    exit, and SIGTERM gives it ``preemption_grace`` seconds (README)."""
    return start_async(obj, target, options_from(SaveOptions, "async_save", options), fence)


@with_signature(LoadOptions, "target")
def open(target: str | os.PathLike | Any, **options: Any) -> Checkpoint:  # noqa: A001
    """Open a checkpoint for random access (use as a context manager).

    ``device``: where tensors are materialized ("cpu", "cuda", "cuda:1", a torch.device).
    ``workers``: CPU decode threads.  For files from an untrusted source:
    ``untrusted=True`` decodes only with the hardened CPU decoders (no nvCOMP;
    nvcomp-ans chunks are refused) and bounds the memory of the decoded index
    to ``max_index_memory`` bytes (default ``nvckpt.options.UNTRUSTED_INDEX_MEMORY``,
    1 GiB; a trusted open has no bound of its own unless it is given);
    ``max_tensor_bytes`` refuses to materialize a tensor, view or slice larger
    than that (LimitError).  ``gpu``: the GPU loader's knobs
    (``nvckpt.GpuLoadOptions``)."""
    return Checkpoint(target, options_from(LoadOptions, "open", options))


@with_signature(LoadOptions, "target", "keys=None")
def load(target: str | os.PathLike | Any, *, keys: Iterable[str] | None = None, **options: Any) -> Any:
    """Load a whole checkpoint, bit-exact, as the structure that was saved (``keys``: just those tensors,
    as a dict; other options: see ``open``)."""
    with Checkpoint(target, options_from(LoadOptions, "load", options)) as ck:
        return ck.load(keys)


__all__ = ["save", "async_save", "SaveFuture", "load", "open", "Checkpoint", "TensorSlice", "SaveResult", "NvckptError"]
