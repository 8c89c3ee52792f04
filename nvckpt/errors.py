"""The one exception hierarchy of nvckpt.

Every error raised while reading or writing a checkpoint is an ``NvckptError``.
Messages name the file, tensor, chunk and byte offset where they are known, so
that one line on stderr says what is wrong and where.
"""

from __future__ import annotations

__all__ = [
    "brief",
    "NvckptError",
    "FormatError",
    "TruncatedError",
    "ChecksumError",
    "UnsupportedCodecError",
    "UnsupportedFeatureError",
    "LimitError",
    "UnsupportedObjectError",
    "TensorNotFoundError",
    "EndOfStreamError",
    "LeftoverTemporaryWarning",
]


def located_message(reason: str, *, path: str | None = None, tensor: str | None = None,
                    chunk: int | None = None, offset: int | None = None) -> str:
    """``reason`` preceded by where it happened: "file, tensor 'x', chunk 3, offset 4096: reason"."""
    where = []
    if path is not None:
        where.append(path)
    if tensor is not None:
        where.append(f"tensor {tensor!r}")
    if chunk is not None:
        where.append(f"chunk {chunk}")
    if offset is not None:
        where.append(f"offset {offset}")
    return f"{', '.join(where)}: {reason}" if where else reason


def brief(value: object, limit: int = 80) -> str:
    """A short description of a value read from a file, for an error message.

    Never the repr of a container (a hostile file can nest them a thousand deep
    or hold a hundred million items): its type and size instead."""
    if isinstance(value, (list, tuple)):
        return f"{'an array' if isinstance(value, list) else 'a tuple'} of {len(value)} items"
    if isinstance(value, dict):
        return f"a map of {len(value)} entries"
    if isinstance(value, (str, bytes, bytearray)):
        text = repr(value[:limit])
        return text + ("..." if len(value) > limit else "")
    if value is None or isinstance(value, (bool, int, float)):
        text = repr(value)
        return text if len(text) <= limit else text[:limit] + "..."
    return f"a {type(value).__name__}"


class NvckptError(Exception):
    """Base class of every nvckpt error."""

    def __init__(
        self,
        message: str,
        *,
        path: object = None,
        tensor: str | None = None,
        chunk: int | None = None,
        offset: int | None = None,
    ) -> None:
        self.path = None if path is None else str(path)
        self.tensor = tensor
        self.chunk = chunk
        self.offset = offset
        self.reason = message
        super().__init__(self._compose())

    def _compose(self) -> str:
        return located_message(self.reason, path=self.path, tensor=self.tensor, chunk=self.chunk, offset=self.offset)

    def located(self, **where: object) -> "NvckptError":
        """Fill in location fields that are still unknown, and return self."""
        for key, value in where.items():
            if getattr(self, key, None) is None and value is not None:
                setattr(self, key, str(value) if key == "path" else value)
        self.args = (self._compose(),)
        return self


class FormatError(NvckptError):
    """The bytes do not follow SPEC.md (bad magic, bad field, inconsistent index)."""


class TruncatedError(FormatError):
    """The file ends before a structure it declares (see ``nvckpt recover``)."""


class ChecksumError(NvckptError):
    """Stored bytes do not match their XXH3-64 checksum."""


class UnsupportedCodecError(NvckptError):
    """A chunk uses a codec this reader cannot decode (unknown, or needs nvCOMP/GPU)."""


class UnsupportedFeatureError(NvckptError):
    """The file needs a format version or required feature this reader lacks."""


class LimitError(NvckptError):
    """A declared size or count exceeds a limit of SPEC.md (or one set by the caller)."""


class UnsupportedObjectError(NvckptError, TypeError):
    """``save`` was given an object it cannot store without pickle."""


class TensorNotFoundError(NvckptError, KeyError):
    """No tensor of that name in the file."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0] if self.args else ""


class EndOfStreamError(NvckptError, EOFError):
    """A stream holds no further checkpoint: nvckpt's reader left it at its end after the last one
    (an EOFError, as pickle.load raises, so a loop reading checkpoints until the end stops)."""


class LeftoverTemporaryWarning(UserWarning):
    """A save found the temporary file of an earlier save to the same path that crashed or was killed."""
