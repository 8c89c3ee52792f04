"""nvckpt: fast, small, safe checkpoints of PyTorch training states.

A streaming, chunked file format (SPEC.md) with a codec and a checksum per
chunk; GPU compression with nvCOMP where available, portable zstd on CPU.

``import nvckpt`` is cheap: torch is imported when a save/load function or
class is first touched (the CLI's info, ls and verify never import it).
"""

from __future__ import annotations

__version__ = "0.2.0"  # the one place: pyproject.toml reads it (tool.setuptools.dynamic)

from typing import TYPE_CHECKING  # noqa: E402

from ._lazy import lazy_attributes  # noqa: E402
from .errors import (  # noqa: E402
    ChecksumError,
    EndOfStreamError,
    FormatError,
    LeftoverTemporaryWarning,
    LimitError,
    NvckptError,
    TensorNotFoundError,
    TruncatedError,
    UnsupportedCodecError,
    UnsupportedFeatureError,
    UnsupportedObjectError,
)

_LAZY = {
    "save": "api", "async_save": "api", "load": "api", "open": "api",
    "Checkpoint": "api", "SaveFuture": "api", "SaveResult": "api", "TensorSlice": "api",
    "release_pinned_memory": "engines.gpu.pinned", "reserve_pinned_memory": "engines.gpu.pinned",
    "SaveOptions": "options", "LoadOptions": "options", "GpuSaveOptions": "options", "GpuLoadOptions": "options",
}

if TYPE_CHECKING:  # what _LAZY imports on first use, for type checkers and the API reference
    from .api import Checkpoint, SaveFuture, SaveResult, TensorSlice, async_save, load, open, save
    from .engines.gpu.pinned import release_pinned_memory, reserve_pinned_memory
    from .options import GpuLoadOptions, GpuSaveOptions, LoadOptions, SaveOptions

__all__ = [
    "save", "async_save", "SaveFuture", "load", "open", "Checkpoint", "TensorSlice", "SaveResult",
    "SaveOptions", "LoadOptions", "GpuSaveOptions", "GpuLoadOptions", "release_pinned_memory",
    "reserve_pinned_memory", "NvckptError", "FormatError", "TruncatedError", "ChecksumError", "UnsupportedCodecError",
    "UnsupportedFeatureError", "LimitError", "UnsupportedObjectError", "TensorNotFoundError", "EndOfStreamError",
    "LeftoverTemporaryWarning", "__version__",
]


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
