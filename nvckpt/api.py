"""What users call: save, async_save, load, open.  Thin: the options are nvckpt.options', the work the sessions'."""

from __future__ import annotations

import os
from typing import Any, Iterable

from ._gc import paused as gc_paused
from .errors import NvckptError
from .options import LoadOptions, SaveOptions, options_from, with_signature
from .session.load import Checkpoint
from .session.async_save import SaveFuture, start_async
from .session.save import SaveResult, SaveSession
from .session.slicing import TensorSlice


@with_signature(SaveOptions, "obj", "target")
def save(obj: Any, target: str | os.PathLike | Any, **options: Any) -> SaveResult:
    """Save a nested training state (tensors in dicts, lists, tuples, with scalars and strings).

    - ``obj``: what to save (the docs' "What can be saved"); anything else raises UnsupportedObjectError
      naming its path, before a byte is written.
    - ``target``: a path (written atomically: temporary file beside it, fsync, rename; the old file stays
      until the new one is complete) or a binary stream (written front to back, never seeking).
    - ``codec``: "auto" (nvcomp-ans on a GPU with nvCOMP, else portable), "portable"
      (signshift+byteshuffle+zstd, one frame per byte plane, readable by any zstd library),
      "portable-1.0" (byteshuffle+zstd as nvckpt 0.1 wrote it), "zstd", "raw", "ans" (GPU only),
      or a ``nvckpt.codecs.Pipeline``.
    - ``metadata``: a JSON-like dict with str keys, stored in the index (``Checkpoint.metadata()``).
    - ``derive`` (default True): store a bf16 tensor that is exactly the rounding of a saved fp32
      tensor, and an exact copy of another tensor, as derived (zero bytes; verified bit for bit on
      their device).  ``derive_bf16``: the former option (bf16 roundings only).
    - ``chunk_size``: target raw bytes per chunk, whole rows of dim 0 where they fit (default: 1 MiB on the
      CPU engine, 4 MiB on the GPU engine), or a ``nvckpt.plan.chunking.ChunkPolicy``.
    - ``alignment``: large chunk payloads start at a multiple of it (a power of two; default 1 on the
      CPU engine, 4096 on the GPU engine, for O_DIRECT).
    - ``zstd_level``: the zstd level, -7..22 (1: fast; higher: smaller and slower).
    - ``tensor_checksums``: also store each tensor's XXH3-64 (every chunk has its own checksum anyway;
      default yes, except in an async_save that reads the tensors ahead, see async_save).
    - ``engine``: "auto" (the GPU engine for CUDA tensors where nvCOMP is), "cpu", "gpu", or an engine to
      run (an ``nvckpt.engines.base.Engine``).
    - ``workers``: CPU encode threads (default: all cores; the process keeps one shared pool per count, nvckpt._threads).
    - ``direct_io``: write with O_DIRECT where the filesystem allows it.
    - ``preemption_grace``: seconds a save may still run after SIGTERM before it is cancelled (the docs' "Async save").
    - ``storage_options``: for a URL target (``s3://bucket/key``, any fsspec URL), its storage backend's options
      (endpoint, credentials, timeouts), over what the environment and config files say.
    - ``gpu``: the GPU engine's knobs (``nvckpt.GpuSaveOptions``).

    Returns a ``SaveResult`` (path, raw_bytes, file_bytes, seconds, ratio, stats).
    Raises ``NvckptError`` (``UnsupportedObjectError`` for what cannot be stored, ``LimitError`` past
    SPEC.md's limits) or ``OSError`` naming the target (disk full, no such directory, read-only), and
    then leaves the target as it was; ``ValueError`` for a bad option.
    """
    with gc_paused():  # the caller waits for the whole save (nvckpt._gc: a collection pass costs more than it frees)
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
    optimizer's next ``step()`` waits (a step pre-hook) until they are read;
    tensors the optimizers do not own (BatchNorm statistics and other buffers a
    forward changes) are copied at the call, up to 1 MiB each and 64 MiB in all.
    Change the tensors in any other way only after ``future.wait_read()``.
    Takes the options of ``save``; a pending save is finished at interpreter
    exit, and SIGTERM gives it ``preemption_grace`` seconds (the docs' "Async save")."""
    return start_async(obj, target, options_from(SaveOptions, "async_save", options), fence)


@with_signature(LoadOptions, "target")
def open(target: str | os.PathLike | Any, **options: Any) -> Checkpoint:  # noqa: A001
    """Open a checkpoint for random access (use as a context manager); a read-only Mapping of tensor names
    to tensors, like safetensors' ``safe_open``.

    - ``target``: a path, a URL of a storage backend, or a seekable binary file object (read from its position,
      where save wrote it; a stream left at its end from its start).
    - ``device``: where every tensor is materialized: "cpu" (the default), "cuda", "cuda:1", a torch.device
      or a CUDA index; the file does not record where a tensor was saved from, so any file loads on any device.
    - ``workers``: CPU decode threads, the caller's among them (default: all cores; shared pools, nvckpt._threads).
    - ``untrusted``: for files from an untrusted source, decode only with the hardened CPU decoders (no
      nvCOMP; nvcomp-ans chunks are refused) and bound the memory of the decoded index to
      ``max_index_memory`` bytes (default ``nvckpt.options.UNTRUSTED_INDEX_MEMORY``, 1 GiB; a trusted
      open has no bound of its own unless it is given).
    - ``max_tensor_bytes``: refuse (LimitError) to materialize a tensor, view or slice larger than this.
    - ``storage_options``: for a URL (``s3://bucket/key``, any fsspec URL), its storage backend's options
      (endpoint, credentials, timeouts), over what the environment and config files say.
    - ``gpu``: the GPU loader's knobs (``nvckpt.GpuLoadOptions``).
    - ``map_location``: torch.load's, instead of ``device``: a device, a string, a dict whose values all
      name one device, or a callable ``fn(storage, "cpu") -> storage`` called once per storage.
    - ``weights_only``: accepted and changes nothing: nvckpt never unpickles, so loading never runs code
      (what torch.load(weights_only=True) protects against) and only tensors and plain data come back.
    - ``mmap``: False or None only: chunks are compressed and checksummed; ``open`` reads lazily instead.

    Raises ``NvckptError`` naming the file (``UnsupportedFeatureError`` for a device this machine lacks)."""
    return Checkpoint(target, options_from(LoadOptions, "open", options))


@with_signature(LoadOptions, "target", "keys=None", "allow_pickle=False")
def load(target: str | os.PathLike | Any, *, keys: Iterable[str] | None = None, allow_pickle: bool = False,
         **options: Any) -> Any:
    """Load a whole checkpoint, bit-exact, as the structure that was saved.

    ``keys``: load only part of it, reading only the tensors in that part: one path (a str) returns
    the value there ("model" is the model's state_dict, "model/weight" one tensor, "step" a scalar);
    a list of paths returns a dict path -> value.  A name as DCP writes it ("model.0.weight", keys
    joined by ".") is accepted where it names one value.
    ``allow_pickle``: also read a torch.save file (during a migration, one call loads either format).
    That runs ``torch.load(weights_only=False)``: the file's pickle may run any code, so give it only
    for files you trust (``weights_only=True`` with it keeps torch's restricted unpickler).  Never the
    default: without it a torch.save file raises a FormatError that says what it is.
    Other options: see ``open``."""
    if type(allow_pickle) is not bool:
        raise TypeError(f"allow_pickle must be True or False, got {allow_pickle!r}")
    load_options = options_from(LoadOptions, "load", options)
    if allow_pickle:
        from .format.sniff import sniff_format

        if sniff_format(target) == "torch":
            from .session.pickled import load_pickled

            return load_pickled(target, keys, load_options)
    with Checkpoint(target, load_options) as ck:
        return ck.load(keys)


__all__ = ["save", "async_save", "SaveFuture", "load", "open", "Checkpoint", "TensorSlice", "SaveResult", "NvckptError"]
