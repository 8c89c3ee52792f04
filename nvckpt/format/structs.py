"""The three fixed-size structures of SPEC.md: preamble, frame header, footer."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from ..errors import ChecksumError, FormatError, TruncatedError, UnsupportedFeatureError
from .constants import (
    FOOTER_MAGIC,
    FOOTER_SIZE,
    FRAME_CODEC,
    FRAME_HEADER_SIZE,
    FRAME_INDEX,
    FRAME_MAGIC,
    FRAME_TENSOR,
    KNOWN_REQUIRED_FEATURES,
    MAX_PADDING,
    PREAMBLE_MAGIC,
    PREAMBLE_SIZE,
    VERSION_MAJOR,
    VERSION_MINOR,
)

_PREAMBLE = struct.Struct("<8sHHIII")
_FRAME = struct.Struct("<4sBBHIIIIQQQ")
_FOOTER = struct.Struct("<QQQII8s")
assert _PREAMBLE.size == PREAMBLE_SIZE and _FRAME.size == FRAME_HEADER_SIZE and _FOOTER.size == FOOTER_SIZE


def xxh3(data) -> int:
    """XXH3-64, seed 0: the checksum of every structure in the format."""
    return xxhash.xxh3_64_intdigest(data)


def _low32(data) -> int:
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


@dataclass(frozen=True)
class Preamble:
    version_major: int = VERSION_MAJOR
    version_minor: int = VERSION_MINOR
    required_features: int = 0
    optional_features: int = 0

    def pack(self) -> bytes:
        return _PREAMBLE.pack(
            PREAMBLE_MAGIC, self.version_major, self.version_minor,
            self.required_features, self.optional_features, 0,
        )

    @classmethod
    def unpack(cls, data: bytes) -> "Preamble":
        if len(data) < PREAMBLE_SIZE:  # SPEC 3: a cut-off nvckpt file only if what there is starts the magic
            if not PREAMBLE_MAGIC.startswith(bytes(data[:len(PREAMBLE_MAGIC)])):
                raise FormatError(f"not an nvckpt file (a {len(data)}-byte file whose bytes are not the start of "
                                  f"the magic {PREAMBLE_MAGIC.hex()})", offset=0)
            raise TruncatedError(f"file is {len(data)} bytes, shorter than the {PREAMBLE_SIZE}-byte preamble", offset=0)
        magic, major, minor, required, optional, reserved = _PREAMBLE.unpack_from(data)
        if magic != PREAMBLE_MAGIC:
            raise FormatError(f"not an nvckpt file (magic {magic.hex()} != {PREAMBLE_MAGIC.hex()})", offset=0)
        if major != VERSION_MAJOR:
            raise UnsupportedFeatureError(
                f"format version {major}.{minor} is not supported (this reader reads {VERSION_MAJOR}.x)", offset=8
            )
        unknown = required & ~KNOWN_REQUIRED_FEATURES
        if unknown:
            bits = [b for b in range(32) if unknown >> b & 1]  # SPEC 3: name the bit numbers
            raise UnsupportedFeatureError(
                f"file requires unknown features: required_features bit{'s' if len(bits) > 1 else ''} "
                f"{', '.join(map(str, bits))} (0x{required:08x}; this reader implements bit "
                f"{', '.join(str(b) for b in range(32) if KNOWN_REQUIRED_FEATURES >> b & 1)})", offset=12
            )
        if reserved != 0:
            raise FormatError(f"preamble reserved field is 0x{reserved:08x}, must be 0", offset=20)
        return cls(major, minor, required, optional)


_UNUSED_FIELDS = {
    FRAME_CODEC: ("tensor_id", "chunk_index"),
    FRAME_TENSOR: ("codec_id", "chunk_index"),
    FRAME_INDEX: ("codec_id", "tensor_id", "chunk_index"),
}


def pack_frame_header(frame_type: int, stored_length: int, raw_length: int, payload_checksum: int, codec_id: int = 0,
                      tensor_id: int = 0, chunk_index: int = 0, padding_length: int = 0, flags: int = 0) -> bytes:
    """The 48 bytes of a frame header (SPEC 4.1), its header checksum computed: ``FrameHeader(...).pack()``
    without making the object (a writer packs two headers per small tensor, thousands per save)."""
    fields = [FRAME_MAGIC, frame_type, flags, codec_id, tensor_id, chunk_index, padding_length, 0,
              stored_length, raw_length, payload_checksum]
    fields[7] = _low32(_FRAME.pack(*fields))
    return _FRAME.pack(*fields)


@dataclass(frozen=True)
class FrameHeader:
    frame_type: int
    stored_length: int
    raw_length: int
    payload_checksum: int
    codec_id: int = 0
    tensor_id: int = 0
    chunk_index: int = 0
    padding_length: int = 0
    flags: int = 0

    def pack(self) -> bytes:
        return pack_frame_header(self.frame_type, self.stored_length, self.raw_length, self.payload_checksum,
                                 self.codec_id, self.tensor_id, self.chunk_index, self.padding_length, self.flags)

    @property
    def payload_skip(self) -> int:
        """Bytes from the start of the frame to the start of its payload."""
        return FRAME_HEADER_SIZE + self.padding_length

    @classmethod
    def unpack(cls, data: bytes, offset: int = 0) -> "FrameHeader":
        """Parse and check one frame header; ``offset`` is only for messages."""
        if len(data) < FRAME_HEADER_SIZE:
            raise TruncatedError(f"frame header cut short ({len(data)} of {FRAME_HEADER_SIZE} bytes)", offset=offset)
        (magic, ftype, flags, codec_id, tensor_id, chunk_index, padding, hcheck,
         stored, raw, pcheck) = _FRAME.unpack_from(data)
        if magic != FRAME_MAGIC:
            raise FormatError(f"bad frame magic {magic.hex()} (expected {FRAME_MAGIC.hex()})", offset=offset)
        header = cls(ftype, stored, raw, pcheck, codec_id, tensor_id, chunk_index, padding, flags)
        expected = _low32(b"".join((bytes(data[:20]), bytes(4), bytes(data[24:FRAME_HEADER_SIZE]))))  # SPEC 4.1
        if hcheck != expected:
            raise ChecksumError(
                f"frame header checksum 0x{hcheck:08x} != computed 0x{expected:08x}", offset=offset
            )
        if flags != 0:
            raise FormatError(f"frame flags 0x{flags:02x} are reserved and must be 0", offset=offset + 5)
        if padding > MAX_PADDING:
            raise FormatError(f"frame padding {padding} exceeds the limit {MAX_PADDING}", offset=offset + 16)
        # SPEC 4.1/4.2: a CODEC, TENSOR or INDEX frame is not coded, and the ids it does not use are 0.
        unused = _UNUSED_FIELDS.get(ftype)
        if unused is not None and (raw != stored or any(getattr(header, f) for f in unused)):
            raise FormatError(f"frame of type {ftype}: raw_length must equal stored_length and "
                              f"{', '.join(unused)} must be 0", offset=offset)
        return header


@dataclass(frozen=True)
class Footer:
    index_offset: int
    index_length: int
    index_checksum: int

    def pack(self) -> bytes:
        head = struct.pack("<QQQI", self.index_offset, self.index_length, self.index_checksum, 0)
        return head + struct.pack("<I8s", _low32(head), FOOTER_MAGIC)

    @classmethod
    def unpack(cls, data: bytes, offset: int = 0) -> "Footer":
        if len(data) != FOOTER_SIZE:
            raise TruncatedError(f"footer is {len(data)} bytes, expected {FOOTER_SIZE}", offset=offset)
        index_offset, index_length, index_checksum, reserved, fcheck, magic = _FOOTER.unpack(data)
        if magic != FOOTER_MAGIC:
            raise TruncatedError(
                f"no footer at the end of the file (end magic {magic.hex()} != {FOOTER_MAGIC.hex()}); "
                "the file may be truncated: try `nvckpt recover`",
                offset=offset + 32,
            )
        expected = _low32(data[:28])
        if fcheck != expected:
            raise ChecksumError(f"footer checksum 0x{fcheck:08x} != computed 0x{expected:08x}", offset=offset + 28)
        if reserved != 0:
            raise FormatError(f"footer reserved field is 0x{reserved:08x}, must be 0", offset=offset + 24)
        return cls(index_offset, index_length, index_checksum)
