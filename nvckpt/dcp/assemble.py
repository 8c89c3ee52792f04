"""Leaving and joining the distributed world: a DCP directory as one state, and one state as a directory.

``assemble(DIR)`` builds every global tensor from its shards (read from the
rank files, each chunk and tensor checksum checked) and nests the values as
the state dict that was saved (DCP's planner data: ``{"model": {...},
"optim": {...}}``); it needs neither torch.distributed nor the world size.
``nvckpt merge DIR out.nvckpt`` and ``nvckpt convert DIR out.safetensors``
are this, then an ordinary write.  ``write_directory`` is the inverse
(``nvckpt split``): one process saves the state with ``dcp.save`` through
``Writer`` into a directory of one rank file, which ``dcp.load`` reshards to
any world size (reading only the rows each rank needs).
"""

from __future__ import annotations

import io
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import FormatError, UnsupportedObjectError
from ..format.tree import escape
from ..options import LoadOptions
from ..plan.dtypes import to_torch
from ..session.load import Checkpoint
from .layout import directory_save_id, foreign_rank_file, key_tag, read_manifest, typed_path


def assemble(path: str | os.PathLike, *, device: str = "cpu", progress: Any = None) -> Any:
    """The whole state saved in the DCP directory ``path``, as one nested object of full tensors.

    Non-tensor values (torch.save bytes in DCP) are read with
    ``torch.load(weights_only=True)``.  ``progress(n)`` gets raw bytes read."""
    m = read_manifest(path)
    save_id = directory_save_id(m)  # what dcp.load checks: every part of the directory is of one save
    opened: dict[str, Checkpoint] = {}

    def open_file(name: str) -> Checkpoint:
        if name not in opened:
            ck = opened[name] = Checkpoint(os.path.join(m.directory, name), LoadOptions(device=device))
            foreign = foreign_rank_file(ck.file.index.metadata, save_id, name)
            if foreign:
                raise FormatError(foreign, path=m.directory)
        return opened[name]

    values: dict[str, Any] = {}
    try:
        for fqn, t in m.tensors.items():
            gaps = t.coverage_gaps()
            if gaps:
                raise FormatError(f"its shards do not cover the global tensor {list(t.shape)} ({gaps} elements)",
                                  path=m.directory, tensor=fqn)
            full = torch.empty(t.shape, dtype=to_torch(t.dtype), device=device)
            for s in t.shards:
                part = open_file(s.file).get_tensor(s.tensor)
                if tuple(part.shape) != s.sizes or part.dtype != full.dtype:
                    raise FormatError(f"holds {part.dtype}{list(part.shape)} for a shard of {fqn!r} the manifest "
                                      f"says is {t.dtype}{list(s.sizes)}", path=os.path.join(m.directory, s.file),
                                      tensor=s.tensor)
                box = full
                for d, (o, n) in enumerate(zip(s.offsets, s.sizes)):
                    box = box.narrow(d, o, n)
                box.copy_(part)
                if progress is not None:
                    progress(part.numel() * part.element_size())
            values[fqn] = full
        for fqn, (file, tensor) in m.objects.items():
            raw = open_file(file).get_tensor(tensor).cpu().numpy().tobytes()
            try:
                values[fqn] = torch.load(io.BytesIO(raw), weights_only=True)
            except Exception as exc:  # an object torch.load refuses to unpickle safely
                raise FormatError(f"the value of {fqn!r} is a pickle that torch.load(weights_only=True) refuses "
                                  f"({weights_only_reason(exc)}); nvckpt never unpickles arbitrary objects",
                                  path=os.path.join(m.directory, file), tensor=tensor) from None
    finally:
        for ck in opened.values():
            ck.close()
    return nest(values, m.paths, m.int_keys, m.key_types, m.empty_dicts)


def nest(values: dict[str, Any], paths: dict[str, list[Any]], int_keys: dict[str, list[int]] | None = None,
         key_types: dict[str, list[tuple[int, str]]] | None = None,
         empty_dicts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Flat ``{fqn: value}`` as the nested state dict ``paths`` (DCP's planner data) describes;
    an integer key makes a list, as DCP's own unflattening does, and the keys ``int_keys`` and ``key_types``
    mark are dict keys of those types (an optimizer's int keys, None or float keys), where the manifest's
    writer knew; ``empty_dicts`` (the manifest's) are put back, as DCP stores nothing for them."""
    root: dict[str, Any] = {}
    placed = [(list(paths.get(fqn) or [fqn]), (int_keys or {}).get(fqn, ()), (key_types or {}).get(fqn, ()),
               value, False) for fqn, value in values.items()]
    placed += [(e["path"], e.get("int_keys", ()), e.get("key_types", ()), None, True) for e in empty_dicts or ()]
    for raw, ints, typed, value, empty in placed:
        path, marked = typed_path(raw, ints, typed)
        if not path:
            continue
        node: Any = root
        for i, (key, nxt) in enumerate(zip(path[:-1], path[1:])):
            node = _child(node, key, [] if isinstance(nxt, int) and i + 1 not in marked else {})
        if empty:
            _child(node, path[-1], {})
        else:
            _put(node, path[-1], value)
    return root


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


def _child(node: Any, key: Any, empty: Any) -> Any:
    if isinstance(node, list):
        while len(node) <= key:
            node.append(None)
        if node[key] is None:
            node[key] = empty
        return node[key]
    return node.setdefault(key, empty)


def _put(node: Any, key: Any, value: Any) -> None:
    if isinstance(node, list):
        while len(node) <= key:
            node.append(None)
    node[key] = value


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


def weights_only_reason(exc: Exception) -> str:
    """The useful sentence of torch's long weights_only message (its wording varies by version)."""
    text = str(exc)
    found = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\n\n|$)", text, re.S)
    if found and found.group(1).strip():
        reason = found.group(1)
    else:
        paragraphs = [p for p in text.split("\n\n") if p.strip()]
        useful = [p for p in paragraphs if not p.lstrip().startswith(("Weights only load failed", "Check the documentation"))]
        reason = (useful or paragraphs or [type(exc).__name__])[0]
    return " ".join(reason.split()).split(". Please use")[0]


__all__ = ["assemble", "nest", "write_directory", "check_round_trip", "empty_dicts"]
