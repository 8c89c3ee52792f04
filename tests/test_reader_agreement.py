"""Files at the edges of SPEC.md: nvckpt, `nvckpt verify`, the independent reader
(conformance/reference_reader.py, random-access and streaming) and the conformance adapter give the same
verdict on each.

Each test builds its file from a valid file of nvckpt.save, edited with conformance/craft.py.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys

import msgpack
import pytest
import torch
import xxhash
import zstandard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import nvckpt  # noqa: E402
from conftest import saved_bytes  # noqa: E402
from conformance import craft  # noqa: E402
from conformance import reference_reader as rr  # noqa: E402
from conformance.adapters import nvckpt_impl  # noqa: E402
from nvckpt.cli import EXIT_PROBLEMS, main  # noqa: E402
from nvckpt.format import bulk  # noqa: E402
from nvckpt.tools.verify import verify  # noqa: E402

EXT6 = msgpack.ExtType(6, (2**64).to_bytes(9, "little", signed=True))


def edited(data: bytes, fn, *, sync: bool = True, **build) -> bytes:
    nv = craft.parse(data)
    fn(nv)
    if sync:
        craft.sync_tensor_frames(nv)
    return craft.build(nv, **build)


def write(tmp_path, data: bytes, name: str = "f.nvckpt") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def load_all(path: str) -> dict:
    with nvckpt.open(path) as ck:
        return {e.name: ck.get_tensor(e.name) for e in ck.index.tensors}


def reference(path: str) -> list[dict]:
    """The independent reader's documents: random-access, then streaming."""
    return [rr.decode_file(path), rr.decode_file(path, streaming=True)]


# -- an empty chunk table for a tensor with bytes (SPEC 8.4) -----------------------------------------

def _empty_table(drop_chunk_frames: bool) -> bytes:
    def fn(nv):
        nv.index["tensors"][0]["chunks"] = []
        if drop_chunk_frames:
            nv.frames = [f for f in nv.frames if f.frame_type != craft.CHUNK]
    return edited(saved_bytes({"w": torch.zeros(1024)}, tensor_checksums=False), fn)


@pytest.mark.parametrize("drop_chunk_frames", [False, True])
def test_empty_chunk_table_of_a_tensor_with_bytes_is_refused_at_open(tmp_path, drop_chunk_frames):
    path = write(tmp_path, _empty_table(drop_chunk_frames))
    with pytest.raises(nvckpt.FormatError, match=r"tensor 'w': the chunk table is empty, shape and dtype need 4096"):
        nvckpt.open(path)
    with pytest.raises(nvckpt.FormatError, match="chunk table is empty"):
        verify(path, workers=1)
    assert all(d["error"] == "format" for d in reference(path))


def test_nvckpt_verify_reports_an_empty_chunk_table(tmp_path, capsys):
    path = write(tmp_path, _empty_table(True))
    assert main(["verify", path]) == EXIT_PROBLEMS
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "chunk table is empty" in err and path in err, err


def test_empty_tensor_keeps_its_empty_chunk_table(tmp_path):
    path = write(tmp_path, saved_bytes({"e": torch.zeros(0, 3), "w": torch.ones(2)}))
    assert load_all(path)["e"].shape == (0, 3)


# -- one chunk whose raw_length is over MAX_CHUNK_LENGTH (SPEC 8.4, 12.1, 16) -------------------------

def test_one_chunk_table_obeys_the_raw_length_limit(tmp_path):
    raw = 1 << 26
    pipeline = [{"name": "zstd", "configuration": {"level": 1}}]

    def fn(nv):
        nv.index["codecs"] = [pipeline]
        next(f for f in nv.frames if f.frame_type == craft.CODEC).payload = craft.pack(pipeline)
        nv.index["tensors"][0]["shape"] = [raw]
        chunk = nv.chunk_frame(0, 0)
        chunk.payload, chunk.raw_length = zstandard.ZstdCompressor(level=1).compress(bytes(raw)), raw

    path = write(tmp_path, edited(saved_bytes({"w": torch.zeros(4, dtype=torch.uint8)}, tensor_checksums=False), fn))
    with pytest.raises((nvckpt.LimitError, nvckpt.FormatError), match=r"chunk 0 raw_length .*16777216.*67108864"):
        nvckpt.open(path)
    assert all(d["error"] in ("limit", "format") for d in reference(path))


# -- an ext 6 integer where only tree values may hold it (SPEC 8.6, 9.2, 11.2) ------------------------

def _typed() -> bytes:
    data = saved_bytes({"w": torch.arange(4.0), "big": 2**70})
    assert craft.parse(data).preamble.required_features == 2
    return data


def _zstd_level(nv):
    pipeline = [{"name": "zstd", "configuration": {"level": EXT6}}]
    nv.index["codecs"] = [pipeline]
    next(f for f in nv.frames if f.frame_type == craft.CODEC).payload = craft.pack(pipeline)
    chunk = nv.chunk_frame(0, 0)
    chunk.raw_length = len(chunk.payload)
    chunk.payload = zstandard.ZstdCompressor().compress(chunk.payload)


@pytest.mark.parametrize("fn, words", [
    (lambda nv: nv.index["tree"].__setitem__("k", {EXT6: 1}), "tree map key is an integer ext"),
    (lambda nv: nv.index.__setitem__("metadata", {"x": [EXT6]}), "metadata holds an ext type 6 value"),
    (_zstd_level, "zstd level must be an integer"),
], ids=["tree-map-key", "metadata", "zstd-level"])
def test_an_ext_6_integer_is_no_int_outside_tree_values(tmp_path, fn, words):
    path = write(tmp_path, edited(_typed(), fn))
    with pytest.raises(nvckpt.FormatError, match=words):
        nvckpt.open(path)
    assert all(d["error"] == "format" for d in reference(path)[:1])


def test_ext_6_stays_a_value_of_the_tree(tmp_path):
    path = write(tmp_path, _typed())
    with nvckpt.open(path) as ck:
        assert ck.load()["big"] == 2**70 and type(ck.load()["big"]) is int


# -- ext values under keys a reader ignores (SPEC 1, 8.1, 8.2) -----------------------------------------

UNKNOWN_EXTS = {
    "ext9": msgpack.ExtType(9, b"abc"),
    "ext0": msgpack.ExtType(0, b""),
    "ext1-one-byte": msgpack.ExtType(1, b"\x00"),
    "ext2-not-array": msgpack.ExtType(2, b"\x01"),
    "ext2-bad-msgpack": msgpack.ExtType(2, b"\x92\xc1\xc1"),
    "ext3-bad-name": msgpack.ExtType(3, b"Not A Dtype"),
    "ext6-in-range": msgpack.ExtType(6, b"\x05"),
}
PLACES = {
    "index": lambda nv, v: nv.index.__setitem__("x-future", v),
    "entry": lambda nv, v: nv.index["tensors"][0].__setitem__("x-future", v),  # and its TENSOR frame (synced)
    "writer": lambda nv, v: nv.index["writer"].__setitem__("build", v),
    "view": lambda nv, v: nv.index["tensors"][nv.tensor_id("v")]["view"].__setitem__("x-future", v),
    "codec-config-of-unknown-codec": lambda nv, v: _unknown_codec(nv, v),
}


def _unknown_codec(nv, value):
    pipeline = [{"name": "x-future-codec", "configuration": {"x": value}}]
    nv.index["codecs"].append(pipeline)
    at = next(i for i, f in enumerate(nv.frames) if f.frame_type == craft.CODEC)
    nv.frames.insert(at + 1, craft.Frame(craft.CODEC, craft.pack(pipeline), codec_id=len(nv.index["codecs"]) - 1))


def _with_view() -> bytes:
    flat = torch.arange(12.0)
    return saved_bytes({"w": torch.ones(3), "v": flat[2:8], "u": flat[4:]})


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("ext", UNKNOWN_EXTS)
def test_any_ext_under_an_ignored_key_is_accepted(tmp_path, place, ext):
    path = write(tmp_path, edited(_with_view(), lambda nv: PLACES[place](nv, UNKNOWN_EXTS[ext])))
    expected = load_all(write(tmp_path, _with_view(), "plain.nvckpt"))
    got = load_all(path)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    report = verify(path, workers=1)
    assert report.ok, [str(p) for p in report.problems]
    assert [d["status"] for d in reference(path)] == ["ok", "ok"]
    assert nvckpt_impl.decode(path)["status"] == "ok"


def test_negative_ext_under_an_ignored_key_is_accepted(tmp_path):
    data = edited(_with_view(), lambda nv: nv.index.__setitem__("x-future", "\0NEG\0"))
    nv = craft.parse(data)
    nv.index_frame().payload = nv.index_frame().payload.replace(craft.pack("\0NEG\0"), b"\xd4\xfb\x00", 1)  # ext -5
    path = write(tmp_path, craft.build(nv, fix_index=False))
    assert load_all(path)["w"].tolist() == [1.0, 1.0, 1.0]
    assert [d["status"] for d in reference(path)] == ["ok", "ok"]


def test_ignored_exts_in_an_index_decoded_in_pieces(tmp_path, monkeypatch):
    """The same rule where the index is large enough to be decoded key by key (nvckpt.format.bulk)."""
    monkeypatch.setattr(bulk, "STREAM_FROM", 16 << 10)
    obj = {f"t{i}": torch.full((1,), float(i)) for i in range(400)}

    def fn(nv):
        nv.index["x-future"] = msgpack.ExtType(9, b"abc")
        nv.index["tensors"][7]["x-future"] = msgpack.ExtType(2, b"\x01")

    data = edited(saved_bytes(obj), fn)
    assert len(craft.parse(data).index_frame().payload) >= bulk.STREAM_FROM
    assert load_all(write(tmp_path, data))["t7"].item() == 7.0


@pytest.mark.parametrize("fn, words", [
    (lambda nv: nv.index["tensors"][0].__setitem__("shape", [msgpack.ExtType(9, b"")]), "got an ext type 9 value"),
    (lambda nv: nv.index["tensors"][0].__setitem__("name", msgpack.ExtType(9, b"")), "'name' must be a string, got an ext type 9"),
    (lambda nv: nv.index["tensors"][0].__setitem__("checksum", EXT6), "'checksum' must be an integer"),
    (lambda nv: nv.index.__setitem__("metadata", {"k": msgpack.ExtType(2, craft.pack([1]))}), "metadata holds a tuple"),
    (lambda nv: nv.index["tree"].__setitem__("x", msgpack.ExtType(11, b"")), "unknown ext type 11 in the tree"),
    (lambda nv: nv.index["tree"].__setitem__("x", msgpack.ExtType(9, b"")), "NumPy array reference \\(ext 9\\) has 0 bytes"),
    (lambda nv: nv.index["tree"].__setitem__("x", msgpack.ExtType(1, b"\x00")), "tensor reference has 1 bytes"),
    (lambda nv: nv.index["tree"].__setitem__("x", msgpack.ExtType(2, b"\x01")), "tuple ext payload is not an array"),
], ids=["shape", "name", "checksum", "metadata-tuple", "tree-ext11", "tree-ext9", "tree-ext1", "tree-ext2"])
def test_known_keys_and_the_tree_still_refuse_exts(tmp_path, fn, words):
    with pytest.raises(nvckpt.FormatError, match=words):
        nvckpt.open(write(tmp_path, edited(_with_view(), fn)))


# -- a derived "function" that is not a str (SPEC 8.5, 1) ----------------------------------------------

def _derived() -> bytes:
    x = torch.arange(4, dtype=torch.float32)
    data = saved_bytes({"a": x, "b": x.clone()})
    assert craft.parse(data).index["tensors"][1]["derived"]["function"] == "copy"
    return data


@pytest.mark.parametrize("value, words", [(None, "'derived' has no 'function'"), (7, "must be a string, got 7"),
                                          (b"copy", "must be a string, got b'copy'")], ids=["missing", "int", "bin"])
def test_derived_function_not_a_string_is_refused_at_open(tmp_path, value, words):
    def fn(nv):
        d = nv.index["tensors"][1]["derived"]
        if value is None:
            del d["function"]
        else:
            d["function"] = value

    path = write(tmp_path, edited(_derived(), fn))
    with pytest.raises(nvckpt.FormatError, match=words):
        nvckpt.open(path)
    assert all(d["error"] == "format" for d in reference(path))


def test_an_unknown_function_name_still_fails_only_when_read(tmp_path):
    path = write(tmp_path, edited(_derived(), lambda nv: nv.index["tensors"][1]["derived"].__setitem__("function", "x-new")))
    with nvckpt.open(path) as ck:
        assert ck["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(nvckpt.UnsupportedFeatureError, match="unknown derived function 'x-new'"):
            ck["b"]


# -- footer check 6 before the INDEX frame header (SPEC 5) ------------------------------------------------

def test_footer_index_bounds_are_checked_before_the_index_header(tmp_path):
    data = bytearray(saved_bytes({"w": torch.zeros(4)}))
    at = len(data) - 40
    off, length, check, _ = struct.unpack_from("<QQQI", data, at)
    struct.pack_into("<QQQI", data, at, off, length + 1, check, 0)  # check 6 fails ...
    struct.pack_into("<I", data, at + 28, xxhash.xxh3_64_intdigest(bytes(data[at:at + 28])) & 0xFFFFFFFF)
    data[off + 20] ^= 0xFF  # ... and so would check 7 (the INDEX header checksum)
    path = write(tmp_path, bytes(data))
    with pytest.raises(nvckpt.FormatError, match="does not fit between the preamble and the footer"):
        nvckpt.open(path)
    assert rr.decode_file(path)["error"] == "format"


# -- the checksum of a view or derived tensor (SPEC 13) ---------------------------------------------------

def _views_and_derived(tmp_path, checksum):
    flat = torch.arange(40, dtype=torch.float32)
    x = torch.randn(8, generator=torch.Generator().manual_seed(0))
    obj = {"v": flat[0:10], "s": flat[20:].view(4, 5).t(), "one": flat.as_strided((1,), (0,), 7),
           "f": x, "h": x.bfloat16(), "c": x.clone()}
    nv = craft.parse(saved_bytes(obj))
    built = [e for e in nv.index["tensors"] if "view" in e or "derived" in e]
    assert {e["name"] for e in built} == {"v", "s", "one", "h", "c"}
    for e in built:
        t = obj[e["name"]]
        flat_t = t.reshape(-1).clone(memory_format=torch.contiguous_format)
        e["checksum"] = checksum(xxhash.xxh3_64_intdigest(flat_t.view(torch.uint8).numpy().tobytes()))
    craft.sync_tensor_frames(nv)
    return write(tmp_path, craft.build(nv)), obj, [e["name"] for e in built]


def test_view_and_derived_checksums_are_verified(tmp_path):
    path, obj, names = _views_and_derived(tmp_path, lambda good: good ^ 1)
    with nvckpt.open(path) as ck:
        assert torch.equal(ck["f"], obj["f"])  # stored tensors are not affected
        for name in names:
            with pytest.raises(nvckpt.ChecksumError, match=f"tensor '{name}'.*tensor checksum does not match its elements"):
                ck.get_tensor(name)
        with pytest.raises(nvckpt.ChecksumError):
            ck.load()
    report = verify(path, workers=1)
    assert sorted(p.tensor for p in report.problems) == sorted(names), [str(p) for p in report.problems]
    assert all("checksum" in p.message for p in report.problems)
    for d in reference(path):
        assert {n for n, t in d["tensors"].items() if t.get("error") == "checksum"} == set(names)


def test_right_view_and_derived_checksums_load(tmp_path):
    path, obj, names = _views_and_derived(tmp_path, lambda good: good)
    with nvckpt.open(path) as ck:
        for name in names:
            assert torch.equal(ck[name], obj[name])
    report = verify(path, workers=1)
    assert report.ok, [str(p) for p in report.problems]
    assert report.tensor_checksums == 2 + len(names)  # the two stored tensors' and the five built ones'


# -- "checksum": nil (SPEC 8.3, 1) ----------------------------------------------------------------------

def test_checksum_nil_is_refused(tmp_path):
    path = write(tmp_path, edited(saved_bytes({"w": torch.zeros(4)}), lambda nv: nv.index["tensors"][0].__setitem__("checksum", None)))
    with pytest.raises(nvckpt.FormatError, match="'checksum' must be an integer"):
        nvckpt.open(path)
    assert [d["error"] for d in reference(path)] == ["format", "format"]


def test_tensor_frame_checksum_nil_differs_from_absent(tmp_path):
    def fn(nv):
        frame = nv.tensor_frame(0)
        d = craft.unpack(frame.payload)
        d["checksum"] = None
        frame.payload = craft.pack(d)

    path = write(tmp_path, edited(saved_bytes({"w": torch.zeros(4)}, tensor_checksums=False), fn, sync=False))
    assert rr.decode_file(path)["status"] == "ok"  # a random-access reader reads no TENSOR frame
    assert rr.decode_file(path, streaming=True)["error"] == "format"


# -- the reference reader and trailing incomplete msgpack (SPEC 1) -----------------------------------

@pytest.mark.parametrize("where", ["index", "tuple"])
def test_reference_reader_refuses_a_trailing_incomplete_object(tmp_path, where):
    base = saved_bytes({"w": torch.zeros(4)})
    nv = craft.parse(base)
    if where == "index":
        nv.index_frame().payload += b"\xa1"
        data = craft.build(nv, fix_index=False)
    else:
        nv.index["tree"]["t"] = msgpack.ExtType(2, craft.pack([1, 2]) + b"\xa1")
        data = craft.build(nv)
    path = write(tmp_path, data)
    assert [d["error"] for d in reference(path)] == ["format", "format"]
    with pytest.raises(nvckpt.FormatError):
        nvckpt.open(path)


def test_reference_unpack_one():
    assert rr.unpack_one(b"\x92\x01\x02") == [1, 2]
    for payload in (b"\x01\xa1", b"\x01\x01", b"\x01\xdd\x00"):
        with pytest.raises(rr.FormatError, match="trailing bytes"):
            rr.unpack_one(payload)
    with pytest.raises(rr.FormatError, match="ends early"):
        rr.unpack_one(b"\x92\x01")


# -- the reference streaming reader and "nchunks" of another type (SPEC 8.3) -------------------------

@pytest.mark.parametrize("value", [True, 1.0])
def test_reference_streaming_reader_checks_the_type_of_nchunks(tmp_path, value):
    def fn(nv):
        frame = nv.tensor_frame(0)
        d = craft.unpack(frame.payload)
        assert d["nchunks"] == 1
        d["nchunks"] = value
        frame.payload = craft.pack(d)

    path = write(tmp_path, edited(saved_bytes({"w": torch.zeros(4)}), fn, sync=False))
    assert rr.decode_file(path, streaming=True)["error"] == "format"
    assert any("TENSOR frame" in str(p) for p in verify(path, workers=1).problems)


# -- the conformance adapter and a one-element view of stride 0 ------------------------------------------

def test_adapter_decodes_a_one_element_view_of_stride_0(tmp_path):
    flat = torch.arange(100, dtype=torch.float32)

    def fn(nv):
        e = nv.index["tensors"][nv.tensor_id("a")]
        e["shape"], e["view"] = [1], {"base": e["view"]["base"], "offset": 89, "stride": [0]}

    path = write(tmp_path, edited(saved_bytes({"a": flat[10:20], "b": flat[50:]}), fn))
    doc = nvckpt_impl.decode(path)
    assert doc["status"] == "ok"
    with nvckpt.open(path) as ck:
        element = ck["a"]
    assert element.tolist() == [99.0]  # the base starts at flat[10]
    assert doc["tensors"]["a"]["sha256"] == hashlib.sha256(struct.pack("<f", 99.0)).hexdigest()
    assert rr.decode_file(path)["tensors"]["a"]["sha256"] == doc["tensors"]["a"]["sha256"]
    assert nvckpt_impl.raw_bytes(flat[::3]) == flat[::3].contiguous().numpy().tobytes()


# -- files shorter than the preamble (SPEC 3, 5) --------------------------------------------------------

@pytest.mark.parametrize("data, error", [
    (b"PK\x03\x04 not a checkpoint", nvckpt.FormatError),
    (b"\x89NVCX", nvckpt.FormatError),
    (b"x", nvckpt.FormatError),
    (b"", nvckpt.TruncatedError),
    (b"\x89NV", nvckpt.TruncatedError),
    (b"\x89NVCKPT\n\x01\x00", nvckpt.TruncatedError),
], ids=["zip", "magic-differs", "one-byte", "empty", "magic-prefix", "cut-preamble"])
def test_short_files_follow_section_3(tmp_path, data, error):
    path = write(tmp_path, data)
    with pytest.raises(error) as info:
        nvckpt.open(path)
    assert (type(info.value) is nvckpt.TruncatedError) == (error is nvckpt.TruncatedError)
    kind = "truncated" if error is nvckpt.TruncatedError else "format"
    assert [d["error"] for d in reference(path)] == [kind, kind]


# -- the frame the footer points at (SPEC 5 check 7 over 4.2) ---------------------------------------------

@pytest.mark.parametrize("ftype", [0, 1, 3, 5, 127, 128, 255])
def test_the_footer_must_point_at_an_index_frame(tmp_path, ftype):
    path = write(tmp_path, edited(saved_bytes({"w": torch.zeros(4)}), lambda nv: setattr(nv.index_frame(), "frame_type", ftype),
                                  sync=False, fix_index=False))
    with pytest.raises(nvckpt.FormatError, match="not the INDEX frame"):
        nvckpt.open(path)
    assert rr.decode_file(path)["error"] == "format"


# -- SPEC 3: unknown required_features bits are named by number --------------------------------------------------

def test_unknown_required_feature_bits_are_named(tmp_path):
    path = write(tmp_path, edited(saved_bytes({"w": torch.zeros(4)}),
                                  lambda nv: setattr(nv.preamble, "required_features", 1 | 1 << 5 | 1 << 31), sync=False))
    with pytest.raises(nvckpt.UnsupportedFeatureError, match=r"required_features bits 0, 5, 31 "):
        nvckpt.open(path)
