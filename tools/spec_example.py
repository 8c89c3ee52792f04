"""Print the annotated hex dump of SPEC.md's worked example (section 21).

    python tools/spec_example.py

Saves {"w": bfloat16 [1.0, 2.0], "step": 3} with codec="raw" and no tensor
checksum to an in-memory stream (front to back, as to a pipe), then walks the
bytes with nothing but struct, xxhash and this file's small msgpack
tokenizer, checking every field and checksum against SPEC.md's tables.

The writer map records the nvckpt, torch and Python versions of the writing
process; they are pinned here so that the dump is the same on every machine and
release.
"""

from __future__ import annotations

import io
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import xxhash  # noqa: E402

import nvckpt  # noqa: E402
import nvckpt.session.save  # noqa: E402

PINNED = {"version": "0.1.0", "torch": "2.13.0", "python": "3.11.7"}
_writer_info = nvckpt.session.save.writer_info


def _pinned_writer_info(extra=None):
    info = _writer_info(extra)
    info.update({k: v for k, v in PINNED.items() if k in info})
    return info


nvckpt.session.save.writer_info = _pinned_writer_info

FRAME_TYPES = {1: "CODEC", 2: "TENSOR", 3: "CHUNK", 4: "INDEX"}
WIDTH = 8  # bytes per dump line


def xxh3(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


class Dump:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.lines: list[str] = []

    def row(self, offset: int, length: int, note: str) -> None:
        """Bytes [offset, offset+length) with a note on the first line."""
        chunk = self.data[offset : offset + length]
        for i in range(0, max(len(chunk), 1), WIDTH):
            part = chunk[i : i + WIDTH]
            text = " ".join(f"{b:02x}" for b in part)
            self.lines.append(f"{offset + i:04x}  {text:<{WIDTH * 3 - 1}}  {note if i == 0 else ''}".rstrip())

    def title(self, text: str) -> None:
        self.lines.append(f"      {text}")


# -- a tiny msgpack tokenizer, for annotation only ---------------------------
def _token(data: bytes, pos: int):
    """(kind, value, length): a scalar with its bytes, or a container header."""
    b = data[pos]
    if b <= 0x7F:
        return "int", b, 1
    if 0x80 <= b <= 0x8F:
        return "map", b & 0x0F, 1
    if 0x90 <= b <= 0x9F:
        return "array", b & 0x0F, 1
    if 0xA0 <= b <= 0xBF:
        n = b & 0x1F
        return "str", data[pos + 1 : pos + 1 + n].decode(), 1 + n
    if b == 0xC0:
        return "nil", None, 1
    if b in (0xC2, 0xC3):
        return "bool", b == 0xC3, 1
    if b in (0xCC, 0xCD, 0xCE, 0xCF):
        n = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}[b]
        return "int", int.from_bytes(data[pos + 1 : pos + 1 + n], "big"), 1 + n
    if b in (0xD0, 0xD1, 0xD2, 0xD3):
        n = {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}[b]
        return "int", int.from_bytes(data[pos + 1 : pos + 1 + n], "big", signed=True), 1 + n
    if b == 0xCB:
        return "float", struct.unpack(">d", data[pos + 1 : pos + 9])[0], 9
    if b == 0xD9:
        n = data[pos + 1]
        return "str", data[pos + 2 : pos + 2 + n].decode(), 2 + n
    if b in (0xD4, 0xD5, 0xD6, 0xD7, 0xD8):
        n = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}[b]
        return "ext", (data[pos + 1], data[pos + 2 : pos + 2 + n]), 2 + n
    if b == 0xC4:
        n = data[pos + 1]
        return "bin", data[pos + 2 : pos + 2 + n], 2 + n
    raise ValueError(f"msgpack byte 0x{b:02x} at {pos} not handled by this example tokenizer")


def _describe(kind: str, value) -> str:
    if kind == "str":
        return f'"{value}"'
    if kind == "int":
        return f"{value}" if value < 1 << 20 else f"0x{value:x}"
    if kind == "ext":
        code, payload = value
        if code == 1:
            return f"ext 1 (tensor ref): tensor id {struct.unpack('<I', payload)[0]}"
        return f"ext {code}"
    if kind in ("nil", "bool", "float"):
        return repr(value)
    return kind


def annotate_msgpack(dump: Dump, base: int, data: bytes, indent: str = "") -> None:
    """One dump row per scalar; a map key is shown with its scalar value."""
    def node(pos: int, depth: int, prefix: str) -> int:
        kind, value, length = _token(data, pos)
        pad = "  " * depth
        if kind == "map":
            dump.row(base + pos, length, f"{indent}{pad}{prefix}map, {value} entries")
            pos += length
            for _ in range(value):
                kkind, kval, klen = _token(data, pos)
                vkind, vval, vlen = _token(data, pos + klen)
                key = _describe(kkind, kval)
                if vkind in ("map", "array"):
                    dump.row(base + pos, klen, f"{indent}{pad}  key {key}")
                    pos = node(pos + klen, depth + 1, "")
                else:
                    dump.row(base + pos, klen + vlen, f"{indent}{pad}  {key}: {_describe(vkind, vval)}")
                    pos += klen + vlen
            return pos
        if kind == "array":
            dump.row(base + pos, length, f"{indent}{pad}{prefix}array, {value} items")
            pos += length
            for _ in range(value):
                pos = node(pos, depth + 1, "")
            return pos
        dump.row(base + pos, length, f"{indent}{pad}{prefix}{_describe(kind, value)}")
        return pos + length

    end = node(0, 0, "")
    assert end == len(data), "trailing bytes after the msgpack object"


# -- the file ------------------------------------------------------------------
def build() -> bytes:
    out = io.BytesIO()
    obj = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "step": 3}
    nvckpt.save(obj, out, codec="raw", tensor_checksums=False)
    return out.getvalue()


def main() -> int:
    data = build()
    d = Dump(data)
    size = len(data)

    d.title("PREAMBLE")
    magic, major, minor, req, opt, res = struct.unpack_from("<8sHHIII", data, 0)
    assert magic == b"\x89NVCKPT\n" and (major, minor, req, opt, res) == (1, 0, 0, 0, 0)
    d.row(0, 8, 'magic "\\x89NVCKPT\\n"')
    d.row(8, 2, f"version_major = {major}")
    d.row(10, 2, f"version_minor = {minor}")
    d.row(12, 4, f"required_features = {req}")
    d.row(16, 4, f"optional_features = {opt}")
    d.row(20, 4, f"reserved = {res}")

    pos = 24
    footer_at = size - 40
    while pos < footer_at:
        (fmagic, ftype, flags, codec_id, tensor_id, chunk_index, padding, hcheck,
         stored, raw, pcheck) = struct.unpack_from("<4sBBHIIIIQQQ", data, pos)
        header = bytearray(data[pos : pos + 48])
        header[20:24] = b"\0\0\0\0"
        assert fmagic == b"NVCF" and flags == 0
        assert hcheck == xxh3(bytes(header)) & 0xFFFFFFFF, "header checksum"
        name = FRAME_TYPES[ftype]
        if ftype != 3:
            assert raw == stored
        d.title(f"{name} FRAME at offset {pos}")
        d.row(pos, 4, 'frame_magic "NVCF"')
        d.row(pos + 4, 1, f"frame_type = {ftype} ({name})")
        d.row(pos + 5, 1, f"flags = {flags}")
        d.row(pos + 6, 2, f"codec_id = {codec_id}")
        d.row(pos + 8, 4, f"tensor_id = {tensor_id}")
        d.row(pos + 12, 4, f"chunk_index = {chunk_index}")
        d.row(pos + 16, 4, f"padding_length = {padding}")
        d.row(pos + 20, 4, f"header_checksum = 0x{hcheck:08x} (XXH3-64 low 32 bits, field zeroed)")
        d.row(pos + 24, 8, f"stored_length = {stored}")
        d.row(pos + 32, 8, f"raw_length = {raw}")
        d.row(pos + 40, 8, f"payload_checksum = 0x{pcheck:016x}")
        if padding:
            assert data[pos + 48 : pos + 48 + padding] == bytes(padding)
            d.row(pos + 48, padding, f"padding ({padding} zero bytes)")
        start = pos + 48 + padding
        payload = data[start : start + stored]
        assert xxh3(payload) == pcheck, "payload checksum"
        d.title(f"{name} payload, offset {start}, {stored} bytes")
        if ftype == 3:
            values = torch.frombuffer(bytearray(payload), dtype=torch.bfloat16).tolist()
            d.row(start, stored, f"chunk bytes (codec raw): bfloat16 {values}")
        else:
            annotate_msgpack(d, start, payload)
        if ftype == 4:
            index_offset, index_length, index_checksum = pos, stored, pcheck
        pos = start + stored
    assert pos == footer_at, "the INDEX frame must end where the footer starts"

    d.title(f"FOOTER at offset {footer_at}")
    f_off, f_len, f_check, f_res, f_fcheck, end_magic = struct.unpack_from("<QQQII8s", data, footer_at)
    assert (f_off, f_len, f_check, f_res) == (index_offset, index_length, index_checksum, 0)
    assert f_fcheck == xxh3(data[footer_at : footer_at + 28]) & 0xFFFFFFFF and end_magic == b"NVCKEND\n"
    d.row(footer_at, 8, f"index_offset = {f_off}")
    d.row(footer_at + 8, 8, f"index_length = {f_len}")
    d.row(footer_at + 16, 8, f"index_checksum = 0x{f_check:016x}")
    d.row(footer_at + 24, 4, f"reserved = {f_res}")
    d.row(footer_at + 28, 4, f"footer_checksum = 0x{f_fcheck:08x} (XXH3-64 low 32 bits of footer bytes 0-27)")
    d.row(footer_at + 32, 8, 'end_magic "NVCKEND\\n"')
    d.title(f"end of file: {size} bytes")

    # The package reads back what it wrote.
    loaded = nvckpt.load(io.BytesIO(data))
    assert loaded["step"] == 3 and loaded["w"].tolist() == [1.0, 2.0] and loaded["w"].dtype == torch.bfloat16

    sys.stdout.write("\n".join(d.lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
