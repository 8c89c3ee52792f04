"""The saved object's structure ("tree" in the index) <-> msgpack.

Containers and Python scalars are stored as themselves; a tensor is stored as
an ext-type reference to its index entry, a tuple as an ext type holding an
array.  No pickle: nothing in a file can run code when it is loaded.
"""

from __future__ import annotations

import contextlib
import gc
import struct
import threading
from itertools import chain
from sys import getsizeof
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import msgpack

from ..errors import FormatError, LimitError, UnsupportedObjectError, brief
from .constants import EXT_TENSOR, EXT_TUPLE, MAX_TREE_DEPTH

_KEY_TYPES = (str, int, float, bool, type(None))


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A leaf of the tree that stands for index entry ``tensor_id``."""

    tensor_id: int


def _pack_hook(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, TensorRef):
        return msgpack.ExtType(EXT_TENSOR, struct.pack("<I", obj.tensor_id))
    if isinstance(obj, tuple):
        return msgpack.ExtType(EXT_TUPLE, pack_tree(list(obj)))
    raise UnsupportedObjectError(f"cannot store an object of type {type(obj).__qualname__}")


def pack_tree(node: Any) -> bytes:
    """Serialise a tree whose tensors were already replaced by TensorRef."""
    return msgpack.packb(node, default=_pack_hook, use_bin_type=True, strict_types=True)


_nesting = threading.local()


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_TENSOR:
        if len(data) != 4:
            raise FormatError(f"tensor reference has {len(data)} bytes, expected 4")
        return TensorRef(struct.unpack("<I", data)[0])
    if code == EXT_TUPLE:
        # A tuple's payload is unpacked by a nested call from inside msgpack's C unpacker: bound the
        # nesting here, before the C stack overflows (about 41 KB of it per level).
        depth = getattr(_nesting, "depth", 0)
        if depth >= MAX_TREE_DEPTH:
            raise LimitError(f"tree nesting exceeds the limit of {MAX_TREE_DEPTH}")
        _nesting.depth = depth + 1
        try:
            items = unpack_tree(data)
        finally:
            _nesting.depth = depth
        if not isinstance(items, list):
            raise FormatError("tuple ext payload is not an array")
        return tuple(items)
    raise FormatError(f"unknown ext type {code} (the tree holds ext types {EXT_TENSOR} and {EXT_TUPLE}, nothing else any)")


def _is_nan(key: Any) -> bool:
    return isinstance(key, float) and key != key


def unique_map(pairs: list[tuple[Any, Any]]) -> dict:
    """msgpack object_pairs_hook: a map may not hold the same key twice (SPEC 1).

    "The same key" is Python's dict equality (1, 1.0 and True; 0.0 and -0.0)
    plus one rule Python's dict lacks: every NaN is the same key as every other."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise FormatError(f"a msgpack map holds the key {brief(dup)} twice")
    if len(pairs) > 1 and float in set(map(type, out)) and sum(_is_nan(k) for k in out) > 1:
        raise FormatError("a msgpack map holds two NaN keys (every NaN is the same key, SPEC 1)")
    return out


#: How deep any value read from a file may nest, counted from the payload's root (level 1).  Well
#: above what SPEC.md lets a valid file use (the tree and metadata: 64 levels inside the index map;
#: values under unknown keys: 64 levels, SPEC 9 "Parser bound"), well below what recursion in
#: Python (repr, ==, json) or C could trip on.
MAX_PAYLOAD_DEPTH = 2 * MAX_TREE_DEPTH + 8


def check_depth(value: Any, what: str, limit: int = MAX_PAYLOAD_DEPTH) -> None:
    """LimitError if containers in ``value`` nest more than ``limit`` levels (``value`` is level 1).

    Iterative, so any depth msgpack produced is safe to look at."""
    if not isinstance(value, (list, tuple, dict)):
        return
    stack = [(value, 1)]
    containers = (list, tuple, dict)
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise LimitError(f"{what} nests more than {limit} levels deep")
        children = item.values() if isinstance(item, dict) else item
        deeper = [(x, depth + 1) for x in children if isinstance(x, containers)]
        if deeper:
            stack.extend(deeper)


class _Budget:
    __slots__ = ("limit", "left")

    def __init__(self, limit: int) -> None:
        self.limit = self.left = limit

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise LimitError(f"the decoded index would take more than max_index_memory={self.limit} bytes of memory")


def _counted_map(pairs: list[tuple[Any, Any]]) -> dict:
    out = unique_map(pairs)
    _nesting.budget.spend(getsizeof(out) + sum(map(getsizeof, chain.from_iterable(pairs))))
    return out


def _counted_list(items: list) -> list:
    _nesting.budget.spend(getsizeof(items) + sum(map(getsizeof, items)))
    return items


@contextlib.contextmanager
def memory_budget(limit: int | None) -> Iterator[None]:
    """Bound the memory of what ``unpackb`` builds in this thread (``None``: no bound).

    Every array and map is charged its own size and its items' as msgpack
    builds it (nested containers are charged twice, so the estimate errs high)."""
    if limit is None:
        yield
        return
    previous = getattr(_nesting, "budget", None)
    _nesting.budget = _Budget(limit)
    try:
        yield
    finally:
        _nesting.budget = previous


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Garbage collection paused: decoding a large index builds millions of containers (none cyclic),
    and the collector would walk them again and again (a 1M-tensor index: 7 s of 9)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def unpackb(data: bytes) -> Any:
    """msgpack as the index and tree use it: str keys or scalars, our ext types, unique keys.

    msgpack's own limits bound what a payload can make it allocate (no container
    longer than the payload) and its nesting (1024 levels, without recursion);
    tuples nest through ``_ext_hook``, bounded there; ``memory_budget`` bounds the total."""
    if getattr(_nesting, "budget", None) is not None:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True,
                               object_pairs_hook=_counted_map, list_hook=_counted_list)
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True,
                           object_pairs_hook=unique_map)


def unpack_tree(data: bytes) -> Any:
    try:
        return unpackb(data)
    except (FormatError, LimitError):
        raise
    except (RecursionError, msgpack.StackError):
        raise LimitError(f"tree nesting exceeds the limit of {MAX_TREE_DEPTH}") from None
    except MemoryError:
        raise LimitError(f"a tuple of {len(data)} bytes does not fit in memory") from None
    except Exception as exc:  # msgpack raises many types on bad input
        raise FormatError(f"tree is not valid msgpack: {str(exc)[:200]}") from None


def check_tree(node: Any, num_tensors: int) -> None:
    """Validate types, depth and tensor references of a decoded tree."""
    stack = [(node, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, dict)) and depth > MAX_TREE_DEPTH:
            raise LimitError(f"tree nesting exceeds the limit of {MAX_TREE_DEPTH}")
        if isinstance(item, TensorRef):
            if item.tensor_id >= num_tensors:
                raise FormatError(f"tree refers to tensor {item.tensor_id}, but the index has {num_tensors}")
        elif isinstance(item, (list, tuple)):
            stack.extend((x, depth + 1) for x in item)
        elif isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, _KEY_TYPES):
                    raise FormatError(f"tree map key of type {type(k).__name__} is not allowed")
                stack.append((v, depth + 1))
        elif not isinstance(item, (str, bytes, int, float, bool, type(None))):
            raise FormatError(f"unexpected {type(item).__name__} in the tree")


def resolve_refs(node: Any, get: Callable[[int], Any]) -> Any:
    """The tree with every TensorRef replaced by ``get(tensor_id)``."""
    if isinstance(node, TensorRef):
        return get(node.tensor_id)
    if isinstance(node, dict):
        return {k: resolve_refs(v, get) for k, v in node.items()}
    if isinstance(node, tuple):
        return tuple(resolve_refs(v, get) for v in node)
    if isinstance(node, list):
        return [resolve_refs(v, get) for v in node]
    return node


def escape(key: object) -> str:
    """One path segment: JSON Pointer escaping (RFC 6901) of str(key)."""
    return str(key).replace("~", "~0").replace("/", "~1")


def leaf_paths(node: Any, parts: tuple[str, ...] = ()) -> Iterator[tuple[str, TensorRef]]:
    """(name, ref) of every tensor leaf, depth first in stored order."""
    if isinstance(node, TensorRef):
        yield "/".join(parts), node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from leaf_paths(v, parts + (escape(k),))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from leaf_paths(v, parts + (str(i),))
