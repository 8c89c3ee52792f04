"""What a file is, from its first bytes: nvckpt, torch.save or safetensors (no torch).

Readers trust content, not names (an nvckpt file may be called ``last.ckpt``, a torch.save file
``model.nvckpt``): ``convert`` picks its reader by it, and the error for a file that is not an nvckpt
file says what the file is and what reads it, in the library as on the command line.
"""

from __future__ import annotations

import os
from typing import Any

from .constants import PREAMBLE_MAGIC

_TORCH_LEGACY = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"  # pickle of torch's legacy MAGIC_NUMBER

# What a file of each format sniff_format tells is, in a message.
WHAT_FORMAT = {"nvckpt": "an nvckpt file", "torch": "a torch.save file", "safetensors": "a safetensors file"}


def sniff_bytes(head: bytes, size: int) -> str | None:
    """The format whose files start with ``head`` (a file's first 16 bytes, ``size`` its length), or None."""
    if head.startswith(PREAMBLE_MAGIC):
        return "nvckpt"
    if head.startswith(b"PK\x03\x04") or head.startswith(_TORCH_LEGACY):
        return "torch"
    if len(head) >= 9 and 0 < int.from_bytes(head[:8], "little") <= size - 8 and head[8:9] == b"{":
        return "safetensors"
    return None


def sniff_format(target: str | os.PathLike | Any) -> str | None:
    """"nvckpt", "torch" (torch.save's zip or legacy format), "safetensors", or None, by content.

    ``target``: a path, or a seekable binary file (read from its position and put back there)."""
    if hasattr(target, "read"):
        try:
            start = target.tell()
            head = target.read(16)
            end = target.seek(0, os.SEEK_END)
            target.seek(start)
        except (OSError, AttributeError, ValueError):
            return None
        return sniff_bytes(bytes(head), end - start)
    try:
        with open(target, "rb") as f:
            head = f.read(16)
            size = os.fstat(f.fileno()).st_size
    except (OSError, TypeError, ValueError):
        return None
    return sniff_bytes(head, size)


def foreign_format_hint(path: str | os.PathLike) -> str:
    """For the error about a file that is not an nvckpt file: what it is and what reads it ("" when its
    content is none of the formats nvckpt knows)."""
    fmt = sniff_format(path)
    if fmt not in ("torch", "safetensors"):
        return ""
    name = os.fspath(path)
    command = f"`nvckpt convert {name} {os.path.splitext(name)[0]}.nvckpt` converts it"
    if fmt == "torch":  # reading it runs its pickle: only on the caller's word
        return (f"; it is {WHAT_FORMAT[fmt]}: {command} (--allow-pickle if it holds more than tensors and plain "
                "data), or nvckpt.load(path, allow_pickle=True) reads it as torch.load does, running its pickle: "
                "only for a file you trust")
    return f"; it is {WHAT_FORMAT[fmt]}: {command} (safetensors.torch.load_file reads it)"


__all__ = ["sniff_format", "sniff_bytes", "foreign_format_hint", "WHAT_FORMAT"]
