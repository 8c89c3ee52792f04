"""``get_slice(name)[...]``: indexing a stored tensor, decoding only the chunks that hold the rows asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..format.entry import TensorEntry
from ..tensors.dtypes import to_torch
from ..read.reader import check_supported

if TYPE_CHECKING:
    from .load import Checkpoint


#: safetensors' names of the dtypes (its slices' get_dtype()): code written for safe_open compares with these.
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0", "float4_e2m1fn_x2": "F4", "complex64": "C64", "int8": "I8", "int16": "I16",
    "int32": "I32", "int64": "I64", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
}


class TensorSlice:
    """``get_slice(name)[rows, ...]``: decodes only the chunks holding the rows asked for.

    As safetensors' slices: ``get_shape()`` (a list) and ``get_dtype()`` (safetensors' dtype name: "F32",
    "BF16"); as a tensor: ``shape`` (a tuple), ``dtype`` (a torch.dtype), ``ndim``, ``len()``; and
    ``dtype_name``, the file's own name of the dtype (SPEC 10: "float32", "bfloat16").  Reading the handle
    reads nothing: only indexing decodes."""

    def __init__(self, checkpoint: Checkpoint, entry: TensorEntry) -> None:
        self._ck = checkpoint
        self._entry = entry
        self.shape = tuple(entry.shape)

    @property
    def dtype(self) -> torch.dtype:
        """The tensor's torch.dtype (UnsupportedFeatureError for a dtype this torch lacks)."""
        check_supported(self._entry, self._ck.path)
        return to_torch(self._entry.dtype.name)

    @property
    def dtype_name(self) -> str:
        """The file's name of the dtype (SPEC 10: "float32", "bfloat16"), what ``get_dtype()`` returned in
        nvckpt 0.1.0."""
        return self._entry.dtype.name

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self.shape)

    def get_shape(self) -> list[int]:
        """The shape as a list, as safetensors' ``get_shape()``."""
        return list(self.shape)

    def get_dtype(self) -> str:
        """The dtype as safetensors names it ("F32", "BF16", "I64", "BOOL", "F8_E4M3", ...), so code written for
        ``safe_open(...).get_slice(name).get_dtype()`` runs unchanged; the two dtypes safetensors has no name for
        keep the file's ("complex32", "complex128").  ``dtype`` is the torch.dtype, ``dtype_name`` the file's name."""
        name = self._entry.dtype.name
        return SAFETENSORS_DTYPES.get(name, name)

    def __len__(self) -> int:
        """The size of dim 0 (TypeError for a 0-d tensor, as torch)."""
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __getitem__(self, index: Any) -> torch.Tensor:
        """The tensor indexed as torch indexes it; a slice, an int or an index tensor on dim 0 decodes only the
        chunks holding the rows it picks (other indices decode the whole tensor, then apply torch's rules)."""
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


__all__ = ["TensorSlice", "SAFETENSORS_DTYPES"]
