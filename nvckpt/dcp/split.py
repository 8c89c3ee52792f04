"""One state as a DCP directory, from one process (``nvckpt split``), and what DCP can give back of a state.

``write_directory`` saves the state with ``dcp.save`` through ``Writer`` into a
directory of one rank file, which ``dcp.load`` reshards to any world size
(reading only the rows each rank needs); ``nvckpt merge`` is the inverse
(nvckpt.sharded.assemble).  DCP walks a state its own way (``_dcp_terminal``)
and stores every dict key as str: the manifest records what it needs to give
the keys' types and the empty dicts back.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import UnsupportedObjectError
from ..format.tree import escape
from ..sharded.layout import key_tag


def check_round_trip(state: Any) -> None:
    """Refuse, before DCP writes anything, a state whose dict keys a manifest cannot give back: DCP stores every
    key as str(key), and the manifest records only the types str, int, float, bool and None, one key per str."""
    fqns: dict[str, str] = {}  # DCP's flat name of every value it stores (keys joined by "."): the first path

    def walk(node: Any, path: tuple[str, ...], dotted: tuple[str, ...]) -> None:
        if isinstance(node, Mapping):
            seen: dict[str, Any] = {}
            for k, v in node.items():
                where = "/".join(path) or "<root>"  # a path as nvckpt names tensors (SPEC 9)
                if not (isinstance(k, str) and str(k) == k) and key_tag(k) is None:
                    raise UnsupportedObjectError(f"dict key {k!r} at {where} has type {type(k).__qualname__}; a DCP "
                                                 "directory keeps keys of type str, int, float, bool and None")
                if str(k) in seen:
                    raise UnsupportedObjectError(f"dict keys {seen[str(k)]!r} and {k!r} at {where} are both stored "
                                                 f"as {str(k)!r} in a DCP directory (it writes every key as str)")
                seen[str(k)] = k
                walk(v, path + (escape(k),), dotted + (str(k),))
        elif isinstance(node, list) and not _dcp_terminal(node):
            for i, v in enumerate(node):
                walk(v, path + (str(i),), dotted + (str(i),))
        else:
            fqn, where = ".".join(dotted), "/".join(path) or "<root>"
            if fqn in fqns:  # e.g. a key "a.b" beside a dict "a" holding "b": DCP would refuse it midway
                raise UnsupportedObjectError(f"{fqns[fqn]} and {where} would both be {fqn!r} in a DCP directory "
                                             "(it joins the keys of a path with '.')")
            fqns[fqn] = where

    walk(state, (), ())


def _dcp_terminal(value: Any) -> bool:
    """DCP's traverse_state_dict: a value stored whole (torch.save bytes) rather than walked into: anything but a
    Mapping, and a list that holds no tensor, no Mapping and no list walked into."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, torch.Tensor) or (isinstance(v, (Mapping, list)) and not _dcp_terminal(v))
                   for v in value)


def empty_dicts(state: Any) -> list[dict[str, Any]]:
    """The empty dicts of ``state`` along DCP's walk, as a manifest's "empty_dicts" records them."""
    out: list[dict[str, Any]] = []

    def walk(node: Any, path: list[Any], ints: list[int], typed: list[tuple[int, str]]) -> None:
        if isinstance(node, Mapping):
            if not node and path:
                out.append({"path": path, **({"int_keys": ints} if ints else {}),
                            **({"key_types": [list(m) for m in typed]} if typed else {})})
            for k, v in node.items():
                tag = key_tag(k)
                at = len(path)
                walk(v, path + [str(k)], ints + ([at] if tag == "int" else []),
                     typed + ([(at, tag)] if tag not in (None, "int") else []))
        elif isinstance(node, list) and not _dcp_terminal(node):
            for i, v in enumerate(node):
                walk(v, path + [i], ints, typed)

    walk(state, [], [], [])
    return out


def write_directory(state: Any, path: str | os.PathLike, **options: Any) -> Any:
    """Save ``state`` (a dict) from this one process as a DCP directory (``options``: ``Writer``'s);
    returns the rank file's SaveResult."""
    import torch.distributed.checkpoint as dcp

    from .writer import Writer

    if not isinstance(state, dict):
        raise TypeError(f"a DCP checkpoint holds a dict (a state dict), not a {type(state).__qualname__}")
    from torch.distributed.checkpoint.api import CheckpointException

    writer = Writer(path, **options)
    writer.source = state  # the keys' own types in the manifest (DCP writes every dict key as str)
    check_round_trip(state)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            try:
                dcp.save(state, storage_writer=writer, no_dist=True)
            except CheckpointException as exc:
                # One process: its own error, as nvckpt raises it (one line in the CLI), not DCP's wrapper
                # of every rank's traceback.
                failures = [f[0] for f in exc.failures.values() if isinstance(f, tuple) and f and isinstance(f[0], BaseException)]
                if failures:
                    raise failures[0] from None
                raise
    except BaseException:
        writer.abandon()  # a failure of DCP's own steps too: one process wrote all of it, nothing stays
        raise
    return writer.last_result



__all__ = ["write_directory", "check_round_trip", "empty_dicts"]
