"""``get_slice(name)[...]``: indexing a stored tensor, decoding only the chunks that hold the rows asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..format.entry import TensorEntry
from ..tensors.dtypes import to_torch
from ..read.reader import check_supported

if TYPE_CHECKING:
    from .load import Checkpoint


class TensorSlice:
    """``get_slice(name)[rows, ...]``: decodes only the chunks holding the rows asked for.

    As safetensors' slices: ``get_shape()`` (a list) and ``get_dtype()`` (the file's dtype name, SPEC 10:
    "float32", "bfloat16"); as a tensor: ``shape`` (a tuple), ``dtype`` (a torch.dtype), ``ndim``, ``len()``."""

    def __init__(self, checkpoint: Checkpoint, entry: TensorEntry) -> None:
        self._ck = checkpoint
        self._entry = entry
        self.shape = tuple(entry.shape)

    @property
    def dtype(self) -> torch.dtype:
        check_supported(self._entry, self._ck.path)
        return to_torch(self._entry.dtype.name)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self._entry.dtype.name

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __getitem__(self, index: Any) -> torch.Tensor:
        if not isinstance(index, tuple):
            index = (index,)
        entry, ck = self._entry, self._ck
        # A bool is an int to Python but a mask to torch (x[True] adds a dim): torch's own rules, on the whole tensor.
        if (not entry.shape or not index or not ck.row_readable(entry) or isinstance(index[0], bool)
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
                return ck._caller_rows(entry, 0, 0)[(slice(None),) + rest]
            lo, hi = rows[0], rows[-1] + 1
            return ck._caller_rows(entry, lo, hi)[(slice(0, hi - lo, step),) + rest]
        if isinstance(first, int) or (isinstance(first, torch.Tensor) and first.dim() == 0 and first.dtype != torch.bool):
            i = int(first)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for dimension 0 with size {n}")
            i %= n
            return ck._caller_rows(entry, i, i + 1)[(0,) + rest]
        # Fancy indexing on dim 0: read the span it touches.
        picked = torch.as_tensor(first)
        if picked.dtype == torch.uint8:  # torch still takes a uint8 tensor as a mask (deprecated): its own rules
            return ck._load([entry.tensor_id])[entry.tensor_id][index]
        if picked.dtype == torch.bool:
            if tuple(picked.shape) != (n,):  # a mask over several dims, or of the wrong length: torch's own rules
                return ck._load([entry.tensor_id])[entry.tensor_id][index]
            picked = picked.nonzero().reshape(-1)
        if picked.numel() == 0:
            return ck._caller_rows(entry, 0, 0)[(picked.long(),) + rest]  # [] is a float tensor
        picked = torch.where(picked < 0, picked + n, picked)
        lo, hi = int(picked.min()), int(picked.max()) + 1
        if lo < 0 or hi > n:
            raise IndexError(f"index out of bounds for dimension 0 with size {n}")
        return ck._caller_rows(entry, lo, hi)[(picked - lo,) + rest]


__all__ = ["TensorSlice"]
