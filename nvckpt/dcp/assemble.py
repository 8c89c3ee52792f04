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
import warnings
from typing import Any

import torch

from ..errors import FormatError
from ..options import LoadOptions
from ..plan.dtypes import to_torch
from ..session.load import Checkpoint
from .layout import read_manifest


def assemble(path: str | os.PathLike, *, device: str = "cpu", progress: Any = None) -> Any:
    """The whole state saved in the DCP directory ``path``, as one nested object of full tensors.

    Non-tensor values (torch.save bytes in DCP) are read with
    ``torch.load(weights_only=True)``.  ``progress(n)`` gets raw bytes read."""
    m = read_manifest(path)
    opened: dict[str, Checkpoint] = {}

    def open_file(name: str) -> Checkpoint:
        if name not in opened:
            opened[name] = Checkpoint(os.path.join(m.directory, name), LoadOptions(device=device))
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
                raise FormatError(f"the value of {fqn!r} is not loadable with weights_only=True: {exc}",
                                  path=os.path.join(m.directory, file), tensor=tensor) from None
    finally:
        for ck in opened.values():
            ck.close()
    return nest(values, m.paths, m.int_keys)


def nest(values: dict[str, Any], paths: dict[str, list[Any]], int_keys: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Flat ``{fqn: value}`` as the nested state dict ``paths`` (DCP's planner data) describes;
    an integer key makes a list, as DCP's own unflattening does, and the keys ``int_keys`` marks are
    int keys of a dict (an optimizer's state, where the manifest's writer knew)."""
    root: dict[str, Any] = {}
    for fqn, value in values.items():
        path = list(paths.get(fqn) or [fqn])
        marked = set((int_keys or {}).get(fqn, ()))
        for i in marked:
            if i < len(path):
                path[i] = int(path[i])
        node: Any = root
        for i, (key, nxt) in enumerate(zip(path[:-1], path[1:])):
            node = _child(node, key, [] if isinstance(nxt, int) and i + 1 not in marked else {})
        _put(node, path[-1], value)
    return root


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
    return writer.last_result


__all__ = ["assemble", "nest", "write_directory"]
