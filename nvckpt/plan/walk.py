"""Plan a save: walk the object, find shared storage and derived tensors, cut chunks.

The plan is device-agnostic: it holds the caller's tensors (CPU or CUDA) and
says which bytes go in which chunk.  Engines (CPU, GPU) turn it into frames.
"""

from __future__ import annotations

import copy
import math
import pathlib
import warnings
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import LimitError, UnsupportedObjectError
from ..format.constants import FEATURE_ARRAYS_PATHS, FEATURE_TYPED_TREE, PATH_FLAVOURS, MAX_BIGINT_BYTES, MAX_NAME_BYTES, MAX_RANK, MAX_TENSOR_BYTES, MAX_TENSORS, MAX_TREE_DEPTH
from ..format.dtypes import DTYPES
from ..format.tree import (ArrayRef, BigInt, DeviceName, DtypeName, PathValue, TensorRef, bigint_bytes, escape, is_typed, same_value,
                           set_item_problem)
from . import layout as layout_of
from .chunking import CPU_CHUNK_SIZE, chunk_policy
from .derived import DerivedSearch
from ..tensors import flat_bytes
from ..tensors.dtypes import name_of

_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1
_KEY_TYPES = (str, int, float, bool, type(None))


@dataclass
class PlannedTensor:
    tensor_id: int
    entry: dict[str, Any]  # index entry without "chunks"
    data: torch.Tensor | None  # what to store (any layout, any device); None for views/derived
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (byte_start, byte_length)

    @property
    def name(self) -> str:
        return self.entry["name"]

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.chunks)

    def flat_bytes(self) -> torch.Tensor:
        """The C-contiguous raw bytes of ``data`` as a 1-D uint8 tensor (same device)."""
        assert self.data is not None
        return flat_bytes(self.data)


@dataclass
class SavePlan:
    tree: Any
    tensors: list[PlannedTensor]
    metadata: dict[str, Any]
    required_features: int = 0  # SPEC 3: FEATURE_TYPED_TREE (a typed extension, 9.2), FEATURE_ARRAYS_PATHS (9.3)
    seconds: dict[str, float] = field(default_factory=dict)  # what planning took: walk, derived tensors
    _search: Any = field(default=None, repr=False)  # a DerivedSearch not yet verified (plan_save(defer=True))
    _decided: threading.Event = field(default_factory=threading.Event, repr=False)
    _decide_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _decide_error: BaseException | None = field(default=None, repr=False)
    _layout: Any = field(default=None, repr=False)  # the _Layout this plan was made from (learns what decide() found)
    _cutter: Any = field(default=None, repr=False)  # the _Layout that cuts its chunks (plan.layout: cut once per size)
    searched: bool = False  # the derived tensors were searched for (False: the pairs of an earlier save were checked)
    layout_reused: bool = False  # entries and chunks taken from an earlier save of the same layout (plan.layout)

    @property
    def undecided(self) -> set[int]:
        """Tensor ids whose storage (stored, derived) ``decide`` may still change."""
        search = self._search  # read once: decide() in another thread drops it
        return set() if self._decided.is_set() or search is None else set(search.undecided)

    def decide(self) -> None:
        """Verify the derived-tensor candidates (once; other callers wait for it, and see its error)."""
        with self._decide_lock:
            if not self._decided.is_set():
                started = time.perf_counter()
                try:
                    if self._search is not None:
                        self._search.verify()
                        if self._layout is not None:
                            self._layout.learn(self.tensors, self._search)
                except BaseException as exc:
                    self._decide_error = exc
                    raise
                finally:
                    self._search = None
                    self.seconds["derived_verify"] = time.perf_counter() - started
                    self._decided.set()
        if self._decide_error is not None:
            raise self._decide_error

    def cut(self, chunk_size: Any) -> None:
        """Cut the stored tensors' chunks: ``chunk_size`` is a ChunkPolicy, or an int for whole rows of about that
        many raw bytes (nvckpt.plan.chunking); plan_save(chunk_size=None) did not cut."""
        self._cutter.cut(self.tensors, chunk_policy(chunk_size))

    @property
    def raw_bytes(self) -> int:
        """Bytes of every tensor a load materializes (views and derived tensors too; not internal bases)."""
        return sum(math.prod(t.entry["shape"]) * DTYPES[t.entry["dtype"]].itemsize
                   for t in self.tensors if not t.entry.get("internal"))

    def entries(self) -> list[dict[str, Any]]:
        return [t.entry for t in self.tensors]

    def chunk_lengths(self) -> list[list[int]]:
        return [[n for _, n in t.chunks] for t in self.tensors]


def _check_int(value: int, path: str) -> int:
    if not _INT_MIN <= value <= _INT_MAX:
        raise UnsupportedObjectError(f"integer at {path or '<root>'} does not fit in 64 bits: {value}")
    return value


def typed_leaf(node: Any, path: str) -> Any:
    """A leaf that SPEC 9.2's typed extensions store (dtype, device, complex, big int, NumPy scalar), as the
    tree holds it; None when ``node`` is none of them."""
    if isinstance(node, torch.dtype):
        return DtypeName(str(node).removeprefix("torch."))
    if isinstance(node, torch.device):
        return DeviceName(str(node))
    if isinstance(node, np.generic) and node.dtype.kind in "biufc":
        # NumPy scalars are stored as the Python number they hold: np.int64 as int, np.float32 as float.
        return _scalar_leaf(node.item(), path)
    return None


_PATH_CLASSES = {getattr(pathlib, name): k for k, name in enumerate(PATH_FLAVOURS)}
# NumPy dtypes stored as the tensor dtype of the same name (SPEC 9.3); byte order aside, no other has a torch form.
_ARRAY_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                           "float32", "float64", "complex64", "complex128"})


def array_tensor(arr: np.ndarray, path: str) -> torch.Tensor:
    """A NumPy array as the tensor that stores it (SPEC 9.3): its memory where torch can view it (so arrays
    that share memory stay shared, as tensors do), else a C-ordered copy; non-native byte order is made
    native (the values are kept, the byte order is not)."""
    if arr.dtype.name not in _ARRAY_DTYPES or arr.dtype.fields is not None:
        fix = ("store arr.tolist() (plain values) or convert it to a numeric dtype" if arr.dtype.kind in "OUSMmV"
               else f"convert it with arr.astype(...) to one of {', '.join(sorted(_ARRAY_DTYPES))}")
        raise UnsupportedObjectError(f"cannot store a NumPy array of dtype {arr.dtype} at {path or '<root>'}: {fix}; "
                                     "nvckpt stores NumPy arrays of bool, int8-64, uint8-64, float16/32/64 and "
                                     "complex64/128 (no pickle)")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only array: the save only reads it
        try:
            return torch.from_numpy(arr)
        except (ValueError, TypeError):  # negative strides, or strides that are no multiple of the item
            return torch.from_numpy(np.array(arr, order="C", copy=True))  # a fresh array: positive strides


def path_leaf(node: pathlib.PurePath, path: str) -> PathValue:
    """A pathlib path as the tree stores it (SPEC 9.3): its class and str(path)."""
    text = str(node)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a POSIX name that is not UTF-8 (os.fsdecode's surrogate escapes)
        raise UnsupportedObjectError(f"path {text[:80]!r} at {path or '<root>'} is not valid Unicode (a file name in "
                                     "another encoding): store os.fsencode(path) (bytes) instead") from None
    return PathValue(_PATH_CLASSES[type(node)], text)


def fix_for(value: Any) -> str:
    """What to store instead of ``value``, a value the tree cannot hold (for the error that refuses it); ""
    where nothing better than the list of storable types can be said."""
    import dataclasses
    import datetime
    import enum
    import functools
    import pathlib
    import types
    from collections.abc import Mapping

    kind = type(value)
    if isinstance(value, np.ndarray):  # a subclass (matrix, masked array, memmap): its extra state is not stored
        return f"store np.asarray(arr) (a plain ndarray; the {type(value).__name__}'s own attributes are not stored)"
    if isinstance(value, pathlib.PurePath):  # a subclass of pathlib's classes
        return "store pathlib.Path(path) (or str(path)); only pathlib's own path classes are stored"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "store dataclasses.asdict(obj) (a dict of its fields; cls(**d) after loading)"
    if callable(getattr(value, "state_dict", None)):
        return "store obj.state_dict() (obj.load_state_dict(...) after loading), as for a module or optimizer"
    if kind.__module__.startswith("omegaconf"):
        return "store OmegaConf.to_container(cfg, resolve=True) (a dict; OmegaConf.create(d) after loading)"
    if isinstance(value, Mapping):
        return "store dict(value)"
    if kind.__name__ == "Namespace":  # argparse's and SimpleNamespace
        return "store vars(ns) (a dict)"
    if isinstance(value, enum.Enum):
        return "store member.value or member.name (an enum that is a str or int is stored as that)"
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return "store value.isoformat() (fromisoformat() after loading)"
    if isinstance(value, datetime.timedelta):
        return "store value.total_seconds()"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType,
                          functools.partial)):
        return "code cannot be stored without pickle: store its name (a str) and look it up after loading"
    if hasattr(value, "__dict__"):
        return ("give its class state_dict() / load_state_dict() and store obj.state_dict(), or store its fields as "
                "a dict (vars(obj))")
    return ""


def _scalar_leaf(value: Any, path: str) -> Any:
    if isinstance(value, complex):
        return complex(value)
    if isinstance(value, int) and not isinstance(value, bool) and not _INT_MIN <= value <= _INT_MAX:
        size = len(bigint_bytes(int(value)))
        if size > MAX_BIGINT_BYTES:  # SPEC 16: a reader refuses it, so the file would not load
            raise LimitError(f"integer at {path or '<root>'} takes {size} bytes, more than the format's limit of "
                             f"{MAX_BIGINT_BYTES} ({8 * MAX_BIGINT_BYTES} bits); store it as a str or bytes")
        return BigInt(int(value))
    return _plain_scalar(value, path)


def _set_value(node: set | frozenset, path: str) -> Any:
    """A set or frozenset of scalars (SPEC 9.2); its items are hashable, so never containers of tensors."""
    items = []
    for item in node:
        value = _set_item(item, path)
        problem = set_item_problem(value)
        if problem is not None:
            raise UnsupportedObjectError(f"{type(node).__name__} at {path or '<root>'}: {problem}; a set may hold "
                                         "None, bool, int, float, complex, str, bytes, torch.dtype, torch.device and "
                                         "tuples and frozensets of those")
        items.append(value)
    if len({same_value(v) for v in items}) != len(items):
        raise UnsupportedObjectError(f"{type(node).__name__} at {path or '<root>'} holds two items that the file "
                                     "would store as one (two NaNs, or 1 and 1.0 after conversion)")
    return frozenset(items) if isinstance(node, frozenset) else set(items)


def _nesting(value: Any) -> int:
    """Container levels of a set value (SPEC 9: a set or tuple is one level)."""
    if isinstance(value, (tuple, set, frozenset)):
        return 1 + max(map(_nesting, value), default=0)
    return 0


def _set_item(item: Any, path: str) -> Any:
    typed = typed_leaf(item, path)
    if typed is not None:
        return typed
    if isinstance(item, tuple):
        return tuple(_set_item(x, path) for x in item)
    if isinstance(item, frozenset):
        return _set_value(item, path)
    if item is None or isinstance(item, (bool, int, float, str, bytes, complex)):
        return _scalar_leaf(item, path)
    return item  # refused by the caller, naming its type


def _normalize_bools(leaves: list[tuple[str, torch.Tensor, tuple[str, int]]]) -> None:
    """Bool tensors holding bytes other than 0 and 1 (a uint8 tensor viewed as bool, torch.empty) stored as
    what torch reads them as: any nonzero byte is True, stored as 1 (SPEC 10: a file with another byte is
    invalid).  One check per device for all bool tensors; a storage holding such a byte is normalized once,
    and every bool leaf of it becomes the same view of the normalized copy (tied tensors and views of it stay
    tied)."""
    by_device: dict[torch.device, list[int]] = {}
    for k, (_, t, facts) in enumerate(leaves):
        if facts[0] == "bool" and t.numel():
            by_device.setdefault(t.device, []).append(k)
    for ks in by_device.values():
        with torch.no_grad():
            odd = torch.stack([(leaves[k][1].view(torch.uint8) > 1).any() for k in ks]).cpu().tolist()
            fixed: dict[int, torch.Tensor] = {}
            for k, bad in zip(ks, odd):
                storage = leaves[k][1].untyped_storage()
                if bad and storage.data_ptr() not in fixed:
                    whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
                    fixed[storage.data_ptr()] = whole.ne(0)
            if not fixed:
                continue
            for k in ks:
                path, t, facts = leaves[k]
                normalized = fixed.get(t.untyped_storage().data_ptr())
                if normalized is not None:
                    leaves[k] = (path, normalized.as_strided(t.shape, t.stride(), t.storage_offset()), facts)


def refuse_without_bytes(t: torch.Tensor, path: str) -> None:
    """Refuses a tensor that has no plain bytes to store: nested, sparse (any layout but strided), quantized,
    or on the meta device (save, and convert for every destination format)."""
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
        raise UnsupportedObjectError(f"tensor at {path or '<root>'} is an uninitialized parameter or buffer of a lazy "
                                     "module (it has no shape or data yet): run a forward pass first, or leave it out")
    if t.is_nested:
        raise UnsupportedObjectError(f"tensor at {path or '<root>'} is a nested tensor; store its components "
                                     "(a list: t.unbind()) instead")
    if t.layout != torch.strided:
        raise UnsupportedObjectError(f"tensor at {path or '<root>'} has layout {t.layout}; only dense tensors are stored")
    if t.is_quantized or t.is_meta:
        raise UnsupportedObjectError(f"tensor at {path or '<root>'} is "
                                     f"{'quantized' if t.is_quantized else 'on the meta device (it holds no data)'}")


def _check_tensor(t: torch.Tensor, path: str) -> tuple[str, int]:
    """Refuses what the format cannot store; returns the tensor's dtype name and element size (asked once
    here: a state has thousands of tensors, and every attribute of one costs host time)."""
    refuse_without_bytes(t, path)
    shape = t.shape
    if len(shape) > MAX_RANK:
        raise LimitError(f"tensor at {path or '<root>'} has rank {len(shape)} > {MAX_RANK}")
    name = name_of(t.dtype)  # raises for dtypes without a byte layout
    size = t.element_size()
    n = t.numel()
    span = (n if n else math.prod(d or 1 for d in shape)) * size  # SPEC 8.3 (zero dims count as 1)
    if span > MAX_TENSOR_BYTES:
        raise LimitError(f"tensor at {path or '<root>'} of shape {list(shape)} spans {span} bytes, more than the "
                         f"limit of {MAX_TENSOR_BYTES}")
    return name, size


def plan_save(
    obj: Any,
    *,
    metadata: dict[str, Any] | None = None,
    chunk_size: Any = CPU_CHUNK_SIZE,
    derive: bool = False,
    copies: bool = False,
    defer: bool = False,
    remember: bool = True,
) -> SavePlan:
    """The plan of saving ``obj``: its tree, one PlannedTensor per distinct tensor, their chunks.

    ``chunk_size``: the target chunk size; None: not cut yet (``SavePlan.cut``, once the engine that will
    run, which depends on where the tensors live, says its chunk size).  ``derive``: find
    bf16 tensors that are the rounding of a stored fp32 one; ``copies``: find exact copies.  ``defer``:
    only pick the candidates; ``SavePlan.decide()`` verifies them later (until then ``undecided`` names
    the tensors whose storage may change).  ``remember``: take the plan of a layout saved before, and keep
    this one's (plan.layout); False for a plan made only to check an object."""
    if chunk_size is not None:
        chunk_size = chunk_policy(chunk_size)
    elif not defer:
        raise ValueError("plan_save(chunk_size=None) needs defer=True: the derived tensors are decided on cut chunks")
    started = time.perf_counter()
    leaves: list[tuple[str, torch.Tensor, tuple[str, int]]] = []  # (path, tensor, (dtype name, element size)) in tree order
    typed = False  # a value only SPEC 9.2's typed extensions store (FEATURE_TYPED_TREE)
    arrays_paths = False  # a NumPy array or a path (SPEC 9.3, FEATURE_ARRAYS_PATHS)

    # The tree is built as it is walked, a tensor as TensorRef(its leaf index) (renumbered below where two
    # leaves are one tensor).  A path is joined only where it is used (a tensor's name, an error): this
    # runs once per container, key and tensor of the state, thousands of times per save.
    def walk(node: Any, parts: tuple[str, ...], depth: int) -> Any:
        nonlocal typed, arrays_paths
        if isinstance(node, torch.Tensor) or type(node) is np.ndarray:
            path = "/".join(parts)
            is_array = not isinstance(node, torch.Tensor)
            if is_array:
                node = array_tensor(node, path)
                arrays_paths = True
            facts = _check_tensor(node, path)
            if node.is_conj() or node.is_neg():
                # A lazy conjugate/negative view shares bytes with its source but shows other values:
                # store the values it shows, as a tensor of its own.
                node = node.detach().resolve_conj().resolve_neg()
            leaves.append((path, node, facts))
            return ArrayRef(len(leaves) - 1) if is_array else TensorRef(len(leaves) - 1)
        if isinstance(node, dict):
            if depth > MAX_TREE_DEPTH:  # SPEC 9: containers count, not leaves
                raise LimitError(f"object nesting at {'/'.join(parts)} exceeds the limit of {MAX_TREE_DEPTH}")
            out = {}
            nans = 0
            for k, v in node.items():
                if type(k) is str and k.isascii():  # the common key: valid UTF-8, stored as it is
                    key = k
                else:
                    key = _dict_key(k, "/".join(parts))
                    if isinstance(key, float) and key != key:
                        nans += 1
                        if nans > 1:  # SPEC 1: every NaN is the same key
                            raise UnsupportedObjectError(f"dict at {'/'.join(parts) or '<root>'} has two NaN keys; a map "
                                                         "may hold at most one")
                seg = key if type(key) is str and "~" not in key and "/" not in key else escape(key)
                out[key] = walk(v, parts + (seg,), depth + 1)
            return out
        if isinstance(node, (list, tuple)):
            if depth > MAX_TREE_DEPTH:
                raise LimitError(f"object nesting at {'/'.join(parts)} exceeds the limit of {MAX_TREE_DEPTH}")
            items = [walk(v, parts + (str(i),), depth + 1) for i, v in enumerate(node)]
            return items if isinstance(node, list) else tuple(items)
        path = "/".join(parts)
        if node is None or isinstance(node, (bool, int, float, str, bytes, complex)):
            value = _scalar_leaf(node, path)
        elif type(node) in _PATH_CLASSES:
            value = path_leaf(node, path)
            arrays_paths = True
        elif isinstance(node, (set, frozenset)):
            value = _set_value(node, path)
            if depth + _nesting(value) - 1 > MAX_TREE_DEPTH:
                raise LimitError(f"object nesting at {path} exceeds the limit of {MAX_TREE_DEPTH}")
        else:
            value = typed_leaf(node, path)
            if value is None:
                fix = fix_for(node)
                raise UnsupportedObjectError(
                    f"cannot store {type(node).__module__}.{type(node).__qualname__} at {path or '<root>'}: "
                    f"{fix + '; ' if fix else ''}nvckpt stores tensors, dicts, lists, tuples, sets, str, bytes, int, float, "
                    "complex, bool, None, torch.dtype and torch.device (no pickle)"
                )
        if not typed and is_typed(value):
            typed = True
        return value

    tree = walk(obj, (), 1)  # the root container is level 1, as in check_tree
    if metadata is not None:
        _check_metadata(metadata)
    _normalize_bools(leaves)

    key = (derive, copies, layout_of.fingerprint(leaves) if remember else None)
    layout = layout_of.known(key)
    reused = layout is not None
    if layout is None:
        plan_tensors, leaf_ids, sources = _dedupe(leaves)
        layout = layout_of.Layout(key, plan_tensors, leaf_ids, sources)
    else:
        plan_tensors, leaf_ids = layout.instantiate(leaves)
    if chunk_size is not None:
        layout.cut(plan_tensors, chunk_size)
    walked = time.perf_counter()
    search = None
    if derive or copies:
        hints = layout.hints()
        search = DerivedSearch(plan_tensors, bf16=derive, copies=copies, hints=hints)
    derived = time.perf_counter()
    if len(plan_tensors) > MAX_TENSORS:
        raise LimitError(f"{len(plan_tensors)} tensors exceed the limit of {MAX_TENSORS}")
    if leaf_ids != list(range(len(leaves))):  # tied weights or views: leaves that are one tensor, bases
        tree = _renumber(tree, leaf_ids)
    # A copy, as the tree is: an async_save must not see the caller change its metadata afterwards.
    plan = SavePlan(tree, plan_tensors, copy.deepcopy(metadata) if metadata else {}, (FEATURE_TYPED_TREE if typed else 0) | (FEATURE_ARRAYS_PATHS if arrays_paths else 0))
    plan.seconds.update(walk=walked - started + time.perf_counter() - derived, derived=derived - walked)
    plan._search = search
    plan._cutter = layout
    plan._layout = layout if search is not None else None
    plan.searched = search is not None and not search.hinted
    plan.layout_reused = reused
    if not defer:
        plan.decide()
    return plan


def _renumber(node: Any, leaf_ids: list[int]) -> Any:
    """The tree with each TensorRef(leaf index) made TensorRef(that leaf's tensor id)."""
    if isinstance(node, TensorRef):
        return type(node)(leaf_ids[node.tensor_id])  # an ArrayRef stays one
    if isinstance(node, dict):
        return {k: _renumber(v, leaf_ids) for k, v in node.items()}
    if isinstance(node, tuple):
        return tuple(_renumber(v, leaf_ids) for v in node)
    if isinstance(node, list):
        return [_renumber(v, leaf_ids) for v in node]
    return node  # a scalar, a set of scalars


def _dict_key(k: Any, path: str) -> Any:
    """A dict key as the file stores it, or UnsupportedObjectError (the common str key never comes here)."""
    if isinstance(k, np.generic) and k.dtype.kind in "biuf":
        k = k.item()  # a NumPy scalar key is the Python number it holds, as a value is
    if not isinstance(k, _KEY_TYPES):
        raise UnsupportedObjectError(f"dict key {k!r} at {path or '<root>'} has type {type(k).__qualname__}; keys must "
                                     "be str, int, float, bool or None")
    if isinstance(k, int) and not isinstance(k, bool) and not _INT_MIN <= k <= _INT_MAX:
        raise UnsupportedObjectError(
            f"dict key {k} at {path or '<root>'} is an int outside [-2**63, 2**64): a map key must fit in "
            "64 bits (big ints are stored as values only, SPEC 9.2); store the key as a str")
    return _plain_scalar(k, path)  # the name is made of the key as stored (an int enum is its int)


def _check_str(value: str, path: str) -> None:
    if value.isascii():
        return
    try:
        value.encode("utf-8")  # msgpack str must be UTF-8: a lone surrogate cannot be stored
    except UnicodeEncodeError:
        raise UnsupportedObjectError(f"string {value[:40]!r} at {path or '<root>'} is not valid Unicode (lone surrogate)") from None


def _plain_scalar(value: Any, path: str) -> Any:
    if isinstance(value, str):
        _check_str(value, path)
    # Subclasses (numpy floats, IntEnum, str enums) are stored as their base type.
    if value is None or type(value) in (bool, int, float, str, bytes):
        return _check_int(value, path) if type(value) is int else value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return _check_int(int(value), path)
    if isinstance(value, str):
        # Not str(value): for a (str, Enum) member that is "Cls.MEMBER" (Python 3.11+), not the str it is.
        return str.__str__(value)
    for base in (float, bytes):
        if isinstance(value, base):
            return base(value)
    return value


def _check_metadata(metadata: Any) -> None:
    if not isinstance(metadata, dict):
        raise UnsupportedObjectError(f"metadata must be a dict with str keys, got {type(metadata).__qualname__}")

    def check(value: Any, where: str, depth: int) -> None:
        if depth > MAX_TREE_DEPTH and isinstance(value, (dict, list)):  # SPEC 8.6: containers count, not leaves
            raise LimitError(f"metadata nesting at {where} exceeds {MAX_TREE_DEPTH}")
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise UnsupportedObjectError(f"metadata key {k!r} at {where or '<root>'} is not a str")
                _check_str(k, f"metadata {where}")
                check(v, f"{where}/{k}", depth + 1)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                check(v, f"{where}/{i}", depth + 1)
        elif value is not None and type(value) not in (bool, int, float, str):
            raise UnsupportedObjectError(
                f"metadata value at {where} has type {type(value).__qualname__}; use JSON-like values "
                "(None, bool, int, float, str, list, dict with str keys)"
            )
        elif type(value) is int:
            _check_int(value, f"metadata {where}")
        elif type(value) is str:
            _check_str(value, f"metadata {where}")

    check(metadata, "", 1)  # the metadata map itself is level 1, as the reader counts


def _view_key(t: torch.Tensor) -> tuple:
    return (t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _dedupe(leaves: list[tuple[str, torch.Tensor, tuple[str, int]]]) -> tuple[list[PlannedTensor], list[int], list[Any]]:
    """One entry per distinct tensor; views of one storage share a base entry (chunks not cut yet).  Also
    returns where each entry's data comes from (_Layout.instantiate): a leaf's index, (leaf, length, offset)
    for a base cut from a leaf's storage, or None (a view)."""
    groups: dict[tuple, list[int]] = {}  # in order of each group's first leaf (dicts keep insertion order)
    for i, (_, t, (_, size)) in enumerate(leaves):
        if t.numel() == 0:
            key: tuple = ("leaf", i)
        else:  # where its storage starts (this loop runs once per tensor)
            key = ("storage", *layout_of.storage_start(t, size))
        groups.setdefault(key, []).append(i)

    names_seen: dict[str, int] = {}
    tensors: list[PlannedTensor] = []
    leaf_ids = [0] * len(leaves)
    paths: set[str] | None = None  # every leaf's name, made once, if a base needs a name
    sources: list[Any] = []

    def add(entry: dict[str, Any], data: torch.Tensor | None, source: Any) -> int:
        tid = len(tensors)
        sources.append(source)
        name = entry["name"]
        if len(name) * 4 > MAX_NAME_BYTES and len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise LimitError(f"tensor name {name[:80]!r}... is longer than {MAX_NAME_BYTES} bytes")
        if name in names_seen:
            raise UnsupportedObjectError(
                f"two different tensors would both be named {name!r}: keys must stay distinct after str() "
                "(for example 1 and '1' in one dict)"
            )
        names_seen[name] = tid
        tensors.append(PlannedTensor(tid, entry, data))
        return tid

    def base_entry(path: str, t: torch.Tensor, facts: tuple[str, int]) -> dict[str, Any]:
        return {"name": path, "dtype": facts[0], "shape": list(t.shape)}

    def add_base(members: list[int], views: dict[tuple, list[int]]) -> None:
        # Several distinct views of one storage (and one dtype): store the spanned elements once.  Two
        # storage objects may begin at one address with different sizes (torch.from_numpy of an array and
        # of a slice of it, frombuffer, DLPack): the base is cut from the largest, which holds every view's
        # elements.
        nonlocal paths
        first = leaves[members[0]][1]
        owner_leaf = max(members, key=lambda i: leaves[i][1].untyped_storage().nbytes())
        owner = leaves[owner_leaf][1]
        lo = min(k[1] for k in views)
        hi = max(k[1] + sum((s - 1) * st for s, st in zip(k[2], k[3])) + 1 for k in views)
        base_data = owner.as_strided((hi - lo,), (1,), lo)
        if paths is None:
            paths = {p for p, _, _ in leaves}
        base_name = _base_name(leaves[members[0]][0], paths, names_seen)
        base = add({"name": base_name, "dtype": name_of(first.dtype), "shape": [hi - lo], "internal": True}, base_data,
                   (owner_leaf, hi - lo, lo))
        for key, same in views.items():
            path, t, facts = leaves[same[0]]
            entry = base_entry(path, t, facts)
            entry["view"] = {"base": base, "offset": key[1] - lo, "stride": list(key[3])}
            if max(key[3], default=0) > MAX_TENSOR_BYTES or key[1] - lo > MAX_TENSOR_BYTES:  # SPEC 16
                raise LimitError(f"view at {path or '<root>'} has a stride or offset above {MAX_TENSOR_BYTES} elements")
            tid = add(entry, None, None)
            for i in same:
                leaf_ids[i] = tid

    # Walk groups in order of their first leaf, so names follow tree order.
    for members in groups.values():
        if len(members) == 1:  # the common case: a tensor that shares its storage with no other leaf
            path, t, facts = leaves[members[0]]
            if _repeats_elements(t):  # expand(): a view of the few elements it addresses (SPEC 14.3)
                add_base(members, {_view_key(t): members})
            else:
                leaf_ids[members[0]] = add(base_entry(path, t, facts), t, members[0])
            continue
        views: dict[tuple, list[int]] = {}
        for i in members:
            views.setdefault(_view_key(leaves[i][1]), []).append(i)
        # The format's views share their base's dtype: views of each dtype share a base of their own (or
        # are one tied tensor); between dtypes the sharing is lost, the values are not (SPEC 14.3).
        by_dtype: dict[torch.dtype, dict[tuple, list[int]]] = {}
        for key, same in views.items():
            by_dtype.setdefault(key[0], {})[key] = same
        for of_dtype in by_dtype.values():
            if len(of_dtype) == 1 and _repeats_elements(leaves[next(iter(of_dtype.values()))[0]][1]):
                add_base(sorted(next(iter(of_dtype.values()))), of_dtype)  # a tied expand()
            elif len(of_dtype) == 1:  # one distinct view: a tied tensor
                (same,) = of_dtype.values()
                path, t, facts = leaves[same[0]]
                tid = add(base_entry(path, t, facts), t, same[0])
                for i in same:
                    leaf_ids[i] = tid
            else:
                add_base(sorted(i for same in of_dtype.values() for i in same), of_dtype)
        _check_alias_names(leaves, members, names_seen, leaf_ids)
    return tensors, leaf_ids, sources


def _repeats_elements(t: torch.Tensor) -> bool:
    """Whether ``t`` addresses fewer elements of its storage than it has (a stride 0 of ``expand()``, or
    overlapping windows): stored densely it would take more than the elements it reads."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.numel() > 1 and min(t.stride(), default=1) >= 0 and span < t.numel()


def _base_name(first: str, paths: set[str], taken: dict[str, int]) -> str:
    """SPEC 14.3: "<first view's name>@base", or, when a tensor of the state (``paths``) or an earlier base
    (``taken``) is called that, the first of "@base1", "@base2", ... that none is (the suffix means nothing
    to a reader)."""
    k = 0
    while f"{first}@base{k or ''}" in paths or f"{first}@base{k or ''}" in taken:
        k += 1
    return f"{first}@base{k or ''}"


def _check_alias_names(leaves, members, names_seen, leaf_ids) -> None:
    # An alias path (second path to a tied tensor) must not be another tensor's name.
    for i in members:
        owner = names_seen.get(leaves[i][0])
        if owner is not None and owner != leaf_ids[i]:
            raise UnsupportedObjectError(f"two different tensors would both be named {leaves[i][0]!r}")
