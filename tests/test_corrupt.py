"""Damaged and malicious files: each kind gives the right NvckptError subclass, never a crash, hang or huge allocation.

Files are made two ways, both from SPEC.md and independent of nvckpt's own writer (conformance/craft.py):
``rewrite_index`` replaces the index of a file nvckpt wrote (new INDEX frame, checksums, footer), and
``build_file`` writes a whole file frame by frame.
"""

from __future__ import annotations

import io
import os
import resource
import struct
import sys
import time
from typing import Any, Callable

import msgpack
import pytest
import torch
import zstandard

import nvckpt
from conftest import assert_tensor_equal, assert_tree_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from conformance import craft  # noqa: E402
from conformance.craft import PREAMBLE, build_file, ref, rewrite_index, with_index_payload  # noqa: E402

RAW = [{"name": "raw", "configuration": {}}]
ZSTD = [{"name": "zstd", "configuration": {"level": 1}}]
ANS = [{"name": "nvcomp-ans", "configuration": {"data_type": "<f4", "nvcomp_version": "6.0.0", "bitstream": "raw"}}]


def read_index(data: bytes) -> tuple[int, dict]:
    """(offset of the INDEX frame, the decoded index) of a valid file."""
    nv = craft.parse(data)
    return nv.index_frame().offset, nv.index


def entry_of(index: dict, name: str) -> dict:
    return next(e for e in index["tensors"] if e["name"] == name)


def patch(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new):]


def flip(data: bytes, offset: int) -> bytes:
    return patch(data, offset, bytes([data[offset] ^ 0x41]))


def opened(data: bytes) -> nvckpt.Checkpoint:
    return nvckpt.open(io.BytesIO(data))


# -- a valid file nvckpt wrote ---------------------------------------------------------------------

STATE = {
    "a": torch.randn(64, 16, generator=torch.Generator().manual_seed(5)),  # 4 KiB, 4 chunks of 1 KiB
    "b": torch.arange(1000, dtype=torch.int32),
    "c": torch.linspace(-1, 1, 300),
}


@pytest.fixture(scope="module")
def good() -> bytes:
    stream = io.BytesIO()
    nvckpt.save(STATE, stream, chunk_size=1024, codec="auto")
    return stream.getvalue()


def test_helpers_reproduce_nvckpt_bytes(good):
    """The independent packers agree with nvckpt byte for byte (so the crafted files below are valid SPEC.md)."""
    assert rewrite_index(good, lambda index: None) == good


def test_crafted_file_loads():
    a = torch.arange(12, dtype=torch.float32)
    raw = a.numpy().tobytes()
    data = build_file(
        [{"name": "a", "dtype": "float32", "shape": [3, 4], "chunks": [(raw[:16], 16, 0), (zstandard.compress(raw[16:]), 32, 1)]},
         {"name": "e", "dtype": "int64", "shape": [0, 5], "chunks": []}],
        [RAW, ZSTD], tree={"a": ref(0), "list": [ref(1), msgpack.ExtType(2, msgpack.packb([1, "x"]))]})
    back = nvckpt.load(io.BytesIO(data))
    assert_tree_equal(back, {"a": a.reshape(3, 4), "list": [torch.empty(0, 5, dtype=torch.int64), (1, "x")]})


# -- chunk and index checksums -------------------------------------------------------------------

def test_flipped_chunk_byte_is_checksum_error_naming_tensor_and_chunk(good):
    _, index = read_index(good)
    offset, stored = entry_of(index, "a")["chunks"][2][:2]
    bad = flip(good, offset + stored // 2)
    with opened(bad) as ck:
        assert_tensor_equal(ck.get_tensor("b"), STATE["b"])
        assert_tensor_equal(ck.get_tensor("c"), STATE["c"])
        assert_tensor_equal(ck.get_slice("a")[0:16], STATE["a"][0:16])  # chunk 0 only
        for read in (lambda: ck.get_tensor("a"), lambda: ck.get_slice("a")[40], lambda: ck.load()):
            with pytest.raises(nvckpt.ChecksumError) as info:
                read()
            assert info.value.tensor == "a" and info.value.chunk == 2
            assert "'a'" in str(info.value) and "chunk 2" in str(info.value) and f"offset {offset}" in str(info.value)


def test_every_byte_of_a_chunk_payload_is_covered(good):
    _, index = read_index(good)
    offset, stored = entry_of(index, "c")["chunks"][0][:2]
    for i in range(offset, offset + stored, max(1, stored // 40)):
        with opened(flip(good, i)) as ck:
            with pytest.raises(nvckpt.ChecksumError):
                ck.get_tensor("c")


@pytest.mark.parametrize("where", [0, 0.5, -1])
def test_flipped_index_byte_is_checksum_error(good, where):
    index_offset, _ = read_index(good)
    length = struct.unpack_from("<Q", good, len(good) - 32)[0]
    start = index_offset + 48
    at = start + int(where * length) if where >= 0 else start + length - 1
    with pytest.raises(nvckpt.ChecksumError, match="index"):
        opened(flip(good, at))


def test_tensor_checksum_mismatch(good):
    def lie(index):
        entry_of(index, "b")["checksum"] ^= 1

    with opened(rewrite_index(good, lie)) as ck:
        with pytest.raises(nvckpt.ChecksumError) as info:
            ck.get_tensor("b")
        assert info.value.tensor == "b"
        assert_tensor_equal(ck.get_slice("b")[10:20], STATE["b"][10:20])  # slices check chunk checksums only


# -- footer, index frame header, truncation ------------------------------------------------------

def footer_with(data: bytes, **fields) -> bytes:
    """The file with footer fields replaced (the footer's own checksum made to match)."""
    footer = craft.Footer(*craft.FOOTER.unpack_from(data, len(data) - craft.FOOTER.size)[:4])
    for name, value in fields.items():
        setattr(footer, name, value)
    return data[:-craft.FOOTER.size] + footer.pack()


@pytest.mark.parametrize("damage,error", [
    (lambda d: flip(d, len(d) - 1), nvckpt.TruncatedError),  # end magic
    (lambda d: flip(d, len(d) - 8), nvckpt.TruncatedError),
    (lambda d: flip(d, len(d) - 12), nvckpt.ChecksumError),  # footer checksum field
    (lambda d: flip(d, len(d) - 40), nvckpt.ChecksumError),  # index_offset, checksum not updated
    (lambda d: footer_with(d, reserved=1), nvckpt.FormatError),
    (lambda d: footer_with(d, index_length=(1 << 30) + 1), nvckpt.LimitError),
    (lambda d: footer_with(d, index_length=(1 << 64) - 1), nvckpt.LimitError),
    (lambda d: footer_with(d, index_offset=(1 << 64) - 1), nvckpt.FormatError),
    (lambda d: footer_with(d, index_offset=0), nvckpt.FormatError),
    (lambda d: footer_with(d, index_offset=24), nvckpt.FormatError),  # points at the first CODEC frame
    (lambda d: footer_with(d, index_length=5), nvckpt.FormatError),
    (lambda d: footer_with(d, index_checksum=1), nvckpt.FormatError),  # disagrees with the INDEX frame header
    (lambda d: d + b"\0" * 10, nvckpt.TruncatedError),  # bytes after the footer: no footer at the end
], ids=["end-magic", "end-magic-first", "footer-checksum", "index-offset-bit", "footer-reserved", "index-too-long",
        "index-length-u64max", "index-offset-u64max", "index-offset-0", "index-offset-codec-frame", "index-length-short",
        "index-checksum-disagrees", "trailing-bytes"])
def test_footer_damage(good, damage, error, tmp_path):
    path = tmp_path / "damaged.nvckpt"  # a file: its footer is its last 40 bytes (SPEC 5)
    path.write_bytes(damage(good))
    with pytest.raises(error) as info:
        nvckpt.open(path)
    if error is nvckpt.FormatError:
        assert type(info.value) is nvckpt.FormatError  # not a TruncatedError
    if damage(good)[: len(good)] == good:  # bytes after a whole checkpoint in a caller's stream are not its own
        with opened(damage(good)) as ck:  # (as torch.load: a stream may hold more after it)
            assert ck.keys()


def test_index_frame_header_damage(good):
    index_offset, _ = read_index(good)
    with pytest.raises(nvckpt.FormatError, match="magic"):
        opened(flip(good, index_offset))
    for field in (4, 5, 16, 24, 32):  # frame type, flags, padding, stored_length, raw_length: header checksum catches them
        with pytest.raises(nvckpt.ChecksumError):
            opened(flip(good, index_offset + field))


def test_truncated_at_every_length(good):
    step = max(1, len(good) // 400)
    cuts = sorted(set(range(0, len(good), step)) | {1, 23, 24, 25, 111, 112, len(good) - 40, len(good) - 39, len(good) - 1})
    for n in cuts:
        with pytest.raises(nvckpt.TruncatedError):
            opened(good[:n])


def test_truncated_file_on_disk_names_path(good, tmp_path):
    path = tmp_path / "cut.nvckpt"
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(nvckpt.TruncatedError) as info:
        nvckpt.load(path)
    assert str(path) in str(info.value) and "recover" in str(info.value)


# -- preamble --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,error", [
    ({"magic": b"\x89NVCKPX\n"}, nvckpt.FormatError),
    ({"magic": b"PK\x03\x04\0\0\0\0"}, nvckpt.FormatError),
    ({"major": 2}, nvckpt.UnsupportedFeatureError),
    ({"major": 0}, nvckpt.UnsupportedFeatureError),
    ({"required": 1}, nvckpt.UnsupportedFeatureError),
    ({"required": 1 << 31}, nvckpt.UnsupportedFeatureError),
    ({"reserved": 7}, nvckpt.FormatError),
    ({"minor": 9}, None),
    ({"optional": 0xFFFFFFFF}, None),
])
def test_preamble(good, fields, error):
    magic, major, minor, required, optional, reserved = PREAMBLE.unpack_from(good)
    values = {"magic": magic, "major": major, "minor": minor, "required": required, "optional": optional, "reserved": reserved}
    values.update(fields)
    base = good
    if "minor" in fields:  # the index repeats the version (its major must match, its minor may)
        base = rewrite_index(good, _set("version", [1, fields["minor"]]))
    data = PREAMBLE.pack(*values.values()) + base[24:]
    if error is None:
        assert_tree_equal(nvckpt.load(io.BytesIO(data)), STATE)  # minor versions and optional bits are ignored
        return
    with pytest.raises(error) as info:
        opened(data)
    assert type(info.value) is error
    if "major" in fields:
        assert f"{fields['major']}." in str(info.value)


# -- codecs this reader cannot decode --------------------------------------------------------------

def test_unknown_codec_in_rewritten_index(good):
    def fake_codec(index):
        index["codecs"].append([{"name": "zfancy", "configuration": {"x": 1}}])
        for chunk in entry_of(index, "b")["chunks"]:
            chunk[3] = len(index["codecs"]) - 1

    with opened(rewrite_index(good, fake_codec)) as ck:  # opening must not fail
        assert_tensor_equal(ck.get_tensor("a"), STATE["a"])
        assert_tensor_equal(ck.get_tensor("c"), STATE["c"])
        for read in (lambda: ck.get_tensor("b"), lambda: ck.get_slice("b")[3:5], lambda: ck.load()):
            with pytest.raises(nvckpt.UnsupportedCodecError) as info:
                read()
            assert "zfancy" in str(info.value) and "'b'" in str(info.value)


def test_unknown_codec_in_crafted_file_names_codec_and_writer():
    raw = torch.arange(8, dtype=torch.int16).numpy().tobytes()
    data = build_file(
        [{"name": "plain", "dtype": "int16", "shape": [8], "chunks": [(raw, 16, 0)]},
         {"name": "fancy", "dtype": "int16", "shape": [8], "chunks": [(b"\x01\x02\x03", 16, 1)]}],
        [RAW, [{"name": "lz9000", "configuration": {}}]])
    with opened(data) as ck:
        assert_tensor_equal(ck.get_tensor("plain"), torch.arange(8, dtype=torch.int16))
        with pytest.raises(nvckpt.UnsupportedCodecError) as info:
            ck.get_tensor("fancy")
    message = str(info.value)
    assert "lz9000" in message and "fancy" in message and "crafted-writer" in message, message


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, nvCOMP may decode ANS: the GPU tests cover it")
def test_ans_chunks_on_cpu(good):
    def ans(index):
        index["codecs"].append(ANS)
        for chunk in entry_of(index, "c")["chunks"]:
            chunk[3] = len(index["codecs"]) - 1

    data = rewrite_index(good, ans)
    with opened(data) as ck:
        assert_tensor_equal(ck.get_tensor("a"), STATE["a"])
        assert_tree_equal(ck.load(keys=["a", "b"]), {"a": STATE["a"], "b": STATE["b"]})
        for read in (lambda: ck.get_tensor("c"), lambda: ck.get_slice("c")[:10], lambda: ck.load()):
            with pytest.raises(nvckpt.UnsupportedCodecError) as info:
                read()
            message = str(info.value)
            assert "nvCOMP" in message and ("GPU" in message or "CUDA" in message) and "'c'" in message, message
            assert "6.0.0" in message


# -- index contents that break the rules -----------------------------------------------------------

def _set(key: str, value: Any) -> Callable[[dict], None]:
    def mutate(index: dict) -> None:
        index[key] = value
    return mutate


def _set_entry(name: str, field: str, value: Any) -> Callable[[dict], None]:
    def mutate(index: dict) -> None:
        entry_of(index, name)[field] = value
    return mutate


def _chunk(name: str, i: int, field: int, value: Callable[[dict, list], int]) -> Callable[[dict], None]:
    def mutate(index: dict) -> None:
        chunk = entry_of(index, name)["chunks"][i]
        chunk[field] = value(index, chunk)
    return mutate


def _view_of_self(index):
    entry = entry_of(index, "c")
    del entry["chunks"]
    entry["view"] = {"base": index["tensors"].index(entry), "offset": 0, "stride": [1]}


def _derived(source: str | int, function: str = "bf16_rne"):
    def mutate(index):
        entry = entry_of(index, "c")
        del entry["chunks"]
        entry["dtype"] = "bfloat16"
        sid = source if isinstance(source, int) else index["tensors"].index(entry_of(index, source))
        entry["derived"] = {"function": function, "source": sid}
    return mutate


def _deep_tree(index):
    tree: Any = ref(0)
    for _ in range(70):
        tree = [tree]
    index["tree"] = tree


INDEX_DAMAGE = {
    # chunk tables
    "overlap-exact": (_chunk("b", 0, 0, lambda ix, c: entry_of(ix, "a")["chunks"][0][0]), nvckpt.FormatError, "overlap"),
    "overlap-partial": (_chunk("a", 1, 0, lambda ix, c: entry_of(ix, "a")["chunks"][0][0] + 1), nvckpt.FormatError, "overlap"),
    "offset-in-preamble": (_chunk("a", 0, 0, lambda ix, c: 10), nvckpt.FormatError, None),
    "offset-past-index": (_chunk("c", 0, 0, lambda ix, c: 1 << 40), nvckpt.FormatError, None),
    "offset-u64-overflow": (_chunk("c", 0, 0, lambda ix, c: (1 << 64) - 1), nvckpt.FormatError, None),
    "stored-too-long": (_chunk("c", 0, 1, lambda ix, c: (16 << 20) + 1), nvckpt.FormatError, None),
    "raw-length-over-limit": (_chunk("c", 0, 2, lambda ix, c: 1 << 40), nvckpt.FormatError, None),
    "raw-lengths-dont-sum": (_chunk("c", 0, 2, lambda ix, c: c[2] - 4), nvckpt.FormatError, None),
    "raw-length-not-itemsize": (_chunk("c", 0, 2, lambda ix, c: c[2] - 1), nvckpt.FormatError, None),
    "codec-id-out-of-range": (_chunk("c", 0, 3, lambda ix, c: 99), nvckpt.FormatError, None),
    "negative-offset": (_chunk("c", 0, 0, lambda ix, c: -5), nvckpt.FormatError, None),
    "chunk-not-array": (_chunk("c", 0, 0, lambda ix, c: "x"), nvckpt.FormatError, None),
    # entries
    "duplicate-name": (_set_entry("b", "name", "a"), nvckpt.FormatError, "duplicate"),
    "unknown-dtype": (_set_entry("b", "dtype", "int3"), nvckpt.UnsupportedFeatureError, "int3"),
    "shape-mismatch": (_set_entry("b", "shape", [999]), nvckpt.FormatError, None),
    "shape-huge": (_set_entry("b", "shape", [1 << 40, 1 << 40]), nvckpt.LimitError, None),
    "rank-65": (_set_entry("b", "shape", [1] * 65), nvckpt.LimitError, None),
    "long-name": (_set_entry("b", "name", "x" * 5000), nvckpt.LimitError, None),
    "view-of-itself": (_view_of_self, nvckpt.FormatError, None),
    "derived-from-itself": (_derived(2), nvckpt.FormatError, None),
    "derived-from-nothing": (_derived(77), nvckpt.FormatError, None),
    "derived-from-int": (_derived("b"), nvckpt.FormatError, None),
    "derived-unknown-function": (_derived("a", "cube_root"), nvckpt.UnsupportedFeatureError, "cube_root"),
    # top level, tree
    "format-name": (_set("format", "safetensors"), nvckpt.FormatError, None),
    "version-2": (_set("version", [2, 0]), nvckpt.FormatError, None),
    "tensors-not-list": (_set("tensors", {"a": 1}), nvckpt.FormatError, None),
    "codec-not-list": (_set("codecs", [{"name": "raw"}]), nvckpt.FormatError, None),
    "codec-step-bad": (_set("codecs", [[{"configuration": {}}]]), nvckpt.FormatError, None),
    "ans-bad-bitstream": (_set("codecs", [[{"name": "nvcomp-ans", "configuration": {
        "data_type": "<f4", "nvcomp_version": "6.0.0", "bitstream": "framed"}}]]), nvckpt.FormatError, None),
    "byteshuffle-size-0": (_set("codecs", [[{"name": "byteshuffle", "configuration": {"elementsize": 0}}, RAW[0]]]),
                           nvckpt.FormatError, None),
    "coder-before-filter": (_set("codecs", [[RAW[0], {"name": "byteshuffle", "configuration": {"elementsize": 2}}]]),
                            nvckpt.FormatError, None),
    "tree-dangling-ref": (_set("tree", {"x": ref(99)}), nvckpt.FormatError, None),
    "tree-unknown-ext": (_set("tree", {"x": msgpack.ExtType(9, b"")}), nvckpt.FormatError, None),
    "tree-short-ref": (_set("tree", {"x": msgpack.ExtType(1, b"\0")}), nvckpt.FormatError, None),
    "tree-too-deep": (_deep_tree, nvckpt.LimitError, None),
    "metadata-int-keys": (_set("metadata", {1: 2}), nvckpt.FormatError, None),
    "empty-map": (lambda index: index.clear() or index.update({"__list__": True}), nvckpt.FormatError, None),
}


@pytest.mark.parametrize("case", list(INDEX_DAMAGE), ids=list(INDEX_DAMAGE))
def test_bad_index_contents(good, case):
    mutate, error, words = INDEX_DAMAGE[case]
    data = rewrite_index(good, mutate)
    with pytest.raises(error) as info:
        with opened(data) as ck:
            ck.load()
    if error is nvckpt.FormatError:
        assert not isinstance(info.value, nvckpt.TruncatedError)
    if words:
        assert words in str(info.value), str(info.value)


@pytest.mark.parametrize("payload", [b"", b"\x92\x01", b"\xc1", b"\xdd\xff\xff\xff\xff", b"\x81\xa1a" * 3, b"\x80\x80"],
                         ids=["empty", "array", "never-used-byte", "huge-array-header", "truncated-map", "trailing-bytes"])
def test_index_that_is_not_msgpack_or_not_a_map(good, payload):
    data = with_index_payload(good, payload)
    with pytest.raises(nvckpt.FormatError):
        opened(data)


# -- lying sizes: decompression bombs and short or long payloads -----------------------------------

def zstd_rle_frame(content_size: int | None, total: int, block: int = 128 << 10) -> bytes:
    """A Zstandard frame (RFC 8878) of RLE blocks decoding to ``total`` zero bytes, declaring ``content_size``."""
    if content_size is None:
        # no Frame_Content_Size: Single_Segment=0, window descriptor for 128 KiB (exponent 7 -> 2^(10+7))
        out = b"\x28\xb5\x2f\xfd" + bytes([0x00]) + bytes([7 << 3])
    else:
        out = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", content_size)  # FCS 8 bytes, single segment
    blocks = []
    left = total
    while left:
        n = min(block, left)
        left -= n
        header = (n << 3) | (1 << 1) | (1 if left == 0 else 0)  # Block_Type 1 = RLE
        blocks.append(struct.pack("<I", header)[:3] + b"\0")
    return out + b"".join(blocks)


def _bomb_file(payload: bytes, raw_length: int = 4096) -> bytes:
    good_raw = torch.arange(1024, dtype=torch.int32).numpy().tobytes()
    return build_file(
        [{"name": "ok", "dtype": "int32", "shape": [1024], "chunks": [(good_raw, 4096, 0)]},
         {"name": "bomb", "dtype": "uint8", "shape": [raw_length], "chunks": [(payload, raw_length, 1)]}],
        [RAW, ZSTD])


def test_rle_frame_helper_is_real_zstd():
    assert zstandard.ZstdDecompressor().decompress(zstd_rle_frame(300_000, 300_000)) == bytes(300_000)


@pytest.mark.parametrize("payload", [
    pytest.param(lambda: zstd_rle_frame(4 << 30, 4 << 30), id="declares-and-holds-4GiB"),
    pytest.param(lambda: zstd_rle_frame(4096, 4 << 30), id="declares-raw-length-holds-4GiB"),
    pytest.param(lambda: zstd_rle_frame(None, 4 << 30), id="no-size-holds-4GiB"),
    pytest.param(lambda: zstandard.ZstdCompressor(write_content_size=False).compress(bytes(8 << 20)), id="no-size-8MiB"),
    pytest.param(lambda: zstandard.compress(bytes(4097)), id="one-byte-too-many"),
    pytest.param(lambda: zstandard.compress(bytes(4095)), id="one-byte-short"),
    pytest.param(lambda: zstandard.compress(bytes(4096))[:-3], id="cut-frame"),
    pytest.param(lambda: b"\x28\xb5\x2f\xfd" + b"\xff" * 40, id="garbage-after-magic"),
    pytest.param(lambda: b"not zstd at all", id="not-zstd"),
    pytest.param(lambda: zstandard.compress(bytes(4096)) + b"\x00\x01", id="trailing-garbage"),
])
def test_decompression_bombs_and_lying_lengths(payload):
    data = _bomb_file(payload())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    with opened(data) as ck:
        assert_tensor_equal(ck.get_tensor("ok"), torch.arange(1024, dtype=torch.int32))
        with pytest.raises((nvckpt.FormatError, nvckpt.LimitError)):
            ck.get_tensor("bomb")
    elapsed = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert elapsed < 5, f"took {elapsed:.1f} s"
    assert grown < 256 << 10, f"peak memory grew by {grown >> 10} MiB"


def test_skippable_and_multiple_zstd_frames_are_valid():
    raw = torch.arange(1024, dtype=torch.int32).numpy().tobytes()
    skippable = b"\x50\x2a\x4d\x18" + struct.pack("<I", 3) + b"abc"
    payload = zstandard.compress(raw[:1000]) + skippable + zstandard.ZstdCompressor(write_content_size=False).compress(raw[1000:])
    data = _bomb_file(payload)
    with opened(data) as ck:
        assert_tensor_equal(ck.get_tensor("bomb"), torch.arange(1024, dtype=torch.int32).view(torch.uint8))


@pytest.mark.parametrize("stored,raw_length", [(100, 200), (200, 100)])
def test_raw_chunk_with_lying_raw_length(stored, raw_length):
    data = build_file([{"name": "r", "dtype": "uint8", "shape": [raw_length], "chunks": [(bytes(stored), raw_length, 0)]}], [RAW])
    with opened(data) as ck:
        with pytest.raises(nvckpt.FormatError):
            ck.get_tensor("r")


def test_byteshuffle_length_not_multiple_of_elementsize():
    shuffle4 = [{"name": "byteshuffle", "configuration": {"elementsize": 4}}, RAW[0]]
    data = build_file([{"name": "s", "dtype": "uint8", "shape": [6], "chunks": [(bytes(6), 6, 0)]}], [shuffle4])
    with opened(data) as ck:
        with pytest.raises(nvckpt.FormatError):
            ck.get_tensor("s")


def test_many_chunks_declared_small_file_is_bounded():
    """A tensor that declares 1 GiB in 64 chunks, each a tiny lying raw payload: fails fast, no 1 GiB decode per chunk."""
    chunks = [(bytes([i]) * 16, 16 << 20, 0) for i in range(64)]
    data = build_file([{"name": "big", "dtype": "uint8", "shape": [1 << 30], "chunks": chunks}], [RAW])
    start = time.perf_counter()
    with opened(data) as ck:
        with pytest.raises(nvckpt.FormatError):
            ck.get_slice("big")[:100]
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("chunk_size,workers", [(1024, 2), (1024, 1), (1 << 20, 2)])
def test_load_refuses_a_tensor_whose_checksum_disagrees(tmp_path, chunk_size, workers):
    """Chunks intact, the tensor checksum wrong: a load names the tensor, whether the tensor is hashed as its
    chunks are decoded (several chunks, any order) or in one pass (one chunk)."""
    from nvckpt.codecs.registry import RAW
    from nvckpt.engines.cpu import encode_cpu
    from nvckpt.engines.items import TensorReady
    from nvckpt.plan.walk import plan_save
    from nvckpt.session.save import write_items

    state = {"t": torch.arange(5000, dtype=torch.float32), "ok": torch.ones(3000)}
    plan = plan_save(state, chunk_size=chunk_size)
    path = tmp_path / "bad.nvckpt"
    with open(path, "wb") as f:
        items = (TensorReady(item.tensor_id, item.checksum ^ 1) if isinstance(item, TensorReady) and item.tensor_id == 0
                 else item for item in encode_cpu(plan, lambda dtype: RAW))
        write_items(f, items, plan, alignment=1, info={"name": "test"})
    with pytest.raises(nvckpt.ChecksumError, match="tensor checksum") as info:
        nvckpt.load(path, workers=workers)
    assert info.value.tensor == "t"
    with nvckpt.open(path) as ck:
        assert torch.equal(ck.get_tensor("ok"), state["ok"])
