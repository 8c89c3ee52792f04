"""Codec registry: names in a file's codec table -> implementations.

Two implementations may share a name only if each decodes the other's output
(nvCOMP Zstd with the RAW bitstream and libzstd are one such pair).
"""

from __future__ import annotations

from typing import Any

from ..errors import FormatError, UnsupportedCodecError
from .base import Codec, Pipeline
from .builtin import ByteShuffle, Raw, Zstd
from .nvcomp_ans import NvcompAns

__all__ = ["Codec", "Pipeline", "Raw", "Zstd", "ByteShuffle", "NvcompAns", "REGISTRY", "pipeline_from_json", "portable", "RAW"]

REGISTRY: dict[str, type[Codec]] = {c.name: c for c in (Raw, Zstd, ByteShuffle, NvcompAns)}

RAW = Pipeline((Raw(),))


class UnknownCodec(Codec):
    """Placeholder for a codec name this reader does not know: decoding it fails clearly."""

    is_filter = None  # unknown: the pipeline's order cannot be checked

    def __init__(self, name: str, configuration: dict[str, Any]) -> None:
        self.name = name  # type: ignore[misc]
        self._configuration = configuration

    def configuration(self) -> dict[str, Any]:
        return self._configuration

    def decode(self, data: memoryview, raw_length: int) -> bytes:
        raise UnsupportedCodecError(
            f"codec {self.name!r} is not known to nvckpt (known: {', '.join(sorted(REGISTRY))}); "
            "a newer nvckpt or the implementation that wrote the file may read it"
        )


def pipeline_from_json(value: Any) -> Pipeline:
    """Parse one codec table entry.  Unknown names are kept (they fail when decoded)."""
    if not isinstance(value, list) or not value:
        raise FormatError(f"codec pipeline must be a non-empty array, got {type(value).__name__}")
    steps: list[Codec] = []
    for step in value:
        if not isinstance(step, dict) or not isinstance(step.get("name"), str):
            raise FormatError(f"codec step must be a map with a string 'name', got {step!r:.200}")
        config = step.get("configuration", {})
        if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
            raise FormatError(f"codec {step['name']!r}: configuration must be a map with string keys")
        extra = set(step) - {"name", "configuration"}
        if extra:
            raise FormatError(f"codec step {step['name']!r} has unknown fields {sorted(extra)}")
        cls = REGISTRY.get(step["name"])
        if cls is None:
            steps.append(UnknownCodec(step["name"], config))
            continue
        try:
            steps.append(cls.from_configuration(config))
        except ValueError as exc:
            raise FormatError(f"codec {step['name']!r}: {exc}") from None
    try:
        return Pipeline(tuple(steps))
    except ValueError as exc:
        raise FormatError(str(exc)) from None


def portable(itemsize: int, level: int = 1) -> Pipeline:
    """byteshuffle+zstd for multi-byte elements, zstd for bytes: any zstd library reads it."""
    if itemsize > 1:
        return Pipeline((ByteShuffle(itemsize), Zstd(level)))
    return Pipeline((Zstd(level),))
