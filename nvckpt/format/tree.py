"""The saved object's structure ("tree" in the index) <-> msgpack.

Containers and Python scalars are stored as themselves; a tensor is stored as
an ext-type reference to its index entry, a tuple as an ext type holding an
array, and the typed extensions of SPEC 9.2 (torch.dtype, torch.device,
complex, ints beyond 64 bits, set, frozenset) as ext types 3..8 with fixed
byte layouts; those of SPEC 9.3 (a NumPy array: a tensor reference loaded as an
array; a pathlib path) as ext types 9 and 10.  No pickle: nothing in a file can run code when it is loaded.
"""

from __future__ import annotations

import contextlib
import re
import struct
import threading
from itertools import chain
from operator import attrgetter
from sys import getsizeof
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import msgpack

from ..errors import FormatError, LimitError, NvckptError, UnsupportedObjectError, brief
from .constants import (
    EXT_BIGINT,
    EXT_COMPLEX,
    EXT_DEVICE,
    EXT_DTYPE,
    EXT_FROZENSET,
    EXT_NDARRAY,
    EXT_PATH,
    EXT_SET,
    EXT_TENSOR,
    EXT_TUPLE,
    FEATURE_ARRAYS_PATHS,
    FEATURE_TYPED_TREE,
    KNOWN_REQUIRED_FEATURES,
    MAX_BIGINT_BYTES,
    NON_NUMPY_DTYPES,
    PATH_FLAVOURS,
    MAX_PAYLOAD_DEPTH,
    MAX_TREE_DEPTH,
    MAX_TYPE_NAME_BYTES,
)

_KEY_TYPES = (str, int, float, bool, type(None))


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A leaf of the tree that stands for index entry ``tensor_id``."""

    tensor_id: int


@dataclass(frozen=True, slots=True)
class ArrayRef(TensorRef):
    """A tensor reference that loads as a NumPy array (ext 9, SPEC 9.3): a TensorRef everywhere else (names,
    loading, checks), so an array is stored, compressed and read like any tensor."""


@dataclass(frozen=True, slots=True)
class PathValue:
    """A pathlib path in the tree (ext 10, SPEC 9.3): its class (an index into PATH_FLAVOURS) and ``str(path)``."""

    flavour: int
    text: str


@dataclass(frozen=True, slots=True)
class DtypeName:
    """A ``torch.dtype`` in the tree (ext 3), by its name in the torch module ("float32")."""

    name: str


@dataclass(frozen=True, slots=True)
class DeviceName:
    """A ``torch.device`` in the tree (ext 4), as ``str(device)`` ("cpu", "cuda:0")."""

    spec: str


class BigInt(int):
    """An int outside msgpack's range [-2^63, 2^64), marked for ext 6 (strict_types hands int subclasses to the hook)."""


class Ext:
    """An ext value outside the tree, kept as stored (code and data, not decoded).

    Only the tree gives ext types a meaning (SPEC 9, 9.2).  Anywhere else an ext is either under a key
    this reader ignores, where it MAY be any value (SPEC 1, 8.1, 8.2), or under a known key, whose type
    check then rejects it (an Ext is no int, str or map)."""

    __slots__ = ("code", "data")

    def __init__(self, code: int, data: bytes) -> None:
        self.code, self.data = code, data

    def __eq__(self, other: object) -> bool:
        return type(other) is Ext and self.code == other.code and self.data == other.data  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((Ext, self.code, self.data))

    def __repr__(self) -> str:
        return f"Ext({self.code}, {self.data[:16]!r}{'...' if len(self.data) > 16 else ''})"


def stored_ext(obj: Any) -> msgpack.ExtType:
    """msgpack's ``default`` hook outside the tree: an ``Ext`` read from a file (in its metadata, or in an
    unregistered codec's configuration) is written back as it was stored (``nvckpt recover``, ``convert``)."""
    if isinstance(obj, Ext):
        return msgpack.ExtType(obj.code, obj.data)
    raise TypeError(f"can not serialize {type(obj).__qualname__!r} object")


def shown(value: Any) -> str:
    """``brief(value)`` for an error message, an ``Ext`` named by its ext type."""
    return f"an ext type {value.code} value" if isinstance(value, Ext) else brief(value)


_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1
_U32 = struct.Struct("<I").unpack
_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
_DEVICE_SPEC = re.compile(r"[a-z][a-z0-9_]*(:(0|[1-9][0-9]{0,8}))?\Z")
TYPED_LEAVES = (DtypeName, DeviceName, complex)


def bigint_bytes(value: int) -> bytes:
    """SPEC 9.2, ext 6: two's complement, little-endian, the fewest bytes that hold it."""
    return value.to_bytes((value if value >= 0 else ~value).bit_length() // 8 + 1, "little", signed=True)


def same_value(item: Any) -> Any:
    """What SPEC 9.2 compares set items by: numbers by exact value across bool, int, float and complex
    (every NaN the same, -0.0 as 0.0, a complex with imaginary part 0 as its real part), strs and bins by
    bytes, tuples item by item, frozensets as sets, dtypes and devices by their names."""
    if item is None:
        return ("nil",)
    if isinstance(item, (bool, int)):
        return ("num", int(item))
    if isinstance(item, float):
        if item != item:
            return ("nan",)
        if item in (float("inf"), float("-inf")):
            return ("inf", item > 0)
        return ("num", int(item)) if item == int(item) else ("frac", item)
    if isinstance(item, complex):
        return same_value(item.real) if item.imag == 0 else ("complex", same_value(item.real), same_value(item.imag))
    if isinstance(item, str):
        return ("str", item)
    if isinstance(item, bytes):
        return ("bin", item)
    if isinstance(item, tuple):
        return ("tuple", tuple(same_value(x) for x in item))
    if isinstance(item, frozenset):
        return ("frozenset", frozenset(same_value(x) for x in item))
    if isinstance(item, DtypeName):
        return ("dtype", item.name)
    if isinstance(item, DeviceName):
        return ("device", item.spec)
    raise TypeError(type(item))


def set_item_problem(item: Any) -> str | None:
    """Why ``item`` cannot be a set item (SPEC 9.2: nil, bool, int, float, str, bin, complex, dtype, device,
    and tuples and frozensets of those); None when it can."""
    if item is None or isinstance(item, (bool, int, float, str, bytes, complex, DtypeName, DeviceName)):
        return None
    if isinstance(item, (tuple, frozenset)):
        return next((p for p in map(set_item_problem, item) if p is not None), None)
    if isinstance(item, TensorRef):
        return f"a set cannot hold {'a NumPy array' if isinstance(item, ArrayRef) else 'a tensor'}"
    return f"a set cannot hold {'a path' if isinstance(item, PathValue) else type(item).__name__}"


def _pack_hook(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, ArrayRef):
        return msgpack.ExtType(EXT_NDARRAY, struct.pack("<I", obj.tensor_id))
    if isinstance(obj, PathValue):
        return msgpack.ExtType(EXT_PATH, bytes([obj.flavour]) + obj.text.encode("utf-8"))
    if isinstance(obj, TensorRef):
        return msgpack.ExtType(EXT_TENSOR, struct.pack("<I", obj.tensor_id))
    if isinstance(obj, tuple):
        return msgpack.ExtType(EXT_TUPLE, pack_tree(list(obj)))
    if isinstance(obj, DtypeName):
        return msgpack.ExtType(EXT_DTYPE, obj.name.encode("ascii"))
    if isinstance(obj, DeviceName):
        return msgpack.ExtType(EXT_DEVICE, obj.spec.encode("ascii"))
    if isinstance(obj, complex):
        return msgpack.ExtType(EXT_COMPLEX, struct.pack("<dd", obj.real, obj.imag))
    if isinstance(obj, int) and not _INT_MIN <= obj <= _INT_MAX:
        return msgpack.ExtType(EXT_BIGINT, bigint_bytes(obj))
    if isinstance(obj, (set, frozenset)):
        # A set has no order: its items are written sorted by their encoding, so a file does not depend on hashing.
        items = sorted(pack_tree(x) for x in obj)
        body = msgpack.Packer().pack_array_header(len(items)) + b"".join(items)
        return msgpack.ExtType(EXT_FROZENSET if isinstance(obj, frozenset) else EXT_SET, body)
    raise UnsupportedObjectError(f"cannot store an object of type {type(obj).__qualname__}")


def pack_tree(node: Any) -> bytes:
    """Serialise a tree whose tensors were already replaced by TensorRef."""
    return msgpack.packb(node, default=_pack_hook, use_bin_type=True, strict_types=True)


_nesting = threading.local()


@contextlib.contextmanager
def _one_level_deeper(limit_message: str) -> Iterator[None]:
    """A tuple's or set's payload is unpacked by a nested call from inside msgpack's C unpacker: bound the
    nesting here, before the C stack overflows (about 41 KB of it per level)."""
    depth = getattr(_nesting, "depth", 0)
    if depth >= MAX_TREE_DEPTH:
        raise LimitError(limit_message)
    _nesting.depth = depth + 1
    try:
        yield
    finally:
        _nesting.depth = depth


def _nested_array(data: bytes, what: str) -> list:
    with _one_level_deeper(f"tree nesting exceeds the limit of {MAX_TREE_DEPTH}"):
        items = unpack_tree(data)
    if not isinstance(items, list):
        raise FormatError(f"{what} ext payload is not an array")
    return items


def _type_name(data: bytes, pattern: re.Pattern, what: str) -> str:
    text = data.decode("ascii", "replace")
    if not 1 <= len(data) <= MAX_TYPE_NAME_BYTES or not pattern.match(text):
        raise FormatError(f"{what} ext payload {text[:80]!r} is not a valid name (SPEC 9.2)")
    return text


def _set_items(data: bytes, what: str) -> tuple[list, set]:
    """A set's items, checked (SPEC 9.2), and the set of their same_value keys."""
    items = _nested_array(data, what)
    seen: set = set()
    for item in items:
        problem = set_item_problem(item)
        if problem is not None:
            raise FormatError(f"{what}: {problem} (SPEC 9.2)")
        key = same_value(item)
        if key in seen:
            shown = brief(item) if isinstance(item, (tuple, frozenset)) else f"{item!r:.80}"
            raise FormatError(f"{what} holds {shown} twice (SPEC 9.2)")
        seen.add(key)
    return items, seen


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_TENSOR and len(data) == 4:  # most exts of a tree: one small object, no nesting
        return TensorRef(_U32(data)[0])
    return _ext_value(code, data)[0]


def _counted_ext_hook(code: int, data: bytes) -> Any:
    """_ext_hook under a memory budget: each value is charged as it is built (a typed value takes up to ~30
    times its bytes in the file: a 3-byte ext 4 is a DeviceName and its str)."""
    value, extra = _ext_value(code, data)
    _nesting.budget.spend(getsizeof(value) + extra)
    return value


def _ext_value(code: int, data: bytes) -> tuple[Any, int]:
    """The tree's value of an ext, and the memory it holds beyond its own object (_counted_ext_hook)."""
    if code == EXT_TENSOR:
        if len(data) != 4:
            raise FormatError(f"tensor reference has {len(data)} bytes, expected 4")
        return TensorRef(struct.unpack("<I", data)[0]), 0
    if code == EXT_TUPLE:
        return tuple(_nested_array(data, "tuple")), 0
    if code == EXT_NDARRAY:
        if len(data) != 4:
            raise FormatError(f"NumPy array reference (ext 9) has {len(data)} bytes, expected 4")
        return ArrayRef(struct.unpack("<I", data)[0]), 0
    if code == EXT_PATH:
        return path_value(data), len(data) + 64
    if code in (EXT_DTYPE, EXT_DEVICE):
        name = _type_name(data, *((_DTYPE_NAME, "dtype") if code == EXT_DTYPE else (_DEVICE_SPEC, "device")))
        return (DtypeName if code == EXT_DTYPE else DeviceName)(name), getsizeof(name)
    if code == EXT_COMPLEX:
        if len(data) != 16:
            raise FormatError(f"complex ext payload has {len(data)} bytes, expected 16")
        return complex(*struct.unpack("<dd", data)), 0
    if code == EXT_BIGINT:
        if len(data) > MAX_BIGINT_BYTES:
            raise LimitError(f"integer of {len(data)} bytes exceeds the limit of {MAX_BIGINT_BYTES}")
        value = int.from_bytes(data, "little", signed=True)
        if _INT_MIN <= value <= _INT_MAX or bigint_bytes(value) != data:
            raise FormatError(f"integer ext payload {data.hex()[:80]} is not the shortest encoding of an int "
                              "outside [-2^63, 2^64) (SPEC 9.2)")
        return value, 0
    if code in (EXT_SET, EXT_FROZENSET):
        items, seen = _set_items(data, "set" if code == EXT_SET else "frozenset")
        # The set of keys that checked the items for duplicates was as large as the set: charged too.
        return (set if code == EXT_SET else frozenset)(items), getsizeof(seen)
    raise FormatError(f"unknown ext type {code} in the tree")


def path_value(data: bytes) -> PathValue:
    """Ext 10's data (SPEC 9.3): a flavour byte 0..3, then the path's str, strict UTF-8, at least one byte."""
    if len(data) < 2 or data[0] >= len(PATH_FLAVOURS):
        raise FormatError(f"path ext (10) data {data[:40].hex()} is not a flavour byte 0..3 and a non-empty str (SPEC 9.3)")
    try:
        text = data[1:].decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError("path ext (10) holds a str that is not valid UTF-8 (SPEC 9.3)") from None
    if "\0" in text:
        raise FormatError("path ext (10) holds a NUL character, which no file system path holds (SPEC 9.3)")
    return PathValue(data[0], text)


def _plain_ext_hook(code: int, data: bytes) -> Any:
    """Exts outside the tree: kept as stored (``Ext``), their data never parsed.  Only the tree gives ext
    types a meaning (SPEC 1, 9): under a key a reader ignores an ext MAY hold any data (a tuple's data nested
    200 deep included), and under a known key the type checks reject it."""
    return Ext(code, data)


def _counted_plain_ext_hook(code: int, data: bytes) -> Any:
    ext = Ext(code, data)
    _nesting.budget.spend(getsizeof(ext) + getsizeof(data))
    return ext


def _is_nan(key: Any) -> bool:
    return isinstance(key, float) and key != key


def _key_form(key: Any) -> Any:
    """What SPEC 1 compares map keys by, for keys inside a key: numbers by exact value across bool, int and
    float (Python's equality, which also makes -0.0 0.0) with every NaN one value; strs, bins and exts by
    their bytes (msgpack's timestamps by the instant); arrays item by item; maps as sets of entries."""
    if isinstance(key, ContainerKey):
        return key.form
    if isinstance(key, list):
        return ("array", tuple(map(_key_form, key)))
    if isinstance(key, dict):
        return ("map", frozenset((_key_form(k), _key_form(v)) for k, v in key.items()))
    if isinstance(key, float) and key != key:
        return ("nan",)
    if isinstance(key, (set, frozenset)):  # a set in the tree (ext 7 or 8): never a valid key (SPEC 9.2)
        return ("set", frozenset(map(_key_form, key)))
    return key


class ContainerKey:
    """A map key that is an array or a map (valid msgpack, allowed only inside values a reader ignores,
    SPEC 1), kept hashable by its SPEC 1 form so that the map can still be a dict."""

    __slots__ = ("value", "form")

    def __init__(self, value: Any) -> None:
        self.value, self.form = value, _key_form(value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ContainerKey) and self.form == other.form

    def __hash__(self) -> int:
        return hash(self.form)

    def __repr__(self) -> str:
        return f"ContainerKey({self.value!r:.80})"

    @property
    def kind(self) -> str:
        return "an array" if isinstance(self.value, list) else "a map" if isinstance(self.value, dict) else "a set"


def key_type(key: Any) -> str:
    """A map key's type, for messages ("array" for a ContainerKey of one)."""
    return key.kind.split()[-1] if isinstance(key, ContainerKey) else f"ext {key.code}" if isinstance(key, Ext) else type(key).__name__


def unique_map(pairs: list[tuple[Any, Any]]) -> dict:
    """msgpack object_pairs_hook: a map may not hold the same key twice (SPEC 1).

    "The same key" is Python's dict equality (1, 1.0 and True; 0.0 and -0.0; bins and exts by their
    bytes) plus one rule Python's dict lacks: every NaN is the same key as every other.  Array and map
    keys become ContainerKeys (the checks of every map with a meaning reject them)."""
    try:
        out = dict(pairs)
    except TypeError:  # an array, map or set key: unhashable as itself
        pairs = [(ContainerKey(k) if isinstance(k, (list, dict, set)) else k, v) for k, v in pairs]
        out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise FormatError(f"a msgpack map holds the key {brief(dup)} twice")
    if len(pairs) > 1 and float in set(map(type, out)) and sum(_is_nan(k) for k in out) > 1:
        raise FormatError("a msgpack map holds two NaN keys (every NaN is the same key, SPEC 1)")
    return out


def check_depth(value: Any, what: str, level: int = 1) -> None:
    """LimitError if containers in ``value``, whose root is at ``level`` of its payload, reach past level
    MAX_PAYLOAD_DEPTH (SPEC 9, "Parser bound": every payload, values under ignored keys included).

    Iterative, so any depth msgpack produced is safe to look at."""
    containers = (list, tuple, dict, set, frozenset)
    if not isinstance(value, containers):
        return
    stack = [(value, level)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_PAYLOAD_DEPTH:
            raise LimitError(f"{what} nests more than {MAX_PAYLOAD_DEPTH} levels deep, counted from its payload's "
                             "root (SPEC 9, MAX_PAYLOAD_DEPTH)")
        if isinstance(item, dict):  # an array or map key (ContainerKey) nests too
            children = [*item.values(), *(k.value for k in item if isinstance(k, ContainerKey))]
        else:
            children = item
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
def msgpack_errors(what: str, memory: str, *, where: str = "", offset: int | None = None) -> Iterator[None]:
    """What msgpack raises while decoding hostile or malformed ``what`` (the index, a frame payload) as
    nvckpt's errors: LimitError for nesting past msgpack's 1024 levels and for input whose decoding does
    not fit in memory (``memory`` says what did not fit), FormatError for the rest; ``where`` narrows it
    down (" (tensor 3)"); nvckpt's own errors pass, located at ``offset`` when given."""
    try:
        yield
    except NvckptError as exc:
        raise exc.located(offset=offset) if offset is not None else exc
    except (RecursionError, msgpack.StackError):
        raise LimitError(f"{what} nesting is too deep" + (where or " (more than msgpack's 1024 levels)"),
                         offset=offset) from None
    except MemoryError:
        raise LimitError(f"{memory} does not fit in memory", offset=offset) from None
    except Exception as exc:  # msgpack raises several types on malformed input
        raise FormatError(f"{what} is not valid msgpack{where}: {str(exc)[:200]}", offset=offset) from None


def unpackb(data: bytes, *, tree: bool = False) -> Any:
    """msgpack as the index and frames use it: str keys or scalars, unique keys; ``tree``: the ext types
    decoded as the tree's (SPEC 9), else kept as ``Ext`` (``_plain_ext_hook``).

    msgpack's own limits bound what a payload can make it allocate (no container
    longer than the payload) and its nesting (1024 levels, without recursion);
    tuples, sets and frozensets nest through ``_ext_hook``, bounded there (``_nested_array``); ``memory_budget`` bounds the total."""
    if getattr(_nesting, "budget", None) is not None:
        hook = _counted_ext_hook if tree else _counted_plain_ext_hook
        return msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False, use_list=True,
                               object_pairs_hook=_counted_map, list_hook=_counted_list)
    return msgpack.unpackb(data, ext_hook=_ext_hook if tree else _plain_ext_hook, raw=False, strict_map_key=False,
                           use_list=True, object_pairs_hook=unique_map)


def unpack_tree(data: bytes) -> Any:
    """A tree (or a tuple's or set's array) from its msgpack bytes, its ext types decoded (SPEC 9, 9.2)."""
    try:
        return unpackb(data, tree=True)
    except (FormatError, LimitError):
        raise
    except (RecursionError, msgpack.StackError):
        raise LimitError(f"tree nesting exceeds the limit of {MAX_TREE_DEPTH}") from None
    except MemoryError:
        raise LimitError(f"a tuple or set of {len(data)} bytes does not fit in memory") from None
    except Exception as exc:  # msgpack raises many types on bad input
        raise FormatError(f"tree is not valid msgpack: {str(exc)[:200]}") from None


def check_tree(node: Any, num_tensors: int, required_features: int = KNOWN_REQUIRED_FEATURES,
               dtypes: Callable[[int], str] | None = None) -> None:
    """Validate types, depth and tensor references of a decoded tree.  The typed extensions (SPEC 9.2)
    are allowed only when ``required_features`` (the preamble's) has FEATURE_TYPED_TREE, arrays and paths
    (9.3) only when it has FEATURE_ARRAYS_PATHS; ``dtypes(tensor_id)``: the entry's dtype name, which an
    array's must have a NumPy dtype for."""
    typed_ok = bool(required_features & FEATURE_TYPED_TREE)
    arrays_ok = bool(required_features & FEATURE_ARRAYS_PATHS)
    stack = [(node, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, dict, set, frozenset)) and depth > MAX_TREE_DEPTH:
            raise LimitError(f"tree nesting exceeds the limit of {MAX_TREE_DEPTH}")
        if not typed_ok and is_typed(item):
            raise FormatError(f"the tree holds a {type(item).__name__} (a typed extension, SPEC 9.2) but the preamble "
                              "does not set required_features bit 1")
        if isinstance(item, (set, frozenset)):
            stack.extend((x, depth + 1) for x in item if isinstance(x, (tuple, frozenset)) or is_typed(x))
        elif isinstance(item, TensorRef):
            if item.tensor_id >= num_tensors:
                raise FormatError(f"tree refers to tensor {item.tensor_id}, but the index has {num_tensors}")
            if isinstance(item, ArrayRef):
                if not arrays_ok:
                    raise FormatError("the tree holds a NumPy array reference (ext 9, SPEC 9.3) but the preamble does "
                                      "not set required_features bit 2")
                if dtypes is not None and dtypes(item.tensor_id) in NON_NUMPY_DTYPES:
                    raise FormatError(f"the tree holds a NumPy array reference to tensor {item.tensor_id} of dtype "
                                      f"{dtypes(item.tensor_id)}, which NumPy has no dtype for (SPEC 9.3)")
        elif isinstance(item, PathValue):
            if not arrays_ok:
                raise FormatError("the tree holds a path (ext 10, SPEC 9.3) but the preamble does not set "
                                  "required_features bit 2")
        elif isinstance(item, (list, tuple)):
            if _only_refs(item, num_tensors):
                continue
            stack.extend((x, depth + 1) for x in item)
        elif isinstance(item, dict):
            if _only_refs(item.values(), num_tensors) and set(map(type, item)) <= _PLAIN_KEY_TYPES:
                continue
            for k, v in item.items():
                if not isinstance(k, _KEY_TYPES):
                    raise FormatError(f"tree map key of type {key_type(k)} is not allowed")
                if is_typed(k):  # an int only ext 6 encodes: typed extensions are never map keys (SPEC 9.2)
                    raise FormatError("tree map key is an integer ext (6); typed extensions are never map keys (SPEC 9.2)")
                stack.append((v, depth + 1))
        elif isinstance(item, Ext):
            raise FormatError(f"unknown ext type {item.code} in the tree")
        elif not isinstance(item, (str, bytes, int, float, bool, type(None), PathValue, *TYPED_LEAVES)):
            raise FormatError(f"unexpected {type(item).__name__} in the tree")


_PLAIN_KEY_TYPES = {str, int, float, bool, type(None)}  # (not BigInt: an int only ext 6 encodes is no key)
_TENSOR_ID = attrgetter("tensor_id")


def _only_refs(values: Any, num_tensors: int) -> bool:
    """Whether ``values`` (a container's, two or more) are all tensor references to entries of the index: a
    module's state dict, checked without a step per value (a state of a million tensors)."""
    return (len(values) > 1 and set(map(type, values)) == {TensorRef}
            and max(map(_TENSOR_ID, values)) < num_tensors)


def is_typed(item: Any) -> bool:
    """A value that only the typed extensions of SPEC 9.2 encode."""
    return (isinstance(item, (set, frozenset, *TYPED_LEAVES))
            or (type(item) in (int, BigInt) and not _INT_MIN <= item <= _INT_MAX))


def tree_features(node: Any) -> int:
    """The required_features bits a file with this tree must set (FEATURE_TYPED_TREE, FEATURE_ARRAYS_PATHS)."""
    stack = [node]
    bits = 0
    while stack:
        item = stack.pop()
        if is_typed(item):
            bits |= FEATURE_TYPED_TREE
        elif isinstance(item, (ArrayRef, PathValue)):
            bits |= FEATURE_ARRAYS_PATHS
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return bits


def resolve_refs(node: Any, get: Callable[[int], Any], typed: Callable[[Any], Any] | None = None,
                 array: Callable[[Any], Any] | None = None) -> Any:
    """The tree with every TensorRef replaced by ``get(tensor_id)`` (an ArrayRef by ``array(get(tensor_id))``
    when ``array`` is given), and (with ``typed``) every DtypeName, DeviceName and PathValue by
    ``typed(value)`` (the loader makes torch and pathlib objects of them)."""
    if isinstance(node, TensorRef):
        if array is not None and isinstance(node, ArrayRef):
            return array(get(node.tensor_id))
        return get(node.tensor_id)
    if typed is not None and isinstance(node, (DtypeName, DeviceName, PathValue)):
        return typed(node)
    if isinstance(node, dict):
        return {k: resolve_refs(v, get, typed, array) for k, v in node.items()}
    if isinstance(node, tuple):
        return tuple(resolve_refs(v, get, typed, array) for v in node)
    if isinstance(node, list):
        return [resolve_refs(v, get, typed, array) for v in node]
    if typed is not None and isinstance(node, (set, frozenset)):
        return type(node)(resolve_refs(v, get, typed, array) for v in node)
    return node


def escape(key: object) -> str:
    """One path segment: JSON Pointer escaping (RFC 6901) of str(key)."""
    return str(key).replace("~", "~0").replace("/", "~1")


def leaf_paths(node: Any, parts: tuple[str, ...] = ()) -> Iterator[tuple[str, TensorRef]]:
    """(name, ref) of every tensor leaf, depth first in stored order."""
    if isinstance(node, TensorRef):
        yield "/".join(parts), node
    elif isinstance(node, dict):
        if len(node) > 1 and set(map(type, node.values())) == {TensorRef}:  # a module's state: one step for all
            prefix = "/".join(parts) + "/" if parts else ""
            yield from [(prefix + (k.replace("~", "~0").replace("/", "~1") if type(k) is str else escape(k)), v)
                        for k, v in node.items()]
            return
        for k, v in node.items():
            yield from leaf_paths(v, parts + (escape(k),))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from leaf_paths(v, parts + (str(i),))


def find_path(node: Any, path: str) -> Any:
    """The node at ``path`` (SPEC 14.1: segments joined by "/", dict keys as escape() writes them, list and
    tuple items by their index); raises KeyError when no node has that path."""
    if path == "":
        return node
    for segment in path.split("/"):
        if isinstance(node, dict):
            node = next((v for k, v in node.items() if escape(k) == segment), _MISSING)
        elif isinstance(node, (list, tuple)) and segment.isdigit() and str(int(segment)) == segment and int(segment) < len(node):
            node = node[int(segment)]
        else:
            node = _MISSING
        if node is _MISSING:
            raise KeyError(path)
    return node


def tensor_refs(node: Any) -> Iterator[TensorRef]:
    """Every tensor reference under ``node`` (sets hold none)."""
    if isinstance(node, TensorRef):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from tensor_refs(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            yield from tensor_refs(v)


_MISSING = object()
