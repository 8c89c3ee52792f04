"""Codec registry: names in a file's codec table -> implementations (SPEC 11.2).

Each registered class is the host implementation (``encode`` / ``decode``) and
says through ``device_step`` what it is on a CUDA device.  Two implementations
may share a name only if each decodes the other's output (nvCOMP Zstd with the
RAW bitstream and libzstd are one such pair).
"""

from __future__ import annotations

from typing import Any

from ..errors import FormatError, UnsupportedCodecError
from ..format.index import check_codec_spec
from .base import Codec, Pipeline
from .builtin import ByteShuffle, Raw, SignShift, Zstd
from .nvcomp.ans import NvcompAns

REGISTRY: dict[str, type[Codec]] = {c.name: c for c in (Raw, Zstd, ByteShuffle, SignShift, NvcompAns)}

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
    """A pipeline from one codec table entry.  Unknown names are kept (they fail when decoded)."""
    steps: list[Codec] = []
    for step in check_codec_spec(value):
        config = step.get("configuration", {})
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


__all__ = ["REGISTRY", "RAW", "UnknownCodec", "pipeline_from_json"]
