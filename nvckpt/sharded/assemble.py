"""A sharded directory as one state: every global tensor built from its shards, nested as it was saved.

``assemble(DIR)`` reads the shards from the rank files (each chunk and tensor
checksum checked; every rank file must be of the directory's one save) and
nests the values as the state dict that was saved (the manifest's paths:
``{"model": {...}, "optim": {...}}``); it needs neither torch.distributed nor
the world size.  ``nvckpt merge DIR out.nvckpt`` and ``nvckpt convert DIR
out.safetensors`` are this, then an ordinary write.  The inverse, one state
as a directory (``nvckpt split``), is the DCP front-end's
(nvckpt.dcp.split.write_directory).
"""

from __future__ import annotations

import io
import os
import re
from typing import Any

import torch

from ..errors import FormatError
from ..options import LoadOptions
from ..tensors.dtypes import to_torch
from ..session.load import Checkpoint
from .layout import MANIFEST, directory_save_id, foreign_rank_file, read_manifest, typed_path


def assemble(path: str | os.PathLike, *, device: str = "cpu", progress: Any = None) -> Any:
    """The whole state saved in the DCP directory ``path``, as one nested object of full tensors.

    Non-tensor values (torch.save bytes in DCP) are read with
    ``torch.load(weights_only=True)``.  ``progress(n)`` gets raw bytes read."""
    m = read_manifest(path)
    save_id = directory_save_id(m)  # what dcp.load checks: every part of the directory is of one save
    opened: dict[str, Checkpoint] = {}

    def open_file(name: str) -> Checkpoint:
        if name not in opened:
            ck = opened[name] = Checkpoint(m.store.open_source(name), LoadOptions(device=device))
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
                                      f"says is {t.dtype}{list(s.sizes)}", path=m.store.join(s.file),
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
                                  path=m.store.join(file), tensor=tensor) from None
    finally:
        for ck in opened.values():
            ck.close()
    try:
        return nest(values, m.paths, m.int_keys, m.key_types, m.empty_dicts)
    except FormatError as exc:
        raise exc.located(path=m.store.join(MANIFEST)) from None


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
        try:
            for i, (key, nxt) in enumerate(zip(path[:-1], path[1:])):
                node = _child(node, key, [] if isinstance(nxt, int) and i + 1 not in marked else {}, len(placed))
            if empty:
                _child(node, path[-1], {}, len(placed))
            else:
                _put(node, path[-1], value, len(placed))
        except (TypeError, ValueError) as exc:  # paths that no one state has (a damaged or crafted manifest)
            raise FormatError(f"bad manifest: the path {raw!r:.120} does not fit the others ({exc})") from None
    return root


def _slot(node: Any, key: Any, count: int) -> None:
    """Check that ``node`` (a container being built) can hold ``key``; a list grows to it.  ``count``: the values
    and empty dicts placed in all; each list position is on the path of one of them, so none is as large."""
    if isinstance(node, list):
        if type(key) is not int or not 0 <= key < count:
            raise ValueError(f"list position {key!r} (the state has {count} values)")
        while len(node) <= key:
            node.append(None)
    elif not isinstance(node, dict):
        raise ValueError(f"a {type(node).__name__} value where a container holds {key!r}")


def _child(node: Any, key: Any, empty: Any, count: int) -> Any:
    _slot(node, key, count)
    if isinstance(node, list):
        if node[key] is None:
            node[key] = empty
        return node[key]
    return node.setdefault(key, empty)


def _put(node: Any, key: Any, value: Any, count: int) -> None:
    _slot(node, key, count)
    if (node[key] if isinstance(node, list) else node.get(key)) is not None:
        raise ValueError(f"two values at {key!r}")
    node[key] = value


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


__all__ = ["assemble", "nest", "weights_only_reason"]
