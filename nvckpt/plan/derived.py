"""Derived tensors (SPEC 14.2): exact functions of another tensor, computed and found with torch.

bf16_rne: a bfloat16 tensor that is round-to-nearest-even of a float32 one,
with the NaN rule of SPEC.md.  Computed in integer arithmetic, so it gives the
same bits on every device and library (torch's own float->bf16 cast differs
between CPU and CUDA for NaN).  copy: a tensor bit for bit equal to another of
the same dtype and shape that is not a view of its storage.

Both are found where the tensors live (torch ops on their device, no copy to the
host): candidates are matched on a fingerprint of their first elements first,
then verified in full.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import numpy.ma  # noqa: F401 - np.unique imports it on first use: here, not in a lazy save's thread (nvckpt._fork)
import torch

from ..format.constants import BF16_RNE, COPY

try:
    from . import _derived as _kernel  # type: ignore[attr-defined]
except ImportError:  # installed without a C compiler: torch ops decide every pair
    _kernel = None
# The batch forms (by address, many pairs a call) where the built kernel has them; one built before them
# decides each pair in a call of its own.
_BATCH = _kernel is not None and hasattr(_kernel, "rne_differs_many") and hasattr(_kernel, "differ_many")

if TYPE_CHECKING:
    from .walk import PlannedTensor

_BLOCK = 1 << 22  # elements per step: bounds the int64 temporaries


def _rne_bits(u: torch.Tensor) -> torch.Tensor:
    """int16 bits of bf16_rne for int32 bits ``u`` of float32 values, in int32 arithmetic: for every
    non-NaN value the upper half plus the carry of rounding the lower half stays within int16."""
    hi = u >> 16  # arithmetic shift: the upper half as a signed 16-bit value
    rounded = hi + (((u & 0xFFFF) + 0x7FFF + (hi & 1)) >> 16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return torch.where(nan, hi | 0x0040, rounded).to(torch.int16)


def _rne_bits_numpy(u: np.ndarray) -> np.ndarray:
    """_rne_bits in numpy, for the little-endian uint32 bits ``u``: little-endian uint16 bits.  The heads'
    rounding runs on the host in an async_save's blocked time: a torch CPU op there may wake torch's
    intra-op thread pool, measured on the H200's host as a 15-20 ms stall in some saves."""
    hi = u >> 16
    rounded = hi + (((u & 0xFFFF) + 0x7FFF + (hi & 1)) >> 16)  # fits 16 bits for every non-NaN value
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, hi | 0x0040, rounded).astype("<u2")


def bf16_rne(source: torch.Tensor) -> torch.Tensor:
    """bfloat16 bits of ``source`` (float32) rounded to nearest even.

    A contiguous host tensor goes through the compiled kernel (``_derived.c``: one pass, the SPEC's
    bits for NaNs too) where it is built.  Otherwise, where torch's own cast is that rounding for every
    non-NaN value (checked once per device, ``_cast_is_rne``) it is used, and only NaNs take the SPEC's
    bits (the cast drops their payload): on a CPU ~10x the speed of the integer arithmetic, which is
    the fallback."""
    if source.dtype != torch.float32:
        raise TypeError(f"bf16_rne needs a float32 source, got {source.dtype}")
    if _kernel is not None and source.device.type == "cpu" and source.is_contiguous() and not source.requires_grad:
        # One pass, GIL released (8x torch's three ops on a CPU, which also wake its intra-op threads).
        out = torch.empty(source.shape, dtype=torch.int16)  # numpy has no bfloat16: the words as int16
        _kernel.rne(source.numpy(), out.numpy())
        return out.view(torch.bfloat16)
    flat = source.reshape(-1)
    if flat.numel() and _cast_is_rne(source.device):
        out = flat.to(torch.bfloat16)
        nan = torch.isnan(flat)
        if source.device.type != "cpu":  # no wait for the device: every element through where()
            quiet = ((flat.view(torch.int32) >> 16) | 0x0040).to(torch.int16)
            out = torch.where(nan, quiet, out.view(torch.int16)).view(torch.bfloat16)
        elif bool(nan.any()):
            out.view(torch.int16)[nan] = _rne_bits(flat.view(torch.int32)[nan])
        return out.reshape(source.shape)
    ints = flat.view(torch.int32)
    out = torch.empty(ints.shape, dtype=torch.int16, device=source.device)
    for start in range(0, ints.numel(), _BLOCK):
        out[start: start + _BLOCK] = _rne_bits(ints[start: start + _BLOCK])
    return out.view(torch.bfloat16).reshape(source.shape)


def bf16_rne_into(source: torch.Tensor, out: torch.Tensor) -> None:
    """``bf16_rne(source)`` written into ``out`` (bfloat16, the source's shape, any strides): a contiguous host
    pair in one pass of the compiled kernel, with no tensor of its own in between."""
    if (_kernel is not None and source.dtype == torch.float32 and source.device.type == "cpu"
            and out.device.type == "cpu" and source.is_contiguous() and out.is_contiguous()
            and not source.requires_grad and not out.requires_grad):
        _kernel.rne(source.numpy(), out.view(torch.int16).numpy())
        return
    out.copy_(bf16_rne(source))


def _any_block(n: int, block: int, device: torch.device, flag: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor: ``flag(start, stop)`` of any block of ``n`` elements (False for none)."""
    flags = [flag(i, i + block) for i in range(0, n, block)]
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=device)
    return flags[0] if len(flags) == 1 else torch.stack(flags).any()


def _differs_from_rne(candidate: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on their device: does bf16 ``candidate`` differ from bf16_rne(``source``)?
    Computed without waiting for the device, so many pairs cost one synchronisation."""
    c, s = candidate.reshape(-1).view(torch.int16), source.reshape(-1).view(torch.int32)
    return _any_block(s.numel(), _BLOCK, s.device, lambda i, j: (_rne_bits(s[i:j]) != c[i:j]).any())


_FAST_BLOCK = 1 << 24  # elements per step of the cast comparison (a bf16 and three bool temporaries)
_CAST_IS_RNE: dict[torch.device, bool] = {}


def _cast_is_rne(device: torch.device) -> bool:
    """Is torch's float32 -> bfloat16 cast SPEC's bf16_rne for every non-NaN value on ``device``?

    Checked once per device on every upper half-word with lower halves at and around the rounding
    points (ties, one above and below, zero, all ones): signs, exponents, denormals, overflow to inf.
    (For NaN it differs: torch's cast drops the payload.)"""
    ok = _CAST_IS_RNE.get(device)
    if ok is None:
        upper = torch.arange(1 << 16, dtype=torch.int64, device=device) << 16
        lower = torch.tensor([0, 1, 0x7FFE, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF], dtype=torch.int64, device=device)
        bits = (upper[:, None] | lower[None, :]).reshape(-1)
        u = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
        f = u.view(torch.float32)
        keep = ~torch.isnan(f)
        ok = _CAST_IS_RNE[device] = torch.equal(f.to(torch.bfloat16).view(torch.int16)[keep], _rne_bits(u)[keep])
    return ok


def _may_differ_from_rne(candidate: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Like _differs_from_rne, in ~5 kernels instead of ~15 when torch's cast is the SPEC rounding here:
    False means equal; True (a difference, or a NaN in the source) needs the exact comparison."""
    if not _cast_is_rne(source.device):
        return _differs_from_rne(candidate, source)
    if source.numel() <= _FAST_BLOCK:  # most tensors: as they are, no reshapes
        return torch.ne(source.to(torch.bfloat16).view(torch.int16), candidate.view(torch.int16)).logical_or_(
            torch.isnan(source)).any()
    c, s = candidate.reshape(-1).view(torch.int16), source.reshape(-1)
    return _any_block(s.numel(), _FAST_BLOCK, s.device, lambda i, j: torch.ne(
        s[i:j].to(torch.bfloat16).view(torch.int16), c[i:j]).logical_or_(torch.isnan(s[i:j])).any())


def is_bf16_rne_of(candidate: torch.Tensor, source: torch.Tensor) -> bool:
    """True when ``candidate`` (bf16) is exactly bf16_rne(``source``) (fp32), bit for bit."""
    if candidate.dtype != torch.bfloat16 or source.dtype != torch.float32 or candidate.shape != source.shape:
        return False
    if candidate.device != source.device:
        return False
    return not bool(_differs_from_rne(candidate, source))


class DerivedSearch:
    """Finding derived tensors in two steps: ``DerivedSearch(...)`` picks the candidates (cheap: one
    host copy of every candidate's first bytes), ``verify()`` compares them in full and marks what is
    derived.  ``undecided``: ids of the tensors whose storage ``verify`` may still change; a read-ahead
    async_save reads every other tensor meanwhile (nvckpt.engines.gpu.encode).

    bf16: a bf16 tensor is stored as bf16_rne of a stored fp32 one of its shape when it is exactly its
    rounding.  Candidates are matched on the rounding of their first 64 elements (computed for all
    tensors of a device at once), so a state with hundreds of same-shaped tensors (biases, norms, Adam
    moments) costs one full comparison per bf16 tensor instead of one per same-shaped pair; the full
    comparisons of all pairs are issued together and read back with one synchronisation per device (a
    per-pair wait costs more than the comparison).

    copies: a tensor is stored as a ``copy`` of an earlier one when their bytes, dtype and shape are
    equal (different storages: tensors of one storage are views already, walk._dedupe).  Tensors of one
    dtype and shape with equal first bytes are compared in rounds: all still undecided ones against their
    class's newest stored tensor at once; the first that differs is stored and is the next round's
    tensor to compare with.  Usually one round.

    hints: (pairs, classes) by tensor id, what an earlier save of the same layout found (plan.layout).
    Those pairs are checked first, and only the bf16 tensors they leave out (or that no longer match
    their hinted source) are searched for, so bf16 roundings are found exactly as without hints; the
    copies are the hinted classes only (a copy that appears later is found by the next full search)."""

    def __init__(self, tensors: list[PlannedTensor], *, bf16: bool, copies: bool,
                 hints: tuple[list[tuple[int, int]], list[list[int]]] | None = None) -> None:
        self.tensors = tensors
        self.pairs: list[tuple[PlannedTensor, PlannedTensor]] = []  # (bf16 candidate, fp32 source), source order
        self.classes: list[list[PlannedTensor]] = []  # possible copies: same dtype, shape, device, first bytes
        self.hinted = hints is not None
        self._hinted_pairs = 0
        if hints is not None:
            pairs, classes = hints
            if bf16:
                self.pairs = [(tensors[c], tensors[s]) for c, s in pairs]
                self._hinted_pairs = len(self.pairs)
                hinted = {c for c, _ in pairs}
                rest = [t for t in tensors if _may_derive(t) and t.entry["dtype"] == "bfloat16" and t.tensor_id not in hinted]
                if rest:
                    self.pairs += self._bf16_search(rest)
            self.classes = [[tensors[i] for i in c] for c in classes] if copies else []
        else:
            # (tensor, dtype name, shape, device) of every stored tensor that may be a source or a candidate:
            # computed once (a state has thousands of tensors; each attribute costs host time).
            stored = _stored(tensors)
            heads = _Heads(stored)
            if bf16:
                self.pairs = _bf16_pairs(stored, heads)
            if copies:
                self._copy_candidates(stored, heads)
        self.undecided = {t.tensor_id for t, _ in self.pairs} | {t.tensor_id for c in self.classes for t in c}

    def _bf16_search(self, candidates: list[PlannedTensor]) -> list[tuple[PlannedTensor, PlannedTensor]]:
        """The pairs of a full search for ``candidates`` only: their heads and those of the fp32 tensors of
        their shapes on their devices are read, no others (none at all where no such fp32 tensor is: a lazy
        save's host copies of small bf16 tensors whose masters stay on the GPU)."""
        keys = {(tuple(t.entry["shape"]), t.data.device) for t in candidates}
        sources = {t.tensor_id for t in self.tensors if _may_derive(t) and t.entry["dtype"] == "float32"
                   and (tuple(t.entry["shape"]), t.data.device) in keys}
        if not sources:
            return []
        wanted = sources | {t.tensor_id for t in candidates}
        stored = _stored([t for t in self.tensors if t.tensor_id in wanted])  # in tensor order, as a full search
        return _bf16_pairs(stored, _Heads(stored))

    def _copy_candidates(self, stored: list[tuple], heads: "_Heads") -> None:
        groups: dict[tuple, list[PlannedTensor]] = {}
        for t, dtype, shape, device in stored:
            groups.setdefault((dtype, shape, device), []).append(t)
        classes: dict[tuple, list[PlannedTensor]] = {}
        for key, g in groups.items():
            if len(g) > 1:
                for t in g:
                    classes.setdefault((key, heads.raw(t)), []).append(t)
        self.classes = [c for c in classes.values() if len(c) > 1]

    def verify(self) -> None:
        """Compare the candidates in full and mark the derived tensors (bf16 roundings, then copies).

        On a GPU the comparisons run on a high-priority stream (after the current stream's work): a
        read-ahead async_save runs them beside the engine's encodes, which would otherwise hold every
        multiprocessor while the comparisons wait behind them."""
        # Only the devices of non-CPU tensors (a torch.device is made per access: ~0.5 us, thousands of pairs)
        devices = ({t.data.device for t, _ in self.pairs if not t.data.is_cpu}
                   | {t.data.device for c in self.classes for t in c if not t.data.is_cpu})
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for device in devices:
                if device.type == "cuda":
                    stream = _priority_stream(device)
                    stream.wait_stream(torch.cuda.current_stream(device))
                    stack.enter_context(torch.cuda.stream(stream))
            if self.pairs:
                self._verify_bf16(self.pairs)
                # A hinted pair that no longer holds: its bf16 tensor is searched for as without hints.
                lost = {id(t): t for t, _ in self.pairs[: self._hinted_pairs] if t.data is not None}
                if lost:
                    tried = {(id(t), id(src)) for t, src in self.pairs}
                    again = [p for p in self._bf16_search(list(lost.values())) if (id(p[0]), id(p[1])) not in tried]
                    if again:
                        self._verify_bf16(again)
            if self.classes:
                self._verify_copies()

    def _verify_bf16(self, pairs: list[tuple[PlannedTensor, PlannedTensor]]) -> None:
        # A flag (a difference, or NaNs, which the cast alone cannot decide) is decided exactly, pair by pair.
        differs = _differing(pairs, _rne_may_differ, lambda p: _differs_from_rne(p[0].data, p[1].data), quick_is_exact=False,
                             size=lambda p: p[1].data.numel(),
                             small=lambda p: p[1].data.numel() <= _GROUP_PAIR and _cast_is_rne(p[1].data.device),
                             host=_rne_differs_on_host, host_many=_rne_differs_on_host_many if _BATCH else None)
        for (t, src), bad in zip(pairs, differs):
            if t.data is not None and not bad:  # verified bit for bit; the first matching source wins
                t.entry["derived"] = {"function": BF16_RNE, "source": src.tensor_id}
                t.data = None
                t.chunks = []

    def _verify_copies(self) -> None:
        sources_of_rne: dict[int, list[PlannedTensor]] = {}
        for t in self.tensors:
            d = t.entry.get("derived")
            if d is not None and d["function"] == BF16_RNE:
                sources_of_rne.setdefault(d["source"], []).append(t)
        classes = [[t for t in c if t.data is not None] for c in self.classes]  # bf16 ones may be derived now
        work = [(c[0], c[1:]) for c in classes if len(c) > 1]  # (stored tensor, undecided after it)
        while work:
            pairs = [(t, rep) for rep, rest in work for t in rest]
            differs = _differing(pairs, _bytes_differ, lambda p: _bytes_differ([p]), quick_is_exact=True,
                                 size=lambda p: p[0].nbytes, small=lambda p: p[0].nbytes <= _GROUP_PAIR,
                                 host=_bytes_differ_on_host, host_many=_bytes_differ_on_host_many if _BATCH else None)
            decided = {id(t): rep for (t, rep), bad in zip(pairs, differs) if not bad}
            next_work = []
            for rep, rest in work:
                left = []
                for t in rest:
                    if id(t) in decided:  # bit for bit, on their device
                        t.entry["derived"] = {"function": COPY, "source": rep.tensor_id}
                        t.data = None
                        t.chunks = []
                        for r in sources_of_rne.pop(t.tensor_id, []):  # a rounding's source must stay stored
                            r.entry["derived"]["source"] = rep.tensor_id
                            sources_of_rne.setdefault(rep.tensor_id, []).append(r)
                    else:
                        left.append(t)
                if len(left) > 1:
                    next_work.append((left[0], left[1:]))
            work = next_work


_STREAMS: dict[torch.device, Any] = {}


def _priority_stream(device: torch.device) -> Any:
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device, priority=-1)  # torch's high priority
    return stream


def _all_on_host(flags: list[torch.Tensor]) -> list[bool]:
    """0-d bool tensors (on any devices) as Python bools, one device-to-host copy per device."""
    out: list[bool] = [False] * len(flags)
    by_device: dict[Any, list[int]] = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([flags[i] for i in idx]).cpu().tolist()):
            out[i] = bool(v)
    return out


_HEAD_BYTES = 64  # raw heads (copies): the first 64 bytes
_HEAD_ELEMENTS = 64  # rounding heads: the first 64 elements


def _first(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` elements of ``t`` in C order, as one view op where ``t`` is contiguous."""
    n = min(n, t.numel())
    return t.as_strided((n,), (1,)) if t.is_contiguous() else t.reshape(-1)[:n]


class _CudaSpan:
    """``size`` bytes of device memory from address ``ptr``, for torch.as_tensor (CUDA Array Interface):
    a view that owns nothing and that nothing reads but the gather of heads below."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "strides": None,
                                         "version": 2}


def _head_addresses(tensors: list[torch.Tensor], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(addresses of the bytes of every tensor's first ``n`` elements in C order, one after the other;
    each tensor's byte count)."""
    starts: list[Any] = []
    lengths: list[Any] = []
    counts = np.empty(len(tensors), dtype=np.int64)
    for k, t in enumerate(tensors):
        m, size, ptr = min(n, t.numel()), t.element_size(), t.data_ptr()
        counts[k] = m * size
        if t.is_contiguous():  # one run of bytes (most tensors)
            starts.append(ptr)
            lengths.append(m * size)
            continue
        # Elements one by one: the offsets of the first m in C order, from the strides.
        index = np.unravel_index(np.arange(m), tuple(t.shape))
        offsets = sum((i * st for i, st in zip(index, t.stride())), np.zeros(m, dtype=np.int64))
        starts.extend((ptr + offsets * size).tolist())
        lengths.extend([size] * m)
    run_starts = np.asarray(starts, dtype=np.int64)
    run_lengths = np.asarray(lengths, dtype=np.int64)
    total = int(run_lengths.sum())
    # Byte j of the output is byte (j - where its run begins in the output) of its run.
    begins = np.cumsum(run_lengths) - run_lengths
    addresses = np.repeat(run_starts - begins, run_lengths) + np.arange(total, dtype=np.int64)
    return addresses, counts


def _gather_heads(tensors: list[torch.Tensor], device: torch.device, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The bytes of every tensor's first ``n`` elements (C order), concatenated, on the host, with the byte
    count of each: one gather and one copy for all of them, by address, instead of a view per tensor (a
    state has thousands of tensors, and each torch call costs microseconds of host time that an
    async_save's caller waits for).  None where the device has no such gather (not CPU or CUDA)."""
    if device.type not in ("cpu", "cuda") or not tensors:
        return None
    addresses, counts = _head_addresses(tensors, n)
    base = int(addresses.min())
    span = int(addresses.max()) - base + 1
    offsets = addresses - base
    try:
        if device.type == "cpu":
            memory = np.frombuffer((ctypes.c_char * span).from_address(base), dtype=np.uint8)
            return memory[offsets], counts
        with torch.cuda.device(device):
            memory = torch.as_tensor(_CudaSpan(base, span), device=device)
        index = torch.from_numpy(offsets).to(device)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return None  # a torch, numpy or ctypes that will not make the span: the views of other devices
    return memory[index].cpu().numpy(), counts


def _may_derive(t: PlannedTensor) -> bool:
    """Is ``t`` a stored tensor that may be a source or a candidate (not a view, an internal base, empty)?"""
    return t.data is not None and not t.entry.get("internal") and t.data.numel() > 0


def _stored(tensors: list[PlannedTensor]) -> list[tuple]:
    """(tensor, dtype name, shape, device) of each stored tensor that may be a source or a candidate."""
    return [(t, t.entry["dtype"], tuple(t.entry["shape"]), t.data.device) for t in tensors if _may_derive(t)]


def _bf16_pairs(stored: list[tuple], heads: "_Heads") -> list[tuple[PlannedTensor, PlannedTensor]]:
    """(bf16 candidate, fp32 source) of ``stored`` whose shapes, devices and rounded first elements agree, in
    candidate order and, per candidate, in source order."""
    candidates = [s for s in stored if s[1] == "bfloat16"]
    shapes = {s[2] for s in candidates}
    sources = [s for s in stored if s[1] == "float32" and s[2] in shapes]  # (an optimizer's step counts: none)
    if not sources or not candidates:
        return []
    index: dict[tuple, list[PlannedTensor]] = {}
    for t, _, shape, device in sources:
        index.setdefault((shape, device, heads.rne(t)), []).append(t)
    return [(t, src) for t, _, shape, device in candidates for src in index.get((shape, device, heads.bits(t)), [])]


class _Heads:
    """The first 64 elements of every tensor, on the host: one gather and one host copy per device (for
    other devices one concatenation and copy per device and dtype), made when first asked for, shared by
    the searches for roundings and for copies; the keys of a whole group (device, dtype) at once.

    ``rne(t)``: the bf16 bits of bf16_rne of a float32 tensor's first 64 elements; ``bits(t)``: a bf16
    tensor's first 64 elements; ``raw(t)``: the first 64 bytes of any tensor."""

    def __init__(self, stored: list[tuple]) -> None:
        self._members: dict[tuple, list[PlannedTensor]] = {}
        self._key: dict[int, tuple] = {}
        for t, dtype, _, device in stored:
            key = self._key[t.tensor_id] = (device, dtype)
            self._members.setdefault(key, []).append(t)
        self._groups: dict[tuple, tuple[np.ndarray, list[int]]] = {}  # head bytes, byte count per member
        self._keys: dict[tuple, dict[int, bytes]] = {}

    def rne(self, t: PlannedTensor) -> bytes:
        return self._lookup("rne", t)

    def bits(self, t: PlannedTensor) -> bytes:
        return self._lookup("bits", t)

    def raw(self, t: PlannedTensor) -> bytes:
        return self._lookup("raw", t)

    def _lookup(self, kind: str, t: PlannedTensor) -> bytes:
        key = self._key[t.tensor_id]
        keys = self._keys.get((kind, key))
        if keys is None:
            keys = self._keys[(kind, key)] = self._make(kind, key)
        return keys[t.tensor_id]

    def _make(self, kind: str, key: tuple) -> dict[int, bytes]:
        if key not in self._groups:
            self._gather(key[0])
        host, counts = self._groups[key]
        members = self._members[key]
        if kind == "rne":  # the rounding of the whole group at once, on the host (a few thousand elements)
            host = _rne_bits_numpy(host.copy().view("<u4")).view(np.uint8)  # a copy: the bytes may sit unaligned
            counts = [n // 2 for n in counts]
            width = None
        else:
            width = max(_HEAD_BYTES, members[0].data.element_size()) if kind == "raw" else None
        return dict(zip((u.tensor_id for u in members), _rows(host, counts, width)))

    def _gather(self, device: torch.device) -> None:
        keys = [k for k in self._members if k[0] == device]
        members = [u for k in keys for u in self._members[k]]
        gathered = _gather_heads([u.data for u in members], device, _HEAD_ELEMENTS)
        if gathered is None:
            for k in keys:
                us = self._members[k]
                flat = torch.cat([_first(u.data, _HEAD_ELEMENTS) for u in us])
                host = (flat if flat.dtype != torch.bool else flat.to(torch.uint8)).cpu().view(torch.uint8).numpy()
                self._groups[k] = (host, [min(u.data.numel(), _HEAD_ELEMENTS) * u.data.element_size() for u in us])
            return
        data, counts = gathered
        at = begin = 0
        for k in keys:  # members are in group order: each group's heads are one slice
            n = len(self._members[k])
            part = counts[at: at + n].tolist()
            end = begin + sum(part)
            self._groups[k] = (data[begin: end], part)
            at, begin = at + n, end


def _rows(data: np.ndarray, counts: list[int], width: int | None) -> list[bytes]:
    """``data`` cut into pieces of ``counts`` bytes, each as bytes (its first ``width`` bytes if given): one
    numpy step per distinct length (most heads have 64 whole elements; an optimizer's step counts one)."""
    sizes = np.asarray(counts, dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    out: list[bytes] = [b""] * len(counts)
    for c in np.unique(sizes).tolist():
        w = c if width is None else min(c, width)
        which = np.flatnonzero(sizes == c)
        if w == 0:
            continue
        rows = data[starts[which, None] + np.arange(w)]
        for k, row in zip(which.tolist(), rows.view(f"V{w}").ravel().tolist()):
            out[k] = row
    return out


Pairs = list[tuple["PlannedTensor", "PlannedTensor"]]


def _differing(pairs: Pairs, quick: Callable[[Pairs], torch.Tensor], exact: Callable[[Any], torch.Tensor], *,
               quick_is_exact: bool, size: Callable[[Any], int], small: Callable[[Any], bool],
               host: Callable[[Any], bool] | None = None,
               host_many: Callable[[Pairs], list[bool]] | None = None) -> list[bool]:
    """Which pairs differ.  ``quick(group)``: a 0-d bool tensor, True when some pair of the group may differ;
    ``exact(pair)``: whether one pair does.  Small pairs (biases, norms, an optimizer's step counts: most of
    a model's tensors) are flagged a group at a time, up to _GROUP_ELEMENTS of ``size`` per group and device:
    a handful of kernels per group instead of several per pair, which in a read-ahead async_save run beside
    the engine's own host work (each kernel launch takes the GIL).  Only the pairs of a flagged group (and a
    flagged pair itself, unless ``quick`` is exact) are then decided one by one.  One synchronisation per
    device and step.  ``host(pair)``: decides a pair of CPU tensors exactly in one compiled pass
    (_derived.c), where it is built; ``host_many(pairs)`` decides C-contiguous ones all in one call."""
    flags: list[torch.Tensor] = []
    members: list[list[int]] = []
    grouped: dict[torch.device, list[int]] = {}
    differs = [False] * len(pairs)
    batch: list[int] = []
    for k, pair in enumerate(pairs):
        if host is not None and _kernel is not None and pair[0].data.is_cpu and pair[1].data.is_cpu:
            if host_many is not None and pair[0].data.is_contiguous() and pair[1].data.is_contiguous():
                batch.append(k)
            else:
                differs[k] = host(pair)
        elif small(pair):
            grouped.setdefault(pair[0].data.device, []).append(k)
        else:
            flags.append(quick([pair]))
            members.append([k])
    if batch:
        for k, d in zip(batch, host_many([pairs[k] for k in batch])):
            differs[k] = d
    for ks in grouped.values():
        for group in _groups(ks, lambda k: size(pairs[k]), _GROUP_ELEMENTS):
            flags.append(quick([pairs[k] for k in group]))
            members.append(group)
    again = []
    for flag, ks in zip(_all_on_host(flags), members):
        if flag and quick_is_exact and len(ks) == 1:
            differs[ks[0]] = True
        elif flag:
            again.extend(ks)
    for k, d in zip(again, _all_on_host([exact(pairs[k]) for k in again])):
        differs[k] = d
    return differs


def _host_words(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A CPU tensor's elements in C order as a numpy array of same-sized integer words (a view where it is
    contiguous)."""
    return t.detach().contiguous().view(dtype).numpy()


def _rne_differs_on_host(pair: tuple[PlannedTensor, PlannedTensor]) -> bool:
    candidate, source = pair
    return _kernel.rne_differs(_host_words(source.data, torch.int32), _host_words(candidate.data, torch.int16))


def _bytes_differ_on_host(pair: tuple[PlannedTensor, PlannedTensor]) -> bool:
    return _kernel.differ(pair[0].flat_bytes().numpy(), pair[1].flat_bytes().numpy())


def _by_address(check: Callable[..., None], rows: list[tuple[torch.Tensor, torch.Tensor, int]]) -> list[bool]:
    """``check(a addresses, b addresses, counts, out)`` (a batch kernel of _derived.c) over C-contiguous host
    tensors (a, b, count): one call for all of them, the tensors held by ``rows`` meanwhile."""
    n = len(rows)
    a = np.fromiter((x.data_ptr() for x, _, _ in rows), dtype=np.uint64, count=n)
    b = np.fromiter((y.data_ptr() for _, y, _ in rows), dtype=np.uint64, count=n)
    counts = np.fromiter((c for _, _, c in rows), dtype=np.uint64, count=n)
    out = np.zeros(n, dtype=np.uint8)
    check(a, b, counts, out)
    return out.astype(bool).tolist()


def _rne_differs_on_host_many(pairs: Pairs) -> list[bool]:
    """_rne_differs_on_host of C-contiguous pairs, in one call (thousands of small pairs: a model's biases and
    norms cost one torch call each instead of eight)."""
    rows = []
    for candidate, source in pairs:
        if candidate.data.numel() != source.data.numel():  # what rne_differs refuses: never a candidate pair
            raise ValueError(f"a source of {source.data.numel()} elements and a candidate of "
                             f"{candidate.data.numel()} do not hold the same number of elements")
        rows.append((source.data, candidate.data, candidate.data.numel()))
    return _by_address(_kernel.rne_differs_many, rows)


def _bytes_differ_on_host_many(pairs: Pairs) -> list[bool]:
    """_bytes_differ_on_host of C-contiguous pairs, in one call; pairs of other lengths differ."""
    sizes = [(a.data.nbytes, b.data.nbytes) for a, b in pairs]
    same = [k for k, (x, y) in enumerate(sizes) if x == y]
    got = _by_address(_kernel.differ_many, [(pairs[k][0].data, pairs[k][1].data, sizes[k][0]) for k in same])
    out = [True] * len(pairs)
    for k, d in zip(same, got):
        out[k] = d
    return out


def _rne_may_differ(group: Pairs) -> torch.Tensor:
    """May a candidate of the group differ from the rounding of its source?  (_may_differ_from_rne, concatenated.)"""
    if len(group) == 1:
        return _may_differ_from_rne(group[0][0].data, group[0][1].data)
    return _may_differ_from_rne(torch.cat([t.data.reshape(-1) for t, _ in group]),
                                torch.cat([src.data.reshape(-1) for _, src in group]))


def _bytes_differ(group: Pairs) -> torch.Tensor:
    """Does any pair of the group (same dtype and shape each) differ in its bytes?  (Concatenated.)"""
    if len(group) == 1:
        return (group[0][1].flat_bytes() != group[0][0].flat_bytes()).any()
    return (torch.cat([t.flat_bytes() for t, _ in group]) != torch.cat([rep.flat_bytes() for _, rep in group])).any()


def _groups(ks: list[int], size: Callable[[int], int], limit: int) -> list[list[int]]:
    """``ks`` cut, in order, into runs whose sizes add up to at most ``limit`` (a larger one alone)."""
    out: list[list[int]] = []
    run, total = [], 0
    for k in ks:
        n = size(k)
        if run and total + n > limit:
            out.append(run)
            run, total = [], 0
        run.append(k)
        total += n
    if run:
        out.append(run)
    return out


_GROUP_PAIR = 1 << 20  # pairs up to this size (elements for roundings, bytes for copies) are grouped, ...
_GROUP_ELEMENTS = 1 << 23  # ... up to this much per group (bounds the temporaries to ~80 MB)


__all__ = ["bf16_rne", "bf16_rne_into", "is_bf16_rne_of", "DerivedSearch"]
