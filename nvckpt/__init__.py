"""nvckpt: fast, small, safe checkpoints of PyTorch training states.

A streaming, chunked file format (SPEC.md) with a codec and a checksum per
chunk; GPU compression with nvCOMP where available, portable zstd on CPU.
"""

__version__ = "0.1.0"

from .api import Checkpoint, SaveFuture, SaveResult, TensorSlice, async_save, load, open, save  # noqa: E402
from .errors import (  # noqa: E402
    ChecksumError,
    FormatError,
    LimitError,
    NvckptError,
    TensorNotFoundError,
    TruncatedError,
    UnsupportedCodecError,
    UnsupportedFeatureError,
    UnsupportedObjectError,
)

__all__ = [
    "save", "async_save", "SaveFuture", "load", "open", "Checkpoint", "TensorSlice", "SaveResult",
    "NvckptError", "FormatError", "TruncatedError", "ChecksumError", "UnsupportedCodecError",
    "UnsupportedFeatureError", "LimitError", "UnsupportedObjectError", "TensorNotFoundError",
    "__version__",
]
