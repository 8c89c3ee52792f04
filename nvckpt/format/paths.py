"""Names of the values in a saved object (SPEC 14.1): lookup by path, DCP's dotted names, near matches.

A value's path joins its keys with "/" (each escaped as JSON Pointer: ``model/0.weight``).  DCP names the
same value by its keys joined with "." (``model.0.weight``), so a name copied from a DCP tool or
``state_dict()`` of a wrapped module is accepted where it names exactly one value.  A name that names
nothing gets the nearest names in its error ("did you mean ...").
"""

from __future__ import annotations

import bisect
import difflib
from typing import Any, Iterable, Iterator

from .tree import escape, find_path

_SUGGESTIONS = 3
_MAX_COMPARED = 2_000  # segments compared at one place of the tree (each a difflib ratio, ~20 us)


def unescape(segment: str) -> str:
    """Inverse of escape (RFC 6901: '~1' -> '/', then '~0' -> '~')."""
    return segment.replace("~1", "/").replace("~0", "~") if "~" in segment else segment


def dotted(path: str) -> str:
    """The name DCP gives the value at ``path``: its keys joined with "." (``model/0.weight`` ->
    ``model.0.weight``)."""
    if "~" not in path:  # no escaped "/" or "~" in its keys: the common name, one pass
        return path.replace("/", ".")
    return ".".join(unescape(s) for s in path.split("/"))


def value_paths(node: Any, leaf: type | tuple[type, ...] = ()) -> Iterator[str]:
    """Every path of ``node`` below its root, containers and leaves, depth first (dicts, lists and tuples are
    walked into; ``leaf`` types are not, nor is anything else)."""
    stack: list[tuple[Any, str]] = [(node, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, leaf):
            continue
        if isinstance(item, dict):
            children = [(v, f"{path}/{_segment(k)}" if path else _segment(k)) for k, v in item.items()]
        elif isinstance(item, (list, tuple)):
            children = [(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(item)]
        else:
            continue
        for child in children:
            yield child[1]
        stack.extend(reversed(children))


def _segment(key: Any) -> str:
    return key if type(key) is str and "~" not in key and "/" not in key else escape(key)


def by_dotted_name(names: Iterable[str]) -> dict[str, str | None]:
    """DCP's name -> the one path it stands for (None where two paths have the same dotted name)."""
    out: dict[str, str | None] = {}
    for name in names:
        key = dotted(name)
        if key != name:
            out[key] = name if key not in out or out[key] == name else None
    return out


def resolve(tree: Any, key: str, leaf: type | tuple[type, ...] = ()) -> str:
    """The path in ``tree`` that ``key`` names: ``key`` itself, or the one path whose dotted name it is;
    KeyError otherwise."""
    try:
        find_path(tree, key)
        return key
    except KeyError:
        pass
    found = by_dotted_name(value_paths(tree, leaf)).get(key)
    if found is None:
        raise KeyError(key)
    return found


def did_you_mean(key: str, names: Iterable[str]) -> str:
    """"; did you mean 'a' or 'b'?" for the names nearest ``key`` (in either spelling), or "".

    The key is matched a segment at a time against the names' tree (a segment that no name has is replaced
    by the nearest that the names at that place have), so a state of a million names answers as fast as a
    small one, and a typo anywhere in the path finds the name it was meant to be."""
    root: dict[str, Any] = {}
    for name in names:
        node = root
        for segment in name.split("/"):
            node = node.setdefault(unescape(segment), {})
        node[_END] = name
    if "/" in key or "." not in key:
        parts, spans = [unescape(s) for s in key.split("/")], (1,)
    else:  # DCP's spelling: a segment of a name may itself hold dots ("0.weight"), so parts are joined too
        parts, spans = key.split("."), (1, 2, 3)
    found: list[str] = []
    _walk(root, parts, 0, spans, found)
    if not found:
        return ""
    return "; did you mean " + " or ".join(repr(n) for n in found) + "?"


_END = object()  # a name ends at this node of the names' tree


def _walk(node: dict, parts: list[str], i: int, spans: tuple[int, ...], found: list[str]) -> None:
    """Names of ``node``'s subtree that ``parts[i:]`` is close to, best first, into ``found``."""
    if len(found) >= _SUGGESTIONS:
        return
    if i == len(parts):
        name = node.get(_END)
        if name is not None and name not in found:
            found.append(name)
        return
    children = [c for c in node if c is not _END]
    options: list[tuple[float, str, int]] = []
    for n in spans:
        if i + n > len(parts):
            break
        segment = ".".join(parts[i:i + n])
        if segment in node:
            options.append((1.0, segment, i + n))
            continue
        compared = children
        if len(compared) > _MAX_COMPARED:  # compare the children that sort next to it (a typo mostly keeps a prefix)
            compared = sorted(compared)
            at = bisect.bisect_left(compared, segment)
            compared = compared[max(0, at - _MAX_COMPARED // 2): at + _MAX_COMPARED // 2]
        for child in difflib.get_close_matches(segment, compared, n=_SUGGESTIONS, cutoff=0.6):
            options.append((difflib.SequenceMatcher(None, segment, child).ratio(), child, i + n))
    for _, child, j in sorted(options, key=lambda o: -o[0])[:_SUGGESTIONS]:
        _walk(node[child], parts, j, spans, found)


__all__ = ["dotted", "unescape", "value_paths", "by_dotted_name", "resolve", "did_you_mean"]
