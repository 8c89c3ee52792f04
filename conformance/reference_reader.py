#!/usr/bin/env python3
"""An independent nvckpt reader, written from SPEC.md alone.

It does not import the ``nvckpt`` package: only numpy, msgpack, xxhash and
zstandard.  Its purpose is to show that SPEC.md is enough to read the format,
and to be a second implementation for the conformance suite.  It is written
for clarity, not speed: it reads whole chunks into memory, one at a time.

Two readers in one file, as SPEC.md section 15 describes them:

- ``RandomAccessReader`` (15.1): preamble, footer, INDEX frame, then chunks
  on demand through the index.  Never reads TENSOR or CODEC frames.
- ``StreamingReader`` (15.2): one pass front to back without seeking (a pipe
  is enough): every frame header and payload checked, chunks decoded as they
  arrive, the index and footer checked against what was seen.

Command line (the conformance runner protocol, conformance/README.md):

    reference_reader.py decode FILE...         random-access reader
    reference_reader.py --streaming decode -   streaming reader on stdin (or FILE...)

prints one JSON document per file, one per line: ``{"status": "ok", ...}``,
or ``{"status": "error", "error": CLASS, "message": ...}``; exit status 0 when
every file decoded, 1 when one was rejected.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import sys
from dataclasses import dataclass
from typing import Any, BinaryIO

import msgpack
import numpy as np
import xxhash
import zstandard

# --------------------------------------------------------------------------------------------
# Errors (SPEC.md section 17).  The conformance protocol names them in lower case.
# --------------------------------------------------------------------------------------------


class NvError(Exception):
    kind = "format"


class FormatError(NvError):
    kind = "format"


class TruncatedError(FormatError):
    kind = "truncated"


class ChecksumError(NvError):
    kind = "checksum"


class UnsupportedFeatureError(NvError):
    kind = "unsupported-feature"


class UnsupportedCodecError(NvError):
    kind = "unsupported-codec"


class LimitError(NvError):
    kind = "limit"


# --------------------------------------------------------------------------------------------
# Constants (sections 3, 4, 5, 16)
# --------------------------------------------------------------------------------------------

PREAMBLE_MAGIC = b"\x89NVCKPT\n"
FRAME_MAGIC = b"NVCF"
END_MAGIC = b"NVCKEND\n"
PREAMBLE_LEN, HEADER_LEN, FOOTER_LEN = 24, 48, 40
CODEC, TENSOR, CHUNK, INDEX = 1, 2, 3, 4

MAX_CHUNK_LENGTH = 1 << 24
MAX_INDEX_LENGTH = 1 << 30
MAX_META_FRAME_LENGTH = 1 << 24
MAX_TENSORS = 1 << 24
MAX_CODECS = 65535
MAX_RANK = 64
MAX_NAME_BYTES = 4096
MAX_TREE_DEPTH = 64
MAX_PAYLOAD_DEPTH = 72  # section 9, "Parser bound": arrays and maps of any payload, its root at level 1
MAX_PADDING = 1 << 20
MAX_TENSOR_BYTES = 1 << 62
MAX_ZSTD_WINDOW = 1 << 24
MAX_BIGINT_BYTES = 1024
TYPED_TREE = 1 << 1  # required_features bit 1 (sections 3, 9.2)
ARRAYS_PATHS = 1 << 2  # required_features bit 2 (sections 3, 9.3)
NON_NUMPY_DTYPES = {"bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                    "float8_e8m0fnu", "float4_e2m1fn_x2", "complex32"}  # section 9.3: no ext 9 refers to one
U64 = (1 << 64) - 1
MAX_MATERIALIZED = 1 << 30  # bytes of one tensor this reader will build in memory
I63 = (1 << 63) - 1

# Section 10: name -> (itemsize, numpy dtype used only to view bytes; None: opaque bytes)
DTYPES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "bool": 1,
}


def xxh3(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def xxh3_32lo(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


# --------------------------------------------------------------------------------------------
# Fixed-size structures
# --------------------------------------------------------------------------------------------

@dataclass
class FrameHeader:
    frame_type: int
    flags: int
    codec_id: int
    tensor_id: int
    chunk_index: int
    padding_length: int
    header_checksum: int
    stored_length: int
    raw_length: int
    payload_checksum: int


def check_preamble(data: bytes) -> tuple[int, int, int]:
    """Section 3.  Returns (major, minor, required_features)."""
    if len(data) < PREAMBLE_LEN:
        if not PREAMBLE_MAGIC.startswith(data[:8]):
            raise FormatError("not an nvckpt file (bad magic)")
        raise TruncatedError(f"file is {len(data)} bytes, shorter than the 24-byte preamble")
    magic, major, minor, required, optional, reserved = struct.unpack("<8sHHIII", data[:PREAMBLE_LEN])
    if magic != PREAMBLE_MAGIC:
        raise FormatError(f"not an nvckpt file (magic {magic.hex()})")
    if major != 1:
        raise UnsupportedFeatureError(f"version_major {major}; this reader supports 1")
    if required & ~(TYPED_TREE | ARRAYS_PATHS):
        bits = [b for b in range(32) if (required & ~(TYPED_TREE | ARRAYS_PATHS)) >> b & 1]
        raise UnsupportedFeatureError(f"unknown required_features bits {bits}")
    if reserved:
        raise FormatError(f"preamble reserved field is {reserved:#x}")
    return major, minor, required


def parse_header(data: bytes, where: int, index: bool = False) -> FrameHeader:
    """Section 4.1: magic and checksum first, then the other fields.  ``index``: the frame the footer points
    at, which must be the INDEX frame (section 5 check 7: any other type is FormatError, 5-127 included)."""
    if len(data) < HEADER_LEN:
        raise TruncatedError(f"frame header at {where} cut short")
    if data[:4] != FRAME_MAGIC:
        raise FormatError(f"bad frame magic at offset {where}")
    fields = struct.unpack("<4xBBHIIIIQQQ", data[:HEADER_LEN])
    h = FrameHeader(*fields)
    zeroed = data[:20] + b"\0\0\0\0" + data[24:HEADER_LEN]
    if xxh3_32lo(zeroed) != h.header_checksum:
        raise ChecksumError(f"frame header checksum mismatch at offset {where}")
    if h.flags != 0:
        raise FormatError(f"frame flags {h.flags:#x} at offset {where}")
    if h.padding_length > MAX_PADDING:
        raise FormatError(f"padding_length {h.padding_length} > 2^20 at offset {where}")
    if index and h.frame_type != INDEX:
        raise FormatError(f"the footer points at a frame of type {h.frame_type} at offset {where}, not the INDEX frame")
    if h.frame_type == 0:
        raise FormatError(f"frame type 0 at offset {where}")
    if 5 <= h.frame_type <= 127:
        raise UnsupportedFeatureError(f"unknown required frame type {h.frame_type} at offset {where}")
    if h.frame_type < 128 and h.frame_type != CHUNK:
        if h.raw_length != h.stored_length:
            raise FormatError(f"frame at {where}: raw_length != stored_length")
        zero = {CODEC: (h.tensor_id, h.chunk_index), TENSOR: (h.codec_id, h.chunk_index),
                INDEX: (h.codec_id, h.tensor_id, h.chunk_index)}[h.frame_type]
        if any(zero):
            raise FormatError(f"frame at {where}: a field that must be 0 is not")
    return h


def parse_footer(data: bytes, file_length: int, positions: bool = True) -> tuple[int, int, int]:
    """Section 5, checks 2-6 (2-4 only without positions: a streaming reader compares with the INDEX frame).
    Returns (index_offset, index_length, index_checksum)."""
    index_offset, index_length, index_checksum, reserved, footer_checksum, end = struct.unpack("<QQQII8s", data)
    if end != END_MAGIC:
        raise TruncatedError("no nvckpt footer: the file may be truncated")
    if xxh3_32lo(data[:28]) != footer_checksum:
        raise ChecksumError("footer checksum mismatch")
    if reserved:
        raise FormatError("footer reserved field is not 0")
    if not positions:
        return index_offset, index_length, index_checksum
    if index_length > MAX_INDEX_LENGTH:
        raise LimitError(f"index_length {index_length} > MAX_INDEX_LENGTH")
    if index_offset < PREAMBLE_LEN or index_offset + HEADER_LEN + index_length > file_length - FOOTER_LEN:
        raise FormatError("footer index_offset/index_length outside the file")
    return index_offset, index_length, index_checksum


# --------------------------------------------------------------------------------------------
# msgpack with the safety rules of sections 1, 9 and 20
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorRef:
    tensor_id: int


@dataclass(frozen=True)
class ArrayRef(TensorRef):
    """Ext 9 (section 9.3): a reference to a tensor entry that loads as a NumPy array."""


@dataclass(frozen=True)
class PathNode:
    """Ext 10 (section 9.3): a path, by its flavour byte (0..3) and its str."""
    flavour: int
    text: str


class Tuple(list):
    """A tuple node of the tree (ext type 2)."""


class Map(list):
    """A msgpack map as a list of (key, value) pairs: keeps order and non-str keys."""


class _Ext:
    def __init__(self, code: int, data: bytes) -> None:
        self.code, self.data = code, data


def key_class(k: Any) -> Any:
    """Section 1, "the same key": nil; strs by their bytes; numbers (bool, int, float) by exact value,
    -0.0 as 0.0, every NaN the same; bins by their bytes; exts by type and data (timestamps by the instant);
    arrays item by item; maps as sets of (key, value) entries, both compared by this rule."""
    if isinstance(k, Map):
        return ("map", frozenset((key_class(a), key_class(b)) for a, b in k))
    if isinstance(k, list):
        return ("array", tuple(key_class(x) for x in k))
    if isinstance(k, bytes):
        return ("bin", k)
    if isinstance(k, _Ext):
        return ("ext", k.code, k.data)
    if isinstance(k, msgpack.Timestamp):
        return ("timestamp", k.seconds, k.nanoseconds)
    if k is None:
        return ("nil",)
    if isinstance(k, str):
        return ("str", k.encode("utf-8"))
    if isinstance(k, bool):
        return ("num", int(k))
    if isinstance(k, int):
        return ("num", k)
    if isinstance(k, float):
        if k != k:
            return ("nan",)
        if k in (float("inf"), float("-inf")):
            return ("inf", k > 0)
        if k == int(k):  # integral: compare with ints exactly (int(2.0**64) is 2**64, not 2**64 - 1)
            return ("num", int(k))
        return ("frac", struct.pack(">d", k))
    return ("other", id(k))


def _pairs(pairs: list) -> Map:
    """Every map of every payload: no key twice (section 1, whole-payload rules)."""
    seen = set()
    for k, _ in pairs:
        c = key_class(k)
        if c in seen:
            raise FormatError(f"a map holds the key {k!r:.60} twice (section 1)")
        seen.add(c)
    return Map(pairs)


def unpack_one(payload: bytes) -> Any:
    """Exactly one msgpack object, no trailing bytes; maps as Map; ext types left undecoded."""
    n = len(payload)
    try:
        u = msgpack.Unpacker(None, raw=False, strict_map_key=False, object_pairs_hook=_pairs,
                             ext_hook=lambda code, data: _Ext(code, data), use_list=True,
                             max_buffer_size=max(n, 1), max_str_len=n, max_bin_len=n,
                             max_array_len=n, max_map_len=n, max_ext_len=n)
        u.feed(payload)
        obj = u.unpack()
        # Where the object ends, not whether a second one decodes: an incomplete object after it (a str
        # header with no bytes) is trailing bytes too, not the end of the data.
        if u.tell() != n:
            raise FormatError(f"trailing bytes after the msgpack object ({n - u.tell()} of {n})")
        check_payload_depth(obj)
        return obj
    except NvError:
        raise
    except msgpack.StackError:
        raise LimitError("msgpack nesting too deep") from None
    except msgpack.OutOfData:
        raise FormatError("msgpack data ends early") from None
    except Exception as exc:  # invalid UTF-8, reserved bytes, limits of the parser
        raise FormatError(f"invalid msgpack: {exc}") from None


def check_payload_depth(obj: Any) -> None:
    """Section 9: no array or map (keys included; ext data is not parsed here) below level 72."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, list):  # Map is a list of pairs
            continue
        if depth > MAX_PAYLOAD_DEPTH:
            raise LimitError(f"msgpack payload nests deeper than {MAX_PAYLOAD_DEPTH} levels")
        items = [x for pair in node for x in pair] if isinstance(node, Map) else node
        stack.extend((x, depth + 1) for x in items)


def _dict(m: Any, what: str) -> dict:
    """A Map with str keys as a dict, rejecting duplicate keys (section 1)."""
    if not isinstance(m, Map):
        raise FormatError(f"{what} must be a map")
    out: dict = {}
    for k, v in m:
        if not isinstance(k, str):
            raise FormatError(f"{what}: keys must be str")
        if k in out:
            raise FormatError(f"{what}: duplicate key {k!r}")
        out[k] = v
    return out


def _uint(v: Any, what: str, hi: int = U64, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise FormatError(f"{what} must be an integer in {lo}..{hi}")
    return v


def _check_map_keys_unique(m: Map, what: str) -> None:
    seen = set()
    for k, _ in m:
        key = (type(k).__name__, k if not isinstance(k, float) or k == k else "nan")
        if key in seen:
            raise FormatError(f"{what}: duplicate map key {k!r}")
        seen.add(key)


@dataclass(frozen=True)
class Typed:
    """A typed extension of section 9.2 that is not a Python number: ext 3 (dtype), 4 (device) by name."""
    code: int
    name: str


class SetNode(list):
    """A set (ext 7) or frozenset (ext 8), items in stored order."""

    def __init__(self, items: Any, frozen: bool) -> None:
        super().__init__(items)
        self.frozen = frozen


def _name_ok(data: bytes, device: bool) -> bool:
    if not 1 <= len(data) <= 64:
        return False
    text = data.decode("latin-1")
    name, _, index = text.partition(":") if device else (text, "", "")
    ok = bool(name) and "a" <= name[0] <= "z" and all(c.isascii() and (c.islower() or c.isdigit() or c == "_") for c in name)
    if device and ":" in text:
        ok = ok and index.isascii() and index.isdigit() and len(index) <= 9 and (index == "0" or index[0] != "0")
    return ok


def same_item(v: Any) -> Any:
    """Section 9.2, "the same value" of set items."""
    if isinstance(v, complex):
        return key_class(v.real) if v.imag == 0 else ("complex", key_class(v.real), key_class(v.imag))
    if isinstance(v, bytes):
        return ("bin", v)
    if isinstance(v, Typed):
        return ("typed", v.code, v.name)
    if isinstance(v, SetNode):
        return ("frozenset", frozenset(same_item(x) for x in v))
    if isinstance(v, Tuple):
        return ("tuple", tuple(same_item(x) for x in v))
    return key_class(v)


def decode_array_or_path(node: _Ext, ntensors: int, features: int) -> Any:
    """Ext types 9 and 10 (section 9.3); the dtype of an array's entry is checked by array_problem."""
    if not features & ARRAYS_PATHS:
        raise FormatError(f"ext type {node.code} in a file without required_features bit 2")
    data = node.data
    if node.code == 9:
        if len(data) != 4:
            raise FormatError("array reference (ext 9) must have 4 bytes")
        tid = struct.unpack("<I", data)[0]
        if tid >= ntensors:
            raise FormatError(f"tree refers to tensor {tid}, index has {ntensors}")
        return ArrayRef(tid)
    if len(data) < 2 or data[0] > 3:
        raise FormatError("path ext (10) must be a flavour byte 0..3 and at least one byte of str")
    try:
        text = data[1:].decode("utf-8")  # strict (section 1)
    except UnicodeDecodeError:
        raise FormatError("path ext (10) holds a str that is not valid UTF-8") from None
    if "\x00" in text:
        raise FormatError("path ext (10) holds U+0000")
    return PathNode(data[0], text)


def array_problem(node: Any, dtypes: list[str]) -> str | None:
    """Section 9.3: an array reference to an entry whose dtype NumPy has no dtype for."""
    if isinstance(node, ArrayRef):
        d = dtypes[node.tensor_id]
        return f"an array reference to a {d} tensor" if d in NON_NUMPY_DTYPES else None
    if isinstance(node, Map):
        return next((p for _, v in node if (p := array_problem(v, dtypes))), None)
    if isinstance(node, list) and not isinstance(node, SetNode):
        return next((p for v in node if (p := array_problem(v, dtypes))), None)
    return None


def decode_typed(node: _Ext, ntensors: int, depth: int, features: int) -> Any:
    """Ext types 3..8 (section 9.2)."""
    if not features & TYPED_TREE:
        raise FormatError(f"ext type {node.code} in a file without required_features bit 1")
    data = node.data
    if node.code in (3, 4):
        if not _name_ok(data, node.code == 4):
            raise FormatError(f"ext {node.code} name {data[:64]!r} is not valid")
        return Typed(node.code, data.decode("ascii"))
    if node.code == 5:
        if len(data) != 16:
            raise FormatError("complex ext data must be 16 bytes")
        return complex(*struct.unpack("<dd", data))
    if node.code == 6:
        if len(data) > MAX_BIGINT_BYTES:
            raise LimitError("integer ext longer than 1024 bytes")
        v = int.from_bytes(data, "little", signed=True)
        if -(1 << 63) <= v < 1 << 64:
            raise FormatError("integer ext holds a value msgpack encodes as an int")
        if len(data) > 1 and ((data[-1] == 0 and data[-2] < 0x80) or (data[-1] == 0xFF and data[-2] >= 0x80)):
            raise FormatError("integer ext is longer than its shortest encoding")
        return v
    if depth > MAX_TREE_DEPTH:
        raise LimitError("tree deeper than 64")
    items = unpack_one(data)
    if not isinstance(items, list) or isinstance(items, Map):
        raise FormatError("set ext data must be one msgpack array")
    out = [decode_tree(x, ntensors, depth + 1, features) for x in items]
    for item in out:
        if not _set_item_ok(item):
            raise FormatError(f"a set holds a {type(item).__name__} (or a tuple holding one)")
    seen = set()
    for item in out:
        c = same_item(item)
        if c in seen:
            raise FormatError(f"a set holds {item!r:.60} twice")
        seen.add(c)
    return SetNode(out, node.code == 8)


def _set_item_ok(v: Any) -> bool:
    """Section 9.2: nil, bool, int, float, str, bin, ext 3-6, and tuples and frozensets of those."""
    if isinstance(v, Tuple) or (isinstance(v, SetNode) and v.frozen):
        return all(map(_set_item_ok, v))
    if isinstance(v, (TensorRef, list, Map)):  # arrays, maps, sets (SetNode is a list) and tensors
        return False
    return v is None or isinstance(v, (bool, int, float, str, bytes, complex, Typed))


def decode_tree(node: Any, ntensors: int, depth: int = 1, features: int = 0) -> Any:
    """Section 9: check types, depth (root container = 1) and ext types; decode tuples, sections 9.2 and 9.3
    (``features``: the preamble's required_features)."""
    if isinstance(node, _Ext) and 3 <= node.code <= 8:
        return decode_typed(node, ntensors, depth, features)
    if isinstance(node, _Ext) and node.code in (9, 10):
        return decode_array_or_path(node, ntensors, features)
    if isinstance(node, _Ext):
        if node.code == 1:
            if len(node.data) != 4:
                raise FormatError("tensor reference must have 4 bytes")
            tid = struct.unpack("<I", node.data)[0]
            if tid >= ntensors:
                raise FormatError(f"tree refers to tensor {tid}, index has {ntensors}")
            return TensorRef(tid)
        if node.code == 2:
            if depth > MAX_TREE_DEPTH:
                raise LimitError("tree deeper than 64")
            items = unpack_one(node.data)
            if not isinstance(items, list) or isinstance(items, Map):
                raise FormatError("tuple ext data must be one msgpack array")
            return Tuple(decode_tree(x, ntensors, depth + 1, features) for x in items)
        raise FormatError(f"ext type {node.code} is not allowed in the tree")
    if isinstance(node, Map):
        if depth > MAX_TREE_DEPTH:
            raise LimitError("tree deeper than 64")
        for k, _ in node:
            if k is not None and not isinstance(k, (str, int, float, bool)):
                raise FormatError(f"tree map key of type {type(k).__name__} is not allowed")
        _check_map_keys_unique(node, "tree map")
        out = Map((k, decode_tree(v, ntensors, depth + 1, features)) for k, v in node)
        return out
    if isinstance(node, list):
        if depth > MAX_TREE_DEPTH:
            raise LimitError("tree deeper than 64")
        return [decode_tree(x, ntensors, depth + 1, features) for x in node]
    if node is None or isinstance(node, (bool, int, float, str, bytes)):
        return node
    raise FormatError(f"unexpected {type(node).__name__} in the tree")


def check_metadata(node: Any, depth: int = 1) -> Any:
    """Section 8.6: JSON-like values, str keys, at most 64 deep."""
    if isinstance(node, Map):
        if depth > MAX_TREE_DEPTH:
            raise LimitError("metadata deeper than 64")
        d = _dict(node, "metadata map")
        return Map((k, check_metadata(v, depth + 1)) for k, v in d.items())
    if isinstance(node, list):
        if depth > MAX_TREE_DEPTH:
            raise LimitError("metadata deeper than 64")
        return [check_metadata(x, depth + 1) for x in node]
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    raise FormatError(f"metadata value of type {type(node).__name__} is not JSON-like")


# --------------------------------------------------------------------------------------------
# Codecs (section 11)
# --------------------------------------------------------------------------------------------

@dataclass
class Step:
    name: str
    configuration: dict
    kind: str  # "filter", "coder" or "unknown"


NVCOMP_DATA_TYPES = ("<f2", "<f4", "|f1", "|u1")


def parse_pipeline(value: Any, cid: int) -> list[Step]:
    if not isinstance(value, list) or isinstance(value, Map) or not value:
        raise FormatError(f"codec {cid}: pipeline must be a non-empty array")
    steps = []
    for raw_step in value:
        step = _dict(raw_step, f"codec {cid} step")
        if set(step) - {"name", "configuration"}:
            raise FormatError(f"codec {cid}: step has keys other than name/configuration")
        name = step.get("name")
        if not isinstance(name, str):
            raise FormatError(f"codec {cid}: step name must be a str")
        config = _dict(step.get("configuration", Map()), f"codec {cid} configuration")
        if name == "raw":
            if config:
                raise FormatError(f"codec {cid}: raw takes no configuration")
            steps.append(Step(name, config, "coder"))
        elif name == "zstd":
            if set(config) - {"level"}:
                raise FormatError(f"codec {cid}: zstd configuration has unknown keys")
            if "level" in config:
                _int_any(config["level"], f"codec {cid}: zstd level")
            steps.append(Step(name, config, "coder"))
        elif name == "byteshuffle":
            if set(config) != {"elementsize"}:
                raise FormatError(f"codec {cid}: byteshuffle needs exactly 'elementsize'")
            _uint(config["elementsize"], f"codec {cid}: byteshuffle elementsize", 16, 1)
            steps.append(Step(name, config, "filter"))
        elif name == "signshift":  # 11.9: elementsize 2, 4 or 8, required, no other key
            if set(config) != {"elementsize"}:
                raise FormatError(f"codec {cid}: signshift needs exactly 'elementsize'")
            k = config["elementsize"]
            if isinstance(k, bool) or not isinstance(k, int) or k not in (2, 4, 8):
                raise FormatError(f"codec {cid}: signshift elementsize must be 2, 4 or 8")
            steps.append(Step(name, config, "filter"))
        elif name == "nvcomp-ans":  # 11.6: all three keys, checked when the codec table is parsed
            if set(config) != {"data_type", "nvcomp_version", "bitstream"}:
                raise FormatError(f"codec {cid}: nvcomp-ans needs exactly data_type, nvcomp_version, bitstream")
            version = config["nvcomp_version"]
            parts = version.split(".") if isinstance(version, str) else []
            if len(parts) != 3 or not all(p and all("0" <= ch <= "9" for ch in p) for p in parts):
                raise FormatError(f"codec {cid}: nvcomp-ans nvcomp_version must be 'MAJOR.MINOR.PATCH', got {version!r}")
            if config["bitstream"] != "raw" or config["data_type"] not in NVCOMP_DATA_TYPES:
                raise FormatError(f"codec {cid}: nvcomp-ans bitstream must be 'raw' and data_type one of {NVCOMP_DATA_TYPES}")
            steps.append(Step(name, config, "coder"))
        else:
            steps.append(Step(name, config, "unknown"))
    kinds = [s.kind for s in steps]
    if "unknown" not in kinds and (kinds[-1] != "coder" or "coder" in kinds[:-1]):
        raise FormatError(f"codec {cid}: filters must come first and exactly one coder last")
    return steps


def _int_any(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise FormatError(f"{what} must be an integer")
    return v


def zstd_frame_windows(data: bytes) -> list[int]:
    """RFC 8878 3.1.1: walk frame and block headers; the Window_Size of each (non-skippable) frame."""
    out, pos = [], 0

    def need(k: int) -> None:
        if pos + k > len(data):
            raise FormatError("zstd data cut short")

    while pos < len(data):
        need(4)
        magic = struct.unpack_from("<I", data, pos)[0]
        if 0x184D2A50 <= magic <= 0x184D2A5F:
            need(8)
            pos += 8 + struct.unpack_from("<I", data, pos + 4)[0]
            need(0)
            continue
        if magic != 0xFD2FB528:
            raise FormatError(f"zstd: bytes at {pos} are not a frame")
        need(5)
        fhd = data[pos + 4]
        if fhd & 0x08:
            raise FormatError("zstd: reserved frame header bit set")
        single = fhd & 0x20
        pos += 5
        window = 0
        if not single:
            need(1)
            exponent, mantissa = data[pos] >> 3, data[pos] & 7
            window = (1 << (10 + exponent)) + ((1 << (10 + exponent)) // 8) * mantissa
            pos += 1
        pos += [0, 1, 2, 4][fhd & 3]
        fcs_size = [1 if single else 0, 2, 4, 8][fhd >> 6]
        need(fcs_size)
        if single:
            window = int.from_bytes(data[pos:pos + fcs_size], "little") + (256 if fcs_size == 2 else 0)
        pos += fcs_size
        last = False
        while not last:
            need(3)
            header = int.from_bytes(data[pos:pos + 3], "little")
            last, kind, size = bool(header & 1), (header >> 1) & 3, header >> 3
            if kind == 3:
                raise FormatError("zstd: reserved block type")
            pos += 3 + (1 if kind == 1 else size)
            need(0)
        pos += 4 if fhd & 0x04 else 0
        need(0)
        out.append(window)
    return out


def zstd_decode(data: bytes, raw_length: int) -> bytes:
    """Decode one or more zstd frames, never producing more than raw_length + 1 bytes (11.4, 11.7)."""
    windows = zstd_frame_windows(data)
    if not windows:
        raise FormatError("zstd chunk holds no frame")
    if max(windows) > MAX_ZSTD_WINDOW:  # before decoding (11.4)
        raise FormatError(f"zstd frame Window_Size {max(windows)} > 2^24")
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True,
                                                           read_size=65536)
        out = bytearray()
        while len(out) <= raw_length:
            block = reader.read(raw_length + 1 - len(out))
            if not block:
                break
            out += block
    except zstandard.ZstdError as exc:
        raise FormatError(f"invalid zstd data: {exc}") from None
    if len(out) != raw_length:
        raise FormatError(f"zstd data decodes to {'more than ' if len(out) > raw_length else ''}"
                          f"{len(out)} bytes, raw_length is {raw_length}")
    return bytes(out)


def decode_chunk(steps: list[Step], cid: int, stored: bytes, raw_length: int, writer: dict) -> bytes:
    for s in steps:  # 11.8: unknown or unavailable codecs fail here, when a tensor needs them
        if s.kind == "unknown":
            raise UnsupportedCodecError(
                f"codec {cid} {s.name!r} is not known to this reader; the file was written by "
                f"{writer.get('name')} {writer.get('version')}")
        if s.name == "nvcomp-ans":
            raise UnsupportedCodecError(
                f"codec {cid} 'nvcomp-ans' (nvCOMP {s.configuration.get('nvcomp_version')} ANS, "
                f"{s.configuration.get('bitstream')} bitstream) decodes only with nvCOMP >= 6.0 on a CUDA GPU; "
                "this reader has no GPU")
    coder, filters = steps[-1], steps[:-1]
    if coder.name == "raw":
        if len(stored) != raw_length:
            raise FormatError(f"raw chunk: stored_length {len(stored)} != raw_length {raw_length}")
        data = stored
    else:
        data = zstd_decode(stored, raw_length)
    for f in reversed(filters):
        k = f.configuration["elementsize"]
        if len(data) % k:
            raise FormatError(f"{f.name}: {len(data)} bytes is not a multiple of elementsize {k}")
        if f.name == "byteshuffle":
            data = np.frombuffer(data, np.uint8).reshape(k, -1).T.tobytes()
        else:  # signshift, 11.9: raw[k-1] = (l' & 0x80) | (h' >> 1), raw[k-2] = ((h' << 7) & 0xFF) | (l' & 0x7F)
            e = np.frombuffer(data, np.uint8).reshape(-1, k).astype(np.int64)
            h, lo = e[:, k - 1].copy(), e[:, k - 2].copy()
            e[:, k - 1] = (lo & 0x80) | (h >> 1)
            e[:, k - 2] = ((h << 7) & 0xFF) | (lo & 0x7F)
            data = e.astype(np.uint8).tobytes()
    return data


# --------------------------------------------------------------------------------------------
# The index (section 8)
# --------------------------------------------------------------------------------------------

@dataclass
class Entry:
    tensor_id: int
    name: str
    dtype: str
    itemsize: int | None  # None: dtype unknown to this reader
    shape: tuple[int, ...]
    kind: str  # "chunks", "view" or "derived"
    chunks: list[tuple[int, int, int, int, int]]
    view: dict | None
    derived: dict | None
    checksum: int | None
    internal: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * (self.itemsize or 0)


@dataclass
class Index:
    version: tuple[int, int]
    writer: dict
    codecs: list[list[Step]]
    tensors: list[Entry]
    tree: Any
    metadata: Any
    raw_entries: list[dict]
    raw_codecs: list


_ABSENT = object()  # a key that is not in the map (canon tells it from every value, nil included)


def canon(v: Any) -> Any:
    """A msgpack value compared by type and value (maps unordered, floats by bits): rule 3 of 4.3, 8.3."""
    if v is _ABSENT:
        return ("absent",)
    if isinstance(v, Map):
        return ("map", frozenset((key_class(k), canon(x)) for k, x in v))
    if isinstance(v, list):
        return ("array", tuple(canon(x) for x in v))
    if isinstance(v, bool) or v is None:
        return ("atom", v)
    if isinstance(v, int):
        return ("int", v)
    if isinstance(v, float):
        return ("float", struct.pack(">d", v))
    if isinstance(v, _Ext):
        return ("ext", v.code, v.data)
    return (type(v).__name__, v)


def canon_pipeline(value: Any) -> Any:
    """Rule 3 of 4.3: the same steps, names and configurations (absent = {}), bytes need not match."""
    steps = []
    for step in value:
        d = _dict(step, "codec step")
        steps.append((d.get("name"), canon(d.get("configuration", Map()))))
    return tuple(steps)


def parse_entry(tid: int, raw: Any, ncodecs: int, index_offset: int) -> Entry:
    e = _dict(raw, f"tensor {tid}")
    name = e.get("name")
    if not isinstance(name, str):
        raise FormatError(f"tensor {tid}: name must be a str")
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:  # bytes of UTF-8, not characters
        raise LimitError(f"tensor {tid}: name longer than {MAX_NAME_BYTES} bytes")
    dtype = e.get("dtype")
    if not isinstance(dtype, str):
        raise FormatError(f"tensor {name!r}: dtype must be a str")
    itemsize = DTYPES.get(dtype)  # unknown: reported when the tensor is read (section 10)
    shape_raw = e.get("shape")
    if not isinstance(shape_raw, list) or isinstance(shape_raw, Map):
        raise FormatError(f"tensor {name!r}: shape must be an array")
    if len(shape_raw) > MAX_RANK:
        raise LimitError(f"tensor {name!r}: rank {len(shape_raw)} > {MAX_RANK}")
    shape = tuple(_uint(d, f"tensor {name!r}: shape dimension") for d in shape_raw)
    span = itemsize or 1  # 8.3: non-zero dimensions times itemsize (1 for a dtype this reader does not know)
    for d in shape:
        if d:
            span *= d
    if span > MAX_TENSOR_BYTES:
        raise LimitError(f"tensor {name!r}: shape spans {span} bytes > 2^62")
    kinds = [k for k in ("chunks", "view", "derived") if k in e]
    if len(kinds) != 1:
        raise FormatError(f"tensor {name!r}: needs exactly one of chunks, view, derived (has {kinds})")
    checksum = e.get("checksum")
    if "checksum" in e:  # optional, but a u64 when present: nil is a value of another type (section 1, Types)
        _uint(checksum, f"tensor {name!r}: checksum")
    internal = e.get("internal", False)
    if not isinstance(internal, bool):
        raise FormatError(f"tensor {name!r}: internal must be a bool")
    entry = Entry(tid, name, dtype, itemsize, shape, kinds[0], [], None, None, checksum, internal)
    if "chunks" in e:
        table = e["chunks"]
        if not isinstance(table, list) or isinstance(table, Map):
            raise FormatError(f"tensor {name!r}: chunks must be an array")
        total = 0
        for i, c in enumerate(table):
            if not isinstance(c, list) or isinstance(c, Map) or len(c) != 5:
                raise FormatError(f"tensor {name!r} chunk {i}: must be an array of 5 ints")
            off = _uint(c[0], f"tensor {name!r} chunk {i} offset")
            stored = _uint(c[1], f"tensor {name!r} chunk {i} stored_length")
            rawlen = _uint(c[2], f"tensor {name!r} chunk {i} raw_length")
            cid = _uint(c[3], f"tensor {name!r} chunk {i} codec_id", 0xFFFF)
            check = _uint(c[4], f"tensor {name!r} chunk {i} checksum")
            for what, v in (("stored_length", stored), ("raw_length", rawlen)):
                if v == 0:
                    raise FormatError(f"tensor {name!r} chunk {i}: {what} is 0")
                if v > MAX_CHUNK_LENGTH:
                    raise LimitError(f"tensor {name!r} chunk {i}: {what} {v} > MAX_CHUNK_LENGTH")
            if itemsize is not None and rawlen % itemsize:
                raise FormatError(f"tensor {name!r} chunk {i}: raw_length not a multiple of itemsize")
            if cid >= ncodecs:
                raise FormatError(f"tensor {name!r} chunk {i}: codec_id {cid} >= {ncodecs}")
            if off < PREAMBLE_LEN + HEADER_LEN or off + stored > index_offset:
                raise FormatError(f"tensor {name!r} chunk {i}: [{off}, {off + stored}) outside [72, {index_offset})")
            entry.chunks.append((off, stored, rawlen, cid, check))
            total += rawlen
        if itemsize is not None and total != entry.nbytes:
            raise FormatError(f"tensor {name!r}: chunks hold {total} bytes, shape and dtype need {entry.nbytes}")
    elif "view" in e:
        v = _dict(e["view"], f"tensor {name!r} view")
        base = _uint(v.get("base"), f"tensor {name!r}: view base")
        offset = _uint(v.get("offset"), f"tensor {name!r}: view offset")
        stride_raw = v.get("stride")
        if not isinstance(stride_raw, list) or isinstance(stride_raw, Map):
            raise FormatError(f"tensor {name!r}: view stride must be an array")
        stride = [_uint(s, f"tensor {name!r}: view stride") for s in stride_raw]
        if offset > MAX_TENSOR_BYTES or any(x > MAX_TENSOR_BYTES for x in stride):
            raise LimitError(f"tensor {name!r}: view offset or stride > 2^62")
        if len(stride) != len(shape):
            raise FormatError(f"tensor {name!r}: {len(stride)} strides for rank {len(shape)}")
        entry.view = {"base": base, "offset": offset, "stride": stride}
    else:
        d = _dict(e["derived"], f"tensor {name!r} derived")
        if not isinstance(d.get("function"), str):
            raise FormatError(f"tensor {name!r}: derived function must be a str")
        entry.derived = {"function": d["function"], "source": _uint(d.get("source"), f"tensor {name!r}: derived source")}
    return entry


def check_references(entries: list[Entry]) -> None:
    """Views and derived entries point at suitable data tensors (8.5)."""
    for e in entries:
        if e.view is not None:
            b = e.view["base"]
            if b >= len(entries):
                raise FormatError(f"tensor {e.name!r}: view base {b} does not exist")
            base = entries[b]
            if base.kind != "chunks" or len(base.shape) != 1 or base.dtype != e.dtype:
                raise FormatError(f"tensor {e.name!r}: view base must be a 1-D data tensor of dtype {e.dtype}")
            if e.numel > 0:
                last = e.view["offset"] + sum((d - 1) * s for d, s in zip(e.shape, e.view["stride"]))
                if last >= base.numel:  # an empty view addresses no element: nothing to check
                    raise FormatError(f"tensor {e.name!r}: view reaches element {last}, base has {base.numel}")
        if e.derived is not None:
            s = e.derived["source"]
            if s >= len(entries) or s == e.tensor_id:
                raise FormatError(f"tensor {e.name!r}: derived source {s} does not exist or is the entry itself")
            if e.derived["function"] not in ("bf16_rne", "copy"):
                continue  # unknown function: UnsupportedFeatureError when read
            src = entries[s]
            if e.derived["function"] == "copy":  # 14.2: a data tensor of the same dtype and shape
                if src.kind != "chunks" or src.dtype != e.dtype or src.shape != e.shape:
                    raise FormatError(f"tensor {e.name!r}: copy source must be a data tensor of the same dtype and shape")
                continue
            if e.dtype != "bfloat16":
                raise FormatError(f"tensor {e.name!r}: bf16_rne tensors have dtype bfloat16")
            if src.kind != "chunks" or src.dtype != "float32" or src.shape != e.shape:
                raise FormatError(f"tensor {e.name!r}: bf16_rne source must be a float32 data tensor of the same shape")


def parse_index(payload: bytes, preamble_version: tuple[int, int, int], index_offset: int) -> Index:
    top = _dict(unpack_one(payload), "index")
    for key in ("format", "version", "codecs", "tensors", "tree"):
        if key not in top:
            raise FormatError(f"index has no {key!r}")
    if top["format"] != "nvckpt":
        raise FormatError("index format is not 'nvckpt'")
    version = top["version"]
    if (not isinstance(version, list) or isinstance(version, Map) or len(version) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 0xFFFF for v in version)):
        raise FormatError(f"index version must be [major, minor], got {version!r}")
    if version[0] != preamble_version[0]:  # a differing minor is allowed (8.1)
        raise FormatError(f"index major version {version[0]} differs from the preamble's {preamble_version[0]}")
    writer = _dict(top.get("writer", Map()), "writer")  # a missing writer or metadata may be taken as empty
    codecs_raw = top["codecs"]
    if not isinstance(codecs_raw, list) or isinstance(codecs_raw, Map):
        raise FormatError("codecs must be an array")
    if len(codecs_raw) > MAX_CODECS:
        raise LimitError(f"{len(codecs_raw)} codecs > {MAX_CODECS}")
    codecs = [parse_pipeline(p, i) for i, p in enumerate(codecs_raw)]
    raw_codecs = list(codecs_raw)
    tensors_raw = top["tensors"]
    if not isinstance(tensors_raw, list) or isinstance(tensors_raw, Map):
        raise FormatError("tensors must be an array")
    if len(tensors_raw) > MAX_TENSORS:
        raise LimitError(f"{len(tensors_raw)} tensors > {MAX_TENSORS}")
    entries = [parse_entry(i, t, len(codecs), index_offset) for i, t in enumerate(tensors_raw)]
    raw_entries = [_dict(t, f"tensor {i}") for i, t in enumerate(tensors_raw)]
    names = set()
    for e in entries:
        if e.name in names:
            raise FormatError(f"duplicate tensor name {e.name!r}")
        names.add(e.name)
    ranges = sorted((off, off + stored, e.name) for e in entries for off, stored, *_ in e.chunks)
    for (a0, a1, an), (b0, b1, bn) in zip(ranges, ranges[1:]):
        if b0 < a1:
            raise FormatError(f"stored ranges of {an!r} [{a0}, {a1}) and {bn!r} [{b0}, {b1}) overlap")
    check_references(entries)
    tree = decode_tree(top["tree"], len(entries), features=preamble_version[2])
    problem = array_problem(tree, [e.dtype for e in entries])
    if problem:
        raise FormatError(f"the tree holds {problem}, which NumPy has no dtype for (section 9.3)")
    metadata = check_metadata(top.get("metadata", Map()))
    if not isinstance(metadata, Map):
        raise FormatError("metadata must be a map")
    by_name = {e.name: e.tensor_id for e in entries}  # 14.1: a name stands for one tensor
    for path, tid in path_refs(tree):
        if by_name.setdefault(path, tid) != tid:
            raise FormatError(f"the name {path!r} stands for two different tensors")
    return Index((version[0], version[1]), writer, codecs, entries, tree, metadata, raw_entries, raw_codecs)


# --------------------------------------------------------------------------------------------
# Materializing tensors (sections 8.5, 10, 13, 14.2)
# --------------------------------------------------------------------------------------------

def bf16_rne(src: bytes) -> bytes:
    x = np.frombuffer(src, "<u4").astype(np.uint64)
    rounded = ((x + 0x7FFF + ((x >> 16) & 1)) & 0xFFFFFFFF) >> 16
    nan = (x >> 16) | 0x0040
    out = np.where((x & 0x7FFFFFFF) > 0x7F800000, nan, rounded) & 0xFFFF
    return out.astype("<u2").tobytes()


class Materializer:
    """Turns entries into C-contiguous raw bytes, given a way to get a data tensor's decoded chunks."""

    def __init__(self, index: Index, chunk_bytes) -> None:
        self.index = index
        self.chunk_bytes = chunk_bytes  # (entry, i) -> decoded bytes of chunk i, checksum verified
        self.cache: dict[int, bytes] = {}

    def raw(self, e: Entry) -> bytes:
        if e.tensor_id in self.cache:
            return self.cache[e.tensor_id]
        if e.itemsize is None:
            raise UnsupportedFeatureError(f"tensor {e.name!r}: unknown dtype {e.dtype!r}")
        if e.nbytes > MAX_MATERIALIZED:  # this reader's own memory limit (section 16 allows one)
            raise LimitError(f"tensor {e.name!r}: {e.nbytes} bytes exceed this reader's limit of {MAX_MATERIALIZED}")
        if e.kind == "chunks":
            data = b"".join(self.chunk_bytes(e, i) for i in range(len(e.chunks)))
        elif e.kind == "view":
            base = self.index.tensors[e.view["base"]]
            elems = np.frombuffer(self.raw(base), np.dtype(f"V{e.itemsize}"))
            if e.numel == 0:
                data = b""
            else:
                idx = np.full(e.shape, e.view["offset"], dtype=np.int64)
                for axis, (d, s) in enumerate(zip(e.shape, e.view["stride"])):
                    shape = [1] * len(e.shape)
                    shape[axis] = d
                    idx = idx + (np.arange(d, dtype=np.int64) * s).reshape(shape)
                data = elems[idx.reshape(-1)].tobytes()
        else:
            if e.derived["function"] not in ("bf16_rne", "copy"):
                raise UnsupportedFeatureError(f"tensor {e.name!r}: unknown derived function {e.derived['function']!r}")
            data = self.raw(self.index.tensors[e.derived["source"]])
            if e.derived["function"] == "bf16_rne":
                data = bf16_rne(data)
        if e.checksum is not None and xxh3(data) != e.checksum:
            raise ChecksumError(f"tensor {e.name!r}: tensor checksum mismatch")
        if e.dtype == "bool" and data and np.frombuffer(data, np.uint8).max() > 1:
            raise FormatError(f"tensor {e.name!r}: bool bytes other than 0 and 1")
        self.cache[e.tensor_id] = data
        return data


# --------------------------------------------------------------------------------------------
# Random-access reader (15.1)
# --------------------------------------------------------------------------------------------

class RandomAccessReader:
    def __init__(self, f: BinaryIO, file_length: int) -> None:
        self.f, self.file_length = f, file_length
        version = check_preamble(self._read(0, min(PREAMBLE_LEN, file_length)))
        if file_length < PREAMBLE_LEN + HEADER_LEN + FOOTER_LEN:
            raise TruncatedError("file too short")
        footer_at = file_length - FOOTER_LEN
        index_offset, index_length, index_checksum = parse_footer(self._read(footer_at, FOOTER_LEN), file_length)
        h = parse_header(self._read(index_offset, HEADER_LEN), index_offset, index=True)
        if (h.stored_length != index_length or h.payload_checksum != index_checksum
                or index_offset + HEADER_LEN + h.padding_length + index_length != footer_at):
            raise FormatError("INDEX frame header disagrees with the footer")
        if any(self._read(index_offset + HEADER_LEN, h.padding_length)):
            raise FormatError("INDEX frame padding is not zero")
        payload = self._read(index_offset + HEADER_LEN + h.padding_length, index_length)
        if xxh3(payload) != index_checksum:
            raise ChecksumError("index checksum mismatch")
        self.index = parse_index(payload, version, index_offset)
        self.materializer = Materializer(self.index, self._chunk)

    def _read(self, offset: int, length: int) -> bytes:
        if offset + length > self.file_length:
            raise TruncatedError(f"read of {length} bytes at {offset} past the end")
        self.f.seek(offset)
        data = self.f.read(length)
        if len(data) != length:
            raise TruncatedError(f"short read at {offset}")
        return data

    def _chunk(self, e: Entry, i: int) -> bytes:
        off, stored, rawlen, cid, check = e.chunks[i]
        data = self._read(off, stored)
        if xxh3(data) != check:  # before any decoder sees the bytes (section 13)
            raise ChecksumError(f"tensor {e.name!r} chunk {i}: checksum mismatch")
        return decode_chunk(self.index.codecs[cid], cid, data, rawlen, self.index.writer)


# --------------------------------------------------------------------------------------------
# Streaming reader (15.2): front to back, no seeks
# --------------------------------------------------------------------------------------------

class StreamingReader:
    def __init__(self, f: BinaryIO) -> None:
        self.f, self.pos = f, 0
        version = check_preamble(self._take(PREAMBLE_LEN, allow_short=True))
        codecs: dict[int, list[Step]] = {}
        codec_values: dict[int, Any] = {}
        described: dict[int, dict] = {}
        chunks: dict[tuple[int, int], tuple[int, FrameHeader, bytes]] = {}  # (tensor, i) -> (offset, header, raw)
        while True:
            at = self.pos
            header_bytes = self._take(HEADER_LEN)
            h = parse_header(header_bytes, at)
            if any(self._take(h.padding_length)):
                raise FormatError(f"padding of the frame at {at} is not zero")
            if h.frame_type >= 128:  # optional extension frame: skipped (payload checksum MAY be left unchecked)
                self._skip(h.stored_length)
                continue
            limit = {CODEC: MAX_META_FRAME_LENGTH, TENSOR: MAX_META_FRAME_LENGTH,
                     CHUNK: MAX_CHUNK_LENGTH, INDEX: MAX_INDEX_LENGTH}[h.frame_type]
            if h.stored_length > limit:
                raise LimitError(f"frame at {at}: stored_length {h.stored_length} over the limit {limit}")
            if h.frame_type == CHUNK and h.raw_length > MAX_CHUNK_LENGTH:
                raise LimitError(f"CHUNK frame at {at}: raw_length {h.raw_length} over MAX_CHUNK_LENGTH")
            payload_at = self.pos
            payload = self._take(h.stored_length)
            if xxh3(payload) != h.payload_checksum:
                raise ChecksumError(f"payload checksum mismatch in the frame at {at}")
            if h.frame_type == CODEC:
                if h.codec_id in codecs:
                    raise FormatError(f"second CODEC frame for codec id {h.codec_id}")
                pipeline = unpack_one(payload)
                codecs[h.codec_id] = parse_pipeline(pipeline, h.codec_id)
                codec_values[h.codec_id] = pipeline
            elif h.frame_type == TENSOR:
                if h.tensor_id in described:
                    raise FormatError(f"second TENSOR frame for tensor {h.tensor_id}")
                described[h.tensor_id] = _dict(unpack_one(payload), f"TENSOR frame {h.tensor_id}")
            elif h.frame_type == CHUNK:
                key = (h.tensor_id, h.chunk_index)
                if h.codec_id not in codecs or h.tensor_id not in described:
                    raise FormatError(f"CHUNK frame at {at} before its CODEC or TENSOR frame (4.3)")
                if key in chunks:
                    raise FormatError(f"second CHUNK frame for tensor {h.tensor_id} chunk {h.chunk_index}")
                # Decoded now, as a stream would be; the dtype check waits for the index.
                raw: bytes | NvError | None = None
                if _decodable(codecs[h.codec_id]):
                    try:
                        raw = decode_chunk(codecs[h.codec_id], h.codec_id, payload, h.raw_length, {})
                    except NvError as exc:  # 15.2: reported for the tensor, as when it is read
                        raw = exc
                chunks[key] = (payload_at, h, raw)
            else:  # INDEX, then the footer (15.2: in this order)
                footer = self._take(FOOTER_LEN)
                index_offset, index_length, index_checksum = parse_footer(footer, self.pos, positions=False)
                if (index_offset != at or index_length != h.stored_length or index_checksum != h.payload_checksum):
                    raise FormatError("footer does not match the INDEX frame")
                if self.f.read(1):
                    raise FormatError("bytes after the footer")
                index = parse_index(payload, version, at)
                self._check_against_frames(index, codecs, described, chunks)
                for cid, value in codec_values.items():
                    if canon_pipeline(value) != canon_pipeline(index.raw_codecs[cid]):
                        raise FormatError(f"the CODEC frame of codec id {cid} differs from the index's pipeline")
                self.index = index
                self.chunks = chunks
                self.materializer = Materializer(index, self._chunk)
                return

    def _take(self, n: int, allow_short: bool = False) -> bytes:
        data = self.f.read(n) if n else b""
        if len(data) != n and not allow_short:
            raise TruncatedError(f"stream ends at {self.pos + len(data)}, inside a structure")
        self.pos += len(data)
        return data

    def _skip(self, n: int) -> None:
        while n:
            part = self.f.read(min(n, 1 << 20))
            if not part:
                raise TruncatedError("stream ends inside an extension frame")
            n -= len(part)
            self.pos += len(part)

    def _check_against_frames(self, index: Index, codecs, described, chunks) -> None:
        """Rules 3-5 of 4.3: the frames seen and the index agree."""
        if set(codecs) != set(range(len(index.codecs))):
            raise FormatError("CODEC frames do not match the codec table")
        if set(described) != set(range(len(index.tensors))):
            raise FormatError("TENSOR frames do not match the tensor table")
        for e in index.tensors:
            d = described[e.tensor_id]
            raw = index.raw_entries[e.tensor_id]
            for key in ("name", "dtype", "shape", "view", "derived", "checksum", "internal"):
                default = False if key == "internal" else _ABSENT  # absent is not nil (8.3: absent from both)
                if canon(d.get(key, default)) != canon(raw.get(key, default)):
                    raise FormatError(f"tensor {e.name!r}: TENSOR frame {key!r} differs from the index (8.3)")
            nchunks = d.get("nchunks")
            if isinstance(nchunks, bool) or not isinstance(nchunks, int) or nchunks != len(e.chunks):  # True == 1 == 1.0
                raise FormatError(f"tensor {e.name!r}: TENSOR frame nchunks {nchunks} != {len(e.chunks)}")
            for i, (off, stored, rawlen, cid, check) in enumerate(e.chunks):
                got = chunks.get((e.tensor_id, i))
                if got is None:
                    raise FormatError(f"tensor {e.name!r}: no CHUNK frame for chunk {i}")
                at, h, _ = got
                if (at, h.stored_length, h.raw_length, h.codec_id, h.payload_checksum) != (off, stored, rawlen, cid, check):
                    raise FormatError(f"tensor {e.name!r} chunk {i}: CHUNK frame differs from the index")
        expected = {(e.tensor_id, i) for e in index.tensors for i in range(len(e.chunks))}
        if set(chunks) != expected:
            raise FormatError("CHUNK frames that no index entry uses")

    def _chunk(self, e: Entry, i: int) -> bytes:
        _, h, raw = self.chunks[(e.tensor_id, i)]
        if isinstance(raw, NvError):
            raise raw
        if raw is None:
            cid = h.codec_id
            return decode_chunk(self.index.codecs[cid], cid, b"", h.raw_length, self.index.writer)
        return raw


def _decodable(steps: list[Step]) -> bool:
    return all(s.kind != "unknown" and s.name != "nvcomp-ans" for s in steps)


# --------------------------------------------------------------------------------------------
# The conformance protocol: a JSON description of the decoded file
# --------------------------------------------------------------------------------------------

def node_json(node: Any, names: list[str]) -> Any:
    """Tree/metadata value -> JSON (conformance/README.md, "The decode document")."""
    if isinstance(node, ArrayRef):
        return {"$ndarray": names[node.tensor_id]}
    if isinstance(node, TensorRef):
        return {"$tensor": names[node.tensor_id]}
    if isinstance(node, PathNode):
        return {"$path": [node.flavour, node.text]}
    if isinstance(node, Tuple):
        return {"$tuple": [node_json(x, names) for x in node]}
    if isinstance(node, SetNode):
        return {"$frozenset" if node.frozen else "$set": [node_json(x, names) for x in node]}
    if isinstance(node, Typed):
        return {"$dtype" if node.code == 3 else "$device": node.name}
    if isinstance(node, complex):
        return {"$complex": [struct.pack(">d", node.real).hex(), struct.pack(">d", node.imag).hex()]}
    if isinstance(node, Map):
        return {"$map": [[node_json(k, names), node_json(v, names)] for k, v in node]}
    if isinstance(node, list):
        return [node_json(x, names) for x in node]
    if isinstance(node, bool) or node is None or isinstance(node, str):
        return node
    if isinstance(node, int):
        return node
    if isinstance(node, float):
        return {"$float": struct.pack(">d", node).hex()}
    if isinstance(node, bytes):
        return {"$bytes": node.hex()}
    raise TypeError(type(node))


def path_refs(node: Any, parts: tuple = ()) -> list[tuple[str, int]]:
    """(name, tensor id) of every path to a tensor reference (section 14.1)."""
    if isinstance(node, TensorRef):
        return [("/".join(parts), node.tensor_id)]
    if isinstance(node, Map):
        return [r for key, v in node for r in path_refs(v, parts + (str(key).replace("~", "~0").replace("/", "~1"),))]
    if isinstance(node, list):
        return [r for i, v in enumerate(node) for r in path_refs(v, parts + (str(i),))]
    return []


def path_keys(node: Any, parts: tuple = ()) -> list[str]:
    """Section 14.1: every path to a tensor reference, keys as Python's str(), ~ -> ~0, / -> ~1, joined by /."""
    if isinstance(node, TensorRef):
        return ["/".join(parts)]
    if isinstance(node, Map):
        return [k for key, v in node for k in path_keys(v, parts + (str(key).replace("~", "~0").replace("/", "~1"),))]
    if isinstance(node, list):
        return [k for i, v in enumerate(node) for k in path_keys(v, parts + (str(i),))]
    return []


def describe(reader: RandomAccessReader | StreamingReader) -> dict:
    index = reader.index
    names = [e.name for e in index.tensors]
    tensors = {}
    for e in index.tensors:
        item: dict[str, Any] = {"dtype": e.dtype, "shape": list(e.shape), "internal": e.internal}
        try:
            data = reader.materializer.raw(e)
            item.update(nbytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        except NvError as exc:
            item.update(error=exc.kind, message=str(exc))
        tensors[e.name] = item
    keys = list(dict.fromkeys(path_keys(index.tree)))  # 14.1: each name once, at its first path
    return {"status": "ok", "version": list(index.version), "tensors": tensors, "keys": keys,
            "tree": node_json(index.tree, names), "metadata": node_json(index.metadata, names)}


def decode_file(path: str, streaming: bool = False) -> dict:
    try:
        if path == "-":
            f = sys.stdin.buffer
            if not streaming:
                f = io.BytesIO(f.read())
        else:
            f = open(path, "rb")
        with f:
            if streaming:
                reader = StreamingReader(f)
            else:
                f.seek(0, 2)
                reader = RandomAccessReader(f, f.tell())
            return describe(reader)
    except NvError as exc:
        return {"status": "error", "error": exc.kind, "message": str(exc)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    streaming = "--streaming" in argv
    if streaming:
        argv.remove("--streaming")
    if len(argv) < 2 or argv[0] != "decode":
        print("usage: reference_reader.py [--streaming] decode FILE... | -", file=sys.stderr)
        return 2
    status = 0
    for path in argv[1:]:  # one JSON document per file, one per line
        result = decode_file(path, streaming)
        print(json.dumps(result, ensure_ascii=True, sort_keys=True), flush=True)
        status = status or (0 if result["status"] == "ok" else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
