"""Small helpers shared by the tools: sizes, tables, progress bars, output folders, names."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Sequence

from ..format.constants import MAX_TREE_DEPTH
from ..format.paths import unescape
from ..format.sniff import WHAT_FORMAT, sniff_format  # noqa: F401 - the tools tell formats by content, as the library
from ..format.tree import escape

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float) -> str:
    """1536 -> '1.5 KiB' (binary units, as ls -h)."""
    try:
        value = float(n)
    except OverflowError:  # a size no file has (a crafted manifest's shape): said in full
        return f"{n:,} B"
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def ratio(raw: int, stored: int) -> float | None:
    """raw / stored, or None where nothing is stored (views, derived, empty tensors)."""
    return raw / stored if stored else None


def ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def seconds_text(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def printable(name: str) -> str:
    """A tensor name fit for a terminal: names may hold control characters or be empty (SPEC 20)."""
    return name if name and name.isprintable() else repr(name)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell; columns listed in ``right`` are right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def set_description_str(self, desc: str) -> None:
        pass


def progress_bar(total: int | None, desc: str, enabled: bool):
    """A tqdm byte counter on stderr, or a do-nothing stand-in when disabled or stderr is not a tty."""
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False)


# (description, total bytes) -> a bar with update(n) and close(); the tools take one of these.
ProgressFactory = Callable[[str, int], Any]


def null_bar(desc: str = "", total: int | None = None) -> _NoBar:
    return _NoBar()


def check_output_folder(path: str | os.PathLike) -> None:
    """Fail before any work when the output cannot be created (no folder, or a folder in its place)."""
    final = os.path.abspath(os.fspath(path))
    if os.path.isdir(final):
        raise IsADirectoryError(21, "Is a directory", os.fspath(path))
    if not os.path.isdir(os.path.dirname(final)):
        raise FileNotFoundError(2, "No such directory", os.path.dirname(final))


def overwrites_source(src: str | os.PathLike, dst: str | os.PathLike) -> bool:
    """Would writing ``dst`` replace ``src`` or a file inside it (a DCP directory's rank file)?  Through
    symlinks and hard links too, not only by the names given."""
    s, d = os.path.realpath(src), os.path.realpath(dst)
    if s == d or (os.path.isdir(s) and os.path.commonpath([s, d]) == s):
        return True
    try:
        return os.path.samefile(src, dst)
    except OSError:  # dst does not exist yet
        return False


def nest_by_name(items: Sequence[tuple[str, Any]]) -> Any | None:
    """Rebuild nested dicts from tensor names, so that each value's path is its name again.

    ``[("model/w", a), ("model/b", b)]`` -> ``{"model": {"w": a, "b": b}}``.  Returns
    None when the names cannot all be paths of one tree (a name that is a prefix
    of another, duplicates, non-canonical escapes); callers then keep a flat map.
    """
    if len(items) == 1 and items[0][0] == "":
        return items[0][1]  # the saved object was a single tensor
    root: dict[str, Any] = {}
    for name, value in items:
        parts = name.split("/")
        if len(parts) > MAX_TREE_DEPTH:  # one dict per segment: the tree would be too deep to store
            return None
        keys = [unescape(p) for p in parts]
        if any(escape(k) != p for k, p in zip(keys, parts)):
            return None
        node = root
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                return None
            node = child
        if keys[-1] in node:
            return None
        node[keys[-1]] = _Leaf(value)
    return _unwrap(root)


class _Leaf:
    """Marks a value placed by nest_by_name (a dict value may itself be a dict)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _unwrap(node: Any) -> Any:
    if isinstance(node, _Leaf):
        return node.value
    return {k: _unwrap(v) for k, v in node.items()}


def on_device(tree: Any, device: str) -> Any:
    """The tree with its tensors on ``device`` (a tensor reached twice stays one tensor)."""
    import torch

    moved: dict[int, torch.Tensor] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return moved.setdefault(id(node), node.to(device))
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            items = [walk(v) for v in node]
            return tuple(items) if isinstance(node, tuple) else items
        return node

    return walk(tree)


class UsageError(ValueError):
    """A command was asked for something that makes no sense (the CLI's exit code 2)."""


class UnknownFormatError(UsageError):
    """A file's format could not be told; ``hint`` names convert's --from/--to, which the commands without
    those options (merge, split) leave out."""

    def __init__(self, reason: str, hint: str) -> None:
        super().__init__(f"{reason}; {hint}")
        self.reason, self.hint = reason, hint


# What convert's --from/--to accept (a DCP directory is told by its manifest and written by `split`).
FILE_FORMATS = ("nvckpt", "safetensors", "torch")

