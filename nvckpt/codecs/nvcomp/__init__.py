"""nvCOMP: the nvcomp-ans codec-table entry (ans), and the batched CUDA coders (device, imported lazily)."""

from .ans import DATA_TYPES, NvcompAns, data_type_for

__all__ = ["NvcompAns", "DATA_TYPES", "data_type_for"]
