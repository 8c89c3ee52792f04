"""The host fast path of the portable codec: one zstd frame per byte plane, coded into and out of
caller memory.

The portable pipelines are ``[signshift(k)?, byteshuffle(k), zstd]`` (SPEC 11).  Their stored bytes
are plain RFC 8878 frames, so any zstd library decodes them; how the writer makes those frames is
its own choice, and this module makes them in the way that wins on model weights:

* the byte planes are cut apart (and, with signshift, the exponent of a bfloat16 / float32 becomes
  one byte) straight from the tensor's memory into a per-thread scratch buffer;
* each plane is its own zstd frame (SPEC 11.4 allows one or more frames per chunk).  A plane is
  coded as **literals only** (one Huffman-coded literals block per 128 KiB, no match search): byte
  planes of weights have almost no long repeats, so libzstd's match finder costs time and, on the
  exponent plane, ratio (1.471 vs 1.505 on MiniLM bf16).  libzstd stores a block raw where Huffman
  does not gain 1/64 (the random low mantissa planes), which also makes them decode at memcpy
  speed.  A plane that literals shrink below a quarter (zeros; a float's top plane of more than
  16 KiB: below an eighth, near-constant exponents), and a lower plane with runs (more than 1 in
  50 bytes equal to the one before: fp32 weights whose low bytes are zero), is also tried with zstd level 1's match finder, and the
  smaller frame is kept;
  so is every plane of an integer or bool tensor (a counter, text, a mask: repeats that literals
  miss), and every plane at a ``zstd_level`` other than 1 (coded by libzstd at that level);
* decoding writes the planes into a per-thread scratch buffer (or, for a pipeline without filters,
  straight into the destination) and puts the elements back into the destination tensor.

Literal-only frames need libzstd's sequence API (``ZSTD_compressSequences``), which python-zstandard
exposes through its CFFI backend (``zstandard._cffi``, needs the ``cffi`` package).  Without it the
planes are coded with python-zstandard's public API (level 1, no match below 7 bytes): still one
valid frame per plane, ratio ~1.5 % lower, and different bytes, so two writers make the same file
only with the same backend and libzstd version (``backend()`` says which; the GPU engine encodes
portable chunks with this very code, so a machine writes one file whichever engine saves).

Cutting the planes apart and putting them back is done by a small compiled kernel
(``_planes.c``, built at install where a C compiler is found: one GIL-free pass per chunk) or,
without it, by numpy in the same steps (the same bytes, 2.5-3.5x slower); ``kernel()`` says which.
Every function here releases the GIL inside libzstd and the kernel, so the CPU engine runs one
chunk per core.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .._fork import importing, module
from .builtin import MAX_ZSTD_WINDOW, check_zstd_window, shift_planes

try:
    from . import _planes as _kernel  # type: ignore[attr-defined]
except ImportError:  # installed without a C compiler: the numpy steps below
    _kernel = None

BLOCK = 128 << 10  # zstd's largest block (ZSTD_BLOCKSIZE_MAX)
_LZ_BELOW = 4  # also try matches when literals alone shrink a plane below 1/4 ...
# ... except a float's top plane (its exponent), which must shrink below 1/8 unless it is small: in the
# 1/8-1/4 band (Adam's second moments) matches took 7.8 ms of 10.7 on a training state's 45 MB and won
# 25 KB of its 40.6 MB file (0.06 %), where the lower planes' runs won 210 KB; below 1/8 (near-constant
# exponents) and on small planes (norm weights) they are cheap and can halve the plane.
_LZ_TOP_BELOW = 8
_LZ_SMALL = 16 << 10
# ... and on a plane below the top one where more than 1 in 50 bytes repeats the one before (5x what
# random bytes do): on MiniLM fp32 that is 4 % of the low planes' bytes and every plane where matches
# win (-77 KB, 0.1 % of the file); on bf16 none.  The top plane (the exponent) repeats by its skew alone.
_RUNS_ABOVE = 50
_LIT_ENABLE = 1  # ZSTD_ps_enable
_EXPLICIT_DELIMITERS = 1  # ZSTD_sf_explicitBlockDelimiters

_native: Any = None


def _load_native() -> Any:
    """(ffi, lib) of python-zstandard's CFFI backend, or False where it cannot be loaded."""
    global _native
    if _native is None:
        with importing():  # in the engine's threads: a fork waits for the import (nvckpt._fork)
            if _native is None:
                try:
                    from zstandard._cffi import ffi, lib  # noqa: PLC0415 (needs the cffi package)

                    for name in ("ZSTD_compressSequences", "ZSTD_decompressDCtx", "ZSTD_CCtx_setParameter",
                                 "ZSTD_compress2", "ZSTD_compressBound", "ZSTD_isError",
                                 "ZSTD_findFrameCompressedSize", "ZSTD_getFrameHeader"):
                        getattr(lib, name)
                    ffi.sizeof("ZSTD_FrameHeader")
                    lib.ZSTD_c_blockDelimiters  # noqa: B018 (present since libzstd 1.5.0)
                    _native = (ffi, lib)
                except Exception:  # ImportError (no cffi), AttributeError (an old libzstd)
                    _native = False
    return _native


def backend() -> str:
    """How this process codes the portable planes: "libzstd-sequences" or "zstandard-level1"."""
    return "libzstd-sequences" if _load_native() else "zstandard-level1"


def kernel() -> str:
    """What cuts and joins the byte planes in this process: "c" (the compiled kernel) or "numpy"."""
    return "numpy" if _kernel is None else "c"


def libzstd_version() -> str:
    return ".".join(map(str, module("zstandard").ZSTD_VERSION))


class _Contexts(threading.local):
    """Per-thread libzstd contexts and scratch buffers (libzstd contexts are not thread-safe)."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}
        self.cctx_lit = self.dctx = None
        self.cctx_lz: dict[int, Any] = {}  # a match-finding context per zstd level
        self.seqs = None
        self.nseqs = 0
        self.public_d = None
        self.public_c: dict[int, Any] = {}  # python-zstandard's compressor per zstd level
        self.frame_header = None

    def buffer(self, name: str, n: int) -> np.ndarray:
        buf = self.buffers.get(name)
        if buf is None or buf.nbytes < n + 64:
            # +64: libzstd may read a few bytes past the literals it is given
            buf = self.buffers[name] = np.empty(max(n, 1 << 20) + 64, dtype=np.uint8)
        return buf


_tls = _Contexts()


def _check(lib: Any, ffi: Any, r: int, what: str) -> int:
    if lib.ZSTD_isError(r):
        raise ValueError(f"zstd {what}: {ffi.string(lib.ZSTD_getErrorName(r)).decode()}")
    return r


def _cctx_literals(ffi: Any, lib: Any) -> Any:
    c = _tls.cctx_lit
    if c is None:
        c = ffi.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
        for param, value in ((lib.ZSTD_c_compressionLevel, 1), (lib.ZSTD_c_blockDelimiters, _EXPLICIT_DELIMITERS),
                             (lib.ZSTD_c_contentSizeFlag, 1), (lib.ZSTD_c_checksumFlag, 0),
                             (lib.ZSTD_c_dictIDFlag, 0), (lib.ZSTD_c_literalCompressionMode, _LIT_ENABLE)):
            _check(lib, ffi, lib.ZSTD_CCtx_setParameter(c, param, value), "parameter")
        _tls.cctx_lit = c
    return c


def _cctx_matches(ffi: Any, lib: Any, level: int) -> Any:
    c = _tls.cctx_lz.get(level)
    if c is None:
        c = ffi.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
        for param, value in ((lib.ZSTD_c_compressionLevel, level), (lib.ZSTD_c_contentSizeFlag, 1),
                             (lib.ZSTD_c_checksumFlag, 0), (lib.ZSTD_c_dictIDFlag, 0)):
            _check(lib, ffi, lib.ZSTD_CCtx_setParameter(c, param, value), "parameter")
        _tls.cctx_lz[level] = c
    return c


def _sequences(ffi: Any, n: int) -> Any:
    """A ZSTD_Sequence array of ``n`` block delimiters (litLength set by the caller)."""
    if _tls.nseqs < n:
        _tls.seqs = ffi.new("ZSTD_Sequence[]", max(n, 16))
        _tls.nseqs = max(n, 16)
    return _tls.seqs


def repeats(plane: Any) -> int:
    """How many bytes of ``plane`` (a contiguous buffer) equal the byte before them."""
    counter = getattr(_kernel, "repeats", None)  # None also for a kernel built before it had repeats()
    if counter is not None:
        return counter(plane)
    data = np.frombuffer(memoryview(plane).cast("B"), dtype=np.uint8)  # bytes, whatever the element type
    return int(np.count_nonzero(data[1:] == data[:-1]))


def _runs(plane: np.ndarray) -> bool:
    """True where a low byte plane repeats its bytes far more often than random bytes do (1 in 256):
    runs that literals cannot code but matches can (MiniLM's fp32 weights: rows whose low bytes are
    zero; the Adam moments of a short run)."""
    return repeats(plane) * _RUNS_ABOVE > plane.nbytes


def _lz_below(j: int, k: int, m: int) -> int:
    """Matches are tried on plane ``j`` of ``k`` (``m`` bytes) where literals shrink it below 1/this."""
    return _LZ_TOP_BELOW if k > 1 and j == k - 1 and m > _LZ_SMALL else _LZ_BELOW


def plane_bound(m: int) -> int:
    """Bytes a plane of ``m`` bytes may take coded (libzstd's bound; at least one empty frame)."""
    return m + (m >> 8) + 64 + 3 * (m // BLOCK + 1)


def _frame_literals(ffi: Any, lib: Any, src: Any, m: int, dst: Any, cap: int) -> int:
    nblocks = max(1, -(-m // BLOCK))
    seqs = _sequences(ffi, nblocks)
    for i in range(nblocks):
        s = seqs[i]
        s.offset = s.matchLength = s.rep = 0
        s.litLength = min(BLOCK, m - i * BLOCK)
    return _check(lib, ffi, lib.ZSTD_compressSequences(_cctx_literals(ffi, lib), dst, cap, seqs, nblocks, src, m),
                  "compressSequences")


def encode_planes(planes: np.ndarray, k: int, out: np.ndarray, level: int = 1, matches: bool = False) -> int:
    """Code ``planes`` (k planes of n/k bytes, contiguous) as one zstd frame per plane into ``out``
    (at least ``k * plane_bound(n/k)`` bytes); returns the bytes written.  At the default ``level`` 1 a plane
    is literals only unless they shrink it below a quarter (the top plane of more than 16 KiB: an eighth),
    or it is a plane below the top one with runs
    (then level 1's matches are tried too); at any
    other level asked for, or with ``matches`` (integers, bytes), the plane is also coded by libzstd at that
    level, and the smaller frame is kept."""
    n = planes.nbytes
    m = n // k
    native = _load_native()
    at = 0
    if native:
        ffi, lib = native
        src_all = ffi.from_buffer("char[]", planes)
        dst_all = ffi.from_buffer("char[]", out, require_writable=True)
        for j in range(k):
            src = src_all + j * m
            dst = dst_all + at
            cap = out.nbytes - at
            size = _frame_literals(ffi, lib, src, m, dst, cap)
            if matches or level != 1 or size * _lz_below(j, k, m) < m or (j < k - 1 and _runs(planes[j * m: (j + 1) * m])):
                scratch = _tls.buffer("lz", plane_bound(m))
                alt = _check(lib, ffi, lib.ZSTD_compress2(_cctx_matches(ffi, lib, level), ffi.from_buffer("char[]", scratch, require_writable=True),
                                                          scratch.nbytes, src, m), "compress2")
                if alt < size:
                    out[at: at + alt] = scratch[:alt]
                    size = alt
            at += size
        return at
    zstandard = module("zstandard")
    c = _tls.public_c.get(level)
    if c is None:
        tuned = {"min_match": 7, "hash_log": 6} if level == 1 else {}  # level 1's parameters for byte planes
        params = zstandard.ZstdCompressionParameters.from_level(level, write_content_size=1, write_checksum=0,
                                                                 write_dict_id=0, **tuned)
        c = _tls.public_c[level] = zstandard.ZstdCompressor(compression_params=params)
    for j in range(k):
        frame = c.compress(planes[j * m: (j + 1) * m])
        out[at: at + len(frame)] = np.frombuffer(frame, dtype=np.uint8)
        at += len(frame)
    return at


#: The kernel's walk of a chunk's zstd frames (None for a kernel built before it had one: libzstd's, below).
_frames = getattr(_kernel, "zstd_frames", None)


def _check_windows(ffi: Any, lib: Any, src: Any, n: int) -> None:
    """``check_zstd_window`` in libzstd: the frames' headers and block headers are walked in C
    (``ZSTD_findFrameCompressedSize``), with the GIL released, instead of in Python."""
    header = _tls.frame_header
    if header is None:
        header = _tls.frame_header = ffi.new("ZSTD_FrameHeader *")
    pos = frames = 0
    while pos < n:
        size = lib.ZSTD_findFrameCompressedSize(src + pos, n - pos)
        if lib.ZSTD_isError(size):
            raise ValueError(f"zstd: no whole frame at byte {pos}: {ffi.string(lib.ZSTD_getErrorName(size)).decode()}")
        if lib.ZSTD_getFrameHeader(header, src + pos, size) != 0:  # an error, or a header cut short
            raise ValueError(f"zstd: invalid frame header at byte {pos}")
        if header.frameType == lib.ZSTD_frame:
            frames += 1
            if header.windowSize > MAX_ZSTD_WINDOW:
                raise ValueError(f"zstd frame needs a window of {header.windowSize} bytes, more than the limit of "
                                 f"{MAX_ZSTD_WINDOW} (SPEC 11.4)")
        pos += size
    if not frames:
        raise ValueError("zstd: the chunk holds no zstd frame")


def decode_frames(data: Any, out: np.ndarray) -> None:
    """Decode the zstd frames of one chunk into ``out`` (its raw length), checking SPEC 11.4's window
    bound first; raises ValueError when the frames are invalid or do not decode to exactly ``out``."""
    n = out.nbytes
    native = _load_native()
    if native:
        ffi, lib = native
        d = _tls.dctx
        if d is None:
            d = _tls.dctx = ffi.gc(lib.ZSTD_createDCtx(), lib.ZSTD_freeDCtx)
        src = ffi.from_buffer("char[]", data)
        if _frames is not None:
            _frames(data, MAX_ZSTD_WINDOW)
        else:
            _check_windows(ffi, lib, src, len(src))
        # One call decodes every frame (skippable ones too) and never writes past ``n`` bytes (SPEC 11.7).
        got = lib.ZSTD_decompressDCtx(d, ffi.from_buffer("char[]", out, require_writable=True), n, src, len(src))
        if lib.ZSTD_isError(got):
            name = ffi.string(lib.ZSTD_getErrorName(got)).decode()
            if "Destination buffer is too small" in name:
                raise ValueError(f"zstd data decodes to more than {n} bytes")
            raise ValueError(f"zstd: {name}")
        if got != n:
            raise ValueError(f"zstd data decodes to {got} bytes, expected {n}")
        return
    from .builtin import Zstd

    check_zstd_window(data)
    out[:] = np.frombuffer(Zstd().decode(memoryview(data), n), dtype=np.uint8)


# -- planes <-> elements -----------------------------------------------------------------------
# Elements of 2 and 4 bytes are moved with whole-word shifts (numpy runs them with SIMD): 2-5x the
# speed of one strided byte copy per plane.  The signshift arithmetic, per element with h the top
# byte and l the one below it (SPEC 11.9):  h' = (h << 1 | l >> 7) & 0xFF, l' = (h & 0x80) | (l & 0x7F);
# on the top 16 bits t = h << 8 | l that is  h' = (t >> 7) & 0xFF,  l' = ((t >> 8) & 0x80) | (t & 0x7F),
# and back  t = (h' << 7) | ((l' * 0x101) & 0x807F).
#: Bytes per pass: the word-wide steps run on blocks whose words and temporaries stay in the core's
#: L2 cache (1.7x the speed of whole-chunk passes that go to memory and back for every step).  512 KiB
#: (a 1 MiB chunk in two or four passes) measured best on two cores of a shared VM: joining 45 MB of bf16
#: planes took 12.3 ms (one thread) / 8.3 ms (two) against 15.2 / 11.0 with 256 KiB blocks and Python int
#: constants (fewer numpy calls per chunk: each takes the GIL to start and to end, and two threads queue).
_BLOCK_BYTES = 512 << 10
# The constants as numpy scalars of the word type: a Python int costs numpy a type resolution per call,
# with the GIL held.
_CONSTANTS = {k: {v: wt(v) for v in (0, 7, 8, 16, 23, 24, 0x80, 0x7F, 0x101, 0x807F)}
              for k, wt in ((2, np.uint16), (4, np.uint32))}


def _temp(name: str, dtype: Any, n: int) -> np.ndarray:
    return _tls.buffer(name, n * np.dtype(dtype).itemsize)[: n * np.dtype(dtype).itemsize].view(dtype)


def split(raw: np.ndarray, k: int, signshift: bool, planes: np.ndarray) -> None:
    """Byte planes of ``raw`` (n bytes, elements of k bytes) into ``planes`` (n bytes): plane j holds
    byte j of every element; with ``signshift``, planes k-1 and k-2 hold the shifted top bytes."""
    if _kernel is not None:
        _kernel.split(raw, planes, k, signshift)
        return
    split_numpy(raw, k, signshift, planes)


def join(planes: np.ndarray, k: int, signshift: bool, out: np.ndarray) -> None:
    """Inverse of ``split``: elements into ``out`` from ``planes`` (which it may change)."""
    if _kernel is not None:
        _kernel.join(planes[: out.nbytes], out, k, signshift)
        return
    join_numpy(planes, k, signshift, out)


def split_numpy(raw: np.ndarray, k: int, signshift: bool, planes: np.ndarray) -> None:
    """``split`` in numpy (where the kernel is not built, and the reference the tests compare it with)."""
    n = raw.nbytes
    m = n // k
    view = planes[:n].reshape(k, m)
    if k in (2, 4) and np.little_endian:
        wt = np.uint16 if k == 2 else np.uint32
        c = _CONSTANTS[k]
        words = raw.view(wt)
        top = 8 * k - 16  # shift of the top 16 bits
        step = _BLOCK_BYTES // k
        for s in range(0, m, step):
            w, e = words[s: s + step], min(m, s + step)
            t = _temp("t", wt, e - s)
            for j in range(k - 2 if signshift else k):
                np.right_shift(w, c[8 * j], out=t)
                np.copyto(view[j, s:e], t, casting="unsafe")
            if signshift:
                np.right_shift(w, c[top + 7], out=t)
                np.copyto(view[k - 1, s:e], t, casting="unsafe")  # h' = t >> 7 (the cast keeps 8 bits)
                u = _temp("u", wt, e - s)
                np.right_shift(w, c[top + 8], out=t)
                np.bitwise_and(t, c[0x80], out=t)
                np.right_shift(w, c[top], out=u)
                np.bitwise_and(u, c[0x7F], out=u)
                np.bitwise_or(t, u, out=t)
                np.copyto(view[k - 2, s:e], t, casting="unsafe")
        return
    elements = raw.reshape(m, k)
    for j in range(k):
        view[j] = elements[:, j]
    if signshift:
        shift_planes(view[k - 1], view[k - 2], inverse=False)


def join_numpy(planes: np.ndarray, k: int, signshift: bool, out: np.ndarray) -> None:
    """``join`` in numpy (changes ``planes`` when ``signshift``)."""
    n = out.nbytes
    m = n // k
    view = planes[:n].reshape(k, m)
    if k in (2, 4) and np.little_endian:
        wt = np.uint16 if k == 2 else np.uint32
        c = _CONSTANTS[k]
        step = _BLOCK_BYTES // k
        for s in range(0, m, step):
            words, e = out.view(wt)[s: s + step], min(m, s + step)
            if signshift:  # the top 16 bits: (h' << 7) | ((l' * 0x101) & 0x807F)
                t = _temp("t", wt, e - s)
                np.left_shift(view[k - 1, s:e], c[7], out=words, dtype=wt)
                np.multiply(view[k - 2, s:e], c[0x101], out=t, dtype=wt)
                np.bitwise_and(t, c[0x807F], out=t)
                np.bitwise_or(words, t, out=words)
                rest = k - 2
            else:
                np.copyto(words, view[k - 1, s:e], casting="unsafe")
                rest = k - 1
            for j in range(rest - 1, -1, -1):
                np.left_shift(words, c[8], out=words)
                np.bitwise_or(words, view[j, s:e], out=words, dtype=wt)
        return
    if signshift:
        shift_planes(view[k - 1], view[k - 2], inverse=True)
    elements = out.reshape(m, k)
    for j in range(k):
        elements[:, j] = view[j]


# -- whole chunks -----------------------------------------------------------------------------
def planar_form(pipeline: Any) -> tuple[int, bool] | None:
    """(k, signshift) when ``pipeline`` is [signshift(k)?, byteshuffle(k)?, zstd] (k = 1 without
    byteshuffle), the pipelines this module codes; else None."""
    steps = pipeline.steps
    if not steps or steps[-1].name != "zstd":
        return None
    names = [s.name for s in steps[:-1]]
    if names == []:
        return 1, False
    if names == ["byteshuffle"]:
        return steps[0].elementsize, False
    if names == ["signshift", "byteshuffle"] and steps[0].elementsize == steps[1].elementsize:
        return steps[1].elementsize, True
    return None


def encode_chunk(raw: Any, k: int, signshift: bool, out: np.ndarray, level: int = 1, matches: bool = False) -> int:
    """A chunk's raw bytes -> its stored bytes in ``out`` (at least ``chunk_bound(len, k)``); returns the length."""
    src = np.frombuffer(raw, dtype=np.uint8)
    n = src.nbytes
    if k == 1:
        return encode_planes(src, 1, out, level, matches)
    planes = _tls.buffer("planes", n)[:n]
    split(src, k, signshift, planes)
    return encode_planes(planes, k, out, level, matches)


def chunk_bound(n: int, k: int) -> int:
    return k * plane_bound(n // max(k, 1))


def decode_chunk(data: Any, k: int, signshift: bool, out: np.ndarray) -> None:
    """Stored bytes -> raw bytes written into ``out`` (exactly the chunk's raw length)."""
    n = out.nbytes
    if k == 1:
        decode_frames(data, out)
        return
    if n % k:
        raise ValueError(f"byteshuffle: {n} bytes is not a multiple of elementsize {k}")
    planes = _tls.buffer("planes", n)[:n]
    decode_frames(data, planes)
    join(planes, k, signshift, out)


__all__ = ["planar_form", "backend", "kernel", "libzstd_version", "encode_chunk", "decode_chunk", "chunk_bound", "split", "join",
           "repeats",
           "encode_planes", "decode_frames", "MAX_ZSTD_WINDOW"]
