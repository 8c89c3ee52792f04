#!/usr/bin/env python3
"""nvckpt (the reference implementation) as a conformance-suite implementation command.

    nvckpt_impl.py [--device cuda] decode FILE...   one JSON decode document per file, one per line
    nvckpt_impl.py decode -                         the file on stdin (read into memory: nvckpt is a
                                                    random-access reader)

``--device cuda`` loads onto the GPU (nvCOMP decodes nvcomp-ans chunks there, when installed).

Uses only nvckpt's public API: ``nvckpt.open``, ``Checkpoint.index`` (every entry,
internal storage bases included), ``get_tensor`` and ``metadata``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import nvckpt  # noqa: E402
from conformance.protocol import node_json  # noqa: E402
from nvckpt.format.tree import ArrayRef, DeviceName, DtypeName, PathValue, TensorRef  # noqa: E402

# Most specific first: TruncatedError is a FormatError.
ERROR_CLASSES = (
    (nvckpt.TruncatedError, "truncated"),
    (nvckpt.FormatError, "format"),
    (nvckpt.ChecksumError, "checksum"),
    (nvckpt.UnsupportedCodecError, "unsupported-codec"),
    (nvckpt.UnsupportedFeatureError, "unsupported-feature"),
    (nvckpt.LimitError, "limit"),
)


def error_class(exc: nvckpt.NvckptError) -> str:
    for cls, name in ERROR_CLASSES:
        if isinstance(exc, cls):
            return name
    return f"other:{type(exc).__name__}"


def own_values(names: list[str]) -> Any:
    """The decode document's encoding of nvckpt's own tree values (tensor and array references, dtypes,
    devices, paths)."""
    def own(node: Any) -> Any:
        if isinstance(node, ArrayRef):
            return {"$ndarray": names[node.tensor_id]}
        if isinstance(node, PathValue):
            return {"$path": [node.flavour, node.text]}
        if isinstance(node, TensorRef):
            return {"$tensor": names[node.tensor_id]}
        if isinstance(node, DtypeName):
            return {"$dtype": node.name}
        if isinstance(node, DeviceName):
            return {"$device": node.spec}
        return None
    return own


def raw_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    flat = t.detach().cpu().reshape(-1)
    if flat.stride() != (1,):  # one element of a stride-0 view: "contiguous" to torch, but .view(uint8) needs stride 1
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy().tobytes()


def decode(target: Any, device: str = "cpu") -> dict:
    try:
        with nvckpt.open(target, device=device) as ck:
            entries = ck.index.tensors
            names = [e.name for e in entries]
            tensors = {}
            for e in entries:
                item: dict[str, Any] = {"dtype": e.dtype.name if hasattr(e.dtype, "name") else str(e.dtype),
                                        "shape": list(e.shape), "internal": bool(e.internal)}
                try:
                    data = raw_bytes(ck.get_tensor(e.name))
                    item.update(nbytes=len(data), sha256=hashlib.sha256(data).hexdigest())
                except nvckpt.NvckptError as exc:
                    item.update(error=error_class(exc), message=str(exc))
                tensors[e.name] = item
            return {"status": "ok", "version": list(ck.index.version), "tensors": tensors, "keys": list(ck.keys()),
                    "tree": node_json(ck.index.tree, own_values(names)),
                    "metadata": node_json(ck.metadata(), own_values(names))}
    except nvckpt.NvckptError as exc:
        return {"status": "error", "error": error_class(exc), "message": str(exc)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    device = "cpu"
    if len(argv) >= 2 and argv[0] == "--device":
        device, argv = argv[1], argv[2:]
    if len(argv) < 2 or argv[0] != "decode":
        print("usage: nvckpt_impl.py [--device DEVICE] decode FILE... | -", file=sys.stderr)
        return 2
    status = 0
    for path in argv[1:]:
        target = io.BytesIO(sys.stdin.buffer.read()) if path == "-" else path
        result = decode(target, device)
        print(json.dumps(result, ensure_ascii=True, sort_keys=True), flush=True)
        status = status or (0 if result["status"] == "ok" else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
