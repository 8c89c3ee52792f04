"""nvCOMP: the nvcomp-ans codec-table entry, and the batched CUDA implementations (backend, imported lazily)."""

from .ans import DATA_TYPES, NvcompAns, data_type_for

__all__ = ["NvcompAns", "DATA_TYPES", "data_type_for"]
