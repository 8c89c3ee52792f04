"""Take an nvckpt file apart into its structures and put it back together.

The conformance generator and the fuzzers use this to make files with exactly
one thing wrong: parse a valid file, change one field, rebuild, and every
checksum that should stay valid is recomputed (frame headers, payloads, the
index, the footer), and the index's chunk offsets follow frames that moved.
Each fix-up can be switched off to leave a checksum or offset deliberately
stale.

Written from SPEC.md, independent of the nvckpt package (it must be able to
build files nvckpt would refuse to write).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import xxhash

PREAMBLE_MAGIC = b"\x89NVCKPT\n"
FRAME_MAGIC = b"NVCF"
FOOTER_MAGIC = b"NVCKEND\n"
PREAMBLE = struct.Struct("<8sHHIII")
FRAME = struct.Struct("<4sBBHIIIIQQQ")
FOOTER = struct.Struct("<QQQII8s")
CODEC, TENSOR, CHUNK, INDEX = 1, 2, 3, 4
MAX_PADDING = 1 << 20


def xxh3(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def low32(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


@dataclass
class Preamble:
    magic: bytes = PREAMBLE_MAGIC
    version_major: int = 1
    version_minor: int = 0
    required_features: int = 0
    optional_features: int = 0
    reserved: int = 0

    def pack(self) -> bytes:
        return PREAMBLE.pack(self.magic, self.version_major, self.version_minor,
                             self.required_features, self.optional_features, self.reserved)


@dataclass
class Frame:
    frame_type: int
    payload: bytes
    codec_id: int = 0
    tensor_id: int = 0
    chunk_index: int = 0
    padding_length: int = 0
    flags: int = 0
    magic: bytes = FRAME_MAGIC
    # None: computed when the file is rebuilt; an int: written as given.
    header_checksum: int | None = None
    stored_length: int | None = None
    raw_length: int | None = None
    payload_checksum: int | None = None
    padding: bytes | None = None  # None: zeros of padding_length
    offset: int = -1  # where it was (parse) or went (build)

    def header(self) -> bytes:
        stored = len(self.payload) if self.stored_length is None else self.stored_length
        raw = (self.raw_length if self.raw_length is not None else stored)
        pcheck = xxh3(self.payload) if self.payload_checksum is None else self.payload_checksum

        def pack(hcheck: int) -> bytes:
            return FRAME.pack(self.magic, self.frame_type, self.flags, self.codec_id, self.tensor_id,
                              self.chunk_index, self.padding_length, hcheck, stored, raw, pcheck)

        return pack(low32(pack(0)) if self.header_checksum is None else self.header_checksum)

    def refreshed(self) -> "Frame":
        """A copy whose header fields that describe the payload are recomputed."""
        raw = self.raw_length if self.frame_type == CHUNK else None
        return replace(self, header_checksum=None, stored_length=None, payload_checksum=None, raw_length=raw)


@dataclass
class Footer:
    index_offset: int = 0
    index_length: int = 0
    index_checksum: int = 0
    reserved: int = 0
    footer_checksum: int | None = None
    magic: bytes = FOOTER_MAGIC

    def pack(self) -> bytes:
        head = struct.pack("<QQQI", self.index_offset, self.index_length, self.index_checksum, self.reserved)
        check = low32(head) if self.footer_checksum is None else self.footer_checksum
        return head + struct.pack("<I8s", check, self.magic)


@dataclass
class NvFile:
    preamble: Preamble
    frames: list[Frame]
    footer: Footer
    index: dict[str, Any] = field(default_factory=dict)  # decoded INDEX payload (ext types kept as ExtType)

    # -- lookups -----------------------------------------------------------
    def index_frame(self) -> Frame:
        """The frame that carries the index: the last INDEX frame (else the last frame, when its type was changed)."""
        return next((f for f in reversed(self.frames) if f.frame_type == INDEX), self.frames[-1])

    def chunk_frame(self, tensor_id: int, chunk_index: int) -> Frame:
        return next(f for f in self.frames
                    if f.frame_type == CHUNK and f.tensor_id == tensor_id and f.chunk_index == chunk_index)

    def tensor_frame(self, tensor_id: int) -> Frame:
        return next(f for f in self.frames if f.frame_type == TENSOR and f.tensor_id == tensor_id)

    def tensor_id(self, name: str) -> int:
        return next(i for i, e in enumerate(self.index["tensors"]) if e["name"] == name)


class ArrayKey(tuple):
    """An array that is a map key (valid msgpack, SPEC 1): hashable, packs as an array, and never equal to an ext
    key (an ExtType is a tuple too) or to a map key."""

    def __eq__(self, other: object) -> bool:
        return type(other) is ArrayKey and tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((ArrayKey, tuple(self)))


class KeyMap:
    """A map that is a map key (valid msgpack, SPEC 1): its (key, value) pairs in stored order, hashable; packs
    as a map (not a tuple subclass: msgpack would pack that as an array)."""

    __slots__ = ("pairs",)

    def __init__(self, pairs) -> None:
        self.pairs = tuple(pairs)

    def __eq__(self, other: object) -> bool:
        return type(other) is KeyMap and self.pairs == other.pairs

    def __hash__(self) -> int:
        return hash((KeyMap, self.pairs))

    def __repr__(self) -> str:
        return f"KeyMap({dict(self.pairs)!r})"


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    # ExtType's constructor refuses msgpack's reserved negative types, which a file may hold (SPEC 1) and
    # which pack back as they were.
    return tuple.__new__(msgpack.ExtType, (code, data))


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return ArrayKey(map(_hashable, key))
    if isinstance(key, dict):
        return KeyMap((_hashable(k), _hashable(v)) for k, v in key.items())
    return key


def _pairs(pairs: list) -> dict:
    try:
        return dict(pairs)
    except TypeError:  # an array or a map as a key
        return {_hashable(k): v for k, v in pairs}


def _default(obj: Any) -> Any:
    if isinstance(obj, KeyMap):
        return dict(obj.pairs)
    raise TypeError(f"cannot pack {type(obj).__name__}")


def unpack(payload: bytes) -> Any:
    """msgpack as stored: ext types stay ExtType objects (negative ones too), array and map keys become
    ArrayKeys and KeyMaps, so repacking gives the same bytes (but for non-shortest encodings)."""
    return msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True, ext_hook=_ext,
                           object_pairs_hook=_pairs)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, default=_default)


def parse(data: bytes) -> NvFile:
    """Split a well-formed file into its structures (raises ValueError on a damaged one)."""
    pre = Preamble(*PREAMBLE.unpack_from(data, 0))
    frames, offset = [], PREAMBLE.size
    end = len(data) - FOOTER.size
    while offset < end:
        (magic, ftype, flags, cid, tid, cidx, pad, hcheck, stored, raw, pcheck) = FRAME.unpack_from(data, offset)
        if magic != FRAME_MAGIC:
            raise ValueError(f"no frame at {offset}")
        start = offset + FRAME.size + pad
        frame = Frame(ftype, bytes(data[start:start + stored]), cid, tid, cidx, pad, flags,
                      raw_length=raw if ftype == CHUNK else None, offset=offset)
        if data[offset + FRAME.size:start] != bytes(pad):
            frame.padding = bytes(data[offset + FRAME.size:start])
        frames.append(frame)
        offset = start + stored
    if offset != end:
        raise ValueError("frames do not end at the footer")
    index_offset, index_length, index_checksum, reserved, _, magic = FOOTER.unpack_from(data, end)
    nv = NvFile(pre, frames, Footer(index_offset, index_length, index_checksum, reserved, magic=magic))
    nv.index = unpack(nv.index_frame().payload)
    return nv


def build(nv: NvFile, *, fix_index: bool = True, fix_frames: bool = True, fix_footer: bool = True,
          alignment: int | None = None) -> bytes:
    """Serialise ``nv`` in frame order.

    fix_frames: recompute every frame header's lengths and checksums (fields set
    on a Frame explicitly still win).  fix_index: rewrite the index's chunk
    entries [offset, stored_length, raw_length, codec_id, checksum] from the
    CHUNK frames as they are laid out now, then re-pack it into the INDEX frame.
    fix_footer: point the footer at the INDEX frame, with its length and checksum.
    alignment: recompute the padding of CHUNK frames as a writer would.
    """
    # Lay out once to learn chunk offsets, then (if the index changes size) again.
    for _ in range(3):
        out = [nv.preamble.pack()]
        pos = len(out[0])
        placed: dict[tuple[int, int], tuple[int, Frame]] = {}
        for f in nv.frames:
            if alignment is not None and f.frame_type == CHUNK:
                f.padding_length = (-(pos + FRAME.size) % alignment) if len(f.payload) >= alignment > 1 else 0
                f.padding = None
            f.offset = pos
            hdr = f.header()
            # Implicit padding is zeros, but never more than one byte over the limit (a header may lie).
            pad = f.padding if f.padding is not None else bytes(min(f.padding_length, MAX_PADDING + 1))
            out += [hdr, pad, f.payload]
            if f.frame_type == CHUNK:
                placed[(f.tensor_id, f.chunk_index)] = (pos + len(hdr) + len(pad), f)
            pos += len(hdr) + len(pad) + len(f.payload)
        if not fix_index:
            break
        changed = False
        for tid, entry in enumerate(nv.index.get("tensors", [])):
            if not isinstance(entry, dict) or not isinstance(entry.get("chunks"), list):
                continue
            for i, c in enumerate(entry["chunks"]):
                if (tid, i) not in placed:
                    continue
                off, f = placed[(tid, i)]
                raw = f.raw_length if f.raw_length is not None else len(f.payload)
                new = [off, len(f.payload), raw, f.codec_id, xxh3(f.payload)]
                if c != new:
                    entry["chunks"][i] = new
                    changed = True
        payload = pack(nv.index)
        idx = nv.index_frame()
        if idx.payload != payload:
            idx.payload = payload
            changed = True
        if not changed:
            break
    if fix_footer:
        idx = nv.index_frame()
        nv.footer.index_offset = idx.offset
        nv.footer.index_length = len(idx.payload)
        nv.footer.index_checksum = xxh3(idx.payload)
    out.append(nv.footer.pack())
    return b"".join(out)


def refresh_frames(nv: NvFile) -> None:
    """Forget explicit header lengths/checksums so that build() recomputes them."""
    nv.frames = [f.refreshed() for f in nv.frames]


def tensor_payload(entry: dict[str, Any]) -> bytes:
    """TENSOR frame payload for an index entry (SPEC.md 8.3)."""
    desc = {k: v for k, v in entry.items() if k != "chunks"}
    desc["nchunks"] = len(entry.get("chunks", []))
    return pack(desc)


def sync_tensor_frames(nv: NvFile) -> None:
    """Rewrite every TENSOR frame from the index entry it describes."""
    for f in nv.frames:
        if f.frame_type == TENSOR and f.tensor_id < len(nv.index["tensors"]):
            f.payload = tensor_payload(nv.index["tensors"][f.tensor_id])


def structure_boundaries(data: bytes) -> list[tuple[int, str]]:
    """(offset, description) of every structure boundary of a valid file: truncation points."""
    nv = parse(data)
    points = [(0, "empty file"), (len(PREAMBLE_MAGIC), "inside the preamble, after the magic"),
              (PREAMBLE.size, "after the preamble")]
    names = {CODEC: "CODEC", TENSOR: "TENSOR", CHUNK: "CHUNK", INDEX: "INDEX"}
    for f in nv.frames:
        kind = names.get(f.frame_type, f"type {f.frame_type}")
        what = f"{kind} frame (tensor {f.tensor_id}, chunk {f.chunk_index})" if f.frame_type == CHUNK else f"{kind} frame"
        points.append((f.offset + 24, f"inside the header of the {what}"))
        points.append((f.offset + FRAME.size, f"after the header of the {what}"))
        if f.padding_length:
            points.append((f.offset + FRAME.size + f.padding_length // 2, f"inside the padding of the {what}"))
        if len(f.payload) > 1:
            points.append((f.offset + FRAME.size + f.padding_length + len(f.payload) // 2, f"inside the payload of the {what}"))
        points.append((f.offset + FRAME.size + f.padding_length + len(f.payload), f"after the {what}"))
    footer_at = len(data) - FOOTER.size
    points += [(footer_at + 20, "inside the footer"), (len(data) - 1, "one byte before the end")]
    seen, out = set(), []
    for off, what in points:
        if off not in seen and off < len(data):
            seen.add(off)
            out.append((off, what))
    return out


# -- whole files from scratch, and a valid file's index replaced ------------------------------------

def ref(tensor_id: int) -> msgpack.ExtType:
    """A tree's reference to tensor ``tensor_id`` (SPEC 9.1: ext type 1, u32 little-endian)."""
    return msgpack.ExtType(1, struct.pack("<I", tensor_id))


def build_file(tensors: list[dict[str, Any]], codecs: list[list[dict]], *, tree: Any = None,
               mutate: Any = None, writer: dict | None = None) -> bytes:
    """A whole file: CODEC frames, then per tensor a TENSOR frame and its CHUNK frames, INDEX, footer.

    Each tensor: {"name", "dtype", "shape", "chunks": [(stored payload, raw_length, codec_id), ...]}; the tree
    references every tensor by name unless ``tree`` is given; ``mutate(index)`` edits the index before it is
    packed."""
    frames = [Frame(CODEC, pack(codec), codec_id=cid) for cid, codec in enumerate(codecs)]
    entries = []
    for tid, t in enumerate(tensors):
        entry = {"name": t["name"], "dtype": t["dtype"], "shape": t["shape"]}
        frames.append(Frame(TENSOR, msgpack.packb({**entry, "nchunks": len(t["chunks"])}), tensor_id=tid))
        frames += [Frame(CHUNK, payload, codec_id=cid, tensor_id=tid, chunk_index=i, raw_length=raw_length)
                   for i, (payload, raw_length, cid) in enumerate(t["chunks"])]
        entries.append({**entry, "chunks": [[0, 0, 0, 0, 0]] * len(t["chunks"])})  # build() fills them in
    index = {
        "format": "nvckpt", "version": [1, 0], "writer": writer or {"name": "crafted-writer", "version": "9.9"},
        "codecs": codecs, "tensors": entries,
        "tree": {t["name"]: ref(i) for i, t in enumerate(tensors)} if tree is None else tree, "metadata": {},
    }
    nv = NvFile(Preamble(), frames + [Frame(INDEX, b"")], Footer(), index)
    build(nv)  # lays the frames out and fills in the chunk tables from them
    if mutate is not None:
        mutate(nv.index)
    nv.index_frame().payload = pack(nv.index)
    return build(nv, fix_index=False)


def with_index_payload(data: bytes, payload: bytes) -> bytes:
    """A valid file whose INDEX frame carries ``payload`` instead (frame checksums and footer made to match);
    everything before the INDEX frame is kept as it is."""
    nv = parse(data)
    nv.index_frame().payload = payload
    return build(nv, fix_index=False)


def rewrite_index(data: bytes, mutate: Any) -> bytes:
    """A valid file with its index replaced by ``mutate(index)`` (a new INDEX frame, checksums and footer)."""
    nv = parse(data)
    mutate(nv.index)
    return with_index_payload(data, pack(nv.index))
