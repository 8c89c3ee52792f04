#!/usr/bin/env python3
"""Fuzz nvckpt's reader: structure-aware and blind mutations of valid files.

Property (SPEC.md section 20): every input either loads (open, every key,
every row slice, load()) or raises an ``NvckptError``; never another
exception, a crash, a hang, or memory far above what the file declares.

Mutations come in two kinds.  Structure-aware ones take a valid file apart
(conformance/craft.py), change one field (a frame header field, a value
anywhere in the msgpack index or tree, a preamble or footer field, a chunk's
stored bytes, the order of frames) and put it back together with every
checksum recomputed, so the input gets past the checksums to the parsers and
decoders behind them.  Blind ones flip bits, truncate, splice and insert
random bytes without fixing anything.

Targets (--targets):
  reader   (default) the reading API above, and every Nth input nvckpt recover.
  all      every reading path and the CLI tools, one per input (picked by the
           input's CRC-32, so an input always runs the same one): the API,
           load(untrusted=True), `nvckpt info | ls | verify | recover` and
           `convert` of the input (as an nvckpt, safetensors or torch.save file,
           by its content), and `info | ls | verify | merge` of a DCP directory
           whose rank file, manifest or .metadata is the input.  The CLI's
           property: an exit code of its table and no exception, whatever the
           input.

Engines:
  loop     (default) a pool of worker processes running random mutations; the
           parent restarts a worker that crashes or hangs and keeps the input.
  atheris  coverage-guided (libFuzzer through atheris, if installed) with the
           same mutations as a custom mutator; one process.  tests/test_fuzz.py
           runs it for a fixed time over --targets all in CI.

    python3 tools/fuzz.py --inputs 1000000 --workers 2 --out /tmp/fuzz-findings
    python3 tools/fuzz.py --engine atheris --targets all -- -max_total_time=3600
    python3 tools/fuzz.py --replay /tmp/fuzz-findings/crash-*.nvckpt [--targets all]

Findings (inputs that broke the property) are written to --out with the
traceback next to them; the last line of the log gives counts and the rate.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import io
import json
import multiprocessing as mp
import os
import random
import resource
import signal
import struct
import sys
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import msgpack  # noqa: E402

from conformance import craft  # noqa: E402

INTERESTING = [0, 1, 2, 3, 4, 7, 8, 15, 16, 24, 48, 63, 64, 65, 127, 128, 255, 256, 4095, 4096, 65535, 65536,
               (1 << 20), (1 << 20) + 1, (1 << 24), (1 << 24) + 1, (1 << 30), (1 << 30) + 1,
               (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 53) + 1, (1 << 62), (1 << 63) - 1,
               1 << 63, (1 << 64) - 1, -1, -2, -(1 << 31), -(1 << 63)]

MAX_INPUT = 2 << 20  # bytes: larger mutants are dropped

HEADER_FIELDS = ("frame_type", "flags", "codec_id", "tensor_id", "chunk_index", "padding_length",
                 "stored_length", "raw_length", "payload_checksum", "header_checksum", "magic")
HEADER_LIMITS = {"frame_type": 0xFF, "flags": 0xFF, "codec_id": 0xFFFF, "tensor_id": 0xFFFFFFFF,
                 "chunk_index": 0xFFFFFFFF, "padding_length": 0xFFFFFFFF, "header_checksum": 0xFFFFFFFF,
                 "stored_length": (1 << 64) - 1, "raw_length": (1 << 64) - 1, "payload_checksum": (1 << 64) - 1}


# --------------------------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------------------------

def make_seeds() -> list[bytes]:
    """Small valid files that between them use every structure of the format."""
    import torch

    import nvckpt
    from nvckpt.codecs import ByteShuffle, Pipeline, Zstd

    g = torch.Generator().manual_seed(7)
    seeds: list[bytes] = []

    def save(obj: Any, **kw: Any) -> bytes:
        buf = io.BytesIO()
        nvckpt.save(obj, buf, **kw)
        return buf.getvalue()

    flat = torch.randn(64, generator=g)
    w32 = torch.randn(6, 5, generator=g)
    seeds.append(save({"w": w32, "b": torch.arange(7, dtype=torch.int64), "step": 3}, chunk_size=40, alignment=64))
    seeds.append(save({"views": [flat[:10].view(2, 5), flat[20:40:2], flat[5:9]], "meta": ("x", 1.5, None)},
                      chunk_size=64, codec="zstd"))
    seeds.append(save({"master": w32, "bf": w32.to(torch.bfloat16), "tied": [w32, w32]}, derive_bf16=True,
                      chunk_size=48, codec="raw", metadata={"run": "fuzz", "n": [1, 2, {"k": None}]}))
    seeds.append(save({"e": torch.empty(0, 4), "s": torch.tensor(2.5, dtype=torch.float64),
                       "b": torch.tensor([True, False, True]), "c": torch.randn(3, dtype=torch.complex64, generator=g),
                       "h": torch.randn(9, generator=g).to(torch.float16), "u": torch.arange(5, dtype=torch.uint8),
                       1: {None: [torch.arange(3, dtype=torch.int16)]}, "ü/~": torch.ones(2, dtype=torch.int32)},
                      chunk_size=4))
    shuffle = Pipeline((ByteShuffle(4), Zstd(3)))
    seeds.append(save([torch.zeros(32, 8), torch.full((40,), 1.25)], codec=shuffle, chunk_size=256, alignment=128))
    seeds.append(save(torch.arange(300, dtype=torch.int32).reshape(30, 10), chunk_size=120, alignment=1))
    # An optional extension frame (type 200) and an optional feature bit: readers skip/ignore them.
    nv = craft.parse(seeds[0])
    nv.preamble.optional_features = 0x80000000
    nv.frames.insert(1, craft.Frame(200, b"extension payload", tensor_id=9))
    seeds.append(craft.build(nv))
    # A deep tree and a chunk coded with an unknown codec name.
    nv = craft.parse(seeds[2])
    deep: Any = msgpack.ExtType(1, struct.pack("<I", 0))
    for _ in range(40):
        deep = [deep]
    nv.index["tree"] = {"deep": deep, "t": msgpack.ExtType(2, craft.pack([1, [2, (3.5)]]))}
    nv.index["codecs"].append([{"name": "future-codec", "configuration": {"x": 1}}])
    seeds.append(craft.build(nv))
    # An index large enough to be decoded in pieces, with a chunk table long enough for the bulk (columns) path.
    seeds.append(save({"many": torch.arange(1100, dtype=torch.int64).to(torch.uint8), "w": w32}, chunk_size=1,
                      codec="raw", alignment=1))
    return seeds


def load_seed_files(folder: str) -> list[bytes]:
    manifest = os.path.join(folder, "manifest.json")
    if not os.path.exists(manifest):
        return []
    with open(manifest) as f:
        cases = json.load(f)["cases"]
    out = []
    for case in cases:
        if case["result"] == "valid" and case["bytes"] <= 65536:  # small seeds: mutations stay fast
            with open(os.path.join(folder, case["file"]), "rb") as f:
                out.append(f.read())
    return out


# --------------------------------------------------------------------------------------------
# Mutations
# --------------------------------------------------------------------------------------------

def interesting_int(rng: random.Random, old: Any = None) -> int:
    r = rng.random()
    if isinstance(old, int) and not isinstance(old, bool) and r < 0.4:
        new = rng.choice([old + 1, old - 1, old * 2, old // 2, old + rng.randint(-64, 64), old ^ (1 << rng.randrange(64)), -old])
        # msgpack holds -2**63 .. 2**64-1: a value past either end (2**64-1 doubled, -(2**64-1)) wraps to 64 bits,
        # so the mutated document can still be packed
        return new if -(1 << 63) <= new < 1 << 64 else new & ((1 << 64) - 1)
    if r < 0.85:
        return rng.choice(INTERESTING)
    return rng.getrandbits(rng.choice([8, 16, 32, 64]))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 3 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind in (2, 3):
        return interesting_int(rng)
    if kind == 4:
        return rng.choice([0.0, -0.0, 1.5, float("inf"), float("nan"), 1e308])
    if kind == 5:
        return rng.choice(["", "a", "nvckpt", "float32", "bfloat16", "bf16_rne", "zstd", "raw", "byteshuffle",
                           "nvcomp-ans", "chunks", "view", "derived", "x" * 5000, "\udcff"[:0] + "é/~", "@base"])
    if kind == 6:
        return rng.randbytes(rng.randrange(8))
    if kind == 7:
        return msgpack.ExtType(rng.choice([0, 1, 2, 3, 127]), rng.randbytes(rng.choice([0, 1, 4, 5])))
    if kind in (8, 9):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["name", "dtype", "shape", "chunks", "view", "derived", "base", "offset", "stride",
                        "source", "function", "checksum", "internal", "k"]): random_value(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def _nodes(obj: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every node of a decoded msgpack value."""
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _nodes(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _nodes(v, path + (i,))
    return out


def _get(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def mutate_value(root: Any, rng: random.Random) -> Any:
    """Change one node of a decoded msgpack document (returns the new root)."""
    path = rng.choice(_nodes(root))
    if not path:
        return random_value(rng) if rng.random() < 0.1 else root
    parent, key = _get(root, path[:-1]), path[-1]
    old = parent[key]
    op = rng.randrange(10)
    if op == 0 and isinstance(parent, dict):
        del parent[key]
    elif op == 1 and isinstance(parent, list):
        parent.insert(rng.randrange(len(parent) + 1), rng.choice(parent) if rng.random() < 0.7 else random_value(rng))
    elif op == 2 and isinstance(parent, list):
        del parent[key]
    elif op == 3 and isinstance(parent, dict):
        parent[rng.choice(["name", "dtype", "shape", "chunks", "view", "derived", "internal", "checksum", "extra"])] = random_value(rng)
    elif op == 4 and isinstance(old, list) and old:
        rng.shuffle(old)
    elif isinstance(old, int) and not isinstance(old, bool) and op < 9:
        parent[key] = interesting_int(rng, old)
    elif isinstance(old, str) and op < 8:
        parent[key] = rng.choice([old + old, old[:-1], "", old.upper(), old + "/x", "bfloat16", "float8_e4m3fn",
                                  "float4_e2m1fn_x2", "complex32", "bool", "uint64", "nvcomp-ans", "zstd"])
    elif isinstance(old, msgpack.ExtType) and op < 8:
        data = bytearray(old.data)
        if data and rng.random() < 0.7:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        else:
            data = bytearray(struct.pack("<I", interesting_int(rng) & 0xFFFFFFFF))
        parent[key] = msgpack.ExtType(old.code if rng.random() < 0.8 else rng.choice([0, 1, 2, 3]), bytes(data))
    else:
        parent[key] = random_value(rng)
    return root


# -- deep nests and huge counts: what random mutation never reaches -------------------------------------

DEPTHS = [63, 64, 65, 66, 127, 128, 129, 130, 136, 137, 193, 194, 200, 1023, 1024, 1025, 5000]
COUNTS = [1 << 16, (1 << 16) + 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1]
SENTINEL = "\x00nvckpt-fuzz-sentinel\x00"
PLACES = ("tree", "metadata", "writer", "unknown-key", "entry-key", "entry-shape", "view", "codec-config",
          "tensor-frame", "codec-frame")


def deep_nest(rng: random.Random, depth: int | None = None, kind: str | None = None) -> bytes:
    """msgpack bytes of containers nested ``depth`` deep: arrays, maps, tuple exts (each inside the ext data
    of the one around it), or a mix; built as bytes, since no msgpack packer nests that far."""
    depth = rng.choice(DEPTHS) if depth is None else depth
    kind = kind or rng.choice(["list", "map", "tuple", "mixed"])
    leaf = rng.choice([b"\xc0", b"\x01", b"\xd6\x01\x00\x00\x00\x00", b"\x90", b"\x80"])
    if kind == "list":
        return b"\x91" * depth + leaf
    if kind == "map":
        return b"\x81\xa1k" * depth + leaf
    node = leaf
    for i in range(min(depth, 300) if kind == "tuple" else depth):
        step = "tuple" if kind == "tuple" else rng.choice(["list", "map", "tuple"]) if i % 8 == 0 else "list"
        if step == "list":
            node = b"\x91" + node
        elif step == "map":
            node = b"\x81\xa1k" + node
        else:
            node = craft.pack(msgpack.ExtType(2, b"\x91" + node))
    return node


def huge_count(rng: random.Random) -> bytes:
    """A container or string whose header says more than the payload holds (a lying count), or a real
    container of many tiny items (what a parser's memory grows with)."""
    r = rng.random()
    if r < 0.5:
        n = rng.choice(COUNTS)
        head = rng.choice([b"\xdd", b"\xdf", b"\xdb", b"\xc6"]) if n >= 1 << 16 else b"\xdc"
        return head + (n & 0xFFFFFFFF).to_bytes(4, "big") + rng.choice([b"", b"\xc0", b"\x90" * 3])
    n = rng.choice([1000, 1 << 16, 200_000])
    item = rng.choice([b"\x90", b"\x80", b"\xc0", b"\xa2ab", b"\xcb" + bytes(8), b"\xd4\x02\x90"])
    return b"\xdd" + n.to_bytes(4, "big") + item * n


def hostile_value(rng: random.Random) -> bytes:
    return deep_nest(rng) if rng.random() < 0.6 else huge_count(rng)


def _splice(payload: bytes, raw: bytes) -> bytes:
    packed = craft.pack(SENTINEL)
    assert payload.count(packed) == 1
    return payload.replace(packed, raw)


def place_hostile(data: bytes, rng: random.Random, raw: bytes | None = None, place: str | None = None) -> bytes:
    """``data`` (a valid file) with ``raw`` msgpack bytes (a deep nest or a huge count, by default) put at
    ``place``: a value the index or a TENSOR or CODEC frame holds.  Checksums are made to match."""
    raw = hostile_value(rng) if raw is None else raw
    place = place or rng.choice(PLACES)
    nv = craft.parse(data)
    ix = nv.index
    entries = ix["tensors"]
    if place in ("tensor-frame", "codec-frame"):
        kind = craft.TENSOR if place == "tensor-frame" else craft.CODEC
        frames = [f for f in nv.frames if f.frame_type == kind]
        if frames:
            f = rng.choice(frames)
            value = craft.unpack(f.payload)
            if isinstance(value, dict):
                value[rng.choice(["shape", "name", "extra"])] = SENTINEL
            else:
                value = [{"name": "raw", "configuration": {"x": SENTINEL}}]
            f.payload = _splice(craft.pack(value), raw)
            return craft.build(nv)
        place = "unknown-key"
    if place == "tree":
        ix["tree"] = {**(ix["tree"] if isinstance(ix["tree"], dict) else {}), "fuzz:deep": SENTINEL}
    elif place == "metadata":
        ix["metadata"] = {"deep": SENTINEL}
    elif place == "writer":
        ix["writer"] = dict(ix.get("writer") or {}, extra=SENTINEL)
    elif place in ("entry-key", "entry-shape", "view") and entries:
        e = rng.choice(entries)
        if place == "view" and isinstance(e.get("view"), dict):
            e["view"]["extra"] = SENTINEL
        else:
            e["shape" if place == "entry-shape" else "extra"] = SENTINEL
    elif place == "codec-config" and ix.get("codecs"):
        ix["codecs"][0][0]["configuration"] = {"x": SENTINEL}
    else:
        ix[rng.choice(["future", "zzz"])] = SENTINEL
    nv.index_frame().payload = _splice(craft.pack(ix), raw)
    return craft.build(nv, fix_index=False)


def _flip(data: bytes, rng: random.Random, count: int = 1) -> bytes:
    b = bytearray(data)
    for _ in range(count):
        if b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def mutate_structured(data: bytes, rng: random.Random) -> bytes:
    nv = craft.parse(data)
    op = rng.randrange(12)
    fix_index = True
    if op == 0:  # one frame header field
        f = rng.choice(nv.frames)
        name = rng.choice(HEADER_FIELDS)
        if name == "magic":
            f.magic = _flip(f.magic, rng)
        else:
            if name == "padding_length" and f.padding is None:
                f.padding = bytes(f.padding_length)  # the header changes, the bytes in the file do not
            old = getattr(f, name)
            if old is None:
                old = {"stored_length": len(f.payload), "raw_length": len(f.payload)}.get(name, 0)
            setattr(f, name, interesting_int(rng, old) & HEADER_LIMITS[name])
        fix_index = rng.random() < 0.5
    elif op in (1, 2, 3):  # one value of the index (entries, chunk tables, codecs, tree, metadata)
        nv.index = mutate_value(nv.index, rng)
        nv.index_frame().payload = craft.pack(nv.index)
        fix_index = False
    elif op == 4:  # preamble
        field = rng.choice(["magic", "version_major", "version_minor", "required_features", "optional_features", "reserved"])
        if field == "magic":
            nv.preamble.magic = _flip(nv.preamble.magic, rng)
        else:
            setattr(nv.preamble, field, interesting_int(rng) & (0xFFFF if field.startswith("version") else 0xFFFFFFFF))
    elif op == 5:  # footer
        field = rng.choice(["index_offset", "index_length", "index_checksum", "reserved", "magic"])
        if field == "magic":
            nv.footer.magic = _flip(nv.footer.magic, rng)
        else:
            setattr(nv.footer, field, interesting_int(rng, getattr(nv.footer, field)) & ((1 << (32 if field == "reserved" else 64)) - 1))
        return craft.build(nv, fix_footer=False)
    elif op in (6, 7):  # a chunk's stored bytes: garbage for the decoders, checksums made to match
        chunks = [f for f in nv.frames if f.frame_type == craft.CHUNK] or nv.frames
        f = rng.choice(chunks)
        r = rng.random()
        if r < 0.5:
            f.payload = _flip(f.payload, rng, rng.randint(1, 4))
        elif r < 0.7:
            f.payload = f.payload[: rng.randrange(len(f.payload) + 1)] or b"\0"
        elif r < 0.85:
            f.payload = f.payload + rng.randbytes(rng.randint(1, 64))
        else:  # a zstd frame of someone else's bytes, or of a lying size
            import zstandard
            raw = rng.randbytes(rng.randint(1, 64)) * rng.randint(1, 4096)
            f.payload = zstandard.ZstdCompressor(level=1, write_content_size=rng.random() < 0.7).compress(raw)
    elif op == 8:  # TENSOR or CODEC frame payloads (the streaming/recovery side)
        meta = [f for f in nv.frames if f.frame_type in (craft.TENSOR, craft.CODEC)]
        if meta:
            f = rng.choice(meta)
            f.payload = craft.pack(mutate_value(craft.unpack(f.payload), rng))
    elif op == 9:  # frame order: swap, duplicate, drop
        i, j = rng.randrange(len(nv.frames)), rng.randrange(len(nv.frames))
        r = rng.random()
        if r < 0.4:
            nv.frames[i], nv.frames[j] = nv.frames[j], nv.frames[i]
        elif r < 0.7:
            nv.frames.insert(j, craft.Frame(**{k: getattr(nv.frames[i], k) for k in
                                                ("frame_type", "payload", "codec_id", "tensor_id", "chunk_index", "raw_length")}))
        elif nv.frames[i].frame_type != craft.INDEX:
            del nv.frames[i]
    elif op == 10:  # padding: size and contents
        f = rng.choice(nv.frames)
        f.padding_length = rng.choice([0, 1, 7, 4096, 1 << 20, (1 << 20) + 1])
        f.padding = None if rng.random() < 0.7 else _flip(bytes(f.padding_length), rng)
    else:  # the tree: a deep or odd structure
        node: Any = rng.choice([msgpack.ExtType(1, struct.pack("<I", 0)), 1, "x"])
        for _ in range(rng.choice([10, 62, 63, 64, 65, 200])):
            node = rng.choice([[node], {"k": node}, msgpack.ExtType(2, craft.pack([node])) if rng.random() < 0.2 else [node]])
        nv.index["tree"] = node
        nv.index_frame().payload = craft.pack(nv.index)
        fix_index = False
    return craft.build(nv, fix_index=fix_index)


def mutate_blind(data: bytes, rng: random.Random, seeds: list[bytes]) -> bytes:
    op = rng.randrange(7)
    if op == 0:
        return _flip(data, rng, rng.choice([1, 1, 2, 8, 64]))
    if op == 1:
        return data[: rng.randrange(len(data) + 1)]
    if op == 2:
        return rng.randbytes(rng.randrange(256))
    if op == 3:  # splice two files
        other = rng.choice(seeds)
        return data[: rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1):]
    if op == 4:  # overwrite a field-sized span with an interesting integer
        b = bytearray(data)
        width = rng.choice([1, 2, 4, 8])
        at = rng.randrange(max(1, len(b) - width))
        b[at:at + width] = (interesting_int(rng) & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
        return bytes(b)
    if op == 5:  # insert or delete bytes
        at = rng.randrange(len(data) + 1)
        if rng.random() < 0.5:
            return data[:at] + rng.randbytes(rng.randint(1, 64)) + data[at:]
        return data[:at] + data[at + rng.randint(1, 64):]
    return data[:24] + rng.randbytes(rng.randrange(512)) + data[-40:]


def mutate(data: bytes, rng: random.Random, seeds: list[bytes]) -> bytes:
    if rng.random() < 0.08:
        try:
            return place_hostile(data, rng)
        except Exception:
            pass  # not a well-formed file: mutate it another way
    if rng.random() < 0.7:
        try:
            return mutate_structured(data, rng)
        except Exception:
            pass  # not a well-formed file (a mutant), or a value msgpack cannot pack: mutate it blind
    return mutate_blind(data, rng, seeds)


# --------------------------------------------------------------------------------------------
# The property
# --------------------------------------------------------------------------------------------

def exercise(data: bytes, *, path: str | None = None) -> str:
    """Read everything the file offers.  Returns "ok" or the NvckptError class name; anything else raises."""
    import nvckpt

    target: Any = path if path is not None else io.BytesIO(data)
    try:
        with nvckpt.open(target, workers=1) as ck:
            for name in ck.keys():
                t = ck.get_tensor(name)
                if t.dim() > 0 and t.shape[0] > 0:
                    sl = ck.get_slice(name)
                    sl[t.shape[0] // 2 : t.shape[0]]
                    sl[0]
            ck.metadata()
            ck.load()
        return "ok"
    except nvckpt.NvckptError as exc:
        return type(exc).__name__


def exercise_recover(data: bytes, folder: str) -> str:
    """nvckpt's recovery tool on the same input, where it exists: results or an NvckptError."""
    try:
        from nvckpt.tools.recover import recover
    except ImportError:
        return "absent"
    import nvckpt

    src, dst = os.path.join(folder, "in.nvckpt-tmp"), os.path.join(folder, "out.nvckpt")
    with open(src, "wb") as f:
        f.write(data)
    try:
        recover(src, dst)
        return "ok"
    except nvckpt.NvckptError as exc:
        return type(exc).__name__
    finally:
        for p in (src, dst):
            if os.path.exists(p):
                os.unlink(p)


# -- every reading path and the CLI tools ------------------------------------------------------------

CLI_EXITS = {0, 1, 3, 4}  # ok, damage, unsupported here, I/O: never 2 (usage) for a valid command line
TARGETS = ("api", "untrusted", "cli-info", "cli-ls", "cli-verify", "cli-recover", "cli-convert-nvckpt",
           "cli-convert-safetensors", "cli-convert-torch", "dcp-rank-file", "dcp-manifest", "dcp-metadata")


def make_tool_seeds() -> list[bytes]:
    """Seeds of the other formats the tools read (convert sniffs a source's format from its content)."""
    import torch

    seeds = []
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}
    try:
        from safetensors.torch import save as st_save

        seeds.append(st_save(state, metadata={"format": "pt", "k": "v"}))
    except ImportError:
        pass
    buf = io.BytesIO()
    torch.save({"model": state, "step": 3, "cfg": {"lr": 0.1}}, buf)
    seeds.append(buf.getvalue())
    return seeds


class Tools:
    """The targets of --targets all, on files in ``folder``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self.directory = os.path.join(folder, "seed-dir")  # a valid DCP directory (one rank file)
        if not os.path.isdir(self.directory):
            import warnings

            import torch

            from nvckpt.dcp.split import write_directory

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                write_directory({"model": {"w": torch.arange(20, dtype=torch.float32).reshape(4, 5)},
                                 "opt": {"state": {0: {"m": torch.ones(3)}}, "lr": 0.5}, "step": 7},
                                self.directory, codec="portable", chunk_size=32)
        with open(os.path.join(self.directory, "nvckpt-dcp.json")) as f:
            self.manifest = json.load(f)

    @staticmethod
    def target_of(data: bytes) -> str:
        import zlib

        return TARGETS[zlib.crc32(data) % len(TARGETS)]

    def run(self, data: bytes, target: str | None = None) -> str:
        """The result of ``target`` (by default the input's own) on ``data``; raises where the property breaks."""
        target = target or self.target_of(data)
        if target == "api":
            return exercise(data)
        if target == "untrusted":
            return self._untrusted(data)
        work = os.path.join(self.folder, "work")
        if os.path.lexists(work):
            import shutil

            shutil.rmtree(work)
        os.makedirs(work)
        if target.startswith("dcp-"):
            return self._directory(data, target, work)
        src = os.path.join(work, "in.pt")  # convert sniffs the format from the content; .pt if it cannot tell
        with open(src, "wb") as f:
            f.write(data)
        command = {"cli-info": ["info", src], "cli-ls": ["ls", "--json", src], "cli-verify": ["verify", src],
                   "cli-recover": ["recover", src, os.path.join(work, "out.nvckpt")],
                   "cli-convert-nvckpt": ["convert", src, os.path.join(work, "out.nvckpt"), "--codec", "portable"],
                   "cli-convert-safetensors": ["convert", src, os.path.join(work, "out.safetensors"), "--keep-tree"],
                   "cli-convert-torch": ["convert", src, os.path.join(work, "out.pt")]}[target]
        return self.cli(command)

    def _untrusted(self, data: bytes) -> str:
        import nvckpt

        try:
            with nvckpt.open(io.BytesIO(data), workers=1, untrusted=True) as ck:
                ck.load()
            return "ok"
        except nvckpt.NvckptError as exc:
            return type(exc).__name__

    def _directory(self, data: bytes, target: str, work: str) -> str:
        import shutil

        directory = os.path.join(work, "dir")
        shutil.copytree(self.directory, directory)
        if target == "dcp-rank-file":
            part, content = "__0.nvckpt", data
        elif target == "dcp-metadata":
            part, content = ".metadata", data
        else:  # one value of the manifest changed, picked by a generator seeded with the input
            doc = mutate_value(json.loads(json.dumps(self.manifest)), random.Random(data))
            part, content = "nvckpt-dcp.json", json.dumps(doc, default=repr).encode()
        with open(os.path.join(directory, part), "wb") as f:
            f.write(content)
        results = [self.cli([tool, directory]) for tool in ("verify", "info", "ls")]
        results.append(self.cli(["merge", directory, os.path.join(work, "merged.nvckpt")]))
        return "/".join(results)

    @staticmethod
    def cli(argv: list[str]) -> str:
        """``nvckpt ARGV`` in this process: its exit code must be one of its table's, its stderr free of tracebacks."""
        import contextlib

        from nvckpt import cli

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
        text = err.getvalue()
        if code not in CLI_EXITS or "Traceback" in text:
            raise AssertionError(f"nvckpt {' '.join(argv[:1])} exited {code}: {text[-2000:]}")
        return f"exit {code}"


def instrument_nvckpt() -> None:
    """Import nvckpt's modules under atheris's instrumentation (coverage of nvckpt's own code only): they are
    imported on first use otherwise, after the instrumentation is over."""
    import atheris

    modules = ["nvckpt", "nvckpt.api", "nvckpt.cli", "nvckpt.format.bulk", "nvckpt.format.frames",
               "nvckpt.format.index", "nvckpt.format.entry", "nvckpt.format.tree", "nvckpt.format.structs",
               "nvckpt.codecs", "nvckpt.codecs.registry", "nvckpt.codecs.builtin", "nvckpt.codecs.planes",
               "nvckpt.read.reader", "nvckpt.session.load", "nvckpt.session.slicing", "nvckpt.io.source",
               "nvckpt.tools.info", "nvckpt.tools.verify", "nvckpt.tools.recover", "nvckpt.tools.convert",
               "nvckpt.tools.dcpdir", "nvckpt.tools._util", "nvckpt.sharded.layout", "nvckpt.sharded.assemble"]
    with atheris.instrument_imports(include=["nvckpt"]):
        for name in modules:
            importlib.import_module(name)


# --------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------

class Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def _limit_memory(extra_bytes: int) -> None:
    """Address space = what the process has now (torch maps a lot) + ``extra_bytes``."""
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra_bytes, resource.RLIM_INFINITY))


_SAVED: dict[str, int] = {}


def signature(exc: BaseException) -> str:
    """Exception type and the innermost nvckpt function: one bug, one signature."""
    tb = traceback.extract_tb(exc.__traceback__)
    inner = [f for f in tb if "nvckpt" in f.filename] or tb
    where = f"{os.path.basename(inner[-1].filename)}:{inner[-1].name}" if inner else "?"
    return f"{type(exc).__name__}@{where}"


def _save_finding(out: str, kind: str, data: bytes, text: str, sig: str = "") -> str | None:
    """Keep the input (at most 3 per signature, so one bug does not fill the disk)."""
    import hashlib
    key = f"{kind}:{sig}"
    _SAVED[key] = _SAVED.get(key, 0) + 1
    if sig and _SAVED[key] > 3:
        return None
    os.makedirs(out, exist_ok=True)
    name = os.path.join(out, f"{kind}-{hashlib.sha256(data).hexdigest()[:16]}")
    with open(name + ".nvckpt", "wb") as f:
        f.write(data)
    with open(name + ".txt", "w") as f:
        f.write(text)
    return name


def worker(wid: int, seed: int, count: int, seeds: list[bytes], out: str, progress: Any, scratch: str,
           timeout: int, mem_extra: int, recover_every: int, targets: str = "reader") -> None:
    import torch
    torch.set_num_threads(1)
    tools = Tools(os.path.join(scratch, f"tools-{wid}")) if targets == "all" else None
    importlib.import_module("nvckpt")  # import before limiting memory
    try:
        importlib.import_module("nvckpt.tools.recover")
    except ImportError:
        pass
    _limit_memory(mem_extra)
    signal.signal(signal.SIGALRM, _alarm)
    rng = random.Random(seed)
    current = os.path.join(scratch, f"current-{wid}.nvckpt")
    folder = os.path.join(scratch, f"w{wid}")
    os.makedirs(folder, exist_ok=True)
    pool = list(seeds)
    outcomes: dict[str, int] = {}
    done = 0
    parent = os.getppid()
    while done < count:
        if done % 100 == 0 and os.getppid() != parent:
            return  # the parent is gone: stop, do not run orphaned
        data = rng.choice(pool)
        try:
            for _ in range(rng.choice([1, 1, 1, 2, 3])):
                data = mutate(data, rng, seeds)
        except MemoryError:  # the mutator itself (a huge splice): not a finding about nvckpt
            continue
        if len(data) > MAX_INPUT:  # mutants of mutants can grow (padding, splices): start again from a seed
            continue
        with open(current, "wb") as f:  # survives a hard crash of this process
            f.write(data)
        signal.alarm(timeout)
        try:
            use_path = rng.random() < 0.1
            if tools is not None:
                result = tools.run(data)
            elif use_path:
                result = exercise(data, path=current)
            else:
                result = exercise(data)
            if tools is None and recover_every and done % recover_every == 0:
                exercise_recover(data, folder)
        except Hang:
            result = "HANG"
            _save_finding(out, "hang", data, f"took more than {timeout} s\n")
        except MemoryError:
            result = "MEMORY"
            _save_finding(out, "memory", data, traceback.format_exc())
        except Exception as exc:  # the property is broken: keep the input
            result = "BUG:" + signature(exc)
            _save_finding(out, "crash", data, traceback.format_exc(), result)
        finally:
            signal.alarm(0)
        outcomes[result] = outcomes.get(result, 0) + 1
        # Keep a few inputs that still load: mutants of mutants reach deeper.
        if result == "ok" and len(pool) < 4 * len(seeds) and rng.random() < 0.05:
            pool.append(data)
        done += 1
        if done % 200 == 0 or done == count:
            progress.put((wid, 200 if done % 200 == 0 else done % 200, dict(outcomes)))
            outcomes.clear()
    progress.put((wid, 0, None))


def run_loop(args: argparse.Namespace, seeds: list[bytes]) -> int:
    ctx = mp.get_context("fork")
    progress = ctx.Queue()
    scratch = args.scratch
    os.makedirs(scratch, exist_ok=True)
    per = -(-args.inputs // args.workers)
    base_seed = args.seed
    procs: dict[int, Any] = {}
    remaining = {w: per for w in range(args.workers)}
    restarts = 0

    def start(wid: int) -> None:
        nonlocal base_seed
        base_seed += 1
        p = ctx.Process(target=worker, args=(wid, base_seed * 1000 + wid, remaining[wid], seeds, args.out, progress,
                                             scratch, args.timeout, args.mem_mb << 20, args.recover_every,
                                             args.targets), daemon=True)
        p.start()
        procs[wid] = p

    for w in range(args.workers):
        start(w)
    total, totals, finished = 0, {}, set()
    t0 = last_log = time.time()
    last_seen = {w: time.time() for w in procs}

    def receive(timeout: float) -> bool:
        nonlocal total
        try:
            wid, n, outcomes = progress.get(timeout=timeout)
        except Exception:  # queue.Empty
            return False
        last_seen[wid] = time.time()
        if outcomes is None:
            finished.add(wid)
        else:
            total += n
            remaining[wid] -= n
            for k, v in outcomes.items():
                totals[k] = totals.get(k, 0) + v
        return True

    def log() -> None:
        now = time.time()
        bugs = {k: v for k, v in totals.items() if k.startswith(("BUG", "HANG", "MEMORY", "PROCESS"))}
        print(json.dumps({"inputs": total, "seconds": round(now - t0, 1), "rate_per_s": round(total / max(now - t0, 1e-9), 1),
                          "outcomes": dict(sorted(totals.items())), "findings": bugs, "restarts": restarts}), flush=True)

    while len(finished) < args.workers:
        receive(5)
        for wid, p in list(procs.items()):
            if wid in finished or p.is_alive():
                if wid not in finished and time.time() - last_seen[wid] > args.timeout * 30:
                    p.kill()  # a hang the alarm could not break
                    p.join()
                else:
                    continue
            if p.exitcode == 0:
                while wid not in finished and receive(1):
                    pass  # its last reports are still in the queue
                if wid in finished:
                    continue
            # A crash (signal, exit code) or a hang: keep its last input and start it again.
            cur = os.path.join(scratch, f"current-{wid}.nvckpt")
            data = open(cur, "rb").read() if os.path.exists(cur) else b""
            _save_finding(args.out, "process", data, f"worker exit code {p.exitcode}\n")
            totals["PROCESS"] = totals.get("PROCESS", 0) + 1
            restarts += 1
            last_seen[wid] = time.time()
            start(wid)
        if time.time() - last_log > args.log_every:
            last_log = time.time()
            log()
    for p in procs.values():
        p.join()
    log()
    bugs = sum(v for k, v in totals.items() if k.startswith(("BUG", "HANG", "MEMORY", "PROCESS")))
    return 1 if bugs else 0


def run_atheris(args: argparse.Namespace, seeds: list[bytes], libfuzzer_args: list[str]) -> int:
    import atheris

    tools = Tools(os.path.join(args.scratch, "tools")) if args.targets == "all" else None

    def one_input(data: bytes) -> None:
        try:
            if tools is not None:
                tools.run(data)
            else:
                exercise(data)
        except Exception as exc:
            # The input and its traceback, as the loop engine keeps them (libFuzzer's own crash artifact needs
            # sanitizer hooks that a pure-Python target lacks), then the finding ends the run.
            target = f" (target {tools.target_of(data)})" if tools is not None else ""
            name = _save_finding(args.out, "crash", data, traceback.format_exc() + target, signature(exc))
            print(f"finding: {name}.nvckpt{target}", file=sys.stderr, flush=True)
            raise

    def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if not data or rng.random() < 0.02:
            data = rng.choice(seeds)
        out = mutate(data, rng, seeds)
        return out[:max_size] if len(out) > max_size else out

    corpus = os.path.join(args.scratch, "atheris-corpus")
    os.makedirs(corpus, exist_ok=True)
    for i, s in enumerate(seeds):
        with open(os.path.join(corpus, f"seed-{i}.nvckpt"), "wb") as f:
            f.write(s)
    argv = [sys.argv[0], corpus, f"-artifact_prefix={args.out.rstrip('/')}/", f"-timeout={args.timeout}",
            f"-rss_limit_mb={args.mem_mb + 1500}", "-max_len=65536", "-print_final_stats=1"] + libfuzzer_args
    os.makedirs(args.out, exist_ok=True)
    atheris.Setup(argv, one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()
    return 0


def replay(paths: list[str], targets: str = "reader", scratch: str = "/tmp/nvckpt-fuzz") -> int:
    tools = Tools(os.path.join(scratch, "tools")) if targets == "all" else None
    bad = 0
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        try:
            print(p, exercise(data) if tools is None else f"{tools.target_of(data)}: {tools.run(data)}")
        except Exception:
            bad += 1
            print(p, "BROKE THE PROPERTY:")
            traceback.print_exc()
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("loop", "atheris"), default="loop")
    ap.add_argument("--targets", choices=("reader", "all"), default="reader",
                    help="the reading API (and recover), or every reading path and the CLI tools")
    ap.add_argument("--inputs", type=int, default=100_000, help="inputs to run (loop engine)")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="/tmp/fuzz-findings", help="folder for inputs that break the property")
    ap.add_argument("--scratch", default="/dev/shm/nvckpt-fuzz" if os.path.isdir("/dev/shm") else "/tmp/nvckpt-fuzz")
    ap.add_argument("--timeout", type=int, default=10, help="seconds one input may take")
    ap.add_argument("--mem-mb", type=int, default=4096, help="address space a worker may add to what it has at start")
    ap.add_argument("--log-every", type=float, default=30.0)
    ap.add_argument("--recover-every", type=int, default=10, help="also run nvckpt recovery on every Nth input (0: never)")
    ap.add_argument("--conformance", default=os.path.join(ROOT, "conformance"), help="add its valid files as seeds")
    ap.add_argument("--replay", nargs="+", help="run these inputs once and report")
    args = ap.parse_args(argv)
    if args.replay:
        return replay([p for pat in args.replay for p in glob.glob(pat)], args.targets, args.scratch)
    if args.engine == "atheris":
        import torch

        torch.set_num_threads(1)
        instrument_nvckpt()
    seeds = make_seeds() + load_seed_files(args.conformance)
    if args.targets == "all":
        seeds += make_tool_seeds()
    print(json.dumps({"engine": args.engine, "targets": args.targets, "seeds": len(seeds), "workers": args.workers,
                      "inputs": args.inputs}), flush=True)
    if args.engine == "atheris":
        return run_atheris(args, seeds, extra)
    return run_loop(args, seeds)


if __name__ == "__main__":
    sys.exit(main())
