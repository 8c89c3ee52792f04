"""``nvckpt.load(path, allow_pickle=True)`` of a torch.save file: torch.load, on the caller's word.

During a migration a directory holds both formats; one call reads either.  Reading a torch.save file
runs its pickle (any code the file names), so this happens only when the caller says the file is
trusted, and never for a file opened with ``untrusted=True``.  ``keys`` select paths of the loaded
object as they do in an nvckpt file (the same names, DCP's dotted names, near matches in the error).
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import torch

from ..errors import TensorNotFoundError
from ..format.paths import by_dotted_name, did_you_mean, value_paths
from ..format.tree import find_path
from ..options import LoadOptions


def load_pickled(target: str | os.PathLike | Any, keys: Iterable[str] | None, options: LoadOptions) -> Any:
    """The object in the torch.save file ``target`` (``torch.load(weights_only=False)`` unless the caller
    gave ``weights_only=True``), or the values at ``keys``, on ``device`` / ``map_location``."""
    if options.untrusted:
        raise ValueError("allow_pickle=True and untrusted=True contradict each other: reading a torch.save file "
                         "runs its pickle")
    where = options.map_location if options.map_location is not None else options.device or "cpu"
    weights_only = False if options.weights_only is None else options.weights_only
    obj = torch.load(target, map_location=where, weights_only=weights_only)
    if keys is None:
        return obj
    one = isinstance(keys, str)
    wanted = [keys] if one else list(keys)
    name = os.fspath(target) if isinstance(target, (str, os.PathLike)) else getattr(target, "name", "<stream>")
    values = {k: _value_at(obj, k, str(name)) for k in wanted}
    return values[keys] if one else values


def _value_at(obj: Any, key: Any, name: str) -> Any:
    if not isinstance(key, str):
        raise TypeError(f"keys must be a str or an iterable of str, got an item {key!r}")
    try:
        return find_path(obj, key)
    except KeyError:
        pass
    paths = list(value_paths(obj, torch.Tensor))
    found = by_dotted_name(paths).get(key)
    if found is None:
        raise TensorNotFoundError(f"nothing is saved at {key!r}: no path of the saved object{did_you_mean(key, paths)}",
                                  path=name)
    return find_path(obj, found)


__all__ = ["load_pickled"]
