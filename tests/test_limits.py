"""Regressions of issue 10 ("Hardening, round 2"), one group per item of the issue.

1. nests bounded before msgpack's recursion, in every payload and on every path;
2. a save whose index would exceed a limit fails before anything is published;
3. a compact index: chunk tables as columns, bulk decoding, an explicit memory bound (untrusted);
4. verify and recover check what a reader checks;
5. max_tensor_bytes covers views; a huge legal tensor is a named error; close() racing readers;
6. target names of 235-255 bytes; errors name the caller's path.

The hostile-file run over every path under a memory cap, and the million-chunk
timing, are tests/test_hostile.py.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import threading

import msgpack
import pytest
import torch
import xxhash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tools")):
    if p not in sys.path:
        sys.path.insert(0, p)

import hostile  # noqa: E402

import nvckpt  # noqa: E402
from conformance import craft  # noqa: E402
from nvckpt.format import bulk  # noqa: E402
from nvckpt.format.frames import read_meta_frame  # noqa: E402
from nvckpt.format.structs import FrameHeader  # noqa: E402
from nvckpt.io.source import LocalFile  # noqa: E402
from nvckpt.tools.recover import recover  # noqa: E402
from nvckpt.tools.verify import verify  # noqa: E402

FILES = os.path.join(ROOT, "conformance", "files")
MiB = 1 << 20


def case(cid: str) -> str:
    return os.path.join(FILES, f"{cid}.nvckpt")


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def small_file(**kw) -> bytes:
    buf = io.BytesIO()
    nvckpt.save({"w": torch.arange(12.0).reshape(3, 4), "t": (1, 2)}, buf, **kw)
    return buf.getvalue()


def with_index(data: bytes, edit) -> bytes:
    nv = craft.parse(data)
    edit(nv.index)
    nv.index_frame().payload = craft.pack(nv.index)
    return craft.build(nv, fix_index=False)


# -- 1. nests -----------------------------------------------------------------------------------------

def test_tuples_200_deep_are_a_limit_error_not_a_segfault():
    """The 1.4 KB file of the issue: tuples nested 200 deep in the tree crashed msgpack's C unpacker."""
    for fn in (lambda p: nvckpt.open(p), lambda p: nvckpt.load(p, untrusted=True)):
        with pytest.raises(nvckpt.LimitError, match="nesting"):
            fn(case("tree-tuple-depth-200"))
    from nvckpt.tools.info import describe

    with pytest.raises(nvckpt.LimitError):
        describe(case("tree-tuple-depth-200"))


@pytest.mark.parametrize("cid", ["tensor-frame-unknown-key-depth-200", "codec-frame-configuration-depth-200"])
def test_deep_tensor_and_codec_frames(cid, tmp_path):
    """TENSOR and CODEC frames go through the same bounded parser (read_meta_frame) as the index: verify and
    recover."""
    with pytest.raises(nvckpt.LimitError, match="nests more than 72"):  # the index holds the same nesting
        verify(case(cid))
    rec = recover(case(cid), tmp_path / "out.nvckpt")
    assert any("nesting" in p or "frame" in p for p in rec.problems), rec.problems
    nv = craft.parse(read(case(cid)))
    frame = max((f for f in nv.frames if f.frame_type in (craft.TENSOR, craft.CODEC)), key=lambda f: len(f.payload))
    src = LocalFile(case(cid))
    try:
        header = FrameHeader.unpack(src.read(frame.offset, 48), frame.offset)
        with pytest.raises((nvckpt.LimitError, nvckpt.FormatError)):
            read_meta_frame(src, frame.offset, header)
    finally:
        src.close()


@pytest.mark.parametrize("raw", [b"\x91" * 5000 + b"\xc0", b"\x81\xa1k" * 2000 + b"\xc0"], ids=["arrays", "maps"])
def test_nests_past_msgpacks_own_bound_are_limit_errors(raw):
    data = small_file()
    nv = craft.parse(data)
    nv.index["future"] = "\0sentinel\0"
    nv.index_frame().payload = craft.pack(nv.index).replace(craft.pack("\0sentinel\0"), raw)
    with pytest.raises(nvckpt.LimitError, match="deep"):
        nvckpt.open(io.BytesIO(craft.build(nv, fix_index=False)))


def test_values_under_unknown_keys_nest_64_deep_but_not_without_bound():
    """SPEC 9: 64 levels under an unknown key must load; far deeper is a LimitError (a writer map too)."""
    ok = with_index(small_file(), lambda ix: ix.__setitem__("future", hostile._fuzz().msgpack.unpackb(b"\x91" * 64 + b"\x01")))
    nvckpt.load(io.BytesIO(ok))
    deep = with_index(small_file(), lambda ix: ix["writer"].__setitem__("x", msgpack.unpackb(b"\x91" * 400 + b"\x01")))
    with pytest.raises(nvckpt.LimitError, match="nests more than"):
        nvckpt.open(io.BytesIO(deep))


def test_error_messages_never_repr_a_huge_or_deep_value():
    data = with_index(small_file(), lambda ix: ix.__setitem__("version", [[0] * 100] * 20_000))
    with pytest.raises(nvckpt.FormatError) as info:
        nvckpt.open(io.BytesIO(data))
    assert len(str(info.value)) < 300 and "array of 20000 items" in str(info.value)


# -- 2. limits on the write side ------------------------------------------------------------------------

def test_an_index_over_the_limit_fails_before_anything_is_written(tmp_path, monkeypatch):
    from nvckpt.format import frames

    target = tmp_path / "ckpt.nvckpt"
    nvckpt.save({"w": torch.ones(4)}, target)
    old = target.read_bytes()
    monkeypatch.setattr(frames, "MAX_INDEX_LENGTH", 4096)
    with pytest.raises(nvckpt.LimitError, match="nothing was written"):
        nvckpt.save({"w": torch.ones(4)}, target, metadata={"notes": "x" * 5000})
    assert target.read_bytes() == old and os.listdir(tmp_path) == ["ckpt.nvckpt"]
    buf = io.BytesIO()  # a stream: not even the preamble
    with pytest.raises(nvckpt.LimitError):
        nvckpt.save({"w": torch.ones(4)}, buf, metadata={"notes": "x" * 5000})
    assert buf.getvalue() == b""


def test_an_index_over_the_limit_found_at_the_end_keeps_the_old_file(tmp_path, monkeypatch):
    """The floor (6 bytes a chunk) passes, the exact size does not: the INDEX frame is never written and
    the temporary file is removed, so the good checkpoint stays."""
    from nvckpt.format import frames

    target = tmp_path / "ckpt.nvckpt"
    nvckpt.save({"w": torch.ones(4)}, target)
    old = target.read_bytes()
    state = {"w": torch.arange(2000, dtype=torch.uint8)}
    floor = len(msgpack.packb([{"name": "w", "dtype": "uint8", "shape": [2000]}])) + 6 * 2000
    monkeypatch.setattr(frames, "MAX_INDEX_LENGTH", floor + 4000)
    with pytest.raises(nvckpt.LimitError, match="the index would be"):
        nvckpt.save(state, target, chunk_size=1, codec="raw", alignment=1)
    assert target.read_bytes() == old and os.listdir(tmp_path) == ["ckpt.nvckpt"]


def _nest(depth: int, leaf):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


@pytest.mark.parametrize("what", ["name", "rank", "tree-depth", "metadata-depth", "tensors", "span"])
def test_every_spec16_limit_fails_before_anything_is_published(what, tmp_path, monkeypatch):
    """SPEC 16: each limit the object can exceed is checked before the first byte (a stream stays empty,
    the file at the path stays the old one, nothing is left beside it)."""
    from nvckpt.plan import walk

    obj, kw = {"w": torch.ones(2)}, {}
    if what == "name":
        obj = {"n" * 4097: torch.ones(2)}
    elif what == "rank":
        obj = {"w": torch.ones([1] * 65)}
    elif what == "tree-depth":
        obj = {"w": _nest(64, torch.ones(2))}
    elif what == "metadata-depth":
        kw = {"metadata": {"m": _nest(64, 1)}}
    elif what == "tensors":
        monkeypatch.setattr(walk, "MAX_TENSORS", 3)
        obj = {f"t{i}": torch.ones(2) for i in range(4)}
    else:
        obj = {"w": torch.zeros(1).expand(1 << 31, 1 << 31)}
    buf = io.BytesIO()
    with pytest.raises(nvckpt.LimitError):
        nvckpt.save(obj, buf, **kw)
    assert buf.getvalue() == b""
    target = tmp_path / "ckpt.nvckpt"
    nvckpt.save({"old": torch.ones(1)}, target)
    old = target.read_bytes()
    with pytest.raises(nvckpt.LimitError):
        nvckpt.save(obj, target, **kw)
    assert target.read_bytes() == old and os.listdir(tmp_path) == ["ckpt.nvckpt"]


def test_a_tensor_spanning_more_than_2p62_bytes_is_refused_before_writing():
    huge = torch.zeros(1).expand(1 << 31, 1 << 31)  # 2^62 float32 elements: 2^64 bytes, no memory
    buf = io.BytesIO()
    with pytest.raises(nvckpt.LimitError, match="spans"):
        nvckpt.save({"x": huge}, buf)
    assert buf.getvalue() == b""


# -- 3. a compact index ---------------------------------------------------------------------------------

def test_bulk_decoding_agrees_with_the_plain_decoding(monkeypatch):
    """Long chunk tables in every int encoding (the conformance file) decode to the same tables both ways."""
    monkeypatch.setattr(bulk, "STREAM_FROM", 16 << 10)
    data = read(case("valid-many-chunks"))
    with nvckpt.open(io.BytesIO(data)) as ck:
        bulk_table = ck.index.tensors[0].chunks.to_json()
        assert len(bulk_table) == 1500
    nv = craft.parse(data)
    plain = [list(map(int, c)) for c in nv.index["tensors"][0]["chunks"]]
    assert bulk_table == plain
    index_payload = nv.index_frame().payload
    assert len(index_payload) >= bulk.STREAM_FROM  # the file does exercise the piecewise path
    decoded = bulk.decode_index(index_payload)
    assert isinstance(decoded["tensors"], bulk.LazyEntries)
    assert isinstance(decoded["tensors"][0]["chunks"], bulk.ChunkColumns)


@pytest.mark.parametrize("cid", ["chunk-list-long-negative", "chunk-list-long-bool", "chunk-list-long-overlap"])
def test_bulk_decoding_finds_the_one_bad_chunk(cid, index_decoding):
    with pytest.raises(nvckpt.FormatError, match=r"chunk 1[234]\d\d"):
        nvckpt.open(case(cid))


def _big_index_file(edit_entry) -> bytes:
    """2000 one-chunk tensors (an index of ~150 KB: decoded in pieces where bulk.STREAM_FROM is lowered to
    16 KiB, ``index_decoding``), entry 1000's bytes edited."""
    n = 2000
    data = bytes(i * 7 & 0xFF for i in range(n))
    h = xxhash.xxh3_64_intdigest
    tensors = [{"name": f"t{i}", "dtype": "uint8", "shape": [1], "chunks": [[72 + i, 1, 1, 0, h(data[i:i + 1])]]}
               for i in range(n)]
    payload = msgpack.packb(hostile._index(tensors, {f"t{i}": hostile._ref(i) for i in range(n)}))
    assert len(payload) > 16 << 10
    entry = msgpack.packb(tensors[1000])
    payload = payload.replace(entry, edit_entry(entry, tensors[1000]), 1)
    body = craft.Preamble().pack() + bytes(48) + data
    return body + craft.Frame(craft.INDEX, payload).header() + payload + craft.Footer(len(body), len(payload), h(payload)).pack()


def _with_deep_key(entry: bytes, parsed: dict) -> bytes:
    return msgpack.packb(dict(parsed, zz="\0S\0")).replace(msgpack.packb("\0S\0"), b"\x91" * 3000 + b"\xc0")


@pytest.mark.parametrize("edit, error, match", [
    (lambda e, p: e.replace(b"\xa5t1000", b"\xa5t\xff\xfe00"), nvckpt.FormatError, "utf-8"),
    (lambda e, p: b"\x85\xa4name\xa1x" + e[1:], nvckpt.FormatError, "twice"),
    (lambda e, p: e.replace(b"\xa5t1000", b"\xd4\x09\x00"), nvckpt.FormatError, "ext type 9"),
    (_with_deep_key, nvckpt.LimitError, "deep"),
    (lambda e, p: e[:-3], nvckpt.FormatError, "msgpack"),
], ids=["utf8", "duplicate-key", "ext", "stack", "truncated"])
def test_an_index_decoded_in_pieces_keeps_every_rule(edit, error, match, index_decoding):
    """The piecewise decoding (entries decoded when parsed) reports what the plain decoding reports."""
    nvckpt.open(io.BytesIO(_big_index_file(lambda e, p: e))).close()
    with pytest.raises(error, match=match):
        nvckpt.open(io.BytesIO(_big_index_file(edit)))


def test_untrusted_bounds_index_memory_explicitly(tmp_path):
    path = tmp_path / "many.nvckpt"
    path.write_bytes(hostile.many_chunks(50_000))
    with nvckpt.open(path, untrusted=True) as ck:  # 1 GiB by default: fits
        assert len(ck.index.tensors[0].chunks) == 50_000
    with pytest.raises(nvckpt.LimitError, match="max_index_memory"):
        nvckpt.open(path, max_index_memory=256 << 10)
    # The budget counts what decoding builds, not the bytes: 200k empty maps are 200 KB of index, ~15 MB of dicts.
    bombs = hostile.nest_bombs(hostile.seed_file())
    data = bombs["unknown-key-empty-maps-200k"]
    assert len(data) < 300_000
    nvckpt.load(io.BytesIO(data), untrusted=True)
    with pytest.raises(nvckpt.LimitError, match="max_index_memory"):
        nvckpt.open(io.BytesIO(data), untrusted=True, max_index_memory=4 * MiB)
    with pytest.raises(ValueError):
        nvckpt.open(path, max_index_memory=-1)


def test_many_small_chunks_load_in_groups(tmp_path):
    """A tensor of 100k one-byte chunks: every byte right, read in a few large preads, not 100k."""
    path = tmp_path / "many.nvckpt"
    path.write_bytes(hostile.many_chunks(100_000))
    with nvckpt.open(path) as ck:
        t = ck.get_tensor("t")
        assert bytes(t.numpy()) == bytes(i * 7 & 0xFF for i in range(100_000))
        assert ck.bytes_read < path.stat().st_size + 200_000
        assert bytes(ck.get_slice("t")[5000:5010].numpy()) == bytes(i * 7 & 0xFF for i in range(5000, 5010))


def test_a_corrupt_chunk_in_a_group_is_named():
    data = bytearray(hostile.many_chunks(3000))
    data[72 + 1234] ^= 0xFF
    with nvckpt.open(io.BytesIO(bytes(data))) as ck:
        with pytest.raises(nvckpt.ChecksumError) as info:
            ck.get_tensor("t")
    assert info.value.chunk == 1234


# -- 4. verify and recover check what a reader checks --------------------------------------------------

@pytest.mark.parametrize("cid", ["bool-byte-2", "chunk-frame-padding-nonzero"])
def test_verify_fails_what_the_spec_rejects(cid):
    assert not verify(case(cid)).ok
    from nvckpt import cli

    assert cli.main(["verify", case(cid)]) == 1


def test_verify_reports_a_tensor_this_reader_cannot_build():
    report = verify(case("valid-unknown-dtype"))
    assert report.ok and any("not readable here" in n.message for n in report.undecoded)


def _zstd_file() -> bytes:
    buf = io.BytesIO()
    nvckpt.save({"a": torch.zeros(4096), "b": torch.ones(8, dtype=torch.bool)}, buf, codec="zstd")
    return buf.getvalue()


def _edit_chunk(data: bytes, tensor: str, payload: bytes) -> bytes:
    nv = craft.parse(data)
    tid = nv.tensor_id(tensor)
    nv.chunk_frame(tid, 0).payload = payload
    return craft.build(nv)


@pytest.mark.parametrize("what", ["garbage-zstd", "bool-2", "tensor-checksum"])
def test_recover_keeps_only_tensors_that_decode_and_match(what, tmp_path):
    data = _zstd_file()
    if what == "garbage-zstd":  # a valid checksum over bytes that are no zstd frame
        data = _edit_chunk(data, "a", b"\x28\xb5\x2f\xfd" + bytes(40))
        lost = "a"
    elif what == "bool-2":
        data = _edit_chunk(data, "b", bytes([1, 2, 0, 1, 0, 1, 0, 1]))
        lost = "b"
    else:  # the stored bytes decode, but not to what the tensor checksum says
        nv = craft.parse(data)
        tid = nv.tensor_id("a")
        entry = craft.unpack(nv.tensor_frame(tid).payload)
        entry["checksum"] ^= 1
        nv.tensor_frame(tid).payload = craft.pack(entry)
        data = craft.build(nv)
        lost = "a"
    src = tmp_path / "src.nvckpt"
    src.write_bytes(data)
    report = recover(src, tmp_path / "out.nvckpt")
    assert lost in report.lost and lost not in report.recovered, report.lost
    with nvckpt.open(tmp_path / "out.nvckpt") as ck:
        assert lost not in ck.keys()


# -- 5. limits that leak --------------------------------------------------------------------------------

def test_max_tensor_bytes_applies_to_views(tmp_path):
    path = tmp_path / "view.nvckpt"
    path.write_bytes(hostile.stride0_view(64 << 30))
    with nvckpt.open(path, max_tensor_bytes=1 << 20) as ck:
        with pytest.raises(nvckpt.LimitError, match="max_tensor_bytes"):
            ck.get_tensor("b")
        with pytest.raises(nvckpt.LimitError):
            ck.load()
        assert ck.get_tensor("a").numel() == 1
    with nvckpt.open(path) as ck:  # no limit asked for: the view, which costs nothing
        assert ck.get_tensor("b").shape == (16 << 30,)


CAPPED_LOAD = r"""
import json, resource, sys
sys.path.insert(0, {root!r})
import nvckpt
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
try:
    nvckpt.load({path!r})
    print(json.dumps(["ok", ""]))
except nvckpt.NvckptError as exc:
    print(json.dumps([type(exc).__name__, str(exc)]))
"""


def test_a_legal_file_declaring_8_gib_is_a_named_error_not_a_torch_one(tmp_path):
    """304 KB on disk, 8 GiB of zeros: under a memory cap, load() says what it could not allocate."""
    path = tmp_path / "huge.nvckpt"
    path.write_bytes(hostile.huge_tensor(8 << 30))
    assert path.stat().st_size < 400_000
    p = subprocess.run([sys.executable, "-c", CAPPED_LOAD.format(root=ROOT, path=str(path))], capture_output=True,
                       text=True, timeout=300)
    kind, message = json.loads(p.stdout)
    assert kind == "LimitError" and "cannot allocate 8589934592 bytes" in message and "'huge'" in message, p.stderr
    with nvckpt.open(path, max_tensor_bytes=1 << 30) as ck:  # refused before allocating, without a cap
        with pytest.raises(nvckpt.LimitError, match="max_tensor_bytes"):
            ck.get_tensor("huge")


def test_close_while_other_threads_read_gives_named_errors_and_right_bytes(tmp_path):
    path = tmp_path / "f.nvckpt"
    tensors = {f"t{i}": torch.arange(50_000, dtype=torch.float32) * i for i in range(8)}
    nvckpt.save(tensors, path, chunk_size=16 << 10)
    for _ in range(5):
        ck = nvckpt.open(path, workers=4)
        errors: list[str] = []
        start = threading.Barrier(9)

        def reader(k: int) -> None:
            start.wait()
            for r in range(40):
                name = f"t{(k + r) % 8}"
                try:
                    t = ck.get_tensor(name)
                except nvckpt.NvckptError:
                    continue  # closed: a named error
                except Exception as exc:  # noqa: BLE001 - the property under test
                    errors.append(f"{type(exc).__name__}: {exc}")
                    return
                if not torch.equal(t, tensors[name]):
                    errors.append(f"{name}: wrong bytes")

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        start.wait()
        ck.close()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        with pytest.raises(nvckpt.NvckptError, match="closed"):
            ck.get_tensor("t1")


# -- 6. names -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [234, 235, 250, 255])
def test_target_names_up_to_name_max_save_and_replace(tmp_path, length):
    name = ("é" * 200).encode()[: length - 7].decode("utf-8", "ignore")
    name += "x" * (length - 7 - len(name.encode())) + ".nvckpt"
    assert len(name.encode()) == length
    target = tmp_path / name
    for value in (1.0, 2.0):  # create, then replace
        nvckpt.save({"w": torch.full((3,), value)}, target)
        assert torch.equal(nvckpt.load(target)["w"], torch.full((3,), value))
    assert os.listdir(tmp_path) == [name]


def test_errors_name_the_callers_path_not_the_temporary(tmp_path):
    missing = tmp_path / "no-such-folder" / "ckpt.nvckpt"
    with pytest.raises(FileNotFoundError) as info:
        nvckpt.save({"w": torch.ones(2)}, missing)
    assert info.value.filename == str(missing) and "nvckpt-tmp" not in str(info.value)
    too_long = tmp_path / ("n" * 256)
    with pytest.raises(OSError) as info:
        nvckpt.save({"w": torch.ones(2)}, too_long)
    assert "nvckpt-tmp" not in str(info.value) and info.value.filename == str(too_long)
    assert os.listdir(tmp_path) == []


def test_checksums_of_hostile_builders_are_valid():
    """The files tools/hostile.py builds are what they claim: valid where they should be."""
    data = hostile.many_tensors(300)
    loaded = nvckpt.load(io.BytesIO(data))
    assert len(loaded) == 300 and int(loaded["t7"][0]) == 49
    assert xxhash.xxh3_64_intdigest(b"") >= 0 and struct.calcsize("<I") == 4


def test_an_index_whose_entries_alone_are_over_the_limit_fails_before_anything_is_written(tmp_path, monkeypatch):
    """Many tensors with long names: their entries (not the tree or metadata) go over the limit."""
    from nvckpt.format import frames

    state = {("n" * 200) + str(i): torch.ones(1) for i in range(200)}
    tree_and_names = len(msgpack.packb(list(state))) * 2
    monkeypatch.setattr(frames, "MAX_INDEX_LENGTH", tree_and_names + 2000)  # above the tree, below tree + entries
    buf = io.BytesIO()
    with pytest.raises(nvckpt.LimitError, match="nothing was written"):
        nvckpt.save(state, buf)
    assert buf.getvalue() == b""
