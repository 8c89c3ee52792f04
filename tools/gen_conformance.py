#!/usr/bin/env python3
"""Generate the nvckpt conformance suite: conformance/files/*.nvckpt and conformance/manifest.json.

Valid files are written by nvckpt's own writer (nvckpt.save) from objects built
with fixed seeds, then, where a case needs something nvckpt never writes
(an optional frame, non-shortest msgpack, an unknown codec), edited with
conformance/craft.py.  Their expected decode (SHA-256 of every tensor's raw
bytes, the tree, the metadata) is computed from the Python objects, not by
reading the file back.

Invalid files are valid files with exactly one thing wrong: craft.py rebuilds
them with every checksum and offset that should stay valid recomputed.

The output is deterministic: no timestamps, fixed seeds, and the writer block
of every index is replaced by the generator's own (so the bytes do not depend
on the Python, torch or nvckpt versions installed).  Chunk payloads coded with
zstd depend on the libzstd version (recorded in the manifest).

    python3 tools/gen_conformance.py [--out conformance] [--only ID ...]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import math
import os
import pathlib
import shutil
import struct
import sys
import threading
import warnings
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402

import nvckpt  # noqa: E402
from conformance import craft  # noqa: E402
from conformance.protocol import float_json, node_json  # noqa: E402
from nvckpt.codecs import ByteShuffle, Pipeline, SignShift, Zstd  # noqa: E402
from nvckpt.plan.derived import bf16_rne  # noqa: E402

WRITER = {"name": "nvckpt-conformance", "version": "1"}
SUITE_VERSION = 1
PATH_CLASSES = ["PurePosixPath", "PureWindowsPath", "PosixPath", "WindowsPath"]  # SPEC 9.3: ext 10's flavour byte
ANS_FIXTURE = os.path.join(ROOT, "conformance", "fixtures", "ans_chunk.json")

ERRORS = ("format", "truncated", "checksum", "unsupported-codec", "unsupported-feature", "limit")
BOTH = ["random-access", "streaming"]
STREAMING = ["streaming"]


# --------------------------------------------------------------------------------------------
# Expected results, from the Python objects
# --------------------------------------------------------------------------------------------

def escape(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def raw_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    flat = t.detach().cpu().reshape(-1)
    if flat.stride() != (1,):  # one element of a stride-0 view: "contiguous" to torch, but .view(uint8) needs stride 1
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy().tobytes()


def leaves(obj: Any, parts: tuple = ()) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return [("/".join(parts), obj)]
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += leaves(v, parts + (escape(k),))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += leaves(v, parts + (str(i),))
    return out


def torch_values(names: dict[int, str]) -> Any:
    """The decode document's encoding of the saved torch objects (tensors by identity, dtypes, devices)."""
    def own(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return {"$tensor": names[id(node)]}
        if isinstance(node, np.ndarray):  # SPEC 9.3
            return {"$ndarray": names[id(node)]}
        if isinstance(node, pathlib.PurePath):
            return {"$path": [PATH_CLASSES.index(type(node).__name__), str(node)]}
        if isinstance(node, torch.dtype):
            return {"$dtype": str(node).removeprefix("torch.")}
        if isinstance(node, torch.device):
            return {"$device": str(node)}
        return None
    return own


def key_string(key: Any) -> str:
    """SPEC.md 14.1: a path segment is str() of the key (Python's), then ~ -> ~0 and / -> ~1."""
    if isinstance(key, dict) and "$float" in key:
        key = struct.unpack(">d", bytes.fromhex(key["$float"]))[0]
    return escape(key)


def keys_of(tree: Any, parts: tuple = ()) -> list[str]:
    """The names a reader offers (keys()): every path to a tensor reference, depth first, in stored order."""
    if isinstance(tree, dict) and ("$tensor" in tree or "$ndarray" in tree):
        return ["/".join(parts)]
    if isinstance(tree, dict) and "$map" in tree:
        return [k for key, v in tree["$map"] for k in keys_of(v, parts + (key_string(key),))]
    if isinstance(tree, dict) and "$tuple" in tree:
        tree = tree["$tuple"]
    if isinstance(tree, list):
        return [k for i, v in enumerate(tree) for k in keys_of(v, parts + (str(i),))]
    return []


def tensor_json(dtype: str, shape: list[int], data: bytes, internal: bool = False) -> dict:
    return {"dtype": dtype, "shape": list(shape), "nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "internal": internal}


def expected_decode(obj: Any, metadata: dict | None, data: bytes) -> dict:
    """What a reader must return for a file nvckpt wrote from ``obj``."""
    nv = craft.parse(data)
    entries = nv.index["tensors"]
    first: dict[int, str] = {}
    by_name: dict[str, torch.Tensor] = {}
    for path, t in leaves(obj):
        first.setdefault(id(t), path)
        by_name.setdefault(path, t)
    tensors = {}
    for tid, e in enumerate(entries):
        if e.get("internal"):
            # A storage base: the elements its views address, taken from the views' storage.
            view_id, view = next((i, v) for i, v in enumerate(entries) if v.get("view", {}).get("base") == tid)
            t = by_name[view["name"]]
            start = t.storage_offset() - view["view"]["offset"]
            item = t.element_size()
            storage = bytes(t.untyped_storage())
            blob = storage[start * item:(start + e["shape"][0]) * item]
            tensors[e["name"]] = tensor_json(e["dtype"], e["shape"], blob, True)
        else:
            t = by_name[e["name"]]
            if isinstance(t, np.ndarray):  # SPEC 9.3: its values in C order, native (little-endian) byte order
                t = torch.from_numpy(np.array(t, dtype=t.dtype.newbyteorder("="), order="C"))
            assert list(t.shape) == list(e["shape"]), e["name"]
            tensors[e["name"]] = tensor_json(e["dtype"], e["shape"], raw_bytes(t))
    return {"tensors": tensors, "tree": node_json(obj, torch_values(first)),
            "metadata": node_json(metadata or {}, torch_values({}))}


# --------------------------------------------------------------------------------------------
# Writing files
# --------------------------------------------------------------------------------------------

def pin_writer(data: bytes) -> bytes:
    nv = craft.parse(data)
    nv.index["writer"] = dict(WRITER)
    return craft.build(nv)


def pinned(kw: dict) -> dict:
    """The options the suite's files were made with before nvckpt 0.2 changed its defaults (portable
    codec, alignment, derived tensors), so that regenerating gives the committed bytes."""
    kw = dict(kw)
    if kw.get("codec", "auto") in ("auto", "portable"):
        kw["codec"] = "portable-1.0"
    kw.setdefault("alignment", 4096)
    if "derive_bf16" not in kw:
        kw.setdefault("derive", False)
    return kw


def save(obj: Any, **kw: Any) -> bytes:
    buf = io.BytesIO()
    nvckpt.save(obj, buf, **pinned(kw))
    return pin_writer(buf.getvalue())


def save_through_pipe(obj: Any, **kw: Any) -> bytes:
    """nvckpt.save onto the write end of an OS pipe (no seek, no tell), read on the other end."""
    r, w = os.pipe()
    chunks: list[bytes] = []

    def drain() -> None:
        with os.fdopen(r, "rb") as f:
            while True:
                block = f.read(65536)
                if not block:
                    break
                chunks.append(block)

    reader = threading.Thread(target=drain)
    reader.start()
    with os.fdopen(w, "wb") as f:
        assert not f.seekable()
        nvckpt.save(obj, f, **pinned(kw))
    reader.join()
    return pin_writer(b"".join(chunks))


def randbytes(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():  # "ComplexHalf support is experimental": storing its bytes is all we need
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape).clone()


def smooth(n: int, seed: int) -> torch.Tensor:
    """Compressible float32 values (a random walk rounded to 1/64)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.cumsum(torch.randn(n, generator=g), 0) * 64).round() / 64


# --------------------------------------------------------------------------------------------
# msgpack with non-shortest encodings (readers MUST accept any valid encoding, SPEC.md 1)
# --------------------------------------------------------------------------------------------

def pack_wide(obj: Any) -> bytes:
    """msgpack using the widest form of every int, str, array and map header."""
    if obj is None:
        return b"\xc0"
    if obj is True:
        return b"\xc3"
    if obj is False:
        return b"\xc2"
    if isinstance(obj, int):
        return b"\xcf" + struct.pack(">Q", obj) if obj >= 0 else b"\xd3" + struct.pack(">q", obj)
    if isinstance(obj, float):
        return b"\xcb" + struct.pack(">d", obj)
    if isinstance(obj, str):
        b = obj.encode("utf-8")
        return b"\xdb" + struct.pack(">I", len(b)) + b
    if isinstance(obj, bytes):
        return b"\xc6" + struct.pack(">I", len(obj)) + obj
    if isinstance(obj, msgpack.ExtType):
        return b"\xc9" + struct.pack(">Ib", len(obj.data), obj.code) + obj.data
    if isinstance(obj, list):
        return b"\xdd" + struct.pack(">I", len(obj)) + b"".join(pack_wide(x) for x in obj)
    if isinstance(obj, dict):
        return b"\xdf" + struct.pack(">I", len(obj)) + b"".join(pack_wide(k) + pack_wide(v) for k, v in obj.items())
    raise TypeError(type(obj))


def nest(depth: int, leaf: Any, kind: str = "list") -> Any:
    """A tree whose deepest container is at ``depth`` (root container = 1)."""
    node = leaf
    for _ in range(depth):
        if kind == "list":
            node = [node]
        elif kind == "map":
            node = {"k": node}
        else:  # tuple ext
            node = msgpack.ExtType(2, craft.pack([node]))
    return node


def tensor_ref(tid: int) -> msgpack.ExtType:
    return msgpack.ExtType(1, struct.pack("<I", tid))


# --------------------------------------------------------------------------------------------
# The suite
# --------------------------------------------------------------------------------------------

class Suite:
    def __init__(self, out: str, only: set[str] | None) -> None:
        self.out = out
        self.only = only
        self.cases: list[dict] = []
        self.files = os.path.join(out, "files")
        os.makedirs(self.files, exist_ok=True)

    def _write(self, cid: str, data: bytes) -> str:
        assert cid not in {c["id"] for c in self.cases}, cid
        name = f"{cid}.nvckpt"
        with open(os.path.join(self.files, name), "wb") as f:
            f.write(data)
        return f"files/{name}"

    def valid(self, cid: str, data: bytes, expected: dict, *, section: str, flags: list[str], description: str,
              level: str = "must", readers: list[str] = BOTH, requires: list[str] | None = None) -> None:
        if self.only and cid not in self.only:
            return
        expected = dict(expected, keys=list(dict.fromkeys(keys_of(expected["tree"]))))  # each name once (SPEC 14.1)
        self.cases.append({
            "id": cid, "file": self._write(cid, data), "result": "valid", "level": level, "flags": flags,
            "section": section, "description": description, "readers": readers, "requires": requires or [],
            "codec": codec_label(data), "bytes": len(data), "expected": expected,
        })

    def invalid(self, cid: str, data: bytes, error: str, *, section: str, flags: list[str], description: str,
                danger: str, level: str = "must", readers: list[str] = BOTH, also: list[str] | None = None,
                codec: str | None = None) -> None:
        assert error in ERRORS and all(a in ERRORS for a in also or [])
        if self.only and cid not in self.only:
            return
        self.cases.append({
            "id": cid, "file": self._write(cid, data), "result": "invalid", "level": level, "flags": flags,
            "section": section, "description": description, "danger": danger, "readers": readers,
            "requires": [], "codec": codec or codec_label(data), "bytes": len(data), "error": error,
            "also_accepted": also or [],
        })


def codec_label(data: bytes) -> str:
    """The most demanding codec a file's chunks use: how the report groups cases."""
    try:
        nv = craft.parse(data)
        codecs = nv.index["codecs"]
        used = {c[3] for e in nv.index["tensors"] if isinstance(e, dict) for c in e.get("chunks", [])
                if isinstance(c, list) and len(c) == 5}
        names = ["+".join(s["name"] for s in codecs[i]) for i in used if isinstance(i, int) and i < len(codecs)]
    except Exception:
        return "none"
    known = {"nvcomp-ans", "signshift+byteshuffle+zstd", "byteshuffle+zstd", "zstd", "raw"}
    if "nvcomp-ans" in names:
        return "nvcomp-ans"
    if any(n not in known for n in names):
        return "unknown-codec"
    for label in ("signshift+byteshuffle+zstd", "byteshuffle+zstd", "zstd", "raw"):
        if label in names:
            return label
    return "none"


# --------------------------------------------------------------------------------------------
# Valid cases
# --------------------------------------------------------------------------------------------

DTYPE_SHAPES = {16: (2, 3), 8: (3, 2), 4: (3, 4), 2: (4, 5), 1: (5, 6)}


def gen_valid(s: Suite) -> dict[str, tuple[Any, dict | None, bytes]]:
    """Writes the valid cases; returns some (object, metadata, bytes) for the invalid ones to start from."""
    from nvckpt.format.dtypes import DTYPES
    from nvckpt.tensors.dtypes import TORCH_DTYPES

    bases: dict[str, tuple[Any, dict | None, bytes]] = {}

    def case(cid: str, obj: Any, *, metadata: dict | None = None, section: str, flags: list[str], description: str,
             level: str = "must", pipe: bool = False, **kw: Any) -> bytes:
        data = (save_through_pipe if pipe else save)(obj, metadata=metadata, **kw)
        s.valid(cid, data, expected_decode(obj, metadata, data), section=section, flags=flags,
                description=description, level=level)
        bases[cid] = (obj, metadata, data)
        return data

    # Every dtype, random bytes (every bit pattern is a value; bool holds 0/1).
    for i, name in enumerate(DTYPES):
        item = DTYPES[name].itemsize
        shape = DTYPE_SHAPES[item]
        n = math.prod(shape) * item
        blob = randbytes(100 + i, n)
        if name == "bool":
            blob = bytes(b & 1 for b in blob)
        t = tensor_from_bytes(blob, TORCH_DTYPES[name], shape)
        case(f"valid-dtype-{name}", {"t": t}, section="10", flags=["dtype", name],
             description=f"one {name} tensor of shape {list(shape)}, random bit patterns", chunk_size=n // 2 or 1)

    g = torch.Generator().manual_seed(1)
    case("valid-zero-dim", {"f": torch.tensor(1.5), "i": torch.tensor(-7, dtype=torch.int64),
                            "b": torch.tensor(True), "h": torch.tensor(0.25, dtype=torch.float16)},
         section="8.3", flags=["0-d"], description="0-d tensors (shape []), one element each")
    case("valid-empty", {"a": torch.empty(0), "b": torch.empty(0, 5, dtype=torch.int32),
                         "c": torch.empty(3, 0, 2, dtype=torch.float16), "d": torch.ones(2)},
         section="8.4", flags=["empty"], description="tensors with a zero dimension: empty chunk tables")
    case("valid-multichunk", {"w": torch.randn(64, 16, generator=g), "x": torch.arange(1000, dtype=torch.int16)},
         section="12.1", flags=["multi-chunk"], description="4 KiB tensors cut into 16 chunks of whole rows",
         chunk_size=256, codec="raw")
    case("valid-row-split", {"w": torch.randn(3, 300, generator=g)}, section="12.1", flags=["multi-chunk", "row-split"],
         description="rows of 1200 bytes larger than the 256-byte target chunk: each row split in element-aligned pieces",
         chunk_size=256, codec="raw")
    case("valid-codec-raw", {"w": smooth(512, 2).reshape(16, 32)}, section="11.3", flags=["codec-raw"],
         description="raw codec", codec="raw", chunk_size=512)
    case("valid-codec-zstd", {"w": smooth(2048, 3).reshape(64, 32), "ids": torch.arange(3000, dtype=torch.int64) % 17},
         section="11.4", flags=["codec-zstd"], description="zstd codec (frames with content size)", codec="zstd",
         chunk_size=2048, zstd_level=3)
    case("valid-codec-byteshuffle-zstd", {"w": smooth(2048, 4).reshape(64, 32),
                                          "h": smooth(1024, 5).to(torch.float16), "d": smooth(256, 6).double()},
         section="11.5", flags=["codec-byteshuffle", "codec-zstd"],
         description="byteshuffle(elementsize = itemsize) then zstd", codec="portable", chunk_size=2048)
    case("valid-byteshuffle-elementsize-2-of-float32", {"w": smooth(1024, 7)}, section="11.5",
         flags=["codec-byteshuffle", "codec-zstd"], description="byteshuffle with elementsize 2 on float32 data",
         codec=Pipeline((ByteShuffle(2), Zstd(5))), chunk_size=1024)

    # Derived bf16: the source has ties, NaNs with payloads, infinities, values that round to infinity.
    special = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7FC00001, 0xFF812345, 0x7F800000, 0xFF800000,
                            0x7F7FFFFF, 0x00000001, 0x80000000, 0x00000000, 0x7F808000], dtype=torch.int64)
    src = torch.cat([special.to(torch.int32).view(torch.float32), torch.randn(36, generator=g)]).reshape(6, 8)
    case("valid-derived-bf16", {"master": src, "half": bf16_rne(src), "other": torch.randn(3, generator=g)},
         section="14.2", flags=["derived", "bf16_rne"],
         description="a bfloat16 tensor stored as bf16_rne of its float32 master (ties, NaN payloads, overflow to inf)",
         derive_bf16=True, codec="raw")

    flat = torch.arange(40, dtype=torch.float32) * 0.5
    case("valid-views", {"a": flat[0:12].view(3, 4), "b": flat[10:30:2], "c": flat[8:20].view(4, 3).t(),
                         "d": flat[5:6].expand(4, 3), "e": flat[0:40]},
         section="14.3", flags=["view", "shared-storage", "zero-stride", "overlap"],
         description="five views of one storage (strided, transposed, zero-stride, overlapping) sharing one internal base")
    w = torch.randn(4, 4, generator=g)
    case("valid-tied", {"embed": w, "head": w, "nested": [w, {"again": w}]}, section="14.1", flags=["tied"],
         description="one tensor reached by four paths: one entry, four tree references")
    tree = {
        "tensors": [torch.ones(2), (torch.zeros(1, dtype=torch.int8), "tuple-str")],
        1: {None: None, True: False, 2.5: "float key", -3: [1, -1, 2**64 - 1, -(2**63)]},
        "floats": [0.0, -0.0, 1e-300, float("inf"), float("-inf"), float("nan"), 3.141592653589793],
        "bytes": b"\x00\xff binary",
        "str": "text with \"quotes\" and \\ and \n",
        "empty": [[], {}, ()],
        "bools": (True, False, None),
        "key types": {None: torch.ones(1), True: torch.ones(2), 2.5: torch.ones(3), 1e-05: torch.ones(4),
                      -7: torch.ones(5), 1e16: torch.ones(6), float("-inf"): torch.ones(7), "~/": torch.ones(8)},
    }
    case("valid-tree", tree, section="9", flags=["tree", "scalars", "strings", "tuples", "int-keys", "bytes"],
         description="a nested tree with every node type: int/bool/nil/float keys (names from Python's str() of "
                     "each key: None, True, 2.5, 1e-05, -7, 1e+16, -inf), tuples, bytes, big ints, nan/inf")
    case("valid-metadata", {"t": torch.ones(1)}, metadata={"run": "conformance", "step": 1234, "lr": 3e-4,
                                                          "tags": ["a", "b"], "config": {"layers": [1, 2, {"x": None}],
                                                                                         "ok": True}},
         section="8.6", flags=["metadata"], description="nested user metadata")
    case("valid-unicode-names", {"ünïcødé": torch.ones(2), "日本語": {"キー": torch.zeros(1)}, "a/b": torch.ones(1),
                                 "~tilde": torch.ones(1), "": torch.ones(1), "emoji 🎉": torch.ones(1)},
         section="14.1", flags=["unicode", "names", "escaping"],
         description="tensor names with non-ASCII keys, '/', '~' (escaped ~1, ~0) and an empty key")
    case("valid-root-tensor", torch.arange(6, dtype=torch.int32).reshape(2, 3), section="14.1", flags=["root-tensor"],
         description="the saved object is itself a tensor: its name is the empty string")
    case("valid-empty-state", {"epoch": 3, "note": "no tensors"}, section="8.1", flags=["no-tensors"],
         description="no tensors at all: empty codec and tensor tables")
    case("valid-alignment-1", {"w": smooth(300, 8), "i": torch.arange(77, dtype=torch.int8)}, section="12.3",
         flags=["alignment"], description="alignment 1 (no padding anywhere)", alignment=1, chunk_size=200, codec="raw")
    case("valid-alignment-64k", {"w": tensor_from_bytes(randbytes(9, 65536), torch.uint8, (65536,))},
         section="12.3", flags=["alignment", "padding"],
         description="alignment 65536: a 64 KiB raw chunk whose payload is padded to a 64 KiB boundary",
         alignment=65536, codec="raw", chunk_size=65536)
    case("valid-no-tensor-checksums", {"w": smooth(64, 10)}, section="13", flags=["no-tensor-checksum"],
         description="tensor checksums left out (they are optional)", tensor_checksums=False)
    pipe_obj = {"w": smooth(600, 11).reshape(20, 30), "step": 9}
    case("valid-pipe", pipe_obj, section="6", flags=["pipe", "streaming-write"],
         description="written by nvckpt.save to an OS pipe (no seek, no tell)", pipe=True, chunk_size=512)
    assert bases["valid-pipe"][2] == save(pipe_obj, chunk_size=512), "a pipe and a file must get the same bytes"
    case("valid-base", {"w": smooth(32, 12).reshape(8, 4), "i": torch.arange(5, dtype=torch.int64),
                        "v": [flat[2:10].view(2, 4), flat[4:12]], "m": w, "b": bf16_rne(w), "step": 3},
         metadata={"k": "v"}, section="8", flags=["base"], codec="raw", chunk_size=32, derive_bf16=True,
         description="the file most invalid cases are made from: multi-chunk, views, derived, scalars, metadata")
    bases["zstd-base"] = (None, None, save({"z": smooth(256, 13)}, codec="zstd", chunk_size=1024))
    bases["shuffle-base"] = (None, None, save({"z": smooth(256, 14)}, codec="portable", chunk_size=1024))

    gen_crafted_valid(s, bases)
    return bases


def gen_crafted_valid(s: Suite, bases: dict) -> None:
    obj, meta, data = bases["valid-base"]
    exp = expected_decode(obj, meta, data)

    # Optional feature bit, optional extension frames (types 128, 200, 255), a higher minor version with unknown keys.
    nv = craft.parse(data)
    nv.preamble.optional_features = 0x80000001
    s.valid("valid-optional-feature-bit", craft.build(nv), exp, section="3", flags=["optional-feature"],
            description="optional_features bits 0 and 31 set: readers ignore unknown optional bits")
    nv = craft.parse(data)
    for pos, ftype in ((1, 128), (4, 200), (len(nv.frames) - 1, 255)):
        nv.frames.insert(pos, craft.Frame(ftype, b"an optional extension frame payload", codec_id=7, tensor_id=3,
                                          chunk_index=9, padding_length=5 if ftype == 200 else 0))
    s.valid("valid-optional-frames", craft.build(nv), exp, section="4.2", flags=["optional-frame"],
            description="frames of types 128, 200 and 255 between the others: readers skip them")
    nv = craft.parse(data)
    nv.preamble.version_minor = 7
    nv.index["version"] = [1, 7]
    nv.index["future_key"] = {"anything": [1, 2]}
    nv.index["writer"]["future"] = "x"
    nv.index["tensors"][0]["future_entry_key"] = 1
    craft.sync_tensor_frames(nv)
    s.valid("valid-minor-version", craft.build(nv), exp, section="19", flags=["minor-version", "unknown-keys"],
            description="version 1.7 with unknown keys in the index, writer and a tensor entry: readers accept and ignore")

    nv = craft.parse(data)
    nv.index["version"] = [1, 3]
    s.valid("valid-index-minor-differs", craft.build(nv), exp, section="8.1", flags=["minor-version"],
            description="the index says version [1, 3], the preamble 1.0: a reader must not reject a differing minor")
    nv = craft.parse(data)
    del nv.index["writer"]
    s.valid("valid-no-writer-map", craft.build(nv), exp, section="8.1", flags=["writer"], level="may",
            description="the index has no 'writer' map (writers must write it; a reader may treat it as empty)")

    nv = craft.parse(data)
    vid = nv.tensor_id("v/1")
    nv.index["tensors"][vid]["shape"] = [0]
    nv.index["tensors"][vid]["view"]["offset"] = 1000
    nv.index["tensors"][vid].pop("checksum", None)
    craft.sync_tensor_frames(nv)
    exp_ev = copy.deepcopy(exp)
    exp_ev["tensors"]["v/1"] = tensor_json(exp_ev["tensors"]["v/1"]["dtype"], [0], b"")
    s.valid("valid-empty-view-offset-past-base", craft.build(nv), exp_ev, section="8.5", flags=["view", "empty"],
            description="an empty view (shape [0]) whose offset 1000 is past the end of its base: it addresses no element")

    # Frames in another order than nvckpt writes them (4.3 rule 6): interleaved tensors, chunks out of order.
    nv = craft.parse(data)
    index = nv.frames[-1]
    codecs = [f for f in nv.frames if f.frame_type == craft.CODEC]
    tensors = [f for f in nv.frames if f.frame_type == craft.TENSOR]
    chunks = [f for f in nv.frames if f.frame_type == craft.CHUNK]
    chunks.sort(key=lambda f: (-f.chunk_index, f.tensor_id))  # interleaved across tensors, descending chunk index
    nv.frames = codecs + list(reversed(tensors)) + chunks + [index]
    s.valid("valid-frame-order", craft.build(nv), exp, section="4.3", flags=["frame-order", "interleaved"],
            description="all CODEC frames, TENSOR frames in reverse id order, then CHUNK frames of all tensors "
                        "interleaved with descending chunk index: allowed by rule 6")

    # Maximum padding (2^20 zero bytes) before a small chunk payload.
    nv = craft.parse(data)
    nv.chunk_frame(0, 1).padding_length = 1 << 20
    s.valid("valid-padding-max", craft.build(nv), exp, section="12.3", flags=["padding", "max-padding"],
            description="padding_length = 2^20 (the maximum) before a small chunk payload")

    # Non-shortest msgpack everywhere in the index, and float32 in the tree.
    nv = craft.parse(data)
    nv.index_frame().payload = pack_wide(nv.index)
    s.valid("valid-msgpack-wide", craft.build(nv, fix_index=False), exp, section="1",
            flags=["msgpack", "non-shortest"],
            description="every int, str, array and map of the index in its widest msgpack form")
    nv = craft.parse(data)
    nv.index["tree"]["lr"] = 0.0  # placeholder: a float64 we then rewrite as float32
    payload = craft.pack(nv.index)
    f64 = b"\xa2lr\xcb" + struct.pack(">d", 0.0)
    assert payload.count(f64) == 1
    nv.index_frame().payload = payload.replace(f64, b"\xa2lr\xca" + struct.pack(">f", 0.15625))
    exp32 = copy.deepcopy(exp)
    exp32["tree"]["$map"].append(["lr", float_json(0.15625)])
    s.valid("valid-msgpack-float32", craft.build(nv, fix_index=False), exp32, section="1", flags=["msgpack", "float32"],
            description="a float 32 in the tree (writers write float 64; readers must accept float 32)")

    # zstd: several frames, a skippable frame, no content size in the frame header.
    obj_z = {"z": smooth(256, 13)}
    raw = raw_bytes(obj_z["z"])
    _, _, zdata = bases["zstd-base"]
    nv = craft.parse(zdata)
    f = nv.chunk_frame(0, 0)
    skippable = struct.pack("<II", 0x184D2A50, 6) + b"ignore"
    f.payload = (zstandard.ZstdCompressor(level=3, write_content_size=False).compress(raw[:300]) + skippable
                 + zstandard.ZstdCompressor(level=3).compress(raw[300:]))
    s.valid("valid-zstd-multiframe", craft.build(nv), expected_decode(obj_z, None, zdata), section="11.4",
            flags=["codec-zstd", "zstd-frames", "zstd-skippable", "zstd-no-content-size"],
            description="one chunk = two zstd frames (the first without Frame_Content_Size) with a skippable frame between")

    # A chunk whose codec this reader does not know: the file opens, the other tensors load.
    nv = craft.parse(data)
    nv.index["codecs"].append([{"name": "x-future-codec", "configuration": {"param": 1}}])
    new_id = len(nv.index["codecs"]) - 1
    nv.frames.insert(0, craft.Frame(craft.CODEC, craft.pack(nv.index["codecs"][-1]), codec_id=new_id))
    tid = nv.tensor_id("i")
    nv.chunk_frame(tid, 0).codec_id = new_id
    exp_u = copy.deepcopy(exp)
    exp_u["tensors"]["i"] = {k: v for k, v in exp_u["tensors"]["i"].items() if k not in ("nbytes", "sha256")} | {
        "error": "unsupported-codec"}
    bases["valid-unknown-codec-src"] = (None, None, craft.build(nv))
    s.valid("valid-unknown-codec", craft.build(nv), exp_u, section="11.8", flags=["unknown-codec"],
            description="tensor 'i' uses an unregistered codec: reading it is UnsupportedCodecError, every other "
                        "tensor loads, the file opens")

    # Unknown dtype and unknown derived function: UnsupportedFeatureError for that tensor only.
    nv = craft.parse(data)
    nv.index["tensors"].append({"name": "future", "dtype": "float7_e3m3", "shape": [3],
                                "chunks": [], "internal": False})
    entry = nv.index["tensors"][-1]
    payload = b"\x01\x02\x03"
    nv.frames.insert(len(nv.frames) - 1, craft.Frame(craft.TENSOR, craft.tensor_payload(entry | {"chunks": [0]}),
                                                     tensor_id=len(nv.index["tensors"]) - 1))
    raw_id = next(i for i, p in enumerate(nv.index["codecs"]) if p[0]["name"] == "raw")
    nv.frames.insert(len(nv.frames) - 1, craft.Frame(craft.CHUNK, payload, codec_id=raw_id,
                                                     tensor_id=len(nv.index["tensors"]) - 1, raw_length=3))
    entry["chunks"] = [[0, 3, 3, raw_id, 0]]  # offset and checksum filled in by build()
    nv.index["tree"]["future"] = tensor_ref(len(nv.index["tensors"]) - 1)
    exp_d = copy.deepcopy(exp)
    exp_d["tensors"]["future"] = {"dtype": "float7_e3m3", "shape": [3], "internal": False, "error": "unsupported-feature"}
    exp_d["tree"]["$map"].append(["future", {"$tensor": "future"}])
    bases["valid-unknown-dtype-src"] = (None, None, craft.build(nv))
    s.valid("valid-unknown-dtype", craft.build(nv), exp_d, section="10", flags=["unknown-dtype"], level="should",
            description="a tensor with a dtype name this version does not define: UnsupportedFeatureError when it "
                        "is read, the file opens and the other tensors load")
    nv = craft.parse(data)
    src = nv.tensor_id("m")
    nv.index["tensors"].append({"name": "future-derived", "dtype": "bfloat16", "shape": nv.index["tensors"][src]["shape"],
                                "derived": {"function": "future_fn", "source": src}})
    nv.frames.insert(len(nv.frames) - 1, craft.Frame(craft.TENSOR, craft.tensor_payload(nv.index["tensors"][-1]),
                                                     tensor_id=len(nv.index["tensors"]) - 1))
    nv.index["tree"]["future-derived"] = tensor_ref(len(nv.index["tensors"]) - 1)
    exp_f = copy.deepcopy(exp)
    exp_f["tensors"]["future-derived"] = {"dtype": "bfloat16", "shape": nv.index["tensors"][src]["shape"],
                                          "internal": False, "error": "unsupported-feature"}
    exp_f["tree"]["$map"].append(["future-derived", {"$tensor": "future-derived"}])
    s.valid("valid-unknown-derived-function", craft.build(nv), exp_f, section="8.5", flags=["unknown-derived"],
            level="should",
            description="a derived tensor with an unknown function name: UnsupportedFeatureError when it is read only")

    # Maximum tree depth (64) and maximum rank (64) are still valid.
    nv = craft.parse(data)
    nv.index["tree"] = nest(63, tensor_ref(0))  # root list at depth 1, innermost list at depth 63, the ref inside
    nv.index["tree"] = [nv.index["tree"]] + [tensor_ref(i) for i in range(1, len(nv.index["tensors"]))
                                             if not nv.index["tensors"][i].get("internal")]
    exp_deep = copy.deepcopy(exp)
    names = [e["name"] for e in nv.index["tensors"] if not e.get("internal")]
    node: Any = {"$tensor": names[0]}
    for _ in range(63):
        node = [node]
    exp_deep["tree"] = [node] + [{"$tensor": n} for n in names[1:]]
    s.valid("valid-tree-depth-64", craft.build(nv), exp_deep, section="9", flags=["depth", "limit"],
            description="a tree nested exactly 64 deep (root container = depth 1): the limit, still valid")
    r64 = torch.arange(6, dtype=torch.int16).reshape([2, 3] + [1] * 62)
    data64 = save({"r": r64}, codec="raw")
    s.valid("valid-rank-64", data64, expected_decode({"r": r64}, None, data64), section="8.3", flags=["rank", "limit"],
            description="a tensor of rank 64 (the limit)")

    # nvcomp-ans: genuine ANS bytes from nvCOMP (fixture produced on a GPU), see conformance/README.md.
    if os.path.exists(ANS_FIXTURE):
        gen_ans(s, bases)


def gen_ans(s: Suite, bases: dict) -> None:
    with open(ANS_FIXTURE) as f:
        fx = json.load(f)
    raw = bytes.fromhex(fx["raw_hex"])
    stored = bytes.fromhex(fx["stored_hex"])
    assert hashlib.sha256(raw).hexdigest() == fx["raw_sha256"] and craft.xxh3(stored) == fx["stored_xxh3"], ANS_FIXTURE
    obj = {"ans": tensor_from_bytes(raw, getattr(torch, fx["dtype"]), tuple(fx["shape"])),
           "plain": torch.arange(8, dtype=torch.int32)}
    data = save(obj, codec="raw")
    exp = expected_decode(obj, None, data)
    nv = craft.parse(data)
    pipeline = [{"name": "nvcomp-ans", "configuration": {"data_type": fx["data_type"],
                                                          "nvcomp_version": fx["nvcomp_version"], "bitstream": "raw"}}]
    nv.index["codecs"].append(pipeline)
    cid = len(nv.index["codecs"]) - 1
    nv.frames.insert(0, craft.Frame(craft.CODEC, craft.pack(pipeline), codec_id=cid))
    tid = nv.tensor_id("ans")
    chunk = nv.chunk_frame(tid, 0)
    chunk.payload = stored
    chunk.codec_id = cid
    nv.index["writer"]["nvcomp"] = fx["nvcomp_version"]
    exp["tensors"]["ans"]["requires"] = ["nvcomp"]  # without nvCOMP: UnsupportedCodecError for this tensor
    s.valid("valid-codec-nvcomp-ans", craft.build(nv), exp, section="11.6", flags=["codec-nvcomp-ans"],
            requires=["nvcomp"],
            description=f"a chunk coded by nvCOMP {fx['nvcomp_version']} ANS (RAW bitstream) on a GPU; readers "
                        "without nvCOMP must report UnsupportedCodecError for 'ans' and still load 'plain'")
    # The same bytes labelled with an nvCOMP version whose ANS bitstream 6.x cannot read.
    nv = craft.parse(craft.build(nv))
    nv.index["codecs"][cid][0]["configuration"]["nvcomp_version"] = "5.1.0"
    nv.frames[0].payload = craft.pack(nv.index["codecs"][cid])
    exp_old = copy.deepcopy(exp)
    exp_old["tensors"]["ans"] = {k: v for k, v in exp_old["tensors"]["ans"].items() if k not in ("nbytes", "sha256")} | {
        "error": "unsupported-codec"}
    s.valid("valid-nvcomp-ans-old-bitstream", craft.build(nv), exp_old, section="11.6",
            flags=["codec-nvcomp-ans", "nvcomp-version"],
            description="an nvcomp-ans chunk recorded as written by nvCOMP 5.1.0: no reader, with or without a GPU, "
                        "may decode it (the 6.0 bitstream changed); UnsupportedCodecError for 'ans' only")


# --------------------------------------------------------------------------------------------
# Invalid cases
# --------------------------------------------------------------------------------------------

def gen_invalid(s: Suite, bases: dict) -> None:
    _, _, base = bases["valid-base"]

    def edit(fn: Callable[[craft.NvFile], Any], src: bytes = base, **build_kw: Any) -> bytes:
        nv = craft.parse(src)
        out = fn(nv)
        if isinstance(out, dict):
            build_kw = {**build_kw, **out}
        return craft.build(nv, **build_kw)

    def index_edit(fn: Callable[[dict], Any], src: bytes = base, sync: bool = False) -> bytes:
        """Change the decoded index (and re-pack it): chunk tables are left exactly as fn made them."""
        nv = craft.parse(src)
        fn(nv.index)
        if sync:  # TENSOR frames change size: chunk offsets move, and the index follows them
            craft.sync_tensor_frames(nv)
            return craft.build(nv)
        nv.index_frame().payload = craft.pack(nv.index)
        return craft.build(nv, fix_index=False)

    def raw_index(payload: bytes, src: bytes = base) -> bytes:
        nv = craft.parse(src)
        nv.index_frame().payload = payload
        return craft.build(nv, fix_index=False)

    inv = s.invalid
    nv0 = craft.parse(base)
    T = {e["name"]: i for i, e in enumerate(nv0.index["tensors"])}

    # -- truncation at every structure boundary -----------------------------------------------
    for off, what in craft.structure_boundaries(base):
        inv(f"truncated-at-{off:05d}", base[:off], "truncated", section="5", flags=["truncated"],
            description=f"the valid base file cut at byte {off} of {len(base)}: {what}",
            danger="a writer killed mid-save or a partial copy; a reader that trusts offsets reads past the end",
            codec="raw")

    # -- magic numbers ----------------------------------------------------------------------------
    inv("bad-preamble-magic", b"\x89NVCKPX\n" + base[8:], "format", section="3", flags=["magic"],
        description="preamble magic ends in 'X' instead of 'T'",
        danger="not an nvckpt file (or a text-mode copy); parsing it would interpret foreign bytes")
    inv("bad-preamble-magic-crlf", base[:7] + b"\r\n" + base[8:], "format", section="3",
        flags=["magic", "line-ending"], description="the magic's \\n became \\r\\n (a text-mode transfer), shifting every byte",
        danger="a line-ending conversion corrupts every binary field; the magic catches it first")
    inv("bad-index-frame-magic", edit(lambda nv: setattr(nv.index_frame(), "magic", b"NVCX")), "format", section="5",
        flags=["magic", "frame"], description="the INDEX frame header's magic is 'NVCX'",
        danger="the footer points at something that is not a frame header")
    inv("bad-chunk-frame-magic", edit(lambda nv: setattr(nv.chunk_frame(0, 1), "magic", b"NVCX")), "format",
        section="4.1", flags=["magic", "frame"], readers=STREAMING,
        description="a CHUNK frame header's magic is 'NVCX' (only a streaming reader reads it)",
        danger="a streaming reader that does not check the magic walks into garbage lengths")
    inv("bad-footer-magic", base[:-8] + b"NVCKEND\r", "truncated", section="5", flags=["magic", "footer"],
        description="the end magic is 'NVCKEND\\r': the file does not end with a footer (a streaming reader, which "
                    "checks the footer after the INDEX frame as SPEC 15.2 says, reports the same TruncatedError)",
        danger="a truncated or appended-to file; the footer's offsets cannot be trusted")

    # -- versions and feature bits ------------------------------------------------------------
    def pre(field: str, value: int) -> Callable:
        return lambda nv: setattr(nv.preamble, field, value)

    inv("unknown-required-feature-bit0", edit(pre("required_features", 1)), "unsupported-feature", section="3",
        flags=["required-feature"], description="required_features bit 0 set (version 1.0 defines none)",
        danger="the file needs a feature this reader lacks: reading on would misinterpret the bytes")
    inv("unknown-required-feature-bit31", edit(pre("required_features", 1 << 31)), "unsupported-feature", section="3",
        flags=["required-feature"], description="required_features bit 31 set",
        danger="as above; a reader must not mask the bit as signed")
    inv("unknown-major-version-2", edit(pre("version_major", 2)), "unsupported-feature", section="3",
        flags=["version"], description="version_major = 2", danger="a future incompatible layout")
    inv("unknown-major-version-0", edit(pre("version_major", 0)), "unsupported-feature", section="3",
        flags=["version"], description="version_major = 0", danger="not a version-1 file")
    inv("preamble-reserved-nonzero", edit(pre("reserved", 1)), "format", section="3", flags=["reserved"],
        description="the preamble's reserved field is 1", danger="reserved fields must stay free for future versions")
    inv("index-major-version-mismatch", index_edit(lambda ix: ix.__setitem__("version", [2, 0])), "format",
        section="8.1", flags=["version"], description="the index says version [2, 0], the preamble 1.0",
        danger="preamble and index disagree on the major version: one of them is damaged or spliced from another file")

    # -- frame header fields (INDEX frame: random-access readers read it) --------------------------
    def frame_set(sel: Callable, **fields: Any) -> Callable:
        def fn(nv: craft.NvFile) -> None:
            f = sel(nv)
            for k, v in fields.items():
                setattr(f, k, v)
        return fn

    idx = lambda nv: nv.index_frame()  # noqa: E731
    inv("index-frame-flags-nonzero", edit(frame_set(idx, flags=1)), "format", section="4.1", flags=["reserved", "frame"],
        description="the INDEX frame's reserved flags byte is 1", danger="reserved bits must stay free")
    inv("index-frame-raw-length-differs", edit(frame_set(idx, raw_length=5)), "format", section="4.1",
        flags=["frame", "lengths"], description="the INDEX frame's raw_length differs from its stored_length",
        danger="a non-CHUNK frame is not coded; a mismatch means a damaged header")
    def footer_set(**fields: Any) -> Callable:
        def fn(nv: craft.NvFile) -> dict:
            craft_data = craft.build(nv)  # lay out, then damage the footer only
            nv.__dict__.update(craft.parse(craft_data).__dict__)
            for k, v in fields.items():
                setattr(nv.footer, k, v(nv.footer) if callable(v) else v)
            return {"fix_footer": False}
        return fn

    def footer_at_codec_frame(nv: craft.NvFile) -> dict:
        """The footer describes the first CODEC frame (its offset, stored_length and payload checksum)."""
        laid_out = footer_set()(nv)
        codec = next(f for f in nv.frames if f.frame_type == craft.CODEC)
        nv.footer.index_offset, nv.footer.index_length = codec.offset, len(codec.payload)
        nv.footer.index_checksum, nv.footer.footer_checksum = craft.xxh3(codec.payload), None
        return laid_out

    inv("index-frame-wrong-type", edit(footer_at_codec_frame), "format", section="5", flags=["frame", "footer"],
        description="the footer's index_offset, index_length and index_checksum describe the first CODEC frame "
                    "(type 1), not the INDEX frame, which is intact (a random-access reader finds a frame of the "
                    "wrong type; a streaming reader, a footer that does not describe the INDEX frame it read)",
        danger="the footer points at the wrong frame: an index parsed from it would be garbage")
    inv("index-frame-tensor-id-nonzero", edit(frame_set(idx, tensor_id=1)), "format", section="4.2",
        flags=["frame", "reserved"], description="the INDEX frame's tensor_id is 1 (must be 0)",
        danger="fields that must be 0 are how damage is noticed")
    inv("index-frame-padding-over-limit", edit(frame_set(idx, padding_length=(1 << 20) + 1)), "format", section="4.1",
        flags=["padding", "limit"], also=["limit"], description="the INDEX frame's padding_length is 2^20 + 1",
        danger="padding beyond the limit lets a header skip arbitrary amounts of data")
    inv("index-frame-padding-nonzero", edit(frame_set(idx, padding_length=8, padding=b"\0\0\0\x01\0\0\0\0")), "format",
        section="4.1", flags=["padding"], level="should", description="the INDEX frame's 8 padding bytes are not all zero",
        danger="non-zero padding is damage, or data hidden where no checksum covers it")
    inv("chunk-frame-padding-nonzero", edit(frame_set(lambda nv: nv.chunk_frame(0, 0), padding_length=4,
                                                      padding=b"\0\x07\0\0")), "format", section="4.1",
        flags=["padding"], readers=STREAMING, description="a CHUNK frame's padding bytes are not zero",
        danger="bytes that no checksum covers")
    for ftype, err in ((0, "format"), (5, "unsupported-feature"), (127, "unsupported-feature")):
        inv(f"frame-type-{ftype}", edit(lambda nv, t=ftype: nv.frames.insert(2, craft.Frame(t, b"payload"))), err,
            section="4.2", flags=["frame-type"], readers=STREAMING,
            description=f"a frame of type {ftype} between the others ({'invalid' if ftype == 0 else 'unknown required'})",
            danger="a required frame this reader does not understand: skipping it could silently lose data")

    # -- checksums, each in turn -------------------------------------------------------------------
    def flip_payload(sel: Callable, at: int = 0) -> Callable:
        def fn(nv: craft.NvFile) -> dict:
            f = sel(nv)
            b = bytearray(f.payload)
            b[at] ^= 0x01
            f.payload_checksum = craft.xxh3(f.payload)  # the header keeps the old checksum
            f.payload = bytes(b)
            return {"fix_index": False}
        return fn

    inv("checksum-chunk", edit(flip_payload(lambda nv: nv.chunk_frame(T["w"], 1), 3)), "checksum", section="13",
        flags=["checksum", "chunk"], description="one bit of a chunk's stored bytes flipped (tensor 'w', chunk 1)",
        danger="damaged data would be decoded and returned as if it were the tensor")
    inv("checksum-index", edit(lambda nv: [flip_payload(idx, 20)(nv), None][1], fix_footer=False, fix_index=False),
        "checksum", section="5", flags=["checksum", "index"],
        description="one bit of the index payload flipped; footer and INDEX header keep the old checksum",
        danger="a damaged index can point anywhere")
    inv("checksum-index-frame-header", edit(frame_set(idx, header_checksum=0x12345678)), "checksum", section="4.1",
        flags=["checksum", "frame-header"], also=["format"],
        description="the INDEX frame's header_checksum is wrong",
        danger="a damaged header gives wrong lengths and offsets")
    inv("checksum-chunk-frame-header", edit(frame_set(lambda nv: nv.chunk_frame(0, 0), header_checksum=0x12345678)),
        "checksum", section="4.1", flags=["checksum", "frame-header"], readers=STREAMING,
        description="a CHUNK frame's header_checksum is wrong (only a streaming reader reads that header)",
        danger="a streaming reader would trust damaged lengths")
    inv("checksum-tensor-frame-payload", edit(flip_payload(lambda nv: nv.tensor_frame(0), 2)), "checksum",
        section="15.2", flags=["checksum", "tensor-frame"], readers=STREAMING,
        description="one bit of a TENSOR frame's payload flipped",
        danger="a streaming or recovering reader would take a damaged name, dtype or shape")
    inv("checksum-codec-frame-payload", edit(flip_payload(lambda nv: next(f for f in nv.frames if f.frame_type == 1), 2)),
        "checksum", section="15.2", flags=["checksum", "codec-frame"], readers=STREAMING,
        description="one bit of a CODEC frame's payload flipped",
        danger="a streaming reader would decode chunks with the wrong codec")

    inv("checksum-footer", edit(footer_set(footer_checksum=0xDEADBEEF)), "checksum", section="5",
        flags=["checksum", "footer"], description="the footer_checksum is wrong",
        danger="a damaged footer points at the wrong place")
    inv("checksum-tensor", index_edit(lambda ix: ix["tensors"][T["i"]].__setitem__("checksum", 12345), sync=True),
        "checksum", section="13", level="should", flags=["checksum", "tensor"],
        description="tensor 'i' has a tensor checksum that does not match its decoded bytes",
        danger="a decoder bug or damaged data that the chunk checksums could not see")
    inv("footer-reserved-nonzero", edit(footer_set(reserved=1)), "format", section="5", flags=["reserved", "footer"],
        description="the footer's reserved field is 1 (footer checksum recomputed)",
        danger="reserved fields must stay free for future versions")

    # -- footer and index offsets --------------------------------------------------------------------
    size = len(base)
    inv("footer-index-offset-past-end", edit(footer_set(index_offset=size + 100)), "format", section="5",
        flags=["offsets"], description="the footer's index_offset is beyond the end of the file",
        danger="a read past the end of the file")
    inv("footer-index-offset-in-preamble", edit(footer_set(index_offset=8)), "format", section="5", flags=["offsets"],
        description="the footer's index_offset is 8, inside the preamble", danger="the index would be read from the preamble")
    inv("footer-index-offset-overflow", edit(footer_set(index_offset=(1 << 64) - 16)), "format", section="5",
        flags=["offsets", "overflow"], description="index_offset = 2^64 - 16: index_offset + 48 + index_length wraps in u64",
        danger="a reader that adds in 64 bits without checking wraps around to a small, 'valid' offset")
    inv("footer-index-at-chunk-frame", edit(footer_set(index_offset=lambda ft: craft.parse(base).chunk_frame(0, 0).offset)),
        "format", section="5", flags=["offsets"], description="the footer points at a CHUNK frame instead of the INDEX frame",
        danger="the index would be parsed from chunk data")
    inv("footer-index-length-differs", edit(footer_set(index_length=lambda ft: ft.index_length - 1)), "format",
        section="5", flags=["lengths"], description="the footer's index_length is one less than the INDEX frame's stored_length",
        danger="footer and frame disagree: one is damaged")
    inv("index-length-over-limit", edit(footer_set(index_length=(1 << 30) + 1)), "limit", section="16",
        flags=["limit", "index"], also=["format"], description="index_length = 2^30 + 1 (MAX_INDEX_LENGTH is 2^30)",
        danger="a reader would allocate or read a gigabyte before checking anything")

    # -- chunk tables: offsets, lengths, overlap, overflow -----------------------------------------------
    def chunk_set(name: str, i: int, field: int, value: Any) -> Callable:
        def fn(ix: dict) -> None:
            c = ix["tensors"][T[name]]["chunks"][i]
            c[field] = value(c) if callable(value) else value
        return fn

    index_off = nv0.index_frame().offset
    inv("chunk-offset-past-index", index_edit(chunk_set("w", 0, 0, index_off - 2)), "format", section="8.4",
        flags=["offsets"], description="a chunk range runs past the start of the INDEX frame",
        danger="chunk bytes would be read from the index or beyond the file")
    inv("chunk-offset-past-end", index_edit(chunk_set("w", 0, 0, size + 4096)), "format", section="8.4",
        flags=["offsets"], description="a chunk offset beyond the end of the file", danger="a read past the end of the file")
    inv("chunk-offset-in-preamble", index_edit(chunk_set("w", 0, 0, 4)), "format", section="8.4", flags=["offsets"],
        description="a chunk offset of 4 (below 24 + 48)", danger="the preamble would be decoded as tensor data")
    inv("chunk-offset-overflow", index_edit(chunk_set("w", 0, 0, (1 << 64) - 8)), "format", section="20",
        flags=["offsets", "overflow"], description="chunk offset 2^64 - 8: offset + stored_length wraps in u64",
        danger="a wrapped end offset passes a naive range check")
    def overlap(ix: dict) -> None:
        c0, c1 = ix["tensors"][T["w"]]["chunks"][:2]
        c1[0] = c0[0] + c0[1] - 1
    inv("chunks-overlap", index_edit(overlap), "format", section="8.4",
        flags=["overlap"], description="chunk 1 of 'w' starts one byte before chunk 0 ends",
        danger="overlapping ranges let a small file decode to a large one and spread one bad byte over several tensors")

    def same_range(ix: dict) -> None:
        ix["tensors"][T["i"]]["chunks"][0][0] = ix["tensors"][T["w"]]["chunks"][0][0]
    inv("chunks-same-range-two-tensors", index_edit(same_range), "format", section="8.4", flags=["overlap"],
        description="two tensors' chunks point at the same stored bytes", danger="as above")
    inv("chunk-stored-length-zero", index_edit(chunk_set("w", 0, 1, 0)), "format", section="8.4", flags=["lengths"],
        description="a chunk with stored_length 0", danger="zero-length chunks break the one-frame-per-chunk rule")
    inv("chunk-raw-length-zero", index_edit(lambda ix: ix["tensors"][T["i"]].__setitem__(
        "chunks", ix["tensors"][T["i"]]["chunks"] + [[1 << 40, 1, 0, 0, 0]])), "format", section="8.4",
        flags=["lengths"], description="an extra chunk with raw_length 0", danger="lengths that add nothing hide data")
    inv("chunk-raw-length-sum-mismatch", index_edit(chunk_set("i", 0, 2, lambda c: c[2] - 8)), "format", section="8.4",
        flags=["lengths"], description="the chunks' raw lengths add up to 8 bytes less than shape x itemsize",
        danger="the tensor would be returned with uninitialized or missing bytes")
    inv("chunk-raw-length-not-itemsize-multiple", index_edit(chunk_set("w", 0, 2, lambda c: c[2] + 2)),
        "format", section="8.4", flags=["lengths"], description="a float32 chunk's raw_length is not a multiple of 4",
        danger="elements would be split across chunks")
    inv("chunk-codec-id-out-of-range", index_edit(chunk_set("w", 0, 3, 99)), "format", section="8.4", flags=["codec-id"],
        description="a chunk uses codec id 99; the codec table has fewer entries", danger="an out-of-bounds table lookup")
    def raw_lengths_differ(nv: craft.NvFile) -> None:
        # Tensor 'i' (int64 [5]) is two raw chunks of 32 + 8 bytes.  Chunk 0 claims 40 raw bytes for its 32
        # stored ones; the shape [6] keeps the sum rule (40 + 8 = 48 = 6 x 8), the tensor checksum is dropped
        # (optional) and the TENSOR frame follows the entry: the raw length is the only fault.
        assert [c[2] for c in nv.index["tensors"][T["i"]]["chunks"]] == [32, 8]
        nv.chunk_frame(T["i"], 0).raw_length = 40
        entry = nv.index["tensors"][T["i"]]
        entry["shape"] = [6]
        entry.pop("checksum", None)
        craft.sync_tensor_frames(nv)
    inv("raw-chunk-lengths-differ", edit(raw_lengths_differ),
        "format", section="11.3", flags=["lengths", "codec-raw"],
        description="a raw-coded chunk claims raw_length 40 for 32 stored bytes; the raw lengths still add up to "
                    "the shape's 48 bytes, so only the 11.3 check finds it",
        danger="a raw 'decoder' that copies raw_length bytes reads past the payload")

    big = (1 << 24) + 4

    def chunk_limit(ix: dict) -> None:
        e = ix["tensors"][T["i"]]
        e["shape"] = [big // 8]
        e["chunks"][0][2] = big
    inv("chunk-raw-length-over-limit", index_edit(chunk_limit), "limit", section="16", flags=["limit", "lengths"],
        also=["format"], description="a chunk with raw_length 2^24 + 4 (MAX_CHUNK_LENGTH is 2^24); shape matches",
        danger="a decoder would be asked to allocate beyond the per-chunk bound")
    inv("chunk-stored-length-over-limit", index_edit(chunk_set("w", 0, 1, big)), "limit", section="16",
        flags=["limit", "lengths"], also=["format"], description="a chunk with stored_length 2^24 + 4",
        danger="a reader would read 16 MiB for one chunk, past the file")

    # -- decompression bombs and lying zstd ------------------------------------------------------------
    _, _, zbase = bases["zstd-base"]

    def zstd_payload(payload: bytes, src: bytes = zbase) -> bytes:
        nv = craft.parse(src)
        nv.chunk_frame(0, 0).payload = payload
        return craft.build(nv)

    zraw = craft.parse(zbase).index["tensors"][0]["chunks"][0][2]
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(256 << 20))
    inv("zstd-bomb-declared", zstd_payload(bomb), "format", section="11.7", flags=["decompression-bomb", "codec-zstd"],
        description=f"a {len(bomb)}-byte zstd frame that declares and holds 256 MiB of zeros, for a {zraw}-byte chunk",
        danger="a decoder that trusts Frame_Content_Size (or decodes to the end) allocates 256 MiB from a tiny file")
    bomb_nosize = zstandard.ZstdCompressor(level=19, write_content_size=False).compress(bytes(64 << 20))
    inv("zstd-bomb-undeclared", zstd_payload(bomb_nosize), "format", section="11.7",
        flags=["decompression-bomb", "codec-zstd"],
        description="a zstd frame without content size that decodes to 64 MiB, for a 1 KiB chunk",
        danger="a streaming decoder must stop at raw_length, not at the end of the frame")
    zr = bytes(raw_bytes(smooth(256, 13)))
    inv("zstd-decodes-short", zstd_payload(zstandard.ZstdCompressor(level=3).compress(zr[:-4])), "format",
        section="11.7", flags=["lengths", "codec-zstd"], description="the zstd data decodes to 4 bytes less than raw_length",
        danger="the tensor would be returned with uninitialized bytes")
    inv("zstd-lies-content-size", zstd_payload(_zstd_with_content_size(zr, zraw * 2)), "format", section="11.7", flags=["lengths", "codec-zstd"],
        description="a zstd frame whose Frame_Content_Size says twice raw_length",
        danger="an allocation sized from the frame header instead of raw_length")
    inv("zstd-garbage", zstd_payload(b"\x28\xb5\x2f\xfd" + bytes(range(60))), "format", section="11.4",
        flags=["codec-zstd", "corrupt"], description="a chunk payload that is not valid zstd data (checksums match)",
        danger="the decoder sees malformed input: it must fail cleanly")
    inv("zstd-trailing-garbage", zstd_payload(zstandard.ZstdCompressor(level=3).compress(zr) + b"junk"), "format",
        section="11.4", flags=["codec-zstd", "corrupt"], description="four bytes that are not a zstd frame after the last frame",
        danger="data outside any frame is damage")
    inv("zstd-needs-dictionary", zstd_payload(_zstd_with_dict_id(zr)), "format", section="11.4",
        flags=["codec-zstd", "dictionary"], description="a zstd frame whose header names Dictionary_ID 0x1234",
        danger="frames must not need a dictionary: the reader has none")

    _, _, sbase = bases["shuffle-base"]

    def codec_edit(pipeline: list, src: bytes = sbase) -> bytes:
        nv = craft.parse(src)
        nv.index["codecs"][0] = pipeline
        next(f for f in nv.frames if f.frame_type == craft.CODEC and f.codec_id == 0).payload = craft.pack(pipeline)
        return craft.build(nv)

    z = {"name": "zstd", "configuration": {"level": 1}}
    inv("codec-byteshuffle-elementsize-17", codec_edit([{"name": "byteshuffle", "configuration": {"elementsize": 17}}, z]),
        "format", section="11.5", flags=["codec-byteshuffle"], description="byteshuffle elementsize 17 (allowed: 1..16)",
        danger="a configuration outside the defined range")
    inv("codec-byteshuffle-length-not-multiple", codec_edit([{"name": "byteshuffle", "configuration": {"elementsize": 3}}, z]),
        "format", section="11.5", flags=["codec-byteshuffle"],
        description="byteshuffle elementsize 3 on a 1024-byte chunk (not a multiple of 3)",
        danger="an unshuffle that ignores the remainder drops or invents bytes")
    inv("codec-filter-after-coder", codec_edit([z, {"name": "byteshuffle", "configuration": {"elementsize": 4}}]),
        "format", section="11.1", flags=["codec-pipeline"], description="pipeline [zstd, byteshuffle]: a filter after the coder",
        danger="an invalid pipeline order")
    inv("codec-empty-pipeline", codec_edit([]), "format", section="11.1", flags=["codec-pipeline"],
        description="an empty codec pipeline", danger="no coder at all")
    inv("codec-step-extra-key", codec_edit([{"name": "byteshuffle", "configuration": {"elementsize": 4}, "x": 1}, z]),
        "format", section="11.1", flags=["codec-pipeline"], description="a codec step with a key other than name/configuration",
        danger="a changed codec must get a new name, not a new key")
    inv("codec-zstd-level-not-int", codec_edit([{"name": "byteshuffle", "configuration": {"elementsize": 4}},
                                                {"name": "zstd", "configuration": {"level": "fast"}}]),
        "format", section="11.2", flags=["codec-zstd", "codec-pipeline"], description="zstd level is the string 'fast'",
        danger="a configuration of the wrong type")
    ans = {"data_type": "<f4", "nvcomp_version": "6.0.0", "bitstream": "raw"}
    for cid_, change, what in (("codec-nvcomp-ans-bitstream-not-raw", {"bitstream": "chunked"}, "bitstream 'chunked'"),
                               ("codec-nvcomp-ans-unknown-data-type", {"data_type": "<i8"}, "data_type '<i8'"),
                               ("codec-nvcomp-ans-missing-version", {"nvcomp_version": None}, "no nvcomp_version")):
        config = {k: v for k, v in (ans | change).items() if v is not None}
        inv(cid_, codec_edit([{"name": "nvcomp-ans", "configuration": config}]), "format", section="11.6",
            flags=["codec-nvcomp-ans", "codec-pipeline"], description=f"an nvcomp-ans codec with {what}",
            danger="nvCOMP would be handed a stream of another format or an unknown element type")
    inv("codec-raw-with-configuration", codec_edit([{"name": "raw", "configuration": {"level": 3}}]), "format",
        section="11.1", flags=["codec-pipeline", "codec-raw"], description="raw with a configuration key",
        danger="configurations have exactly the defined keys")

    # -- index structure ------------------------------------------------------------------------------
    inv("index-not-msgpack", raw_index(b"\xc1" * 16), "format", section="8", flags=["msgpack"],
        description="the index payload starts with 0xc1 (never used in msgpack)", danger="garbage instead of an index")
    inv("index-trailing-bytes", raw_index(craft.parse(base).index_frame().payload + b"\xc0"), "format", section="1",
        flags=["msgpack"], description="one msgpack nil after the index map", danger="extra data no one reads")
    inv("index-not-a-map", raw_index(craft.pack([1, 2, 3])), "format", section="8.1", flags=["msgpack"],
        description="the index is an array", danger="wrong type at the top")
    inv("index-missing-tree", index_edit(lambda ix: ix.pop("tree")), "format", section="8.1", flags=["index"],
        description="the index has no 'tree' key", danger="a required key is missing")
    inv("index-wrong-format-name", index_edit(lambda ix: ix.__setitem__("format", "safetensors")), "format",
        section="8.1", flags=["index"], description="index 'format' is 'safetensors'", danger="a foreign index")
    inv("index-tensors-not-array", index_edit(lambda ix: ix.__setitem__("tensors", {"a": 1})), "format", section="8.1",
        flags=["index"], description="index 'tensors' is a map", danger="wrong type")
    payload = craft.parse(base).index_frame().payload
    assert payload[0] == 0x87  # fixmap of 7
    dup = b"\x88" + payload[1:] + craft.pack("format") + craft.pack("nvckpt")
    inv("index-duplicate-key", raw_index(dup), "format", section="1", flags=["msgpack", "duplicate-key"],
        description="the index map has the key 'format' twice", danger="two readers could take different values")

    def entry_set(name: str, key: str, value: Any) -> Callable:
        return lambda ix: ix["tensors"][T[name]].__setitem__(key, value)

    def entry_del(name: str, key: str) -> Callable:
        return lambda ix: ix["tensors"][T[name]].pop(key)

    inv("entry-duplicate-name", index_edit(entry_set("i", "name", "w"), sync=True), "format", section="8.3",
        flags=["duplicate-name"], description="two tensor entries are both named 'w'",
        danger="get_tensor('w') would return either tensor")
    inv("entry-both-chunks-and-view", index_edit(lambda ix: ix["tensors"][T["i"]].__setitem__(
        "view", {"base": T["v/0@base"], "offset": 0, "stride": [1]})), "format", section="8.3", flags=["entry-kind"],
        description="an entry with both 'chunks' and 'view'", danger="two readers could build different tensors")
    _, _, empty_base = bases["valid-empty"]
    E = {e["name"]: i for i, e in enumerate(craft.parse(empty_base).index["tensors"])}
    inv("entry-no-kind", index_edit(lambda ix: ix["tensors"][E["c"]].pop("chunks"), src=empty_base, sync=True),
        "format", section="8.3", flags=["entry-kind"],
        description="an empty tensor's entry (float16 [3, 0, 2]) with none of 'chunks', 'view', 'derived'; no CHUNK "
                    "frame held it, and its TENSOR frame says 0 chunks as before",
        danger="a tensor with no data")
    inv("entry-shape-negative", index_edit(entry_set("i", "shape", [-5]), sync=True), "format", section="8.3",
        flags=["shape"], description="shape [-5]", danger="negative sizes wrap to huge unsigned ones")

    def empty_shape(name: str, shape: list[int]) -> bytes:
        """An empty tensor of valid-empty given another empty shape: no chunk, the same (empty) checksum."""
        return index_edit(lambda ix: ix["tensors"][E[name]].__setitem__("shape", shape), src=empty_base, sync=True)

    inv("entry-dim-over-2p63", empty_shape("c", [1 << 63, 0]), "limit", section="8.3",
        flags=["shape", "overflow", "limit"], also=["format"],
        description="float16 shape [2^63, 0]: empty (nbytes 0), but a dimension of 2^63 spans more than 2^62 bytes",
        danger="beyond the signed 64-bit range every implementation (and torch) can hold")
    inv("entry-shape-product-overflow", index_edit(lambda ix: ix["tensors"][T["i"]].update(
        shape=[1 << 32, 1 << 32, 2], chunks=[]), sync=True), "format", section="8.3",
        flags=["shape", "overflow"], also=["limit"], description="shape [2^32, 2^32, 2] int64: the element count overflows 64 bits",
        danger="a wrapped numel * itemsize (here 0 in u64) passes size checks and under-allocates")
    inv("entry-shape-overflow-with-zero-dim", empty_shape("b", [0, 1 << 61, 2]), "limit", section="8.3",
        flags=["shape", "overflow", "limit"], also=["format"],
        description="int32 shape [0, 2^61, 2]: empty (nbytes 0), but its span (non-zero dimensions x itemsize, "
                    "2^64 bytes) exceeds MAX_TENSOR_BYTES; everything else, chunk table and checksum, is an empty tensor's",
        danger="a row of this tensor (2^61 x 2 x 4 bytes) overflows 64 bits: slicing off the zero dimension wraps")
    inv("entry-rank-65", index_edit(lambda ix: ix["tensors"][T["i"]].update(shape=[5] + [1] * 64), sync=True),
        "limit", section="16", flags=["rank", "limit"], also=["format"], description="a tensor of rank 65",
        danger="rank beyond what implementations can hold on the stack")
    inv("entry-name-too-long", index_edit(entry_set("i", "name", "n" * 4097), sync=True), "limit", section="16",
        flags=["name", "limit"], also=["format"], description="a tensor name of 4097 bytes", danger="unbounded names")
    inv("entry-name-not-str", index_edit(entry_set("i", "name", b"i"), sync=True), "format", section="8.3",
        flags=["name"], description="a tensor name stored as msgpack bin", danger="names are UTF-8 strings")
    utf8 = craft.parse(base).index_frame().payload
    assert utf8.count(b"\xa4name\xa1i") == 1
    inv("entry-name-invalid-utf8", raw_index(utf8.replace(b"\xa4name\xa1i", b"\xa4name\xa1\xff")), "format",
        section="1", flags=["name", "utf-8"], description="a tensor name whose msgpack str holds the byte 0xff (not UTF-8)",
        danger="invalid UTF-8 names break every tool that prints, compares or uses them as paths")
    inv("entry-internal-not-bool", index_edit(entry_set("i", "internal", 1), sync=True), "format", section="8.3",
        flags=["entry"], description="'internal': 1 instead of a bool", danger="wrong type")

    # -- views and derived entries ---------------------------------------------------------------------
    view = "v/0"
    inv("view-out-of-range", index_edit(lambda ix: ix["tensors"][T[view]]["view"].__setitem__("offset", 1000)),
        "format", section="8.5", flags=["view"], description="a view whose last element is past the end of its base",
        danger="an as_strided view out of range reads other memory")
    inv("view-stride-overflow", index_edit(lambda ix: ix["tensors"][T[view]]["view"].__setitem__("stride", [1 << 63, 1])),
        "format", section="20", flags=["view", "overflow"], also=["limit"],
        description="a view stride of 2^63 on a dimension of 2: the bound check wraps to 0 in u64 (strides are "
                    "limited to 2^62, SPEC 8.5, 16)",
        danger="a wrapped bound passes the range check")
    inv("view-base-self", index_edit(lambda ix: ix["tensors"][T[view]]["view"].__setitem__("base", T[view])),
        "format", section="8.5", flags=["view", "self-reference"], description="a view whose base is itself",
        danger="endless recursion when the view is built")
    inv("view-base-missing", index_edit(lambda ix: ix["tensors"][T[view]]["view"].__setitem__("base", 99)),
        "format", section="8.5", flags=["view", "dangling"], description="a view whose base id does not exist",
        danger="an out-of-bounds table lookup")
    inv("view-base-is-view", index_edit(lambda ix: ix["tensors"][T[view]]["view"].__setitem__("base", T["v/1"])),
        "format", section="8.5", flags=["view"], description="a view whose base is another view",
        danger="chains of views (possibly cycles) instead of one data tensor")
    inv("view-base-2d", index_edit(lambda ix: ix["tensors"][T[view]]["view"].__setitem__("base", T["w"])),
        "format", section="8.5", flags=["view"], description="a view whose base is a 2-D data tensor",
        danger="bases are 1-D storage")
    inv("view-stride-rank-mismatch", index_edit(lambda ix: ix["tensors"][T[view]]["view"].__setitem__("stride", [4])),
        "format", section="8.5", flags=["view"], description="a rank-2 view with one stride",
        danger="an index computed from missing strides")
    inv("view-dtype-differs", index_edit(lambda ix: ix["tensors"][T[view]].__setitem__("dtype", "int32"), sync=True),
        "format", section="8.5", flags=["view"], description="an int32 view of a float32 base",
        danger="views share the base's dtype; reinterpretation is not a view")
    der = "b"
    inv("derived-self", index_edit(lambda ix: ix["tensors"][T[der]]["derived"].__setitem__("source", T[der]), sync=True),
        "format", section="8.5", flags=["derived", "self-reference"], description="a derived tensor whose source is itself",
        danger="endless recursion")
    inv("derived-source-missing", index_edit(lambda ix: ix["tensors"][T[der]]["derived"].__setitem__("source", 99),
                                             sync=True),
        "format", section="8.5", flags=["derived", "dangling"], description="a derived tensor whose source does not exist",
        danger="an out-of-bounds table lookup")
    inv("derived-source-not-float32", index_edit(lambda ix: ix["tensors"][T[der]]["derived"].__setitem__("source", T["i"]),
                                                 sync=True),
        "format", section="8.5", flags=["derived"], description="bf16_rne of an int64 tensor",
        danger="the function is defined on float32 bits only")
    inv("derived-source-is-derived-shape", index_edit(lambda ix: ix["tensors"][T[der]].__setitem__("shape", [16]),
                                                      sync=True),
        "format", section="8.5", flags=["derived"], description="a derived tensor whose shape differs from its source's",
        danger="a size mismatch between source and result")
    inv("derived-dtype-not-bf16", index_edit(lambda ix: ix["tensors"][T[der]].__setitem__("dtype", "float16"), sync=True),
        "format", section="8.5", flags=["derived"], description="a bf16_rne entry with dtype float16",
        danger="the bytes would be read as the wrong type")

    # -- the tree ---------------------------------------------------------------------------------------
    def tree_set(node: Any) -> Callable:
        return lambda ix: ix.__setitem__("tree", node)

    inv("tree-depth-65", index_edit(tree_set(nest(65, tensor_ref(0)))), "limit", section="9", flags=["depth", "limit"],
        also=["format"], description="a tree of nested arrays 65 deep (root = depth 1)",
        danger="recursive parsers exhaust their stack")
    inv("tree-depth-65-maps", index_edit(tree_set(nest(65, 1, "map"))), "limit", section="9", flags=["depth", "limit"],
        also=["format"], description="a tree of nested maps 65 deep", danger="as above")
    inv("tree-depth-65-tuples", index_edit(tree_set(nest(65, 1, "tuple"))), "limit", section="9",
        flags=["depth", "limit", "tuples"], also=["format"],
        description="65 tuples nested inside each other's ext data", danger="recursion through ext payloads")
    inv("tree-depth-100000", raw_index(_deep_index(craft.parse(base).index, 100_000)), "limit", section="20",
        flags=["depth", "limit", "stack"], also=["format"], description="arrays nested 100000 deep (a stack bomb)",
        danger="a recursive parser crashes with a stack overflow")
    inv("metadata-depth-65", index_edit(lambda ix: ix.__setitem__("metadata", {"m": nest(64, 1)})), "limit",
        section="8.6", flags=["depth", "limit", "metadata"], also=["format"],
        description="metadata nested 65 deep", danger="as for the tree")
    inv("metadata-ext-type", index_edit(lambda ix: ix.__setitem__("metadata", {"m": tensor_ref(0)})), "format",
        section="8.6", flags=["metadata", "ext"],
        description="a tensor reference (ext 1) inside the metadata", danger="metadata is JSON-like: no ext types")
    inv("metadata-nested-int-key", index_edit(lambda ix: ix.__setitem__("metadata", {"m": {1: "x"}})), "format",
        section="8.6", flags=["metadata"], description="a nested metadata map with an int key",
        danger="metadata maps have str keys (JSON objects)")
    inv("tree-ref-missing", index_edit(tree_set({"x": tensor_ref(99)})), "format", section="9", flags=["tree", "dangling"],
        description="a tensor reference to id 99", danger="an out-of-bounds table lookup")
    inv("tree-ref-5-bytes", index_edit(tree_set({"x": msgpack.ExtType(1, b"\0\0\0\0\0")})), "format", section="9",
        flags=["tree"], description="a tensor reference ext with 5 data bytes", danger="a malformed reference")
    inv("tree-unknown-ext", index_edit(tree_set({"x": msgpack.ExtType(3, b"\x01")})), "format", section="9",
        flags=["tree", "ext"], description="ext type 3 in the tree", danger="types this version does not define")
    inv("tree-timestamp-ext", raw_index(_index_with_raw_tree(craft.parse(base).index, b"\x81\xa1x\xd6\xff\0\0\0\0")), "format", section="9",
        flags=["tree", "ext"], description="msgpack's timestamp ext (-1) in the tree", danger="as above")
    inv("tree-tuple-not-array", index_edit(tree_set({"x": msgpack.ExtType(2, craft.pack({"a": 1}))})), "format",
        section="9", flags=["tree", "tuples"], description="a tuple ext whose data is a map", danger="malformed tuple")
    inv("tree-tuple-trailing", index_edit(tree_set({"x": msgpack.ExtType(2, craft.pack([1]) + b"\xc0")})), "format",
        section="9", flags=["tree", "tuples"], description="a tuple ext with bytes after its array",
        danger="data outside the array")
    inv("tree-key-array", raw_index(_index_with_raw_tree(craft.parse(base).index, b"\x81\x91\x01\x02")), "format",
        section="9", flags=["tree"], description="a tree map whose key is an array", danger="keys must be scalars")

    gen_second_edition(s, bases, edit, index_edit, raw_index, T)
    gen_issue10(s, bases, raw_index)
    gen_issue11(s, edit, index_edit)

    # -- bool values ----------------------------------------------------------------------------------------
    bool_obj = {"b": torch.tensor([True, False, True])}
    bdata = save(bool_obj, codec="raw", tensor_checksums=False)
    inv("bool-byte-2", edit(lambda nv: setattr(nv.chunk_frame(0, 0), "payload", b"\x01\x02\x00"), bdata), "format",
        section="10", level="should", flags=["dtype", "bool"], description="a bool tensor holding the byte 0x02",
        danger="a bool that is neither true nor false is undefined behaviour in C++ and Rust")


# --------------------------------------------------------------------------------------------
# Issue 10: hostile nests and counts, and chunk tables long enough for a reader's bulk decoding
# --------------------------------------------------------------------------------------------

def _int_as(v: int, variant: int) -> bytes:
    """A non-negative int in one of nine msgpack encodings (the shortest, or a wider one that holds it)."""
    forms = [None, (0xCF, ">Q", 1 << 64), (0xD3, ">q", 1 << 63), (0xCE, ">I", 1 << 32), (0xD2, ">i", 1 << 31),
             (0xCD, ">H", 1 << 16), (0xD1, ">h", 1 << 15), (0xCC, ">B", 1 << 8), (0xD0, ">b", 1 << 7)]
    form = forms[variant % len(forms)]
    if form is None or v >= form[2]:
        return craft.pack(v)
    return bytes([form[0]]) + struct.pack(form[1], v)


def _pack_index_with_chunks(index: dict, chunk_bytes: Callable[[int, list[int]], bytes]) -> bytes:
    """The index with every chunk entry [o, s, r, c, x] packed by ``chunk_bytes(i, chunk)`` (the rest as usual)."""
    out = bytes([0x80 | len(index)])
    for key, value in index.items():
        out += craft.pack(key)
        if key != "tensors":
            out += craft.pack(value)
            continue
        out += b"\xdd" + struct.pack(">I", len(value))
        for entry in value:
            out += b"\xdf" + struct.pack(">I", len(entry))
            for k, v in entry.items():
                out += craft.pack(k)
                if k == "chunks":
                    out += b"\xdd" + struct.pack(">I", len(v)) + b"".join(chunk_bytes(i, c) for i, c in enumerate(v))
                else:
                    out += craft.pack(v)
    return out


def _wide_chunk(i: int, c: list[int]) -> bytes:
    return b"\x95" + b"".join(_int_as(v, i + j) for j, v in enumerate(c))


def gen_issue10(s: Suite, bases: dict, raw_index: Callable) -> None:
    inv = s.invalid
    _, _, base = bases["valid-base"]
    nv0 = craft.parse(base)

    # A chunk table long enough that a reader may decode it in bulk (nvckpt: from the msgpack bytes into
    # columns, no object per chunk), its ints in every encoding msgpack has for them.
    n = 1500
    many = {"t": tensor_from_bytes(randbytes(1010, n), torch.uint8, (n,))}
    mdata = save(many, codec="raw", chunk_size=1, alignment=1)
    nvm = craft.parse(mdata)
    nvm.index_frame().payload = _pack_index_with_chunks(nvm.index, _wide_chunk)
    wide = craft.build(nvm, fix_index=False)
    s.valid("valid-many-chunks", wide, expected_decode(many, None, mdata), section="8.4",
            flags=["multi-chunk", "codec-raw", "msgpack-encoding", "bulk"],
            description=f"one tensor of {n} one-byte chunks, each chunk's ints in another of msgpack's nine int "
                        "encodings (the shortest, uint 8-64, int 8-64): a reader that decodes long chunk tables in bulk "
                        "must accept every encoding")

    def long_table(i_bad: int, bad: Callable[[list[int]], bytes]) -> bytes:
        nv = craft.parse(mdata)
        nv.index_frame().payload = _pack_index_with_chunks(
            nv.index, lambda i, c: bad(c) if i == i_bad else _wide_chunk(i, c))
        return craft.build(nv, fix_index=False)

    inv("chunk-list-long-negative", long_table(1234, lambda c: b"\x95" + craft.pack(c[0]) + b"\xff" + craft.pack(c[2])
                                               + craft.pack(c[3]) + craft.pack(c[4])),
        "format", section="8.4", flags=["offsets", "bulk"],
        description=f"chunk 1234 of {n} has stored_length -1 (a negative fixint)",
        danger="a bulk decoder that reads ints as unsigned bytes takes -1 for 2^64-1, or 255")
    inv("chunk-list-long-bool", long_table(1400, lambda c: b"\x95" + b"".join(craft.pack(v) for v in c[:3]) + b"\xc2"
                                           + craft.pack(c[4])),
        "format", section="1", flags=["bulk", "types"],
        description=f"chunk 1400 of {n} has the codec id false (a bool where an int is listed)",
        danger="a bulk decoder (or a language where false == 0) takes it for codec 0")
    before = craft.parse(mdata).index["tensors"][0]["chunks"][1299]
    inv("chunk-list-long-overlap", long_table(1300, lambda c: craft.pack(before)),
        "format", section="8.4", flags=["overlap", "bulk"],
        description=f"chunk 1300 of {n} lists the same bytes as chunk 1299 (offset, length and checksum)",
        danger="overlapping ranges let one stored byte appear twice; a check of neighbours only in sorted order "
               "must still find it")

    # Nests and counts, far beyond what random mutation reaches.
    inv("tree-tuple-depth-200", raw_index(_index_with_raw_tree(nv0.index, craft.pack(nest(200, 1, "tuple")))),
        "limit", section="9", flags=["depth", "limit", "tuples", "stack"], also=["format"],
        description="tuples nested 200 deep, each inside the ext data of the one around it (1.4 KB)",
        danger="each tuple is parsed by a nested call of the msgpack parser: a recursive reader's C stack "
               "overflows (nvckpt before issue 10: a segfault at 194 levels)")
    inv("metadata-depth-2000", raw_index(_pack_map_raw(nv0.index, "metadata", b"\x81\xa1m" + b"\x91" * 2000 + b"\xc0")),
        "limit", section="8.6", flags=["depth", "limit", "metadata", "stack"], also=["format"],
        description="metadata arrays nested 2000 deep", danger="a stack bomb in the metadata, which tools print")

    # Deep nesting where a reader must still parse: a tensor entry's unknown key (a streaming reader meets its
    # TENSOR frame copy first) and an unregistered codec's configuration (its CODEC frame too).  As tuples
    # (ext data, which no reader parses outside the tree, SPEC 1) the same nesting is valid.
    def ignored_nest(value: Any) -> bytes:
        nv = craft.parse(base)
        nv.index["tensors"][0]["x-future"] = value
        craft.sync_tensor_frames(nv)
        add_unregistered_codec(nv, {"x": value})
        return craft.build(nv)

    def deep_in(where: str) -> bytes:
        nv = craft.parse(base)
        if where == "entry":
            nv.index["tensors"][0]["x-future"] = nest(200, 1)
            craft.sync_tensor_frames(nv)
        else:
            add_unregistered_codec(nv, {"x": nest(200, 1)})
        return craft.build(nv)

    inv("tensor-frame-unknown-key-depth-200", deep_in("entry"), "limit", section="9", also=["format"],
        flags=["depth", "limit", "stack", "frame", "unknown-keys"],
        description="an unknown key of a tensor entry, and of its TENSOR frame as a writer must copy it, holds "
                    "arrays nested 200 deep (past MAX_PAYLOAD_DEPTH, 72)",
        danger="a streaming or recovering reader parses TENSOR frames: a stack bomb where nothing else looks")
    inv("codec-frame-configuration-depth-200", deep_in("codec"), "limit", section="9", also=["format"],
        flags=["depth", "limit", "stack", "frame", "unknown-codec"],
        description="an unregistered codec's configuration, in the codec table and in its CODEC frame, holds "
                    "arrays nested 200 deep (past MAX_PAYLOAD_DEPTH, 72)",
        danger="as above, in the codec table a streaming reader builds from CODEC frames")
    obj, meta, _ = bases["valid-base"]
    s.valid("valid-ignored-tuples-depth-200", ignored_nest(nest(200, 1, "tuple")), expected_decode(obj, meta, base),
            section="1", flags=["depth", "tuples", "unknown-keys", "unknown-codec"],
            description="tuples nested 200 deep, each in the ext data of the one around it, under an unknown key of "
                        "a tensor entry (and its TENSOR frame) and in an unregistered codec's configuration (and its "
                        "CODEC frame): ext data outside the tree is opaque, never parsed, so the file is valid")
    inv("index-array-count-2p32", raw_index(_pack_map_raw(nv0.index, "tensors", b"\xdd\xff\xff\xff\xff\xc0")),
        "format", section="20", flags=["limit", "lying-size", "count"], also=["limit", "truncated"],
        description="the 'tensors' array header says 2^32-1 entries; the payload holds one byte of them",
        danger="a parser that allocates what a header says before reading it asks for 32 GiB")
    inv("tree-map-count-2p32", raw_index(_index_with_raw_tree(nv0.index, b"\xdf\xff\xff\xff\xff\xa1k\xc0")),
        "format", section="20", flags=["limit", "lying-size", "count", "tree"], also=["limit", "truncated"],
        description="a tree map header says 2^32-1 entries, one follows", danger="as above, for a map")
    inv("metadata-str-length-2p32", raw_index(_pack_map_raw(nv0.index, "metadata", b"\x81\xa1m\xdb\xff\xff\xff\xffabc")),
        "format", section="20", flags=["limit", "lying-size", "metadata"], also=["limit", "truncated"],
        description="a metadata str header says 2^32-1 bytes, three follow", danger="as above, for a str")


def _pack_map_raw(index: dict, key: str, value: bytes) -> bytes:
    """The index with ``key``'s value replaced by the raw msgpack bytes ``value``."""
    return _pack_map([(craft.pack(k), value if k == key else craft.pack(v)) for k, v in index.items()])


# --------------------------------------------------------------------------------------------
# SPEC.md 1.0, second edition (19.1): the cases for its decisions and for every MUST that had none
# --------------------------------------------------------------------------------------------

def _pack_map(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """A msgpack map from already-packed keys and values (keys Python's dict would merge stay apart)."""
    n = len(pairs)
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)
    return head + b"".join(k + v for k, v in pairs)


def _f32(bits: int) -> bytes:
    return b"\xca" + struct.pack(">I", bits)


def _f64(bits: int) -> bytes:
    return b"\xcb" + struct.pack(">Q", bits)


def _bits(x: float) -> int:
    return struct.unpack(">Q", struct.pack(">d", x))[0]


def gen_issue11(s: Suite, edit: Callable, index_edit: Callable) -> None:
    """The third edition's additions: the signshift filter (SPEC 11.9), one zstd frame per byte plane
    (11.4, informative) and the copy derived function (14.2)."""
    def valid(cid: str, obj: Any, *, section: str, flags: list[str], description: str, **kw: Any) -> bytes:
        buf = io.BytesIO()
        nvckpt.save(obj, buf, alignment=4096, **kw)  # this edition's writer, options as given
        data = pin_writer(buf.getvalue())
        s.valid(cid, data, expected_decode(obj, None, data), section=section, flags=flags, description=description)
        return data

    bf = (smooth(4096, 1101) * 3).to(torch.bfloat16).reshape(64, 64)
    f32 = smooth(2048, 1102).reshape(32, 64) * 0.02
    f64 = smooth(512, 1103).double()
    valid("valid-codec-signshift-bfloat16", {"w": bf}, section="11.9",
          flags=["codec-signshift", "codec-byteshuffle", "codec-zstd", "zstd-frames"], codec="portable",
          derive=False, chunk_size=4096,
          description="the portable preset on bfloat16: [signshift(2), byteshuffle(2), zstd], one zstd frame per byte plane")
    valid("valid-codec-signshift-float32", {"w": f32, "tiny": torch.tensor([1.0, -2.0, 0.5, -0.0])}, section="11.9",
          flags=["codec-signshift", "codec-byteshuffle", "codec-zstd", "zstd-frames"], codec="portable",
          derive=False, chunk_size=2048,
          description="the portable preset on float32: [signshift(4), byteshuffle(4), zstd] (a 16-byte tensor stored raw)")
    shift8 = Pipeline((SignShift(8), ByteShuffle(8), Zstd(1)), planar=True)
    valid("valid-codec-signshift-elementsize-8", {"d": f64}, section="11.9", flags=["codec-signshift", "codec-zstd"],
          codec=shift8, derive=False, chunk_size=1024, description="signshift(8) then byteshuffle(8) then zstd on float64")
    shift_only = Pipeline((SignShift(2), Zstd(3)))
    valid("valid-codec-signshift-then-zstd", {"h": bf.to(torch.float16)}, section="11.9",
          flags=["codec-signshift", "codec-zstd"], codec=shift_only, derive=False, chunk_size=4096,
          description="[signshift(2), zstd(3)] on float16: one frame per chunk, no byteshuffle")
    w = smooth(96, 1104).reshape(8, 12)
    copy_obj = {"w": w, "w_copy": w.clone(), "ids": torch.arange(24, dtype=torch.int32),
                "ids_copy": torch.arange(24, dtype=torch.int32), "m": f32[:4].clone(), "m_bf16": bf16_rne(f32[:4])}
    cdata = valid("valid-derived-copy", copy_obj, section="14.2", flags=["derived", "copy", "bf16-rne"], codec="raw",
                  chunk_size=64,
                  description="exact copies stored as derived 'copy' entries of their sources (and one bf16_rne)")

    inv = s.invalid
    ss = {"name": "byteshuffle", "configuration": {"elementsize": 2}}
    z = {"name": "zstd", "configuration": {"level": 1}}
    bdata = io.BytesIO()
    nvckpt.save({"w": bf}, bdata, codec="portable", derive=False, chunk_size=4096, alignment=4096)
    bdata = pin_writer(bdata.getvalue())

    def codec_edit(step: dict, src: bytes = bdata) -> bytes:
        nv = craft.parse(src)
        pipeline = [step, ss, z]
        nv.index["codecs"][0] = pipeline
        next(f for f in nv.frames if f.frame_type == craft.CODEC and f.codec_id == 0).payload = craft.pack(pipeline)
        return craft.build(nv)

    for cid, config, what in (("codec-signshift-elementsize-3", {"elementsize": 3}, "elementsize 3 (allowed: 2, 4, 8)"),
                              ("codec-signshift-elementsize-16", {"elementsize": 16}, "elementsize 16 (allowed: 2, 4, 8)"),
                              ("codec-signshift-elementsize-bool", {"elementsize": True}, "elementsize true (a bool, not an int)"),
                              ("codec-signshift-no-elementsize", {}, "no elementsize"),
                              ("codec-signshift-extra-key", {"elementsize": 2, "order": 1}, "a key other than elementsize")):
        inv(cid, codec_edit({"name": "signshift", "configuration": config}), "format", section="11.9",
            flags=["codec-signshift", "codec-pipeline"], description=f"signshift with {what}",
            danger="a configuration outside the registered range must not be guessed at")
    odd_w = (smooth(1026, 1105) * 3).to(torch.bfloat16)  # 2052 bytes: a multiple of 2 and 4, not of 8
    odd = io.BytesIO()
    nvckpt.save({"w": odd_w}, odd, codec="portable", derive=False, alignment=4096)
    inv("codec-signshift-length-not-multiple", codec_edit({"name": "signshift", "configuration": {"elementsize": 8}},
                                                          pin_writer(odd.getvalue())),
        "format", section="11.9", flags=["codec-signshift", "lengths"],
        description="signshift elementsize 8 on a chunk of 2052 bytes (not a multiple of 8)",
        danger="an element cut by the chunk's end has no top two bytes to move")
    nv = craft.parse(cdata)
    tid = {e["name"]: i for i, e in enumerate(nv.index["tensors"])}
    assert nv.index["tensors"][tid["w_copy"]]["derived"] == {"function": "copy", "source": tid["w"]}

    def set_entry(name: str, key: str, value: Any) -> Callable:
        return lambda ix: ix["tensors"][tid[name]].__setitem__(key, value)

    inv("derived-copy-dtype-differs", index_edit(set_entry("ids_copy", "dtype", "float32"), cdata, sync=True), "format",
        section="8.5", flags=["derived", "copy"], description="a copy of an int32 tensor whose entry says float32",
        danger="a copy changes no byte, so it cannot change the dtype either: the values would be reinterpreted")
    inv("derived-copy-shape-differs", index_edit(set_entry("w_copy", "shape", [12, 8]), cdata, sync=True), "format",
        section="8.5", flags=["derived", "copy"], description="a copy of an 8x12 tensor whose entry says 12x8",
        danger="same bytes, other shape: rows would be cut at other places")


def gen_second_edition(s: Suite, bases: dict, edit: Callable, index_edit: Callable, raw_index: Callable,
                       T: dict[str, int]) -> None:
    inv = s.invalid
    obj, meta, base = bases["valid-base"]
    exp = expected_decode(obj, meta, base)
    nv0 = craft.parse(base)

    def tree_with(extra: bytes, key: str = "k") -> bytes:
        """valid-base's index with one more tree entry, key -> raw msgpack ``extra``."""
        tree = nv0.index["tree"]
        pairs = [(craft.pack(k), craft.pack(v)) for k, v in tree.items()] + [(craft.pack(key), extra)]
        return raw_index(_index_with_raw_tree(nv0.index, _pack_map(pairs)))

    def exp_with(key: str, value: Any) -> dict:
        e = copy.deepcopy(exp)
        e["tree"]["$map"].append([key, value])
        return e

    # -- "the same key" (SPEC 1) -----------------------------------------------------------------------
    distinct = [(craft.pack(1), "int 1"), (craft.pack("1"), "str '1'"), (_f64(_bits(2.5)), "2.5"),
                (craft.pack(2**64 - 1), "int 2^64-1"), (_f64(_bits(2.0**64)), "float 2^64"),
                (craft.pack(2**53 + 1), "int 2^53+1"), (_f64(_bits(2.0**53)), "float 2^53"),
                (craft.pack(None), "nil"), (_f64(_bits(-0.0)), "-0.0"), (_f64(0x7FF8000000000000), "one NaN"),
                (_f64(_bits(float("inf"))), "inf"), (_f32(0x3DCCCCCD), "float32 0.1"),
                (_f64(_bits(0.1)), "float64 0.1")]
    key_json = [1, "1", float_json(2.5), 2**64 - 1, float_json(2.0**64), 2**53 + 1, float_json(2.0**53), None,
                float_json(-0.0), {"$float": "7ff8000000000000"}, float_json(float("inf")),
                float_json(struct.unpack(">f", struct.pack(">I", 0x3DCCCCCD))[0]), float_json(0.1)]
    s.valid("valid-keys-distinct-across-types", tree_with(_pack_map([(k, craft.pack(v)) for k, v in distinct])),
            exp_with("k", {"$map": [[kj, v] for kj, (_, v) in zip(key_json, distinct)]}), section="1",
            flags=["tree", "keys", "key-equality", "nan-key"],
            description="one tree map holding 1, '1', 2.5, 2^64-1 and the float 2^64, 2^53+1 and the float 2^53, nil, "
                        "-0.0, one NaN, inf, float32 0.1 and float64 0.1: all different keys by SPEC 1")
    same = [("tree-keys-int-float-equal", craft.pack(1), _f64(_bits(1.0)), "the int 1 and the float 1.0"),
            ("tree-keys-int-bool-equal", craft.pack(1), craft.pack(True), "the int 1 and true"),
            ("tree-keys-zero-negative-zero", _f64(_bits(0.0)), _f64(_bits(-0.0)), "0.0 and -0.0"),
            ("tree-keys-two-nans", _f64(0x7FF8000000000000), _f64(0x7FF8000000000001),
             "two NaNs with different bits"),
            ("tree-keys-float32-float64-equal", _f32(0x3F000000), _f64(_bits(0.5)), "float32 0.5 and float64 0.5"),
            ("tree-keys-int-two-encodings", b"\x01", b"\xcf" + struct.pack(">Q", 1),
             "the int 1 as a fixint and as a uint 64"),
            ("tree-keys-float-2p53-int-2p53", craft.pack(2**53), _f64(_bits(2.0**53)), "the int 2^53 and the float 2^53")]
    for cid, k1, k2, what in same:
        inv(cid, tree_with(_pack_map([(k1, craft.pack("a")), (k2, craft.pack("b"))])), "format", section="1",
            flags=["tree", "keys", "key-equality", "duplicate-key"],
            description=f"a tree map whose keys are {what}: the same key by SPEC 1",
            danger="a reader whose map type merges the two keys silently drops an entry; readers disagree")

    # -- whole-payload rules under unknown keys (SPEC 1), strict UTF-8 (38) ----------------------------
    def index_with_future(value: bytes) -> bytes:
        pairs = [(craft.pack(k), craft.pack(v)) for k, v in nv0.index.items()] + [(craft.pack("future"), value)]
        return raw_index(_pack_map(pairs))

    inv("unknown-key-duplicate-key", index_with_future(_pack_map([(craft.pack("a"), b"\x01"), (craft.pack("a"), b"\x02")])),
        "format", section="1", flags=["msgpack", "duplicate-key", "unknown-keys"],
        description="an unknown index key whose map value holds the key 'a' twice",
        danger="'ignored' is about meaning, not well-formedness: readers that skip the check disagree on the file")
    inv("unknown-key-invalid-utf8", index_with_future(b"\xa2\xc3\x28"), "format", section="1",
        flags=["msgpack", "utf-8", "unknown-keys"], description="an unknown index key whose str value is not UTF-8 (c3 28)",
        danger="as above; a lenient decoder would pass garbage through to tools that copy unknown keys")
    payload = nv0.index_frame().payload
    assert payload.count(b"\xa4name\xa1i") == 1
    for cid, seq, what in (("entry-name-surrogate-utf8", b"\xed\xa0\x80", "an encoded surrogate U+D800 (WTF-8)"),
                           ("entry-name-overlong-utf8", b"\xc0\xaf", "an overlong encoding of '/' (c0 af)")):
        inv(cid, raw_index(payload.replace(b"\xa4name\xa1i", b"\xa4name" + bytes([0xa0 | len(seq)]) + seq)), "format",
            section="1", flags=["name", "utf-8"], description=f"a tensor name holding {what}",
            danger="not UTF-8: some decoders accept it, others do not, and a '/' hidden in an overlong form defeats "
                   "path checks")
    s.valid("valid-unknown-key-depth-64", index_with_future(craft.pack(nest(64, 1))), exp, section="9",
            flags=["unknown-keys", "depth"],
            description="an unknown index key holding arrays nested 64 deep: readers must accept it")

    # -- str keys and types in the index's maps (SPEC 1, 8) ---------------------------------------------
    inv("index-int-key", index_edit(lambda ix: ix.__setitem__(7, "x")), "format", section="1", flags=["index", "keys"],
        description="the index map has a key 7 (an int) besides its str keys",
        danger="the index's maps have str keys; readers that ignore the key and readers that reject it disagree")
    inv("entry-int-key", index_edit(lambda ix: ix["tensors"][T["i"]].__setitem__(7, 1), sync=True), "format",
        section="1", flags=["entry", "keys"], description="a tensor entry (and its TENSOR frame) with a key 7 (an int)",
        danger="as above")
    inv("writer-not-map", index_edit(lambda ix: ix.__setitem__("writer", "nvckpt")), "format", section="8.1",
        flags=["index", "writer"], description="'writer' is a str, not a map",
        danger="a present key of the wrong type is damage, not absence")
    inv("metadata-not-map", index_edit(lambda ix: ix.__setitem__("metadata", [1, 2])), "format", section="8.1",
        flags=["index", "metadata"], description="'metadata' is an array, not a map", danger="as above")
    inv("index-version-three-elements", index_edit(lambda ix: ix.__setitem__("version", [1, 0, 0])), "format",
        section="8.1", flags=["version"], description="index 'version' is [1, 0, 0]",
        danger="a version that is not [major, minor] cannot be compared")
    inv("index-version-minor-over-u16", index_edit(lambda ix: ix.__setitem__("version", [1, 65536])), "format",
        section="8.1", flags=["version"], description="index 'version' is [1, 65536]: the minor is not a u16",
        danger="the preamble cannot hold it: index and preamble disagree")
    inv("metadata-bin", index_edit(lambda ix: ix.__setitem__("metadata", {"m": b"\x00"})), "format", section="8.6",
        flags=["metadata"], description="a bin value inside the metadata", danger="metadata is JSON-like: no bin")
    md = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "-0": -0.0, "u64": 2**64 - 1,
          "i64": -(2**63), "f32": 0.5}
    nv = craft.parse(base)
    nv.index["metadata"] = md
    mdp = craft.pack(nv.index)
    f32 = b"\xa3f32\xcb" + struct.pack(">d", 0.5)
    assert mdp.count(f32) == 1
    exp_md = copy.deepcopy(exp)
    exp_md["metadata"] = node_json(md, torch_values({}))
    s.valid("valid-metadata-edge-values", raw_index(mdp.replace(f32, b"\xa3f32\xca" + struct.pack(">f", 0.5))), exp_md,
            section="8.6", flags=["metadata", "float32"],
            description="metadata holding NaN, inf, -inf, -0.0, 2^64-1, -2^63 and a float 32: all JSON-like values")

    # -- shapes (SPEC 8.3, 10) ---------------------------------------------------------------------------
    eobj, emeta, empty_base = bases["valid-empty"]
    nv = craft.parse(empty_base)
    E = {e["name"]: i for i, e in enumerate(nv.index["tensors"])}
    nv.index["tensors"][E["b"]]["shape"] = [0, 1 << 60]
    nv.index["tensors"][E["c"]]["shape"] = [1 << 60, 0, 2]
    craft.sync_tensor_frames(nv)
    exp_e = expected_decode(eobj, emeta, empty_base)
    exp_e["tensors"]["b"]["shape"] = [0, 1 << 60]
    exp_e["tensors"]["c"]["shape"] = [1 << 60, 0, 2]
    s.valid("valid-empty-big-dims", craft.build(nv), exp_e, section="8.3", flags=["shape", "empty", "limit"],
            description="empty tensors int32 [0, 2^60] and float16 [2^60, 0, 2]: span exactly 2^62 bytes, the limit")
    nv = craft.parse(bases["valid-unknown-dtype-src"][2])
    fid = next(i for i, e in enumerate(nv.index["tensors"]) if e["name"] == "future")
    nv.index["tensors"][fid]["shape"] = [(1 << 62) + 1]
    craft.sync_tensor_frames(nv)
    inv("unknown-dtype-huge-shape", craft.build(nv), "limit", section="10", also=["format"],
        flags=["unknown-dtype", "shape", "limit"],
        description="an entry of unknown dtype 'float7_e3m3' with shape [2^62 + 1]: the span limit applies with "
                    "itemsize 1", danger="an unknown dtype must not switch off the size limits")

    # -- views and derived entries (SPEC 8.5) --------------------------------------------------------------
    inv("view-offset-over-limit", index_edit(lambda ix: ix["tensors"][T["v/0"]]["view"].__setitem__("offset", (1 << 62) + 1)),
        "limit", section="8.5", also=["format"], flags=["view", "limit"], description="a view offset of 2^62 + 1",
        danger="offsets are bounded so that offset + strides fit in 64 bits")
    inv("view-missing-stride", index_edit(lambda ix: ix["tensors"][T["v/0"]]["view"].pop("stride")), "format",
        section="8.5", flags=["view"], description="a view map with no 'stride'", danger="a required key is missing")
    for cid, source, what in (("derived-unknown-function-source-self", T["b"], "itself"),
                              ("derived-unknown-function-source-missing", 99, "a tensor id that does not exist")):
        def fn(ix: dict, source: int = source) -> None:
            ix["tensors"][T["b"]]["derived"] = {"function": "future_fn", "source": source}
        inv(cid, index_edit(fn, sync=True), "format", section="8.5", flags=["derived", "unknown-derived"],
            description=f"a derived entry with an unknown function whose source is {what}",
            danger="even an unknown function's source must be a real, other entry: else recursion or a bad lookup")
    s.valid("valid-tree-refs-internal", tree_with(craft.pack(tensor_ref(T["v/0@base"])), "storage"),
            exp_with("storage", {"$tensor": "v/0@base"}), section="9", flags=["tree", "internal", "view"],
            description="the tree refers to the internal storage base too: writers must not, readers must accept")

    # -- names (SPEC 14.1) ----------------------------------------------------------------------------------
    s.valid("valid-same-tensor-same-name-two-paths",
            tree_with(_pack_map([(craft.pack(1), craft.pack(tensor_ref(T["w"]))),
                                 (craft.pack("1"), craft.pack(tensor_ref(T["w"])))]), "dup"),
            exp_with("dup", {"$map": [[1, {"$tensor": "w"}], ["1", {"$tensor": "w"}]]}), section="14.1",
            flags=["names", "tied", "keys"],
            description="one tensor reached by the paths dup/1 (int key) and dup/1 (str key): keys() lists the name once")
    inv("tree-name-clash", tree_with(_pack_map([(craft.pack(1), craft.pack(tensor_ref(T["w"]))),
                                                (craft.pack("1"), craft.pack(tensor_ref(T["i"])))]), "dup"),
        "format", section="14.1", flags=["names", "duplicate-name"],
        description="paths dup/1 (int key) and dup/1 (str key) refer to two different tensors",
        danger="get_tensor('dup/1') would return either tensor")

    def path_is_other_name(nv: craft.NvFile) -> None:
        nv.index["tensors"][T["v/0@base"]]["name"] = "storage"
        nv.index["tree"]["storage"] = tensor_ref(T["i"])
        craft.sync_tensor_frames(nv)
    inv("tree-path-is-other-entry-name", edit(path_is_other_name), "format", section="14.1",
        flags=["names", "duplicate-name"],
        description="the tree path 'storage' refers to tensor 'i' while the internal base entry is named 'storage'",
        danger="get_tensor('storage') would return either tensor")

    # -- codecs (SPEC 11) --------------------------------------------------------------------------------------
    _, _, sbase = bases["shuffle-base"]

    def codec_edit(pipeline: list, src: bytes = sbase) -> bytes:
        nv = craft.parse(src)
        nv.index["codecs"][0] = pipeline
        next(f for f in nv.frames if f.frame_type == craft.CODEC and f.codec_id == 0).payload = craft.pack(pipeline)
        return craft.build(nv)

    z = {"name": "zstd", "configuration": {"level": 1}}
    inv("codec-byteshuffle-no-elementsize", codec_edit([{"name": "byteshuffle", "configuration": {}}, z]), "format",
        section="11.2", flags=["codec-byteshuffle", "codec-pipeline"], description="byteshuffle with no elementsize",
        danger="a required parameter is missing: readers would guess different element sizes")
    inv("codec-configuration-int-key", codec_edit([{"name": "byteshuffle", "configuration": {"elementsize": 4, 1: 2}}, z]),
        "format", section="1", flags=["codec-pipeline", "keys"], description="a codec configuration with an int key",
        danger="configurations are maps with str keys")
    inv("codec-unknown-next-to-bad-step", codec_edit([{"name": "byteshuffle", "configuration": {"elementsize": 17}},
                                                      {"name": "x-future-coder"}]), "format", section="11.1",
        flags=["codec-pipeline", "unknown-codec"],
        description="pipeline [byteshuffle(elementsize 17), x-future-coder]: an unregistered coder does not excuse a "
                    "bad registered step", danger="a configuration outside the defined range")
    ans = {"data_type": "<f4", "nvcomp_version": "6.0", "bitstream": "raw"}
    inv("codec-nvcomp-ans-version-malformed", codec_edit([{"name": "nvcomp-ans", "configuration": ans}]), "format",
        section="11.6", flags=["codec-nvcomp-ans", "nvcomp-version"],
        description="an nvcomp-ans codec with nvcomp_version '6.0' (not MAJOR.MINOR.PATCH)",
        danger="readers would compare versions differently; decided at open as FormatError")

    # A damaged chunk of a codec this reader does not know: either error is conforming (11.8).
    _, _, udata = bases["valid-unknown-codec-src"]
    nv = craft.parse(udata)
    f = nv.chunk_frame(T["i"], 0)
    f.payload_checksum = craft.xxh3(f.payload)
    f.payload = bytes([f.payload[0] ^ 1]) + f.payload[1:]
    inv("checksum-chunk-unknown-codec", craft.build(nv, fix_index=False), "unsupported-codec", section="11.8",
        also=["checksum"], flags=["checksum", "unknown-codec"],
        description="a damaged chunk (one bit flipped) of the tensor that uses an unregistered codec",
        danger="the bytes must never reach a decoder; which error comes first is implementation-defined")

    # -- zstd (SPEC 11.4) ------------------------------------------------------------------------------------
    _, _, zbase = bases["zstd-base"]
    zr = bytes(raw_bytes(smooth(256, 13)))

    def zstd_payload(payload: bytes) -> bytes:
        nv = craft.parse(zbase)
        nv.chunk_frame(0, 0).payload = payload
        return craft.build(nv)

    def with_window(exponent: int) -> bytes:
        frame = bytearray(zstandard.ZstdCompressor(level=3, write_content_size=False).compress(zr))
        assert frame[4] & 0x20 == 0, "expected a frame with a Window_Descriptor"
        frame[5] = exponent << 3  # Window_Size = 2^(10 + exponent)
        return bytes(frame)
    zexp = expected_decode({"z": smooth(256, 13)}, None, zbase)
    s.valid("valid-zstd-window-2p24", zstd_payload(with_window(14)), zexp, section="11.4",
            flags=["codec-zstd", "zstd-window", "limit"],
            description="a zstd frame with no content size and Window_Size 2^24 (the limit) for a 1 KiB chunk")
    inv("zstd-window-too-large", zstd_payload(with_window(20)), "format", section="11.4",
        flags=["codec-zstd", "zstd-window", "limit"],
        description="a zstd frame with no content size and Window_Size 2^30 for a 1 KiB chunk",
        danger="streaming decoders refuse it (libzstd's default limit is 2^27) while one-shot ones accept it")
    frame = bytearray(zstandard.ZstdCompressor(level=3, write_checksum=True).compress(zr))
    frame[-1] ^= 0xFF
    inv("zstd-bad-content-checksum", zstd_payload(bytes(frame)), "format", section="11.4",
        flags=["codec-zstd", "checksum"],
        description="a zstd frame whose Content_Checksum is wrong (the chunk checksum matches the damaged bytes)",
        danger="a decoder that skips the content checksum returns data the writer's encoder did not produce")

    # -- streaming readers: frame rules (4.3), duplicates, TENSOR and CODEC frames against the index ----------
    def move_to_end(sel: Callable) -> Callable:
        def fn(nv: craft.NvFile) -> None:
            f = sel(nv)
            nv.frames.remove(f)
            nv.frames.insert(len(nv.frames) - 1, f)
        return fn

    def duplicate(sel: Callable) -> Callable:
        def fn(nv: craft.NvFile) -> None:
            nv.frames.insert(len(nv.frames) - 1, copy.copy(sel(nv)))
        return fn

    first_codec = lambda nv: next(f for f in nv.frames if f.frame_type == craft.CODEC)  # noqa: E731
    for cid, fn, what in (
            ("chunk-before-codec-frame", move_to_end(first_codec), "the only CODEC frame comes after every CHUNK frame"),
            ("chunk-before-tensor-frame", move_to_end(lambda nv: nv.tensor_frame(T["w"])),
             "tensor 'w''s TENSOR frame comes after its CHUNK frames"),
            ("duplicate-codec-frame", duplicate(first_codec), "a second CODEC frame for codec id 0"),
            ("duplicate-tensor-frame", duplicate(lambda nv: nv.tensor_frame(T["i"])), "a second TENSOR frame for 'i'"),
            ("duplicate-chunk-frame", duplicate(lambda nv: nv.chunk_frame(T["i"], 1)),
             "a second CHUNK frame for chunk 1 of 'i' (the index points at the second)")):
        inv(cid, edit(fn), "format", section="15.2", readers=STREAMING, flags=["frame-order", "streaming"],
            description=what + " (frame rules 3-5 of 4.3)",
            danger="a streaming reader cannot decode a chunk before its codec and tensor, and two copies of one "
                   "frame leave it to guess which is right")

    def codec_frame_payload(pipeline: list) -> Callable:
        return lambda nv: setattr(first_codec(nv), "payload", craft.pack(pipeline))
    shuffled_raw = [{"name": "byteshuffle", "configuration": {"elementsize": 1}}, {"name": "raw", "configuration": {}}]
    inv("codec-frame-differs-from-index", edit(codec_frame_payload(shuffled_raw)),
        "format", section="4.3", readers=STREAMING, flags=["codec-frame", "streaming"],
        description="the CODEC frame of codec id 0 says [byteshuffle(1), raw], the index's codec table [raw]: the "
                    "chunks decode alike, only the comparison of rule 3 finds it",
        danger="a streaming reader and a random-access reader would decode the same chunks with different pipelines")
    s.valid("valid-codec-frame-same-pipeline", edit(codec_frame_payload([{"name": "raw"}])), exp, section="4.3",
            flags=["codec-frame", "streaming"],
            description="the CODEC frame writes [{name: raw}] with no configuration, the index [{name: raw, "
                        "configuration: {}}]: the same pipeline (rule 3 of 4.3)")

    def tensor_frame_set(name: str, key: str, value: Any, drop: bool = False) -> Callable:
        def fn(nv: craft.NvFile) -> None:
            desc = craft.unpack(nv.tensor_frame(T[name]).payload)
            if drop:
                desc.pop(key)
            else:
                desc[key] = value
            nv.tensor_frame(T[name]).payload = craft.pack(desc)
        return fn
    inv("tensor-frame-differs-from-index", edit(tensor_frame_set("w", "dtype", "int32")), "format", section="8.3",
        readers=STREAMING, flags=["tensor-frame", "streaming"],
        description="tensor 'w''s TENSOR frame says dtype int32, its index entry float32",
        danger="a recovering reader (which trusts TENSOR frames) and a normal one would return different tensors")

    def internal_only_in_index(nv: craft.NvFile) -> None:
        nv.index["tensors"][T["w"]]["internal"] = False  # the TENSOR frame keeps no 'internal' key
    s.valid("valid-tensor-frame-internal-absent", edit(internal_only_in_index), exp, section="8.3",
            flags=["tensor-frame", "streaming"],
            description="the index entry of 'w' says internal: false, its TENSOR frame has no 'internal': the same")
    inv("codec-frame-tensor-id-nonzero", edit(lambda nv: setattr(first_codec(nv), "tensor_id", 1)), "format",
        section="4.1", readers=STREAMING, flags=["frame", "reserved", "streaming"],
        description="a CODEC frame header with tensor_id 1 (must be 0)", danger="fields that must be 0 are how damage is noticed")
    inv("chunk-frame-stored-length-over-limit", edit(lambda nv: setattr(nv.chunk_frame(T["w"], 0), "stored_length",
                                                                        (1 << 24) + 1)),
        "limit", section="16", also=["format"], readers=STREAMING, flags=["limit", "lengths", "streaming"],
        description="a CHUNK frame header claims stored_length 2^24 + 1; the reader must refuse it at the header, "
                    "before reading (the payload is not there)",
        danger="a streaming reader would allocate or read 16 MiB on a header's word")
    inv("tensor-frame-over-meta-limit", edit(lambda nv: setattr(nv.tensor_frame(T["w"]), "stored_length", (1 << 24) + 1)),
        "limit", section="16", also=["format"], readers=STREAMING, flags=["limit", "lengths", "streaming"],
        description="a TENSOR frame header claims stored_length 2^24 + 1 (MAX_META_FRAME_LENGTH is 2^24), refused at "
                    "the header", danger="as above")
    inv("bytes-after-footer", base + b"\0\0\0\0", "format", section="15.2", readers=STREAMING,
        flags=["footer", "streaming"], description="four bytes after the footer",
        danger="data after the end is either damage or a second file glued on")
    inv("bytes-after-footer-random-access", base + b"\0\0\0\0", "truncated", section="15.2", readers=["random-access"],
        flags=["footer"], description="four bytes after the footer: the last 40 bytes are no footer",
        danger="as above")

    def orphan_chunk(nv: craft.NvFile) -> None:
        f = copy.copy(nv.chunk_frame(T["i"], 1))
        f.chunk_index = 2  # 'i' has chunks 0 and 1 only
        nv.frames.insert(len(nv.frames) - 1, f)
    inv("orphan-chunk-frame", edit(orphan_chunk), "format", section="4.3", readers=STREAMING,
        flags=["frame-order", "streaming"],
        description="a CHUNK frame for chunk 2 of 'i', which has two chunks: no index entry uses it (rule 5 of 4.3)",
        danger="bytes a streaming reader decodes but no random-access reader sees: the two would disagree")

    def odd_writer(nv: craft.NvFile) -> None:
        nv.index["writer"] = {"name": 5, "version": None, "torch": ["2", "13"]}
    exp_w = copy.deepcopy(exp)
    s.valid("valid-writer-odd-values", edit(odd_writer), exp_w, section="8.2", flags=["writer"],
            description="a writer map whose name is an int, version nil and torch an array: readers must not reject it")

    # -- extension frames (SPEC 4.1, 4.2) -------------------------------------------------------------------------
    def ext_frame(**kw: Any) -> Callable:
        return lambda nv: nv.frames.insert(2, craft.Frame(130, b"extension data", **kw))
    s.valid("valid-extension-frame-raw-length", edit(ext_frame(raw_length=999, codec_id=5, tensor_id=6, chunk_index=7)),
            exp, section="4.1", flags=["optional-frame"],
            description="an extension frame (type 130) whose raw_length 999 differs from its stored_length: its "
                        "fields belong to the extension")
    inv("extension-frame-padding-nonzero", edit(ext_frame(padding_length=4, padding=b"\0\0\x01\0")), "format",
        section="4.1", readers=STREAMING, flags=["optional-frame", "padding", "streaming"],
        description="an extension frame whose 4 padding bytes are not zero",
        danger="bytes that no checksum covers, in a frame a reader skips")

    # float 32 NaN widening (SPEC 1)
    nv = craft.parse(base)
    nv.index["tree"]["snan"] = 0.0
    payload = craft.pack(nv.index)
    f64 = b"\xa4snan\xcb" + struct.pack(">d", 0.0)
    assert payload.count(f64) == 1
    exp_nan = exp_with("snan", {"$float": "7ff8000020000000"})
    s.valid("valid-msgpack-float32-nan", raw_index(payload.replace(f64, b"\xa4snan" + _f32(0x7F800001))), exp_nan,
            section="1", flags=["msgpack", "float32", "nan"],
            description="a float 32 signalling NaN 7f800001 in the tree: widened with the quiet bit set, 7ff8000020000000")


def _zstd_with_content_size(data: bytes, declared: int) -> bytes:
    """A zstd frame of ``data`` whose header declares ``declared`` bytes (8-byte Frame_Content_Size)."""
    frame = bytearray(zstandard.ZstdCompressor(level=3, write_checksum=False).compress(data))
    params = zstandard.get_frame_parameters(bytes(frame))
    fhd = frame[4]
    fcs_flag, single = fhd >> 6, (fhd >> 5) & 1
    did_len = (0, 1, 2, 4)[fhd & 3]
    pos = 5 + (0 if single else 1) + did_len
    size_len = {0: 1 if single else 0, 1: 2, 2: 4, 3: 8}[fcs_flag]
    assert params.content_size == len(data) and size_len
    new_fhd = (fhd & 0x3F) | (3 << 6)
    return bytes(frame[:4]) + bytes([new_fhd]) + bytes(frame[5:pos]) + struct.pack("<Q", declared) + bytes(frame[pos + size_len:])


def _zstd_with_dict_id(data: bytes) -> bytes:
    """A zstd frame (raw-content dictionary) whose header carries Dictionary_ID 0x1234."""
    frame = bytearray(zstandard.ZstdCompressor(level=3, write_dict_id=False).compress(data))
    fhd = frame[4]
    assert fhd & 3 == 0
    single = (fhd >> 5) & 1
    pos = 5 + (0 if single else 1)
    return bytes(frame[:4]) + bytes([fhd | 2]) + bytes(frame[5:pos]) + struct.pack("<H", 0x1234) + bytes(frame[pos:])


def _deep_index(index: dict, depth: int) -> bytes:
    return _index_with_raw_tree(index, b"\x91" * depth + b"\xc0")


def add_unregistered_codec(nv: craft.NvFile, configuration: dict) -> None:
    """Append an unregistered codec ('x-future', used by no chunk) to the codec table, and its CODEC frame."""
    pipeline = [{"name": "x-future", "configuration": configuration}]
    nv.index["codecs"].append(pipeline)
    codec_id = len(nv.index["codecs"]) - 1
    last = max(i for i, f in enumerate(nv.frames) if f.frame_type == craft.CODEC)
    nv.frames.insert(last + 1, craft.Frame(craft.CODEC, craft.pack(pipeline), codec_id=codec_id))


def _index_with_raw_tree(index: dict, tree: bytes) -> bytes:
    """The index with its 'tree' value replaced by raw msgpack bytes (which msgpack libraries cannot build)."""
    rest = {k: v for k, v in index.items() if k != "tree"}
    out = bytes([0x80 | (len(rest) + 1)])
    for k, v in rest.items():
        out += craft.pack(k) + craft.pack(v)
    return out + craft.pack("tree") + tree


# --------------------------------------------------------------------------------------------
# SPEC.md 1.1: the typed extensions of the tree (9.2), required feature bit 1 (3)
# --------------------------------------------------------------------------------------------

def _with_raw_tree(src: bytes, tree: bytes, required: int, minor: int) -> bytes:
    """``src`` with its tree replaced by ``tree`` (msgpack bytes), its required_features and minor version set."""
    f = craft.parse(src)
    f.preamble.required_features, f.preamble.version_minor = required, minor
    f.index["version"] = [1, minor]
    f.index_frame().payload = _index_with_raw_tree(f.index, tree)
    return craft.build(f, fix_index=False)


def _ext(code: int, body: bytes) -> bytes:
    return craft.pack(msgpack.ExtType(code, body))


def _w_and_x(value: bytes) -> bytes:
    """A tree {"w": tensor 0, "x": value} with ``value`` given as msgpack bytes."""
    return _pack_map([(craft.pack("w"), craft.pack(msgpack.ExtType(1, struct.pack("<I", 0)))),
                      (craft.pack("x"), value)])


def gen_issue13(s: Suite) -> None:
    obj = {"w": smooth(64, 13).reshape(8, 8), "config": {
        "dtype": torch.bfloat16, "dtypes": [torch.float8_e4m3fn, torch.complex64, torch.uint16],
        "device": torch.device("cuda", 1), "cpu": torch.device("cpu"),
        "z": complex(1.5, -2.0), "z_bits": complex(-0.0, float("inf")),
        "big": 2**64, "neg": -(2**63) - 1, "huge": 3**200, "min_neg": -(2**71),
        "tags": {"a", b"b", 3, 2.5, None, True, (1, "x"), frozenset({1, 2}), torch.float16, 1j},
        "empty": set(), "frozen": frozenset({torch.device("cpu")}), "mixed": (torch.int8, 2**70, {0})}}
    data = save(obj, codec="raw")
    nv = craft.parse(data)
    assert (nv.preamble.version_minor, nv.preamble.required_features) == (1, 2)
    exp = expected_decode(obj, None, data)
    s.valid("valid-typed-tree", data, exp, section="9.2", flags=["tree", "typed", "required-feature"],
            description="torch.dtype, torch.device, complex, ints beyond 64 bits, set and frozenset in the tree "
                        "(ext types 3-8; required_features bit 1, version 1.1)")

    def with_tree(tree: bytes, *, required: int = 2, minor: int = 1) -> bytes:
        return _with_raw_tree(data, tree, required, minor)

    ext, one = _ext, _w_and_x

    w_exp = {"$tensor": "w"}

    def exp_one(value: Any) -> dict:
        e = copy.deepcopy(exp)
        e["tree"] = {"$map": [["w", w_exp], ["x", value]]}
        return e

    unsorted = ext(7, b"\x93" + craft.pack("z") + craft.pack(1) + ext(5, struct.pack("<dd", 0.0, 1.0)))
    s.valid("valid-typed-set-any-order", with_tree(one(unsorted)),
            exp_one({"$set": ["z", 1, {"$complex": [float_json(0.0)["$float"], float_json(1.0)["$float"]]}]}),
            section="9.2", flags=["tree", "typed", "set"],
            description="a set whose items are not sorted by their encoding (a writer SHOULD sort them; a reader "
                        "MUST accept any order)")
    s.valid("valid-typed-bit-without-typed-values", with_tree(one(craft.pack(1))), exp_one(1), section="3",
            flags=["required-feature", "typed"],
            description="required_features bit 1 set, version 1.1, but no typed extension in the tree")
    s.valid("valid-typed-bigint-9-bytes", with_tree(one(ext(6, (2**64).to_bytes(9, "little", signed=True)))),
            exp_one(2**64), section="9.2", flags=["tree", "typed", "bigint"],
            description="2^64, the smallest int beyond msgpack's range: 9 bytes, 00 x8 then 01")

    inv = s.invalid
    cases = [
        ("typed-without-feature-bit", with_tree(one(ext(3, b"float32")), required=0, minor=0), "format",
         "a dtype ext (3) in a file whose preamble does not set required_features bit 1",
         "a 1.0 reader and a 1.1 reader must agree on a file that does not declare what it needs"),
        ("typed-without-feature-bit-minor-1", with_tree(one(ext(5, bytes(16))), required=0), "format",
         "a complex ext (5) in a version 1.1 file whose required_features is 0",
         "version_minor is never a reason to accept or refuse: only the feature bit is"),
        ("typed-dtype-uppercase", with_tree(one(ext(3, b"Float32"))), "format",
         "a dtype ext whose name is 'Float32' (names match `[a-z][a-z0-9_]*`)",
         "a name that is not a torch attribute name; getattr on arbitrary text reaches more than dtypes"),
        ("typed-dtype-dunder", with_tree(one(ext(3, b"__class__"))), "format",
         "a dtype ext whose name is '__class__'", "getattr(torch, name) on a name like this reaches non-dtypes"),
        ("typed-dtype-empty", with_tree(one(ext(3, b""))), "format", "a dtype ext with no bytes",
         "an empty name"),
        ("typed-dtype-65-bytes", with_tree(one(ext(3, b"a" * 65))), "format", "a dtype ext of 65 bytes",
         "names are at most 64 bytes"),
        ("typed-device-leading-zero", with_tree(one(ext(4, b"cuda:01"))), "format",
         "a device ext 'cuda:01' (an index has no leading zero)", "two spellings of one device"),
        ("typed-device-no-index", with_tree(one(ext(4, b"cuda:"))), "format", "a device ext 'cuda:'",
         "a colon with no index"),
        ("typed-complex-15-bytes", with_tree(one(ext(5, bytes(15)))), "format", "a complex ext of 15 bytes",
         "a reader that reads 16 bytes reads past the ext's data"),
        ("typed-bigint-in-range", with_tree(one(ext(6, b"\x05"))), "format", "an int ext (6) holding 5",
         "one value with two encodings (msgpack's int and ext 6)"),
        ("typed-bigint-not-shortest", with_tree(one(ext(6, (2**64).to_bytes(10, "little", signed=True)))), "format",
         "an int ext holding 2^64 in 10 bytes (the shortest is 9)", "one value with two encodings"),
        ("typed-bigint-negative-not-shortest", with_tree(one(ext(6, (-(2**64)).to_bytes(10, "little", signed=True)))),
         "format", "an int ext holding -2^64 in 10 bytes (ff padding; the shortest is 9)", "as above"),
        ("typed-bigint-1025-bytes", with_tree(one(ext(6, b"\x01" * 1025))), "limit",
         "an int ext of 1025 bytes (MAX_BIGINT_BYTES is 1024)",
         "converting a huge integer to text or doing arithmetic on it is quadratic"),
        ("typed-set-duplicate-int-float", with_tree(one(ext(7, craft.pack([1, 1.0])))), "format",
         "a set holding 1 and 1.0 (the same value by SPEC 1)", "a set that loads with fewer items than stored"),
        ("typed-set-duplicate-complex-real", with_tree(one(ext(8, b"\x92\x02" + ext(5, struct.pack("<dd", 2.0, 0.0))))),
         "format", "a frozenset holding 2 and complex(2, 0) (the same value by SPEC 9.2)", "as above"),
        ("typed-set-duplicate-nan", with_tree(one(ext(7, b"\x92" + _f64(0x7FF8000000000000) + _f64(0x7FF8000000000001)))),
         "format", "a set holding two NaNs with different bits (every NaN is the same value)", "as above"),
        ("typed-set-holds-tensor", with_tree(one(ext(7, b"\x91" + craft.pack(msgpack.ExtType(1, struct.pack("<I", 0)))))),
         "format", "a set holding a tensor reference", "a tensor in a set has no name and no hash by value"),
        ("typed-set-holds-array", with_tree(one(ext(7, craft.pack([[1]])))), "format", "a set holding an array",
         "a list is not hashable: a Python reader cannot build the set"),
        ("typed-set-holds-set", with_tree(one(ext(7, b"\x91" + ext(7, b"\x90")))), "format",
         "a set holding a set (only frozensets nest)", "as above"),
        ("typed-set-tuple-holds-map", with_tree(one(ext(8, b"\x91" + ext(2, craft.pack([{"a": 1}]))))), "format",
         "a frozenset holding a tuple that holds a map", "as above"),
        ("typed-set-not-array", with_tree(one(ext(7, craft.pack({"a": 1})))), "format", "a set ext whose data is a map",
         "malformed set"),
        ("typed-ext-as-map-key", with_tree(_pack_map([(craft.pack("w"), craft.pack(msgpack.ExtType(1, bytes(4)))),
                                                      (ext(3, b"float32"), craft.pack(1))])), "format",
         "a tree map whose key is a dtype ext", "typed extensions are values, never keys"),
        ("typed-ext-9", with_tree(one(ext(9, b"x"))), "format", "ext type 9 in a file with required_features bit 1",
         "types version 1.1 does not define"),
    ]
    for cid, payload, error, description, danger in cases:
        inv(cid, payload, error, section="9.2" if "bit" not in cid else "3", flags=["tree", "typed"],
            description=description, danger=danger, also=["format"] if error == "limit" else None)


# --------------------------------------------------------------------------------------------
# SPEC.md 1.2: NumPy arrays and paths in the tree (9.3), required feature bit 2 (3)
# --------------------------------------------------------------------------------------------

def gen_arrays_paths(s: Suite) -> None:
    rng = np.random.RandomState(7)
    grid = np.arange(24, dtype=np.float64).reshape(4, 6)
    obj = {
        "w": smooth(64, 17).reshape(8, 8),
        "numpy_random_state": rng.get_state(),  # ('MT19937', uint32[624], pos, has_gauss, cached_gaussian)
        "generator": np.random.Generator(np.random.MT19937(5)).bit_generator.state,  # {'state': {'key': uint32[624]}}
        "arrays": {
            "fortran": np.asfortranarray(grid), "strided": grid[::2, 1::2], "scalar": np.array(-7, dtype=np.int16),
            "empty": np.zeros((0, 3), dtype=np.uint64), "bool": np.array([True, False, True]),
            "complex": np.array([1 + 2j, -0.0 - 1j], dtype=np.complex128), "half": np.array([0.5, -2.0], np.float16),
            "big_endian": np.array([1, -2, 3], dtype=">i4"),
        },
        "paths": [pathlib.PurePosixPath("/data/run 1/x.bin"), pathlib.PureWindowsPath("C:\\runs\\é"),
                  pathlib.PosixPath("ckpt/last.nvckpt")],
        "dtype": torch.float32,
    }
    data = save(obj, codec="raw")
    nv = craft.parse(data)
    assert (nv.preamble.version_minor, nv.preamble.required_features, nv.index["version"]) == (2, 6, [1, 2])
    exp = expected_decode(obj, None, data)
    s.valid("valid-arrays-paths", data, exp, section="9.3", flags=["tree", "ndarray", "path", "required-feature"],
            description="NumPy arrays (np.random.get_state(), a Generator's MT19937 state, Fortran-order, strided, "
                        "0-d, empty, bool, complex, float16, big-endian) and pathlib paths of three classes in the tree "
                        "(ext 9 and 10, required_features bits 1 and 2, version 1.2)")
    only = {"a": np.arange(5, dtype=np.int64)}
    only_data = save(only, codec="raw")
    assert craft.parse(only_data).preamble.required_features == 4
    s.valid("valid-array-bit-2-only", only_data, expected_decode(only, None, only_data), section="3",
            flags=["tree", "ndarray", "required-feature"],
            description="an int64 array and nothing of 9.2: required_features bit 2 alone, version 1.2")

    def with_tree(tree: bytes, *, required: int = 4, minor: int = 2, src: bytes = data) -> bytes:
        return _with_raw_tree(src, tree, required, minor)

    ext, one = _ext, _w_and_x

    def exp_one(value: Any) -> dict:
        e = copy.deepcopy(exp)
        e["tree"] = {"$map": [["w", {"$tensor": "w"}], ["x", value]]}
        return e

    ref0 = struct.pack("<I", 0)
    s.valid("valid-array-and-tensor-one-entry", with_tree(one(ext(9, ref0))), exp_one({"$ndarray": "w"}),
            section="9.3", flags=["tree", "ndarray"],
            description="ext 1 and ext 9 refer to one entry (a tensor and an array sharing memory): both paths are names")
    s.valid("valid-path-windows-concrete", with_tree(one(ext(10, b"\x03C:\\runs\\a"))), exp_one({"$path": [3, "C:\\runs\\a"]}),
            section="9.3", flags=["tree", "path"],
            description="a WindowsPath (flavour 3), which a reader on Linux returns as a PureWindowsPath")

    bf16 = save({"w": torch.linspace(-1, 1, 8, dtype=torch.bfloat16)}, codec="raw")
    inv = s.invalid
    cases = [
        ("array-without-feature-bit-2", with_tree(one(ext(9, ref0)), required=2, minor=1), "format",
         "an array reference (ext 9) in a file whose preamble sets required_features bit 1 only",
         "a reader that does not implement bit 2 would take the file for one it reads", "3"),
        ("path-without-feature-bit-2", with_tree(one(ext(10, b"\x00/a")), required=0, minor=0), "format",
         "a path ext (10) in a file whose required_features is 0", "as above", "3"),
        ("array-ref-5-bytes", with_tree(one(ext(9, ref0 + b"\0"))), "format", "an array reference of 5 bytes",
         "a reader that reads 4 bytes ignores the fifth: two encodings of one reference", "9.3"),
        ("array-ref-out-of-range", with_tree(one(ext(9, struct.pack("<I", 1000)))), "format",
         f"an array reference to tensor 1000 in an index of {len(nv.index['tensors'])} tensors", "a read past the end of the tensor table", "9.3"),
        ("array-ref-bfloat16", with_tree(one(ext(9, ref0)), src=bf16), "format",
         "an array reference to a bfloat16 entry (NumPy has no bfloat16)",
         "a reader would return some other dtype, or fail while loading instead of at open", "9.3"),
        ("path-flavour-4", with_tree(one(ext(10, b"\x04/a"))), "format", "a path ext whose flavour byte is 4",
         "a class this version does not define", "9.3"),
        ("path-empty", with_tree(one(ext(10, b"\x00"))), "format", "a path ext with a flavour byte and no str",
         "str(path) is never empty ('.' for the current directory): two encodings of one path", "9.3"),
        ("path-invalid-utf8", with_tree(one(ext(10, b"\x00/a\xff"))), "format",
         "a path ext whose str is not UTF-8", "a lenient decoder returns another path than was stored", "9.3"),
        ("path-nul", with_tree(one(ext(10, b"\x00/a\x00b"))), "format", "a path ext whose str holds U+0000",
         "a path that C file APIs cut at the NUL, opening another file than the one named", "9.3"),
        ("path-as-map-key", with_tree(_pack_map([(craft.pack("w"), craft.pack(msgpack.ExtType(1, ref0))),
                                                 (ext(10, b"\x00/a"), craft.pack(1))])), "format",
         "a tree map whose key is a path ext", "typed values are never map keys", "9.3"),
        ("set-holds-path", with_tree(one(ext(7, b"\x91" + ext(10, b"\x00/a"))), required=6), "format",
         "a set holding a path ext", "set items are compared by value; paths are not set items", "9.3"),
        ("set-holds-array", with_tree(one(ext(8, b"\x91" + ext(9, ref0))), required=6), "format",
         "a frozenset holding an array reference", "an array is not hashable", "9.3"),
    ]
    for cid, payload, error, description, danger, section in cases:
        inv(cid, payload, error, section=section, flags=["tree", "ndarray" if "array" in cid else "path"],
            description=description, danger=danger)


# --------------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def readme_tables(cases: list[dict]) -> dict[str, str]:
    """The case tables of conformance/README.md, one line per file."""
    valid = ["| id | level | SPEC | exercises |", "|---|---|---|---|"]
    invalid = ["| id | level | readers | error | SPEC | what is wrong | why it is dangerous |",
               "|---|---|---|---|---|---|---|"]
    for c in cases:
        if c["result"] == "valid":
            valid.append(f"| `{c['id']}` | {c['level']} | {c['section']} | {_cell(c['description'])} |")
        else:
            err = " or ".join([c["error"]] + c["also_accepted"])
            readers = "both" if len(c["readers"]) == 2 else c["readers"][0]
            invalid.append(f"| `{c['id']}` | {c['level']} | {readers} | {err} | {c['section']} | "
                           f"{_cell(c['description'])} | {_cell(c['danger'])} |")
    total = sum(c["bytes"] for c in cases)
    nvalid = sum(c["result"] == "valid" for c in cases)
    levels = {lv: sum(c["level"] == lv for c in cases) for lv in ("must", "should", "may")}
    summary = (f"Suite: **{len(cases)} cases ({nvalid} valid, {len(cases) - nvalid} invalid; "
               f"{levels['must']} must, {levels['should']} should, {levels['may']} may), {total:,} bytes** of files, "
               "of which two megabytes are the zero padding of `valid-padding-max` and "
               "`index-frame-padding-over-limit` (git stores runs of zeros in a few bytes).")
    return {"valid-cases": "\n".join(valid), "invalid-cases": "\n".join(invalid), "summary": summary}


def replace_block(text: str, key: str, body: str) -> str:
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    i, j = text.index(begin) + len(begin), text.index(end)
    return text[:i] + "\n" + body + "\n" + text[j:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "conformance"))
    ap.add_argument("--only", nargs="*", help="generate only these case ids (the manifest then lists only them)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    files = os.path.join(args.out, "files")
    if not args.only and os.path.isdir(files):
        shutil.rmtree(files)
    s = Suite(args.out, set(args.only) if args.only else None)
    bases = gen_valid(s)
    gen_invalid(s, bases)
    gen_issue13(s)
    gen_arrays_paths(s)
    manifest = {
        "suite": "nvckpt conformance", "suite_version": SUITE_VERSION, "format_version": [1, 2],
        "generator": {"tool": "tools/gen_conformance.py", "writer": WRITER, "zstd": ".".join(map(str, zstandard.ZSTD_VERSION))},
        "errors": list(ERRORS),
        "cases": s.cases,
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False, sort_keys=False)
        f.write("\n")
    readme = os.path.join(args.out, "README.md")
    if not args.only and os.path.exists(readme):
        with open(readme) as f:
            text = f.read()
        for key, body in readme_tables(s.cases).items():
            text = replace_block(text, key, body)
        with open(readme, "w") as f:
            f.write(text)
    total = sum(c["bytes"] for c in s.cases)
    nvalid = sum(c["result"] == "valid" for c in s.cases)
    print(f"{len(s.cases)} cases ({nvalid} valid, {len(s.cases) - nvalid} invalid), {total} bytes of files")
    if not args.only:  # the second edition's clarification cases are built from the files made above
        import subprocess

        subprocess.run([sys.executable, os.path.join(ROOT, "conformance", "gen_clarifications.py"), "--out", args.out],
                       check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
