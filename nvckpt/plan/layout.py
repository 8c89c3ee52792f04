"""What planning learned about one layout of a state, reused by the next save of the same layout.

A training loop saves the same tensors again and again: the same names, dtypes, shapes and storage
sharing, new values.  The entries, the shared-storage groups and the chunks follow from that layout alone, so a
save whose leaves match an earlier save's (``fingerprint``) takes them from it instead of working them
out again; and the derived tensors the earlier save found (bf16 roundings, copies) are checked first,
in full as always, instead of a search that reads every tensor's first bytes.  bf16 roundings are still
found exactly: only the bf16 tensors the hints leave out, or whose hinted source no longer matches, are
searched for.  Copies are the hinted ones: one that no longer holds is stored as it is and the next save
of that layout searches again, as does every ``SEARCH_EVERY``-th save (a copy that appears later is found
then).  Nothing here holds a tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from .._fork import Lock
from ..format.constants import BF16_RNE
from ..format.dtypes import DTYPES
from .chunking import ChunkPolicy, checked_ranges

KEPT = 4  # layouts remembered (a process saves one or two states: the model, the training state)
SEARCH_EVERY = 8  # a save of a known layout still searches for derived tensors once in this many

_layouts: OrderedDict[tuple, "Layout"] = OrderedDict()
_lock = Lock()  # a forked child gets it unlocked (nvckpt._fork)

Leaves = list[tuple[str, torch.Tensor, tuple[str, int]]]
Hints = tuple[list[tuple[int, int]], list[list[int]]]


def storage_start(t: torch.Tensor, size: int) -> tuple[int, int]:
    """(device index, address where the storage of ``t`` begins; ``size``: its element size): what tells leaves
    of one storage apart from others (walk._dedupe groups by it), without making a storage object."""
    return t.get_device(), t.data_ptr() - t.storage_offset() * size


def fingerprint(leaves: Leaves) -> tuple | None:
    """Everything the entries, the shared-storage groups and the chunks depend on, per leaf in tree order:
    its path, dtype, shape, strides, offset, device, storage size, and which earlier leaf (if any) starts
    at the same storage address (walk._dedupe's groups) -- not the address itself, so that a state whose
    tensors moved (a lazy save's fresh copies of small tensors, a model built again) is the same layout.
    None where a tensor will not say (a subclass without storage): such a state is planned afresh."""
    first: dict[tuple, int] = {}
    out = []
    try:
        for i, (path, t, (_, size)) in enumerate(leaves):
            start = storage_start(t, size)
            group = first.setdefault(start, i) if t.numel() else i
            out.append((path, t.dtype, t.shape, t.stride(), t.storage_offset(), start[0], t.untyped_storage().nbytes(),
                        group))
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None
    return tuple(out)


def known(key: tuple) -> "Layout | None":
    if key[-1] is None:
        return None
    with _lock:
        layout = _layouts.get(key)
        if layout is not None:
            _layouts.move_to_end(key)
        return layout


def forget() -> None:
    """Drop every remembered layout (tests; a process that wants each save planned from scratch)."""
    with _lock:
        _layouts.clear()


class Layout:
    """The plan of one layout: entries as _dedupe made them (before any derived-tensor decision), where
    each entry's data comes from, the leaves' tensor ids, the chunks per chunk size, the derived tensors
    last found."""

    def __init__(self, key: tuple, tensors: list[Any], leaf_ids: list[int], sources: list[Any]) -> None:
        self.entries = [_copy_entry(t.entry) for t in tensors]
        self.sources = sources
        self.leaf_ids = leaf_ids
        self._cut: tuple[ChunkPolicy, list[list[tuple[int, int]]]] | None = None  # (policy, each entry's chunks)
        self._hints: Hints | None = None
        self._since_search = 0
        self.copies = bool(key[1])
        if key[-1] is not None:
            with _lock:
                _layouts[key] = self
                while len(_layouts) > KEPT:
                    _layouts.popitem(last=False)

    def instantiate(self, leaves: Leaves) -> tuple[list[Any], list[int]]:
        """The planned tensors of ``leaves`` (a state of this layout): fresh entries, the leaves' tensors."""
        from .walk import PlannedTensor

        tensors = []
        for tid, (entry, source) in enumerate(zip(self.entries, self.sources)):
            if source is None:
                data = None
            elif type(source) is int:
                data = leaves[source][1]
            else:  # a base: the spanned elements of the largest storage (walk._dedupe)
                owner, length, offset = source
                data = leaves[owner][1].as_strided((length,), (1,), offset)
            tensors.append(PlannedTensor(tid, _copy_entry(entry), data))
        return tensors, self.leaf_ids

    def cut(self, tensors: list[Any], policy: ChunkPolicy) -> None:
        """Cut every stored tensor's chunks (the lists are shared between saves: nothing changes one)."""
        cut = self._cut  # (policy, chunks), replaced whole: two saves of this layout may cut at once
        if cut is None or cut[0] != policy:
            cut = self._cut = (policy, [checked_ranges(policy, tuple(e["shape"]), DTYPES[e["dtype"]].itemsize)
                                        if s is not None else [] for e, s in zip(self.entries, self.sources)])
        for t, chunks in zip(tensors, cut[1]):
            if t.data is not None:
                t.chunks = chunks

    def hints(self) -> Hints | None:
        """The derived tensors to check first this time, or None: search them all."""
        if self._hints is None or (self.copies and self._since_search + 1 >= SEARCH_EVERY):
            return None
        self._since_search += 1
        return self._hints

    def learn(self, tensors: list[Any], search: Any) -> None:
        """What ``search`` (verified) found: the next save's candidates.  A hinted search that lost a copy
        leaves none, so that the next save searches (bf16 roundings a hinted search finds exactly)."""
        pairs: list[tuple[int, int]] = []
        classes: dict[int, list[int]] = {}
        for t in tensors:
            d = t.entry.get("derived")
            if d is None:
                continue
            if d["function"] == BF16_RNE:
                pairs.append((t.tensor_id, d["source"]))
            else:
                classes.setdefault(d["source"], [d["source"]]).append(t.tensor_id)
        found = (pairs, list(classes.values()))
        if not search.hinted:
            self._hints, self._since_search = found, 0
        elif self._hints is not None and found[1] != self._hints[1]:
            self._hints = None
        else:
            self._hints = found


def _copy_entry(entry: dict[str, Any]) -> dict[str, Any]:
    e = dict(entry)
    e["shape"] = list(entry["shape"])
    view = entry.get("view")
    if view is not None:
        e["view"] = {**view, "stride": list(view["stride"])}
    return e
