"""Codec steps and pipelines (SPEC.md, "Codecs").

A pipeline is what a codec id in a file stands for: zero or more filters
(bytes -> bytes of the same length, e.g. byteshuffle) followed by one coder
(raw, zstd, nvcomp-ans).  Steps are small frozen objects with a name and a
JSON-able configuration, as in zarr v3 and numcodecs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple


class DeviceOp(NamedTuple):
    """What a pipeline is on a CUDA device (nvckpt.codecs.nvcomp): one batched nvCOMP coder,
    after an optional byte-plane split of ``shuffle``-byte elements."""

    algorithm: str  # "ans" or "zstd"
    data_type: str = "|u1"  # nvCOMP ANS data-type mode
    shuffle: int = 1
    written_by: str = ""  # nvCOMP version that wrote an ANS stream ("" for zstd)

    @property
    def planes(self) -> bool:
        """The device splits elements into byte planes before its coder (an encode batch needs scratch)."""
        return self.shuffle > 1

    def describe(self) -> str:
        """How errors and reports name this device coder, e.g. ``ans(|u1, shuffle=2)``."""
        return f"{self.algorithm}({self.data_type}, shuffle={self.shuffle})"


#: How a device loader decodes a pipeline's chunks (``Pipeline.device_route``): copy them, decode them on the
#: host and upload them, or ("planes", k): the coder on the host, the byte planes put back on the device.
RAW_ROUTE, HOST_ROUTE = "raw", "cpu"


class DecodeRejected(ValueError):
    """A decoder refused its input, or it decoded to another length than the chunk's raw length."""


def _frozen(value: Any) -> Any:
    """A hashable form of a configuration, equal where the configurations are equal.  An unregistered codec's
    configuration is kept as stored (SPEC 11.1): any msgpack value (ext values, bytes, maps with keys of any
    type), which json.dumps refused (`nvckpt recover` crashed on an ext value in a CODEC frame)."""
    if isinstance(value, dict):
        return frozenset((_frozen(k), _frozen(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


class Codec:
    """One step of a pipeline.  Subclasses set ``name`` and ``is_filter``.

    The host implementation is ``encode`` / ``decode`` (bytes in, bytes out);
    ``device_step`` says what the step is on a CUDA device, where the GPU
    engines run whole batches of chunks through nvCOMP (None: host only)."""

    name: ClassVar[str]
    is_filter: ClassVar[bool | None] = False  # None: unknown codec, order not checkable
    # Names of the software that decodes this codec, for error messages.
    readers: ClassVar[str] = "any nvckpt reader"
    # True when no host decoder exists (nvcomp-ans): such chunks decode only on a GPU.
    needs_gpu: ClassVar[bool] = False
    # Its device decoder runs only when a load asks for it (GpuLoadOptions.gpu_zstd); else the host decodes
    # the coder and the device undoes the filters.
    device_decode_opt_in: ClassVar[bool] = False

    def device_step(self) -> dict[str, Any] | None:
        """The fields of a DeviceOp this step sets on a CUDA device, or None if it has no device form."""
        return None

    def check_stored(self, payload: memoryview) -> None:
        """Raise ValueError for stored bytes this codec's readers must refuse although their checksum matches
        (what a device decoder would not check itself: zstd's window bound, SPEC 11.4).  Coders only."""

    def configuration(self) -> dict[str, Any]:
        """The step's parameters as stored in the file's codec table (SPEC 11.1); ``{}`` when it has none."""
        return {}

    @classmethod
    def from_configuration(cls, configuration: dict[str, Any]) -> "Codec":
        """The step a file's codec table describes (ValueError for a configuration it does not take)."""
        if configuration:
            raise ValueError(f"codec {cls.name!r} takes no configuration, got {configuration!r}")
        return cls()

    def encode(self, data: memoryview) -> bytes | memoryview:
        """Encode ``data`` on the host (a coder may return more bytes than it was given: the writer then stores the chunk raw)."""
        raise NotImplementedError

    def decode(self, data: memoryview, raw_length: int) -> bytes | memoryview:
        """Decode ``data``; must return exactly ``raw_length`` bytes or raise."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        # The name too: every unregistered codec is one class (UnknownCodec) whatever its name.
        return (type(self) is type(other) and self.name == other.name  # type: ignore[attr-defined]
                and self.configuration() == other.configuration())  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.name, _frozen(self.configuration())))

    def __repr__(self) -> str:
        config = self.configuration()
        try:
            shown = json.dumps(config, sort_keys=True)
        except (TypeError, ValueError):  # an unregistered codec's configuration, kept as stored: any msgpack value
            shown = repr(config)
        return f"{self.name}({shown})"


@dataclass(frozen=True)
class Pipeline:
    """Filters then one coder.  Hashable, so a writer can give it one codec id.

    ``planar``: a writer-side choice, not recorded in the file (two pipelines that differ only in
    it are the same codec): encode as one zstd frame per byte plane (nvckpt.codecs.planes), as the
    portable preset does.  False: run the steps one after the other.  ``matches`` (planar only, not
    recorded either): also try zstd's match finder on every plane, for integers and bytes, whose repeats
    (a counter, text, a mask) literals alone miss; float weights have none worth the time."""

    steps: tuple[Codec, ...]
    planar: bool = field(default=False, compare=False)
    matches: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("a codec pipeline needs at least one step")
        *filters, coder = self.steps
        if any(s.is_filter is None for s in self.steps):
            return
        if coder.is_filter or any(not f.is_filter for f in filters):
            raise ValueError(f"pipeline {self.describe()} must be filters followed by exactly one coder")

    @property
    def coder(self) -> Codec:
        """The last step, which turns bytes into the stored payload (the others are filters)."""
        return self.steps[-1]

    @property
    def is_raw(self) -> bool:
        """The bytes stored are the raw bytes (SPEC 11.3)."""
        return len(self.steps) == 1 and self.coder.name == "raw"

    def check_known(self) -> None:
        """UnsupportedCodecError for a pipeline with an unregistered step, before any step decodes: with one,
        the last step need not be the coder (SPEC 11.3: ``[x-future, raw]`` is no raw chunk)."""
        for step in self.steps:
            if step.is_filter is None:
                step.decode(memoryview(b""), 0)  # an unregistered step's decode raises UnsupportedCodecError

    @property
    def needs_gpu(self) -> bool:
        """A step has no host decoder (nvcomp-ans): its chunks decode only on a GPU with nvCOMP."""
        return any(s.needs_gpu for s in self.steps)

    def __hash__(self) -> int:
        # Computed once: engines key their tables by pipeline, per chunk (thousands per save).
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash(self.steps)
        return h

    def __getstate__(self) -> dict[str, Any]:
        # Without the cached values: a str hash differs in another process.
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_device_op", "_planar_form")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def device_op(self) -> DeviceOp | None:
        """This pipeline as one batched device call, or None where a step has no device form."""
        if "_device_op" not in self.__dict__:
            self.__dict__["_device_op"] = self._device_op()
        return self.__dict__["_device_op"]

    def _device_op(self) -> DeviceOp | None:
        if self.is_raw:
            return None
        fields: dict[str, Any] = {}
        for step in self.steps:
            part = step.device_step()
            if part is None:
                return None
            fields.update(part)
        return DeviceOp(**fields) if "algorithm" in fields else None

    def device_route(self, device_opt_in: bool = False) -> Any:
        """How a device loader decodes this pipeline's chunks: RAW_ROUTE (copied), HOST_ROUTE (decoded on the
        host, uploaded), ("planes", k) (the coder on the host, the filters undone on the device), or the
        DeviceOp its device decoder runs.  ``device_opt_in``: run device decoders that need asking for."""
        if self.is_raw:
            return RAW_ROUTE
        op = self.device_op()
        if op is None:
            return HOST_ROUTE
        if self.coder.device_decode_opt_in and not device_opt_in:
            return ("planes", op.shuffle)
        return op

    def check_stored(self, payload: memoryview) -> None:
        """The coder's check of stored bytes (``Codec.check_stored``), for bytes a device wrote or will read."""
        self.coder.check_stored(payload)

    @property
    def checks_stored(self) -> bool:
        """Does the coder check stored bytes at all (so that a caller may skip the call)?"""
        return type(self.coder).check_stored is not Codec.check_stored

    def planar_form(self) -> tuple[int, bool] | None:
        """(k, signshift) where this pipeline's host coding is the byte-plane path of nvckpt.codecs.planes
        (one zstd frame per plane: [signshift(k)?, byteshuffle(k)?, zstd]), else None."""
        if "_planar_form" not in self.__dict__:
            from .._fork import importing

            with importing():  # first use maybe in an engine's thread: a fork waits for the import (nvckpt._fork)
                from .planes import planar_form

            self.__dict__["_planar_form"] = planar_form(self)
        return self.__dict__["_planar_form"]

    def decode_into(self, data: Any, out: Any) -> None:
        """Host decode of a chunk's stored bytes ``data`` into ``out`` (a uint8 numpy array of its raw length):
        the byte-plane path where it applies, else the steps one after the other (ValueError, ZstdError or
        UnsupportedCodecError for bytes they refuse)."""
        form = self.planar_form()
        if form is not None:
            from .planes import decode_chunk

            decode_chunk(data, form[0], form[1], out)
            return
        import numpy as np

        decoded = memoryview(self.decode(memoryview(data), out.nbytes)).cast("B")
        if decoded.nbytes != out.nbytes:
            raise DecodeRejected(f"chunk decoded to {decoded.nbytes} bytes, raw_length is {out.nbytes}")
        out[:] = np.frombuffer(decoded, dtype=np.uint8)

    def encode_bound(self, n: int) -> int | None:
        """The most bytes ``encode_into`` writes for ``n`` raw bytes; None where this pipeline has no
        byte-plane encoder (``encode`` then returns new bytes)."""
        form = self.planar_form() if self.planar else None
        if form is None:
            return None
        from .planes import chunk_bound

        return chunk_bound(n, form[0])

    def encode_into(self, raw: Any, out: Any) -> int:
        """Byte-plane encode of ``raw`` into ``out`` (at least ``encode_bound`` bytes); returns the length."""
        k, signshift = self.planar_form()  # type: ignore[misc]
        from .planes import encode_chunk

        return encode_chunk(raw, k, signshift, out, self.coder.level, self.matches)  # type: ignore[attr-defined]

    def to_json(self) -> list[dict[str, Any]]:
        """The pipeline as a file's codec table stores it (SPEC 11.1): one ``{name, configuration}`` per step."""
        return [{"name": s.name, "configuration": s.configuration()} for s in self.steps]

    def describe(self) -> str:
        """How errors, ``nvckpt ls`` and reports name the pipeline, e.g. ``signshift+byteshuffle(elementsize=2)+zstd``."""
        return "+".join(
            s.name + (f"({','.join(f'{k}={v}' for k, v in s.configuration().items())})" if s.configuration() else "")
            for s in self.steps
        )

    def encode(self, data: memoryview) -> bytes | memoryview:
        """Run every step's host encoder in order (the step-by-step path; planar pipelines have a faster one)."""
        for step in self.steps:
            data = step.encode(memoryview(data))
        return data

    def decode(self, data: memoryview, raw_length: int) -> bytes | memoryview:
        """Undo the steps in reverse order; returns exactly ``raw_length`` bytes or raises."""
        self.check_known()
        out = self.coder.decode(memoryview(data), raw_length)
        for step in reversed(self.steps[:-1]):
            out = step.decode(memoryview(out), raw_length)
        return out
