"""Reading a checkpoint as tensors: ``Checkpoint`` (lazy, random access) and the one place tensors are
materialized from raw bytes (dtype, shape, bools, views on their base, derived tensors on the device)."""

from __future__ import annotations

import copy
import math
import operator
import pathlib
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import xxhash

from .._fork import Lock
from .._gc import paused as gc_paused
from .._threads import TASK_BYTES, TASK_PIECES
from ..errors import brief, ChecksumError, FormatError, LimitError, TensorNotFoundError, UnsupportedCodecError, UnsupportedFeatureError
from ..format.constants import BF16_RNE, COPY, PATH_FLAVOURS
from ..format.entry import TensorEntry, not_internal
from ..format.structs import xxh3
from ..format.paths import by_dotted_name, did_you_mean, value_paths
from ..format.tree import ArrayRef, DeviceName, DtypeName, PathValue, TensorRef, find_path, resolve_refs, tensor_refs
from ..options import LoadOptions, index_memory_limit
from ..plan.derived import bf16_rne, bf16_rne_into
from ..tensors import flat_bytes
from ..tensors.dtypes import to_torch
from ..read.reader import ChunkReader, _groups, check_supported

if TYPE_CHECKING:
    from .slicing import TensorSlice




class _InOrderHash:
    """XXH3-64 of a tensor's raw bytes fed chunk by chunk in order, whatever order they are decoded in."""

    def __init__(self, entry: TensorEntry) -> None:
        self.entry = entry
        self.state = xxhash.xxh3_64()
        self.next = 0
        self.done: set[int] = set()
        self.lock = threading.Lock()

    def add(self, i: int, array: Any) -> bool:
        """Chunk ``i`` is decoded into ``array``; True once every chunk has been hashed."""
        with self.lock:
            self.done.add(i)
            chunks = self.entry.chunks
            while self.next in self.done:
                c = chunks[self.next]
                self.state.update(array[c.raw_start: c.raw_start + c.raw_length])
                self.done.discard(self.next)
                self.next += 1
            return self.next == len(chunks)

    def digest(self) -> int:
        return self.state.intdigest()


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


def _check_elements(entry: TensorEntry, t: torch.Tensor, path: str) -> None:
    """SPEC 13: a view's or derived tensor's "checksum" covers its own elements in C order (checked only
    when the entry has one: nvckpt writes none, so this costs a copy and a hash only for files that do)."""
    if entry.checksum is None:
        return
    if xxh3(flat_bytes(t.detach()).cpu().numpy()) != entry.checksum:
        raise ChecksumError("tensor checksum does not match its elements", path=path, tensor=entry.name)


def _derive(entry: TensorEntry, source: torch.Tensor, nbytes: int, path: str) -> torch.Tensor:
    """A derived tensor (SPEC 14.2) from its source, or rows of it from the same rows of its source; a failed
    allocation (of ``nbytes``) is the LimitError that allocate() gives."""
    try:
        return source.clone() if entry.derived["function"] == COPY else bf16_rne(source)
    except (RuntimeError, MemoryError) as exc:
        raise allocation_error(exc, nbytes, entry, path) from None


def _derive_into(entry: TensorEntry, source: torch.Tensor, out: torch.Tensor) -> None:
    """A derived tensor's elements (SPEC 14.2) computed from ``source``, the same box of its source, into ``out``
    (any strides): a copy moved as bits (a NaN's payload kept), a rounding through bf16_rne_into."""
    if entry.derived["function"] == COPY:
        ints = _TORCH_INTS[out.element_size()]
        out.view(ints).copy_(source.view(ints))
    else:
        bf16_rne_into(source, out)


def _typed(entry: TensorEntry, raw: torch.Tensor, shape: tuple[int, ...], path: str) -> torch.Tensor:
    """Raw bytes (1-D uint8) as a tensor of the entry's dtype and ``shape``."""
    _check_bools(entry, raw, path)
    dtype = to_torch(entry.dtype.name)
    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=raw.device)
    return raw.view(dtype).reshape(shape)


class _Entries(dict):
    """An index's entries by tensor id, each made once (an index keeps plain ones as columns, format.entry)."""

    def __init__(self, table: Any) -> None:
        super().__init__()
        self.table = table

    def __missing__(self, tid: int) -> TensorEntry:
        e = self[tid] = self.table[tid]
        return e


def torch_device(where: Any) -> torch.device:
    """``device=`` as a torch.device that exists here (a string, a torch.device, or a CUDA device index)."""
    if type(where) is int and where >= 0:
        where = f"cuda:{where}"  # an index is a CUDA device, as in torch.load (torch.device(0) needs one present)
    try:
        device = torch.device(where)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device, a string such as 'cpu' or 'cuda:0', or a CUDA device "
                         f"index, got {where!r}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UnsupportedFeatureError(f"cannot load onto {device}: this torch ({torch.__version__}) sees no CUDA "
                                          "device; load with device='cpu'")
        if device.index is not None and device.index >= count:
            raise UnsupportedFeatureError(f"cannot load onto {device}: this machine has {count} CUDA device(s)")
    return device


def target_device(options: LoadOptions) -> tuple[torch.device, Callable[[Any, str], Any] | None]:
    """Where tensors are materialized, and torch.load's relocation function if ``map_location`` is one.

    nvckpt does not record which device a tensor was saved from, so every tensor loads onto one device:
    a ``map_location`` dict is accepted when all its values name one device."""
    where = options.map_location if options.map_location is not None else options.device
    if where is None or (isinstance(where, dict) and not where):  # torch.load: {} remaps nothing
        where = "cpu"
    if isinstance(where, dict):
        targets = {str(torch_device(v)) for v in where.values()}
        if len(targets) != 1:
            raise ValueError("map_location as a dict needs all its values to be one device: nvckpt does not record "
                             "which device a tensor was saved from, and loads every tensor onto one device "
                             "(give device= instead)")
        device = torch.device(targets.pop())
    elif callable(where) and not isinstance(where, (str, torch.device)):
        return torch.device("cpu"), where
    else:
        device = torch_device(where)
    if device.type == "meta":
        raise ValueError("device='meta' holds no data, and a load reads every byte it returns: to see shapes and "
                         "dtypes without loading, use nvckpt.open(path) (or `nvckpt ls`)")
    return device, None


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """A tensor that the tree references as a NumPy array (ext 9, SPEC 9.3) as that array: same dtype, shape
    and bytes (C order), on the host whatever device the tensors were loaded onto."""
    return tensor.detach().cpu().numpy()


def path_object(node: PathValue) -> pathlib.PurePath:
    """A path of the tree (ext 10, SPEC 9.3) as its pathlib class; a concrete path of the other operating
    system's flavour (a WindowsPath read on Linux), which cannot be made here, as the pure class of its flavour."""
    name = PATH_FLAVOURS[node.flavour]
    try:
        return getattr(pathlib, name)(node.text)
    except (NotImplementedError, OSError):  # "cannot instantiate 'WindowsPath' on your system"
        return (pathlib.PureWindowsPath if name == "WindowsPath" else pathlib.PurePosixPath)(node.text)


def torch_value(node: DtypeName | DeviceName | PathValue) -> Any:
    """A typed extension of the tree (SPEC 9.2, 9.3) as the torch (or pathlib) object it stands for."""
    if isinstance(node, PathValue):
        return path_object(node)
    if isinstance(node, DtypeName):
        dtype = getattr(torch, node.name, None)
        if not isinstance(dtype, torch.dtype):
            raise UnsupportedFeatureError(f"the saved object holds torch.{node.name}, a dtype this torch "
                                          f"({torch.__version__}) does not have")
        return dtype
    try:
        device = torch.device(node.spec)
    except RuntimeError:
        raise UnsupportedFeatureError(f"the saved object holds the device {node.spec!r}, which this torch "
                                      f"({torch.__version__}) does not know") from None
    if str(device) != node.spec:  # SPEC 9.2: kept exactly or refused (torch keeps a device index in 8 bits)
        raise UnsupportedFeatureError(f"the saved object holds the device {node.spec!r}, which this torch "
                                      f"({torch.__version__}) cannot represent (it would be {str(device)!r})")
    return device


def _c_order(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Are a view's elements one run of its base in C order (dims of size 1 may have any stride)?"""
    run = 1
    for n, st in zip(reversed(shape), reversed(stride)):
        if n != 1 and st != run:
            return False
        run *= n
    return True


def _check_box(entry: TensorEntry, offsets: Sequence[int], lengths: Sequence[int],
               path: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Offsets and lengths as int tuples, one per dim, inside the tensor (ValueError otherwise)."""
    offsets, lengths = tuple(offsets), tuple(lengths)
    shape = tuple(entry.shape)
    if len(offsets) != len(shape) or len(lengths) != len(shape):
        raise ValueError(f"{path}, tensor {entry.name!r}: a box of {len(offsets)} offsets and {len(lengths)} "
                         f"lengths for a tensor of {len(shape)} dims {list(shape)}")
    try:  # any integer (numpy, a 0-d tensor), as indexing takes them; not bools or floats
        if any(isinstance(v, bool) for v in offsets + lengths):
            raise TypeError
        offsets, lengths = tuple(operator.index(v) for v in offsets), tuple(operator.index(v) for v in lengths)
    except TypeError:
        raise ValueError(f"{path}, tensor {entry.name!r}: box offsets and lengths must be integers, got "
                        f"{list(offsets)} and {list(lengths)}") from None
    for d, (o, n, size) in enumerate(zip(offsets, lengths, shape)):
        if o < 0 or n < 0 or o + n > size:
            raise ValueError(f"{path}, tensor {entry.name!r}: box [{o}, {o}+{n}) is outside dim {d} of size {size}")
    return offsets, lengths


#: numpy integer types by element size: a box's elements are moved as bits (bf16, fp8 and bool alike).
_INTS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Rows of a column strip are decoded in bands of about this many bytes (each chunk of a band once).
BAND_BYTES = 4 << 20
_band_tls = threading.local()


def _band_scratch(n: int) -> np.ndarray:
    """This thread's buffer for a band of rows (kept: bands of one load are of about one size)."""
    buf = getattr(_band_tls, "buf", None)
    if buf is None or buf.nbytes < n:
        buf = _band_tls.buf = np.empty(max(n, 1 << 20), dtype=np.uint8)
    return buf[:n]


def _same_size_ints(out: torch.Tensor) -> np.ndarray:
    """``out``'s memory as a numpy array of integers of its element size, its strides kept (bits, not values)."""
    return out.view(_TORCH_INTS[out.element_size()]).numpy()


def _bands(entry: TensorEntry, held: list[tuple[tuple[int, ...], tuple[int, ...], Any]]) -> list[tuple[int, int]]:
    """Rows [lo, hi) of ``entry`` decoded together for its column boxes ``held``: the union of their row ranges
    cut into bands of about BAND_BYTES, each ending where a chunk ends on a row boundary, so no chunk is
    decoded twice (a band grows past BAND_BYTES until one does)."""
    row = entry.nbytes // entry.shape[0]
    spans = sorted((o[0], o[0] + n[0]) for o, n, _ in held if n[0])
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    chunks = entry.chunks
    assert chunks is not None
    out = []
    for a, b in merged:
        first = chunks.covering(a * row, b * row)
        columns = chunks.columns(first.start, first.stop)
        lo, size = a, 0
        for s, n in zip(columns[5], columns[2]):
            size += n
            end = s + n
            if size >= BAND_BYTES and end % row == 0 and lo < end // row < b:
                out.append((lo, end // row))
                lo, size = end // row, 0
        out.append((lo, b))
    return out


class Checkpoint(Mapping):
    """An open nvckpt file: lazy, random access, safe to share between threads.

    A read-only Mapping of tensor names to tensors (``ck["model/weight"]``, ``ck.items()``, ``ck.get(name)``,
    ``name in ck``), like safetensors' ``safe_open``; each access reads that tensor from the file.

    ``untrusted=True`` decodes with the hardened CPU decoders only, never
    nvCOMP (SPEC.md 20: checksums are not signatures, and nvCOMP's decoders
    assume valid input); nvcomp-ans chunks then raise UnsupportedCodecError.
    ``max_tensor_bytes``: refuse (LimitError) to materialize a tensor or slice
    larger than this, before allocating it; a small file may declare a huge
    tensor of highly compressible chunks."""

    def __init__(self, target: Any, options: LoadOptions | None = None) -> None:
        options = options or LoadOptions()
        self.options = options
        self.device, self._relocate = target_device(options)
        self.untrusted = options.untrusted
        self._file = ChunkReader(target, workers=options.workers, max_tensor_bytes=options.max_tensor_bytes,
                                    max_index_memory=index_memory_limit(options),
                                    storage_options=options.storage_options)
        self._gpu = None if options.untrusted else self._gpu_backend()
        self._stats_lock = Lock()  # a forked child gets it unlocked (nvckpt._fork)
        self._stats: dict[str, Any] = {"gpu_loads": 0, "gpu_seconds": 0.0, "gpu_stored_bytes": 0}
        self._dotted: dict[str, str | None] | None = None  # DCP's dotted names of the tree's paths (_path)

    def _gpu_backend(self) -> Any:
        """The GPU loader's backend: the one the options give, else the CUDA device's where nvCOMP is; else None
        (host decode, then copy)."""
        if self.options.gpu.backend is not None:
            return self.options.gpu.backend
        if self.device.type != "cuda":
            return None
        from ..codecs.nvcomp import device as nb

        if not nb.available():
            return None
        from ..engines.gpu.backend import CudaBackend

        return CudaBackend(self.device, gpu_zstd=self.options.gpu.gpu_zstd, timing=self.options.gpu.timing)

    # A Mapping compares by contents: an open file is equal only to itself (comparing would read both files).
    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    # context manager
    def __enter__(self) -> "Checkpoint":
        """``with nvckpt.open(path) as ck:``: the file is closed at the end of the block."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the file (see ``close``)."""
        self.close()

    def close(self) -> None:
        """Close the file, once the reads of this Checkpoint still running on the shared decode threads have
        ended; tensors already returned stay valid (they own their memory).  Closing twice is harmless."""
        self._file.close()

    @property
    def path(self) -> str:
        """The file's path, as given (or a stream's name), as errors name it."""
        return self._file.path

    @property
    def index(self) -> Any:
        """The parsed index (nvckpt.format.index.Index: entries, tree, metadata; read-only)."""
        return self._file.index

    @property
    def file(self) -> ChunkReader:
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
        """Every tensor's name (its path in the saved object, SPEC 14.1), in the order it was saved."""
        return list(self._file.index.paths)

    def __getitem__(self, name: str) -> Any:
        """``ck[name]``: the tensor named ``name``, as ``get_tensor(name)``; any other path of the saved object
        gives its value, as ``load(keys=name)`` (``ck["step"]``, ``ck["model"]``); a NumPy array that was saved
        is a NumPy array here (``get_tensor`` reads its tensor)."""
        if isinstance(name, str) and name in self._file.index.arrays:
            return self.load(name)
        try:
            return self.get_tensor(name)
        except TensorNotFoundError:
            if not isinstance(name, str) or self._path(name) is None:
                raise
        return self.load(name)

    def __contains__(self, name: object) -> bool:
        """``name in ck`` exactly when ``ck[name]`` and ``load(keys=name)`` find it: the saved object's tensors
        (``keys()``), the path of any other value in it ("step", "model"), DCP's dotted name of one of those,
        and the internal bases of views (SPEC 14.3, "<first view>@base"), which ``keys()`` leaves out."""
        if not isinstance(name, str):
            return False
        try:
            self._file.entry(name)
        except TensorNotFoundError:
            return self._path(name) is not None
        return True

    def __iter__(self) -> Iterator[str]:
        """The tensors' names (``keys()``), in the order they were saved."""
        return iter(self.keys())

    def __len__(self) -> int:
        """The number of tensor names (``len(keys())``)."""
        return len(self._file.index.paths)

    def metadata(self) -> dict[str, Any]:
        """The ``metadata=`` dict given to ``save`` (JSON-like), a copy of its own for each call."""
        return copy.deepcopy(self._file.index.metadata)

    def writer(self) -> dict[str, Any]:
        """What wrote the file: {"name", "version", ...} (SPEC 8.2; "nvcomp" when ANS chunks were written)."""
        return self._file.index.writer

    # -- materializing ------------------------------------------------------
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device)

    def _gpu_run(self, fn: Any, *args: Any) -> Any:
        stats: dict[str, Any] = {}
        try:
            with self._gpu.lease():  # the loader's buffers go back to the device when it returns
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

    def _raw_tensors(self, entries: list[TensorEntry], progress: Callable[[int], None] | None,
                     decoded: Callable[[int, torch.Tensor], None] | None = None) -> dict[int, torch.Tensor]:
        """Raw bytes (1-D uint8 on the target device) of stored tensors, their tensor checksums verified.
        ``decoded(tensor id, raw bytes)``: called on a decode thread as soon as a tensor's last chunk is
        decoded, where the bytes stay in host memory (a CPU load)."""
        if self._gpu is not None and entries:
            from ..engines.gpu.decode import decode_entries

            out = self._gpu_run(decode_entries, entries)
            if progress is not None:
                progress(sum(e.nbytes for e in entries))
            return out
        return self._host_tensors(entries, progress, decoded if self.device.type == "cpu" else None)

    def _host_tensors(self, entries: list[TensorEntry], progress: Callable[[int], None] | None,
                      decoded: Callable[[int, torch.Tensor], None] | None = None,
                      into: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """Every chunk of ``entries`` read, verified and decoded on the decode threads, straight into the
        tensors' memory (``into``: the caller's, 1-D uint8 by tensor id; else allocated here); small chunks
        in tasks of ~256 KiB, so thousands of small tensors cost little.
        A tensor's checksum is a task started by whichever thread finishes its last chunk, so it runs
        beside the other chunks' decoding (and on bytes still in cache); so does ``decoded``."""
        f = self._file
        dests = into if into is not None else {e.tensor_id: allocate(e.nbytes, e, self.path) for e in entries}
        arrays = {tid: t.numpy() for tid, t in dests.items()}
        left = {e.tensor_id: len(e.chunks) for e in entries}
        lock = threading.Lock()
        tasks: list[list[tuple[TensorEntry, int]]] = []
        runs: list[tuple[TensorEntry, range]] = []  # chunks read with one request (an object store)
        group: list[tuple[TensorEntry, int]] = []
        size = 0
        policy = f.source.coalescing
        if policy.whole_loads:  # a run is read into one of the read-ahead's buffers
            policy = policy.with_(max_span=min(policy.max_span, policy.load_span),
                                  alone_from=min(policy.alone_from, policy.load_span + 1))
        for e in entries:
            if policy.whole_loads and e.chunks:
                runs += [(e, run) for run in _groups(e, range(len(e.chunks)), policy)]
                continue
            for i, c in enumerate(e.chunks):
                if c.raw_length >= TASK_BYTES:
                    tasks.append([(e, i)])
                    continue
                group.append((e, i))
                size += c.raw_length
                if size >= TASK_BYTES or len(group) >= TASK_PIECES:
                    tasks.append(group)
                    group, size = [], 0
        if group:
            tasks.append(group)

        def check(e: TensorEntry, digest: int | None = None) -> None:
            """The tensor's checksum against ``digest`` (hashed as it was decoded), else its decoded bytes."""
            if (xxh3(arrays[e.tensor_id]) if digest is None else digest) != e.checksum:
                raise ChecksumError("tensor checksum does not match its decoded bytes", path=self.path, tensor=e.name)

        # A tensor of several chunks is hashed as its chunks are decoded, in order, by whichever thread
        # completes the next one (its bytes still in cache), not in one pass at the end.
        hashing = {e.tensor_id: _InOrderHash(e) for e in entries if e.checksum is not None and len(e.chunks) > 1}

        def refused(exc: UnsupportedCodecError) -> UnsupportedCodecError:
            if self.untrusted:
                exc.reason += " (refused: the file was opened with untrusted=True, which never runs nvCOMP)"
                exc.located()
            return exc

        def run(task: list[tuple[TensorEntry, int]]) -> None:
            for e, i in task:
                try:
                    f.fill(e, i, 0, arrays[e.tensor_id])
                except UnsupportedCodecError as exc:
                    raise refused(exc)
                done(e, i)

        def run_chunks(task: tuple[TensorEntry, range], data: Any = None) -> None:
            e, chunks = task
            try:
                f.read_run(e, chunks, arrays[e.tensor_id], data)
            except UnsupportedCodecError as exc:
                raise refused(exc)
            for i in chunks:
                done(e, i)

        def done(e: TensorEntry, i: int) -> None:
            h = hashing.get(e.tensor_id)
            if h is not None and h.add(i, arrays[e.tensor_id]):
                check(e, h.digest())
            with lock:
                left[e.tensor_id] -= 1
                last = left[e.tensor_id] == 0
            if last and e.checksum is not None and h is None:
                check(e)
            if last and decoded is not None:
                decoded(e.tensor_id, dests[e.tensor_id])
            if last and progress is not None:
                progress(e.nbytes)

        for e in entries:  # tensors without chunks (empty ones)
            if not e.chunks and e.checksum is not None:
                check(e)
        read_ahead = getattr(f.source, "read_ahead", None)
        if runs and read_ahead is not None:
            # An object store: the next runs' requests in flight while these decode (bounded memory)
            with read_ahead([f.run_range(e, chunks) for e, chunks in runs]) as ahead:
                def run_ahead(k: int) -> None:
                    try:
                        run_chunks(runs[k], ahead.take(k))
                    finally:
                        ahead.done(k)

                f.map(run_ahead, list(range(len(runs))))
        elif runs:
            f.map(run_chunks, runs)
        f.map(run, tasks)
        return {tid: self._to_device(t) for tid, t in dests.items()}

    def _caller_rows(self, entry: TensorEntry, first: int, stop: int) -> torch.Tensor:
        """``_rows`` for a caller (get_slice, read_box): relocated by a callable map_location, as whole
        tensors are."""
        rows = self._rows(entry, first, stop)
        return rows if self._relocate is None else self._relocated({0: rows})[0]

    def row_readable(self, entry: TensorEntry) -> bool:
        """Can rows of ``entry`` be read without building it whole?  A stored tensor's can, and so can those of
        a view laid out in C order in its base (a slice of a flat parameter buffer) and of a tensor derived
        from a tensor whose rows can be read (a rounding or a copy has its source's shape)."""
        tensors = self._file.index.tensors
        if entry.chunks is not None:
            return True
        if entry.view is not None:
            return tensors[entry.view["base"]].chunks is not None and _c_order(entry.shape, entry.view["stride"])
        if entry.derived is not None and entry.derived["function"] in (BF16_RNE, COPY):
            source = tensors[entry.derived["source"]]
            return tuple(source.shape) == tuple(entry.shape) and self.row_readable(source)
        return False

    def _rows(self, entry: TensorEntry, first: int, stop: int) -> torch.Tensor:
        """Rows [first, stop) of a tensor whose rows can be read (``row_readable``) on the target device,
        decoding only the chunks that hold them."""
        check_supported(entry, self.path)
        if entry.chunks is None:
            return self._rows_not_stored(entry, first, stop)
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

    def _rows_not_stored(self, entry: TensorEntry, first: int, stop: int) -> torch.Tensor:
        tensors = self._file.index.tensors
        nbytes = max(0, stop - first) * (entry.nbytes // entry.shape[0] if entry.shape[0] else 0)
        self._file.check_size(entry, nbytes)
        if entry.view is not None:  # in C order in its base: the rows are one run of the base's elements
            base, at = tensors[entry.view["base"]], entry.view["offset"]
            row = math.prod(entry.shape[1:])
            flat = self._rows(base, at + first * row, at + max(first, stop) * row)
            return flat.reshape((max(0, stop - first),) + tuple(entry.shape[1:]))
        rows = self._rows(tensors[entry.derived["source"]], first, stop)
        return _derive(entry, rows, nbytes, self.path)

    def _load(self, tids: Iterable[int], progress: Callable[[int], None] | None = None) -> dict[int, torch.Tensor]:
        """Tensors by id, with views built on their (shared) base and derived tensors computed on the device."""
        tensors = _Entries(self._file.index.tensors)
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
        # Tensors derived from a stored tensor are computed on the decode thread that finished their source
        # (its bytes still in cache, beside the other chunks' decoding), not one by one once all are decoded.
        users: dict[int, list[TensorEntry]] = {}
        for tid in wanted:
            d = tensors[tid].derived
            if d is not None and tensors[d["source"]].chunks is not None:
                users.setdefault(d["source"], []).append(tensors[tid])
        early: dict[int, torch.Tensor] = {}  # by id: the derived tensors, and their sources as typed there

        def decoded(tid: int, raw: torch.Tensor) -> None:
            source = early[tid] = _typed(tensors[tid], raw, tensors[tid].shape, self.path)
            for e in users.get(tid, ()):
                early[e.tensor_id] = _derive(e, source, e.nbytes, self.path)

        raws = self._raw_tensors(stored, progress, decoded if users else None)
        out = {tid: early.pop(tid) if tid in early else _typed(tensors[tid], raw, tensors[tid].shape, self.path)
               for tid, raw in raws.items()}
        for tid in wanted:  # bases and sources come before their users
            e = tensors[tid]
            if e.view is not None:
                out[tid] = out[e.view["base"]].as_strided(e.shape, e.view["stride"], e.view["offset"])
            elif e.derived is not None:
                derived = early.pop(tid, None)
                out[tid] = _derive(e, out[e.derived["source"]], e.nbytes, self.path) if derived is None else derived
            if e.chunks is None:  # stored tensors' checksums were verified as they were decoded
                _check_elements(e, out[tid], self.path)
        return out if self._relocate is None else self._relocated(out)

    def _relocated(self, tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """torch.load's callable ``map_location(storage, "cpu")``, once per storage (views keep sharing)."""
        moved: dict[Any, Any] = {}
        out = {}
        for tid, t in tensors.items():
            storage = t.untyped_storage()
            key = storage.data_ptr() if storage.nbytes() else ("empty", tid)
            if key not in moved:
                new = self._relocate(storage, "cpu")  # type: ignore[misc]
                if new is None:  # torch.load: None leaves the storage where it was loaded
                    new = storage
                if isinstance(new, torch.TypedStorage):
                    new = new.untyped()
                if not isinstance(new, torch.UntypedStorage):
                    raise TypeError(f"map_location returned a {type(new).__qualname__}, not a storage or None")
                moved[key] = new
            new = moved[key]
            out[tid] = (t if new is storage else
                        torch.empty(0, dtype=t.dtype, device=new.device).set_(new, t.storage_offset(), t.shape, t.stride()))
        return out

    # -- public reads ---------------------------------------------------------
    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor named ``name`` (one of ``keys()``, or its dotted name as DCP writes it), on this
        checkpoint's device (a saved NumPy array as a tensor of its dtype: ``ck[name]`` gives the array); raises TensorNotFoundError (a KeyError) for an unknown name, naming the nearest
        names, or saying where ``name`` is another value of the saved object."""
        entry = self._tensor_entry(name)
        if entry.view is not None and entry.shape and self.row_readable(entry):
            # A slice of a flat buffer: only its own elements are decoded, into memory of its own, not the whole
            # base once per view ({k: f[k] for k in f.keys()} over a flat parameter buffer).
            out = self._rows(entry, 0, entry.shape[0])
            _check_elements(entry, out, self.path)
            return out if self._relocate is None else self._relocated({0: out})[0]
        return self._load([entry.tensor_id])[entry.tensor_id]

    def read_box(self, name: str, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        """The n-d box ``[offsets[d], offsets[d] + lengths[d])`` of every dim ``d`` of a stored tensor.

        Decodes only the chunks holding the box's rows of dim 0 (chunks are
        whole rows: nvckpt.plan.chunking).  A row box therefore costs its own
        bytes; a box narrower than the tensor in a later dim (a column box)
        decodes whole rows of its row range and keeps its columns, so it costs
        rows x full row bytes (loading Shard(1) from a Shard(0) save decodes
        every stored row once per reader; ``read_boxes_into`` decodes them once
        for all the boxes it is given).  A view in C order in its base (a
        slice of a flat buffer) and a tensor derived from a stored one read
        their rows the same way; other views are built whole, then cut."""
        entry = self._tensor_entry(name)
        offsets, lengths = _check_box(entry, offsets, lengths, self.path)
        if not entry.shape:
            return self._load([entry.tensor_id])[entry.tensor_id]
        if not self.row_readable(entry):  # e.g. a transposed view: it has no rows of its own to read
            whole = self._load([entry.tensor_id])[entry.tensor_id]
            rows = whole.narrow(0, offsets[0], lengths[0])
        else:
            rows = self._caller_rows(entry, offsets[0], offsets[0] + lengths[0])
        for d in range(1, len(offsets)):
            if lengths[d] != entry.shape[d]:
                rows = rows.narrow(d, offsets[d], lengths[d])
        return rows

    def read_boxes_into(self, boxes: Sequence[tuple[str, Sequence[int], Sequence[int], torch.Tensor]]) -> list[int]:
        """Each box ``(name, offsets, lengths, out)`` of a stored or derived tensor (``read_box``'s) decoded into
        ``out``, a CPU tensor of the box's shape and the tensor's dtype (any strides), with no tensor of the box's
        own in between; returns the positions of the boxes it left to the caller (a view, another dtype or
        device: read those with ``read_box`` and copy).

        All boxes' chunks are decoded in one run on the decode threads, each chunk once: a box spanning the
        tensor's later dims whole (a row box: FSDP's Shard(0)) is decoded straight into ``out`` where it is
        contiguous, a whole tensor with its tensor checksum checked as it is decoded; a narrower box (a
        column strip: Shard(1), a 2-D mesh) is decoded a band of whole rows at a time into a thread's scratch
        and each box that band holds keeps its columns, so several boxes of one tensor decode its rows once.
        A derived tensor's box (bf16 weights of fp32 master weights, SPEC 14.2) is computed into ``out`` from
        the same box of its source where another box decodes that into its own target, else from its source's
        rows decoded a band at a time (a whole source's tensor checksum hashed as its bands go by): no copy
        of the source is held beyond a band."""
        f = self._file
        left: list[int] = []
        whole: dict[int, torch.Tensor] = {}
        tasks: list[tuple[Any, ...]] = []
        strips: dict[int, tuple[TensorEntry, list[tuple[tuple[int, ...], tuple[int, ...], np.ndarray]]]] = {}
        bools: list[tuple[TensorEntry, torch.Tensor]] = []
        targets: dict[tuple[int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}  # boxes decoded into an out
        derived: list[tuple[TensorEntry, TensorEntry, tuple[int, ...], tuple[int, ...], torch.Tensor]] = []
        for k, (name, offsets, lengths, out) in enumerate(boxes):
            entry = f.entry(name)
            offsets, lengths = _check_box(entry, offsets, lengths, self.path)
            source = self._derived_source(entry, lengths, out)
            if source is None and not self._box_direct(entry, lengths, out):
                left.append(k)
                continue
            check_supported(entry, self.path)
            f.check_size(entry, math.prod(lengths) * entry.dtype.itemsize)
            if entry.dtype.name == "bool":
                bools.append((entry, out))
            if out.numel() == 0:
                continue
            if source is not None:
                derived.append((entry, source, offsets, lengths, out))
                continue
            targets.setdefault((entry.tensor_id, offsets, lengths), out)
            if not entry.shape or (tuple(lengths[1:]) == tuple(entry.shape[1:]) and out.is_contiguous()):
                # its elements are one run of memory (a dim of one element may have any stride): that run, flat
                flat = out.new_empty(0).set_(out.untyped_storage(), out.storage_offset(), (out.numel(),), (1,))
                flat = flat.view(torch.uint8)
                if (not entry.shape or lengths[0] == entry.shape[0]) and entry.tensor_id not in whole:
                    whole[entry.tensor_id] = flat
                    continue
                row = entry.nbytes // entry.shape[0]
                tasks += [("rows", *t) for t in f.fill_tasks(entry, offsets[0] * row, (offsets[0] + lengths[0]) * row,
                                                             memoryview(flat.numpy()))]
                continue
            strips.setdefault(entry.tensor_id, (entry, []))[1].append((offsets, lengths, _same_size_ints(out)))
        for entry, held in strips.values():
            tasks += [("band", entry, lo, hi, held) for lo, hi in _bands(entry, held)]
        after: list[tuple[TensorEntry, torch.Tensor, torch.Tensor]] = []  # (derived entry, source box, out)
        from_rows: dict[int, tuple[TensorEntry, list[tuple[tuple[int, ...], tuple[int, ...], Any]]]] = {}
        for entry, source, offsets, lengths, out in derived:
            decoded = targets.get((source.tensor_id, offsets, lengths))
            if decoded is not None:
                after.append((entry, decoded, out))
            elif tuple(lengths) == tuple(source.shape):
                tasks.append(("derive", source, entry, out))  # a whole source: its bands in order, hashed
            else:
                from_rows.setdefault(source.tensor_id, (source, []))[1].append((offsets, lengths, (entry, out)))
        for source, held in from_rows.values():
            tasks += [("derive rows", source, lo, hi, held) for lo, hi in _bands(source, held)]
        if whole:
            tensors = f.index.tensors
            self._host_tensors([tensors[tid] for tid in whole], None, into=whole)
        f.map(self._box_task, tasks)
        if after:  # their sources are decoded (and verified) into their own targets now
            f.map(lambda task: _derive_into(*task), after)
        for entry, out in bools:  # SPEC 10, as _check_bools
            if out.numel() and bool((_same_size_ints(out) > 1).any()):
                raise FormatError("bool tensor holds a byte other than 0 and 1", path=self.path, tensor=entry.name)
        return left

    def _box_direct(self, entry: TensorEntry, lengths: tuple[int, ...], out: torch.Tensor) -> bool:
        """Can ``read_boxes_into`` decode this box of a stored tensor straight into ``out``?"""
        return entry.chunks is not None and self._box_fits(entry, lengths, out)

    def _box_fits(self, entry: TensorEntry, lengths: tuple[int, ...], out: Any) -> bool:
        """Is ``out`` a host tensor that ``read_boxes_into`` can write this box of ``entry`` into, as bits?"""
        return (self.device.type == "cpu" and self._gpu is None and self._relocate is None
                and isinstance(out, torch.Tensor) and out.device.type == "cpu" and tuple(out.shape) == lengths
                and entry.unsupported is None and out.dtype == to_torch(entry.dtype.name)
                and out.element_size() in _INTS and not out.is_conj() and not out.is_neg())

    def _derived_source(self, entry: TensorEntry, lengths: tuple[int, ...], out: Any) -> TensorEntry | None:
        """The stored source of a derived tensor whose box ``read_boxes_into`` computes into ``out`` from the
        same box of the source, else None.  A derived entry with a checksum of its own is left to the caller
        (nvckpt writes none), which checks its elements against it."""
        d = entry.derived
        if d is None or entry.checksum is not None or d.get("function") not in (BF16_RNE, COPY):
            return None
        source = self._file.index.tensors[d["source"]]
        if source.chunks is None or source.unsupported is not None or tuple(source.shape) != tuple(entry.shape):
            return None
        if (source.dtype.name, entry.dtype.name) != (("float32", "bfloat16") if d["function"] == BF16_RNE
                                                      else (entry.dtype.name, entry.dtype.name)):
            return None
        return source if self._box_fits(entry, lengths, out) else None

    def _band(self, entry: TensorEntry, lo: int, hi: int) -> np.ndarray:
        """Raw bytes [lo, hi) of a stored tensor, its chunks holding them read, verified and decoded into this
        thread's band scratch."""
        scratch = _band_scratch(hi - lo)
        f = self._file
        for t in f.fill_tasks(entry, lo, hi, memoryview(scratch)):
            f.fill_task(*t)
        return scratch

    def _box_task(self, task: tuple[Any, ...]) -> None:
        if task[0] == "rows":
            self._file.fill_task(*task[1:])
            return
        if task[0] == "derive":  # a derived tensor whole, from its source's bands in order
            _, source, entry, out = task
            shape = tuple(source.shape)
            row = source.nbytes // shape[0] if shape else source.nbytes
            digest = xxhash.xxh3_64() if source.checksum is not None else None
            for lo, hi in _bands(source, [((0,), shape[:1], None)]) if shape else [(0, 1)]:
                raw = self._band(source, lo * row, hi * row)
                if digest is not None:
                    digest.update(raw)
                rows = torch.from_numpy(raw).view(to_torch(source.dtype.name))
                _derive_into(entry, rows.reshape((hi - lo,) + shape[1:]) if shape else rows.reshape(()),
                             out[lo:hi] if shape else out)
            if digest is not None and digest.intdigest() != source.checksum:
                raise ChecksumError("tensor checksum does not match its decoded bytes", path=self.path,
                                    tensor=source.name)
            return
        kind, entry, lo, hi, held = task
        shape = tuple(entry.shape)
        row = entry.nbytes // shape[0]
        raw = self._band(entry, lo * row, hi * row)
        if kind == "derive rows":  # the source's rows, as values: each box is derived from them
            rows = torch.from_numpy(raw).view(to_torch(entry.dtype.name)).reshape((hi - lo,) + shape[1:])
        else:  # a stored tensor's rows, as bits
            rows = raw.view(_INTS[entry.dtype.itemsize]).reshape((hi - lo,) + shape[1:])
        for offsets, lengths, out in held:
            a, b = max(lo, offsets[0]), min(hi, offsets[0] + lengths[0])
            if a >= b:
                continue
            index = (slice(a - lo, b - lo),) + tuple(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:]))
            if kind == "derive rows":
                derived, target = out
                _derive_into(derived, rows[index], target[a - offsets[0]: b - offsets[0]])
            else:
                out[a - offsets[0]: b - offsets[0]] = rows[index]

    def get_slice(self, name: str) -> "TensorSlice":
        """A lazy handle on tensor ``name``: ``get_slice(name)[a:b]`` reads only the chunks holding rows a..b-1;
        ``get_shape()`` and ``get_dtype()`` read nothing."""
        from .slicing import TensorSlice

        return TensorSlice(self, self._tensor_entry(name))

    def _tensor_entry(self, name: str) -> TensorEntry:
        """``file.entry(name)``; for a path that holds another value, an error that says so."""
        try:
            return self._file.entry(name)
        except TensorNotFoundError as exc:
            path = self._path(name) if isinstance(name, str) else None
            if path is None:
                raise
            node = find_path(self._file.index.tree, path)
            what = (f"a dict of {len(node)} entries" if isinstance(node, dict) else
                    f"a {type(node).__name__} of {len(node)} items" if isinstance(node, (list, tuple)) else
                    f"the {type(node).__name__} {brief(node)}")
            exc.reason = (f"{name!r} holds {what} in the saved object, not a tensor: ck[{name!r}] or "
                          f"nvckpt.load(path, keys={name!r}) reads it")
            raise exc.located() from None

    def _path(self, key: str) -> str | None:
        """The path in the saved object that ``key`` names (itself, or the one path whose dotted name it is)."""
        tree = self._file.index.tree
        try:
            find_path(tree, key)
            return key
        except KeyError:
            if "." not in key:  # no dotted name: nothing more to look for (and no walk of the tree)
                return None
        with self._stats_lock, gc_paused():  # made on the first miss, then kept (not a walk of the tree per miss)
            if self._dotted is None:
                self._dotted = by_dotted_name(value_paths(tree, TensorRef))
        return self._dotted.get(key)

    def _node(self, key: str) -> Any:
        """The tree node a ``load(keys=...)`` key names: a tensor's name, the path of any value in the tree, or
        DCP's dotted name of one of those."""
        index = self._file.index
        if key in index.paths:
            return (ArrayRef if key in index.arrays else TensorRef)(index.paths[key])
        path = self._path(key)
        if path is not None:
            return find_path(index.tree, path)
        try:
            return TensorRef(self._file.entry(key).tensor_id)  # an internal base is reachable by name too
        except TensorNotFoundError:
            names = [*index.paths, *value_paths(index.tree, TensorRef)]
            raise TensorNotFoundError(f"nothing is saved at {key!r}: it is neither a tensor's name (keys()) nor the "
                                      f"path of a value in the saved object{did_you_mean(key, dict.fromkeys(names))}",
                                      path=self.path) from None

    def load(self, keys: Iterable[str] | None = None, *, progress: Callable[[int], None] | None = None) -> Any:
        """The whole saved object; with ``keys``, only part of it, reading only the tensors that part holds.

        ``keys``: one path (a str: "model" gives the model's state_dict, "model/weight" one tensor, "step"
        a scalar) returns the value at that path; a list of paths returns a dict path -> value.  Paths are
        those of ``keys()`` (SPEC 14.1), or of any value in the saved object.
        ``progress(n)`` is called with the raw bytes of the stored tensors as they are decoded."""
        with gc_paused():  # thousands of tensors and containers built, none cyclic (nvckpt._gc)
            return self._load_tree(keys, progress)

    def _load_tree(self, keys: Iterable[str] | None, progress: Callable[[int], None] | None) -> Any:
        index = self._file.index
        if keys is None:
            # Every entry the tree refers to (a reference to an "internal" entry is legal, SPEC 9).
            loaded = self._load({*index.paths.values(), *not_internal(index.tensors)}, progress)
            return resolve_refs(index.tree, loaded.__getitem__, torch_value, as_array)
        one = isinstance(keys, str)
        if not one and not isinstance(keys, Iterable):
            raise TypeError(f"keys must be a str path (such as 'model' or '1') or an iterable of str, got "
                            f"{type(keys).__qualname__} {keys!r}")
        wanted = [keys] if one else list(keys)
        for k in wanted:
            if not isinstance(k, str):
                raise TypeError(f"keys must be a str or an iterable of str, got an item {k!r}")
        nodes = {k: self._node(k) for k in wanted}
        loaded = self._load({r.tensor_id for n in nodes.values() for r in tensor_refs(n)}, progress)
        values = {k: resolve_refs(n, loaded.__getitem__, torch_value, as_array) for k, n in nodes.items()}
        return values[keys] if one else values


__all__ = ["Checkpoint"]
