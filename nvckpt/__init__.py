"""nvckpt: fast, small, safe checkpoints of PyTorch training states.

A streaming, chunked file format (SPEC.md) with a codec and a checksum per
chunk; GPU compression with nvCOMP where available, portable zstd on CPU.

``import nvckpt`` is cheap: torch is imported when a save/load function or
class is first touched (the CLI's info, ls and verify never import it).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    ChecksumError,
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
    "release_pinned_memory": "engines.gpu.pinned",
    "SaveOptions": "options", "LoadOptions": "options", "GpuSaveOptions": "options", "GpuLoadOptions": "options",
}

__all__ = [
    "save", "async_save", "SaveFuture", "load", "open", "Checkpoint", "TensorSlice", "SaveResult",
    "SaveOptions", "LoadOptions", "GpuSaveOptions", "GpuLoadOptions", "release_pinned_memory",
    "NvckptError", "FormatError", "TruncatedError", "ChecksumError", "UnsupportedCodecError",
    "UnsupportedFeatureError", "LimitError", "UnsupportedObjectError", "TensorNotFoundError", "LeftoverTemporaryWarning",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nvckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
