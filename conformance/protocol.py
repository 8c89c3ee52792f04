"""The decode document's encoding of tree and metadata values (conformance/README.md, "The decode document").

One encoder for the implementations in this repository that are written in Python on top of their own value
types: the nvckpt adapter (``nvckpt.format.tree`` values) and the suite generator (the torch objects it saved).
Each passes ``own(node)``, which encodes its implementation's tensor references, dtypes and devices and returns
None for everything else.  (conformance/reference_reader.py keeps its own copy on purpose: it is one file
written from SPEC.md alone, importing nothing of this repository.)
"""

from __future__ import annotations

import json
import struct
from typing import Any, Callable


def float_json(x: float) -> dict:
    return {"$float": struct.pack(">d", x).hex()}


def node_json(node: Any, own: Callable[[Any], Any]) -> Any:
    special = own(node)
    if special is not None:
        return special
    if isinstance(node, tuple):
        return {"$tuple": [node_json(x, own) for x in node]}
    if isinstance(node, dict):
        return {"$map": [[node_json(k, own), node_json(v, own)] for k, v in node.items()]}
    if isinstance(node, list):
        return [node_json(x, own) for x in node]
    if isinstance(node, float):
        return float_json(node)
    if isinstance(node, bytes):
        return {"$bytes": node.hex()}
    if isinstance(node, (set, frozenset)):  # SPEC 9.2 (the runner compares set items unordered; sorted: reproducible)
        items = sorted((node_json(x, own) for x in node), key=lambda x: json.dumps(x, sort_keys=True))
        return {"$frozenset" if isinstance(node, frozenset) else "$set": items}
    if isinstance(node, complex):
        return {"$complex": [float_json(node.real)["$float"], float_json(node.imag)["$float"]]}
    return node  # None, bool, int, str
