"""nvCOMP's device coders: batched nvCOMP encode and decode of chunks in torch-owned memory.

nvCOMP (``nvidia-nvcomp-cu12``, Python package ``nvidia.nvcomp``, version 6) is
imported lazily, on first use; without it every entry point raises
``UnsupportedCodecError`` naming the package to install.

Two coders run here, both with nvCOMP's RAW bitstream (one chunk = one stream,
no nvCOMP container header):

* ``ans``:  nvCOMP ANS, data-type mode chosen by the element type
  (``<f2`` bf16/fp16, ``<f4`` fp32, ``|f1`` fp8 e4m3, ``|u1`` bytes otherwise).
* ``zstd``: nvCOMP Zstd; RAW frames are standard RFC 8878 frames that any zstd
  library decodes.  For elements of k > 1 bytes the chunk is first split into
  byte planes on the GPU (SPEC.md "byteshuffle": out[j*n + i] = in[i*k + j]).

Memory rules (MEASURED.md, "nvCOMP pitfalls"):

* every buffer nvCOMP reads or writes is a torch tensor: compressed output is
  carved out of one torch buffer (``encode(out=...)``), decoded output goes
  straight into the caller's destination (``decode(out=...)``).  No torch
  tensor ever aliases memory owned by an ``nvcomp.Array``;
* the nvCOMP wrappers (Arrays, BatchArrays) of a batch stay referenced until
  the batch's results were waited for, i.e. until the GPU is done with them;
* nvCOMP runs on the caller's torch stream (``Codec(cuda_stream=...)``), so it
  is ordered with torch's own work on that stream; buffers used by it are
  allocated on that stream;
* nvCOMP does not detect corrupt input: callers verify every chunk's checksum
  before its bytes reach ``decode``;
* ANS encodes go through nvCOMP's C API (``native``) once it was seen to
  write this codec's streams: that call holds no GIL and its compressed sizes
  need no copy back, where the Python API's wait behind the running
  device-to-host copy with the GIL held;
* ANS leaves some bytes of its output unwritten: the output buffer is zeroed;
* a batch is wrapped as ONE buffer plus an offset table (``_Span``), not one
  nvCOMP wrapper per chunk (that costs ~17 us of host time per chunk);
* in a batch every output entry needs the compressed-size bound of the
  batch's largest chunk (nvCOMP raises ValueError otherwise);
* no ``nvcomp.set_device_allocator`` with a Python callable: with one set,
  the process segfaulted at exit (seen once; without it, clean exits).

Measured on one H200 (tools/gpu_probe.py), MiniLM bf16 tiled to 2 GiB, one
call, host overhead and size read-back included: ANS <f2 1 MiB chunks 344 GB/s
encode / 267 GB/s decode (ratio 1.502); 4 MiB chunks 604 / 590 GB/s; batches
of 256 MiB 178 GB/s, of 64 MiB 95 GB/s (about 0.4 ms fixed cost per call).
Zstd RAW after byte-plane split: 6.5 GB/s encode, 26 GB/s decode, ratio 1.446.

A ``GpuCodec`` is not thread-safe (nvCOMP Codec objects hold scratch state):
use one per thread, e.g. through ``codec_for()``.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..._fork import Lock, importing
from ...errors import UnsupportedCodecError
from ..base import DecodeRejected, DeviceOp
from . import native
from .ans import ITEMSIZE
from ...tensors.staging import align_up, packed_offsets, stage_parts

NVCOMP_PACKAGE = "nvidia-nvcomp-cu12"
NVCOMP_MODULE = "nvidia.nvcomp"
MAX_ANS_CHUNK = 16 << 20  # nvCOMP ANS compresses at most 16 MiB per chunk

ALGORITHMS = {"ans": "ANS", "zstd": "Zstd"}

_nv: Any = None


# -- loading -----------------------------------------------------------------
def load_nvcomp() -> Any:
    """The ``nvidia.nvcomp`` module, imported on first use."""
    global _nv
    if _nv is None:
        with importing():  # a fork waits for the import (nvckpt._fork)
            if _nv is None:
                try:
                    import nvidia.nvcomp as nv  # noqa: PLC0415 (lazy on purpose)
                except Exception as exc:  # ImportError, or OSError loading libnvcomp.so
                    raise UnsupportedCodecError(
                        f"nvCOMP is needed for GPU compression but {NVCOMP_MODULE} cannot be imported "
                        f"({type(exc).__name__}: {exc}); install it with `pip install {NVCOMP_PACKAGE}` "
                        "(or `pip install 'nvckpt[gpu]'`)"
                    ) from exc
                major = _major(getattr(nv, "__version__", "0"))
                if major < 6:
                    raise UnsupportedCodecError(
                        f"nvCOMP {nv.__version__} is installed; nvckpt needs nvCOMP 6 or newer "
                        f"(`pip install -U {NVCOMP_PACKAGE}`)"
                    )
                _nv = nv
    return _nv


def available() -> bool:
    """True when a CUDA device and an importable nvCOMP 6 are present."""
    if not torch.cuda.is_available():
        return False
    try:
        load_nvcomp()
    except UnsupportedCodecError:
        return False
    return True


def nvcomp_version() -> str:
    """nvCOMP's version string, e.g. "6.0.0" (what the nvcomp-ans codec records: MAJOR.MINOR.PATCH, SPEC 11.6)."""
    return ".".join(str(load_nvcomp().__version__).split(".")[:3])


def _major(version: str) -> int:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return 0


def check_readable(op: DeviceOp) -> None:
    """Raise UnsupportedCodecError for chunks this nvCOMP cannot decode (ANS of another major version)."""
    if op.algorithm == "ans":
        check_ans_version(op.written_by)


def check_ans_version(written_by: str) -> None:
    """Refuse ANS streams from another nvCOMP major version (the bitstream changed in 6.0)."""
    installed = nvcomp_version()
    if written_by and _major(written_by) != _major(installed):
        raise UnsupportedCodecError(
            f"chunk was coded by nvCOMP {written_by} ANS, but nvCOMP {installed} is installed: "
            f"the ANS bitstream differs between major versions; install {NVCOMP_PACKAGE}=={written_by.split('.')[0]}.*"
        )


# -- GPU byte planes (SPEC.md "byteshuffle") -----------------------------------
def byteshuffle_into(dst: torch.Tensor, src: torch.Tensor, k: int) -> None:
    """dst[j*n + i] = src[i*k + j] for 1-D uint8 tensors of n*k bytes (runs on the current stream)."""
    n = src.numel() // k
    dst.view(k, n).copy_(src.view(n, k).t())


def unshuffle_into(dst: torch.Tensor, src: torch.Tensor, k: int) -> None:
    """Inverse of ``byteshuffle_into``: dst[i*k + j] = src[j*n + i]."""
    n = src.numel() // k
    dst.view(n, k).copy_(src.view(k, n).t())


def _runs(chunks: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Group consecutive chunks that are equal-sized, adjacent in memory and of ONE storage: [(first, count)].

    (Two tensors that torch's allocator placed back to back are adjacent but
    not one storage: a strided view over both would be out of its bounds.)"""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(chunks):
        j = i + 1
        size = chunks[i].numel()
        storage = chunks[i].untyped_storage().data_ptr()
        while (j < len(chunks) and chunks[j].numel() == size
               and chunks[j].data_ptr() == chunks[j - 1].data_ptr() + size
               and chunks[j].untyped_storage().data_ptr() == storage):
            j += 1
        runs.append((i, j - i))
        i = j
    return runs


def _shuffle_batch(dst: torch.Tensor, dst_offsets: list[int], chunks: Sequence[torch.Tensor], k: int,
                   inverse: bool) -> None:
    """Byte-plane split (or its inverse) of every chunk; one kernel per run of uniform chunks.

    Forward: chunks are sources, dst[dst_offsets[i]:] receives planes.  Inverse:
    dst holds planes at dst_offsets, chunks receive the elements.
    """
    for first, count in _runs(chunks):
        size = chunks[first].numel()
        n = size // k
        contiguous_dst = all(dst_offsets[first + c] == dst_offsets[first] + c * size for c in range(count))
        if count > 1 and contiguous_dst:
            base = chunks[first]
            elems = torch.as_strided(base, (count, n, k), (size, k, 1))
            planes = dst[dst_offsets[first]: dst_offsets[first] + count * size].view(count, k, n)
            if inverse:
                elems.copy_(planes.transpose(1, 2))
            else:
                planes.copy_(elems.transpose(1, 2))
            continue
        for c in range(first, first + count):
            part = dst[dst_offsets[c]: dst_offsets[c] + size]
            if inverse:
                unshuffle_into(chunks[c], part, k)
            else:
                byteshuffle_into(part, chunks[c], k)


# -- batches -------------------------------------------------------------------
class _Span:
    """Device bytes [base, end) covering a list of byte ranges, as one buffer for
    ``nvcomp.as_arrays(buffer, offsets, sizes)``.

    One wrapper per batch instead of one per chunk: wrapping each chunk
    separately costs ~17 us of host time per chunk (measured), which capped a
    2 GiB encode of 1 MiB chunks at 58 GB/s.  nvCOMP only touches the
    [offset, offset + size) ranges; ``keep`` (the tensors holding them) is
    referenced here, so their memory outlives the batch (nvCOMP keeps the
    buffer object alive).
    """

    def __init__(self, ptrs: Sequence[int], sizes: Sequence[int], keep: Any) -> None:
        self.keep = keep
        base = min(ptrs)
        end = max(p + n for p, n in zip(ptrs, sizes))
        self.offsets = [p - base for p in ptrs]
        self.sizes = list(sizes)
        self.__cuda_array_interface__ = {
            "shape": (end - base,), "typestr": "|u1", "data": (base, False), "strides": None, "version": 3,
        }

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> "_Span":
        tensors = tuple(tensors)
        return cls([t.data_ptr() for t in tensors], [t.numel() for t in tensors], tensors)


@dataclass
class EncodedBatch:
    """Compressed chunks of one batched encode, in one torch-owned device buffer.

    Chunk i is ``buffer[offsets[i] : offsets[i] + sizes()[i]]``.  ``sizes()``
    waits for the encode (and then drops the nvCOMP wrappers); ``event`` is
    recorded on the codec's stream after the encode, for ordering copies on
    other streams.  Call ``sizes()`` before dropping the batch, and keep it
    until its bytes were copied out.
    """

    buffer: torch.Tensor
    offsets: list[int]
    capacity: int
    raw_lengths: list[int]
    event: torch.cuda.Event
    _result: Any = None
    _keep: tuple = ()
    _sizes: list[int] | None = None
    codec_events: tuple | None = None  # (before, after) the nvCOMP call alone, when the codec times itself

    def sizes(self) -> list[int]:
        if self._sizes is None:
            sizes = [int(s) for s in self._result.buffer_sizes]  # waits for the encode
            self._result, self._keep = None, ()
            if len(sizes) != len(self.offsets) or any(not 0 < n <= self.capacity for n in sizes):
                raise RuntimeError(f"nvCOMP reported impossible compressed sizes for a batch of {len(self.offsets)} chunks")
            self._sizes = sizes
        return self._sizes


# nvCOMP's bound per (algorithm, data type, chunk length), for the whole process: a save runs in a thread
# of its own (async_save), whose codecs are new, and a state of thousands of tensors has as many lengths.
_BOUNDS: dict[tuple[str, str, int], int] = {}


@dataclass
class GpuCodec:
    """One nvCOMP codec (RAW bitstream) bound to a device and a torch stream.

    algorithm: "ans" or "zstd".  data_type: ANS mode (ANS_DATA_TYPES); it is
    the codec's ``data_type`` that selects the mode, not the arrays' dtype
    (measured: uint8 and float16 views give the same stream).  shuffle:
    byte-plane split of elements of this many bytes before zstd (1 = none).
    Not thread-safe.
    """

    algorithm: str
    data_type: str = "|u1"
    shuffle: int = 1
    device: torch.device | None = None
    stream: torch.cuda.Stream | None = None
    timing: bool = False  # record CUDA events around each nvCOMP call (last_codec_events)
    _codec: Any = field(default=None, repr=False)
    _native: Any = field(default=None, repr=False)  # native.NativeAns, False where unavailable, None: not asked yet

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {self.algorithm!r}")
        if self.algorithm == "ans":
            if self.data_type not in ITEMSIZE:
                raise ValueError(f"ANS data_type must be one of {tuple(ITEMSIZE)}, got {self.data_type!r}")
            if self.shuffle != 1:
                raise ValueError("byte-plane split applies to zstd only")
        elif not 1 <= self.shuffle <= 16:
            raise ValueError(f"shuffle element size must be in 1..16, got {self.shuffle}")
        nv = load_nvcomp()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.device is None else torch.device(self.device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.stream is None:
            self.stream = torch.cuda.current_stream(self.device)
        kwargs: dict[str, Any] = {
            "algorithm": ALGORITHMS[self.algorithm],
            "bitstream_kind": nv.BitstreamKind.RAW,
            "device_id": self.device.index,
            "cuda_stream": self.stream.cuda_stream,
        }
        if self.algorithm == "ans":
            kwargs["data_type"] = self.data_type
        self._codec = nv.Codec(**kwargs)
        # nvCOMP's advice: 16 B when in doubt (it reports 16 for ANS, 4/1 for Zstd).
        self.comp_alignment = max(16, int(self._codec.get_required_compression_alignment()))
        self.decomp_alignment = max(16, int(self._codec.get_required_decompression_alignment()))
        self.itemsize = ITEMSIZE[self.data_type] if self.algorithm == "ans" else self.shuffle

    # -- helpers --
    def max_compressed_size(self, raw_length: int) -> int:
        """nvCOMP's bound on one chunk's compressed size.  In a batch, EVERY output
        entry needs the bound of the batch's largest chunk (nvCOMP checks that)."""
        key = (self.algorithm, self.data_type, raw_length)
        bound = _BOUNDS.get(key)
        if bound is None:
            nv = load_nvcomp()
            with torch.cuda.stream(self.stream):
                probe = torch.empty(raw_length, dtype=torch.uint8, device=self.device)
            bound = _BOUNDS[key] = int(self._codec.get_max_comp_buffer_size(nv.as_array(probe, self.stream.cuda_stream)))
        return bound

    def _check_chunks(self, chunks: Sequence[torch.Tensor], what: str) -> None:
        for i, c in enumerate(chunks):
            if c.dtype != torch.uint8 or c.dim() != 1 or not c.is_contiguous() or c.device != self.device:
                raise ValueError(f"{what} {i} must be a contiguous 1-D uint8 tensor on {self.device}")
            if c.numel() == 0:
                raise ValueError(f"{what} {i} is empty")
            if c.numel() % self.itemsize:
                raise ValueError(f"{what} {i}: {c.numel()} bytes is not a multiple of the element size {self.itemsize}")

    def _aligned(self, chunks: Sequence[torch.Tensor], alignment: int) -> list[torch.Tensor]:
        """Chunks whose address nvCOMP accepts; misaligned ones are copied (on the stream)."""
        out = list(chunks)
        bad = [i for i, c in enumerate(out) if c.data_ptr() % alignment]
        if bad:
            with torch.cuda.stream(self.stream):
                staged = stage_parts([(c, 0, c.numel()) for c in out], bad, alignment, self.device)
            for i, (stage, o, n) in zip(bad, staged):
                out[i] = stage[o: o + n]
        return out

    def _batch(self, tensors: Sequence[torch.Tensor]) -> Any:
        return self._arrays(_Span.of(tensors))

    def _arrays(self, span: _Span) -> Any:
        return load_nvcomp().as_arrays(span, span.offsets, span.sizes, self.stream.cuda_stream)

    # -- encode --
    def encode(self, chunks: Sequence[torch.Tensor]) -> EncodedBatch:
        """Encode chunks (1-D uint8 CUDA tensors, each <= 16 MiB) in one batched call.

        The chunks' contents must be ready on ``self.stream`` (make it wait
        for the producer first) and must not change until ``sizes()`` returned.
        Returns at once; ``EncodedBatch.sizes()`` waits.
        """
        if not chunks:
            raise ValueError("nothing to encode")
        self._check_chunks(chunks, "chunk")
        return self.encode_parts([(c, 0, c.numel()) for c in chunks])

    def encode_parts(self, parts: Sequence[tuple[torch.Tensor, int, int]], *, native_api: bool = True) -> EncodedBatch:
        """``encode`` of chunks given as (tensor, start, length): bytes [start, start + length) of a contiguous
        1-D uint8 CUDA tensor.  The engine's form: no tensor view per chunk (each costs microseconds of
        host time, thousands per save), and each tensor is checked once, not once per chunk.  ANS goes
        through nvCOMP's C API where it gives this codec's streams (``native_api=False``: never)."""
        if not parts:
            raise ValueError("nothing to encode")
        nv = load_nvcomp()
        s = self.stream
        known: dict[int, tuple[int, int]] = {}  # id(tensor) -> (address, bytes)
        keep: list[torch.Tensor] = []  # what the chunks are in: alive until the encode is done
        ptrs, raw_lengths = [], []
        for i, (base, start, n) in enumerate(parts):
            got = known.get(id(base))
            if got is None:
                if base.dtype != torch.uint8 or base.dim() != 1 or not base.is_contiguous() or base.device != self.device:
                    raise ValueError(f"the source of chunk {i} must be a contiguous 1-D uint8 tensor on {self.device}")
                got = known[id(base)] = (base.data_ptr(), base.numel())
                keep.append(base)
            if not (n > 0 and 0 <= start and start + n <= got[1]) or n % self.itemsize:
                raise ValueError(f"chunk {i}: bytes [{start}, {start + n}) are not a non-empty range of whole "
                                 f"{self.itemsize}-byte elements within its {got[1]}-byte source")
            ptrs.append(got[0] + start)
            raw_lengths.append(n)
        biggest = max(raw_lengths)
        if self.algorithm == "ans" and biggest > MAX_ANS_CHUNK:
            raise ValueError(f"nvCOMP ANS compresses at most {MAX_ANS_CHUNK} bytes per chunk, got {biggest}")
        a = self.comp_alignment
        cap = align_up(self.max_compressed_size(biggest), a)
        offsets = [i * cap for i in range(len(parts))]
        with torch.cuda.stream(s):
            # Zeroed: nvCOMP ANS leaves a few bytes inside each reported stream length
            # unwritten (measured: 476 bytes over 8 chunks of 1 MiB differed between
            # 0x00- and 0xFF-filled outputs).  Zeroing keeps files deterministic and
            # keeps stale GPU memory out of them; the memset costs ~1 ms per 2 GB.
            out = torch.zeros(cap * len(parts), dtype=torch.uint8, device=self.device)
            if self.algorithm == "zstd" and self.shuffle > 1:
                chunks = [base[start: start + n] for base, start, n in parts]
                planes_offsets, p = packed_offsets(raw_lengths, a)
                planes = torch.empty(p, dtype=torch.uint8, device=self.device)
                _shuffle_batch(planes, planes_offsets, chunks, self.shuffle, inverse=False)
                ptrs = [planes.data_ptr() + o for o in planes_offsets]
                keep.append(planes)
            else:
                bad = [i for i, ptr in enumerate(ptrs) if ptr % a]
                if bad:  # misaligned chunks are copied (on the stream) to where nvCOMP accepts them
                    staged = stage_parts(parts, bad, a, self.device)
                    for i, (stage, o, _) in zip(bad, staged):
                        ptrs[i] = stage.data_ptr() + o
                    keep.append(staged[0][0])
            fast = self._native_ans() if native_api else None
            before = self._mark()
            if fast is not None:  # nvCOMP's C API: the same streams, no GIL held, sizes without a copy
                result: Any = fast.encode(ptrs, raw_lengths, out, cap, tuple(keep))
                wrappers: tuple = ()
            else:
                src = self._arrays(_Span(ptrs, raw_lengths, keep))
                dst = nv.as_arrays(out, offsets, [cap] * len(parts), s.cuda_stream)
                result = self._codec.encode(src, out=dst)
                wrappers = (src, dst)
            after = self._mark()
            event = torch.cuda.Event()
            event.record(s)
        batch = EncodedBatch(out, offsets, cap, raw_lengths, event, result, (*wrappers, keep))
        batch.codec_events = (before, after) if before is not None else None
        return batch

    def _native_ans(self) -> Any:
        """The C-API encoder of this ANS codec (nvckpt.codecs.nvcomp.native), or None: kept per codec once
        checked against this codec's own streams."""
        if self.algorithm != "ans" or not native.ENABLED:
            return None
        if self._native is None and _major(nvcomp_version()) != native.NVCOMP_MAJOR:
            self._native = False  # the C prototypes and type numbers are those of this major version
        if self._native is None:
            def reference(parts: list[tuple[torch.Tensor, int, int]]) -> tuple[list[bytes], int]:
                batch = self.encode_parts(parts, native_api=False)
                return [bytes(batch.buffer[o: o + n].cpu().numpy()) for o, n in zip(batch.offsets, batch.sizes())], batch.capacity

            self._native = native.ans_encoder(self.data_type, self.device, self.stream, reference) or False
        return self._native or None

    def _mark(self) -> Any:
        if not self.timing:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.stream)
        return ev

    # -- decode --
    def decode(self, payloads: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        """Decode compressed chunks into the destinations, whose sizes are the raw lengths.

        ``payloads``: 1-D uint8 CUDA tensors holding the stored bytes, their
        checksums already verified.  ``outs``: 1-D uint8 CUDA views into
        torch-owned memory, exactly the raw length of each chunk.  Both must be
        ready on ``self.stream``.  Blocks until the decode finished (nvCOMP
        reads the stream headers back); the outputs are then valid on the stream.
        Raises DecodeRejected if a chunk decodes to a length other than its destination's.
        """
        if len(payloads) != len(outs):
            raise ValueError("payloads and outs differ in length")
        if not payloads:
            return
        self._check_chunks(outs, "destination")
        for i, p in enumerate(payloads):
            if p.dtype != torch.uint8 or p.dim() != 1 or p.device != self.device or p.numel() == 0:
                raise ValueError(f"payload {i} must be a non-empty 1-D uint8 tensor on {self.device}")
        s = self.stream
        a = self.decomp_alignment
        raw_lengths = [o.numel() for o in outs]
        with torch.cuda.stream(s):
            srcs = self._aligned(payloads, a)
            shuffled = self.algorithm == "zstd" and self.shuffle > 1
            staged: list[tuple[torch.Tensor, torch.Tensor]] = []
            if shuffled:
                offs, p = packed_offsets(raw_lengths, a)
                scratch = torch.empty(p, dtype=torch.uint8, device=self.device)
                targets = [scratch[o: o + n] for o, n in zip(offs, raw_lengths)]
            else:
                targets = self._aligned_outputs(outs, a, staged)
            src = self._batch(srcs)
            dst = self._batch(targets)
            before = self._mark()
            result = self._codec.decode(src, out=dst)
            after = self._mark()
            self.last_codec_events = (before, after) if before is not None else None
            sizes = [int(x) for x in result.buffer_sizes]  # waits for the decode
            del result, src, dst
            for i, (got, want) in enumerate(zip(sizes, raw_lengths)):
                if got != want:
                    raise DecodeRejected(f"chunk {i} of a batch decoded to {got} bytes, expected {want}")
            if shuffled:
                _shuffle_batch(scratch, offs, list(outs), self.shuffle, inverse=True)
            else:
                for o, tmp in staged:
                    o.copy_(tmp)

    def _aligned_outputs(self, outs: Sequence[torch.Tensor], a: int,
                         staged: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        targets = list(outs)
        bad = [i for i, o in enumerate(outs) if o.data_ptr() % a]
        if bad:
            offs, p = packed_offsets((outs[i].numel() for i in bad), a)
            stage = torch.empty(p, dtype=torch.uint8, device=self.device)
            for i, o in zip(bad, offs):
                targets[i] = stage[o: o + outs[i].numel()]
                staged.append((outs[i], targets[i]))
        return targets


# -- codecs: one per thread, kept for the next thread --------------------------------
# Every async_save runs in a thread of its own (so does every load's decode pool), and a warm save's profile
# on the H200 showed ~9 ms creating its codec in that new thread (the first codec of a process took 22 ms, a
# second one in the same thread 0.09 ms): a thread's codecs go back to this pool when the thread ends,
# for the next thread that asks for the same (codec, device, stream).  Work stays ordered: a codec is bound
# to its stream, and the engine's streams are the device's (engines.gpu.backend.device_streams).
_IDLE: dict[tuple, list[GpuCodec]] = {}
_IDLE_LOCK = Lock()  # a forked child gets it unlocked (nvckpt._fork)
_IDLE_KEPT = 8  # idle codecs kept per key (a decode pool has a few threads)
_local = threading.local()


class _ThreadCodecs:
    """The codecs of one thread; they return to ``_IDLE`` when its thread-local storage is freed (the thread ended)."""

    def __init__(self) -> None:
        self.codecs: dict[tuple, GpuCodec] = {}
        weakref.finalize(self, _give_back, self.codecs)


def _give_back(codecs: dict[tuple, GpuCodec]) -> None:
    with _IDLE_LOCK:
        for key, codec in codecs.items():
            idle = _IDLE.setdefault(key, [])
            if len(idle) < _IDLE_KEPT:
                idle.append(codec)
    codecs.clear()


def codec_for(op: DeviceOp, *, device: torch.device, stream: torch.cuda.Stream) -> GpuCodec:
    """This thread's GpuCodec for a pipeline's device op on (device, stream): an idle one that an ended
    thread left, else a new one."""
    check_readable(op)
    key = (op.algorithm, op.data_type, op.shuffle, device.index, stream.cuda_stream)
    mine = getattr(_local, "mine", None)
    if mine is None:
        mine = _local.mine = _ThreadCodecs()
    codec = mine.codecs.get(key)
    if codec is None:
        with _IDLE_LOCK:
            idle = _IDLE.get(key)
            codec = idle.pop() if idle else None
        if codec is None:
            data_type = op.data_type if op.algorithm == "ans" else "|u1"
            codec = GpuCodec(op.algorithm, data_type, op.shuffle, device, stream)
        mine.codecs[key] = codec
    return codec


def release_codecs() -> int:
    """Drop the idle codecs (and whatever nvCOMP keeps for them); returns how many."""
    with _IDLE_LOCK:
        n = sum(len(v) for v in _IDLE.values())
        _IDLE.clear()
    return n


__all__ = [
    "NVCOMP_PACKAGE", "load_nvcomp", "available", "nvcomp_version", "check_ans_version",
    "byteshuffle_into", "unshuffle_into", "EncodedBatch", "GpuCodec", "codec_for", "release_codecs", "DecodeRejected",
]
