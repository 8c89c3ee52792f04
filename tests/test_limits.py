"""SPEC 16's limits and the nesting bounds: a reader refuses what is over them with a named error (never a
crash, a recursion error or an allocation far beyond the file), and a save fails before it publishes a file a
reader would refuse.

The hostile-file run over every path under a memory cap, and the million-chunk timing, are
tests/test_hostile.py.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

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
from conftest import assert_tensor_equal  # noqa: E402
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


# -- nesting: bounded before msgpack's recursion, in every payload and on every path (SPEC 9, 16) ------------

def test_tuples_200_deep_are_a_limit_error_not_a_segfault():
    """A 1.4 KB file: tuples nested 200 deep in the tree crashed msgpack's C unpacker."""
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


def _nested_dicts(levels: int) -> dict:
    """``levels`` dicts, each inside the one before (the outermost is level 1)."""
    root: dict = {}
    node = root
    for _ in range(levels - 1):
        node["a"] = {}
        node = node["a"]
    return root


def test_metadata_nested_65_deep_is_refused_by_save():
    # The reader rejects metadata nested deeper than 64 (SPEC 8.6, the map itself is level 1);
    # save used to count from 0 and write a file that then could not be opened.
    with pytest.raises(nvckpt.LimitError):
        nvckpt.save({"w": torch.ones(2)}, io.BytesIO(), metadata=_nested_dicts(65))
    stream = io.BytesIO()
    nvckpt.save({"w": torch.ones(2)}, stream, metadata=_nested_dicts(64))
    stream.seek(0)
    with nvckpt.open(stream) as ck:
        assert ck.metadata() == _nested_dicts(64)


def test_tree_of_64_containers_with_leaves_inside_saves_and_loads():
    # SPEC 9 counts containers (the root is depth 1): 64 nested lists are legal, whatever leaf
    # the innermost holds.  save used to count the leaf as a level and refuse the tree.
    for leaf in (7, torch.arange(3)):
        obj: object = leaf
        for _ in range(64):
            obj = [obj]
        stream = io.BytesIO()
        nvckpt.save(obj, stream)
        stream.seek(0)
        back = nvckpt.load(stream)
        for _ in range(64):
            assert isinstance(back, list) and len(back) == 1
            back = back[0]
        if isinstance(leaf, torch.Tensor):
            assert_tensor_equal(back, leaf)
        else:
            assert back == leaf
    with pytest.raises(nvckpt.LimitError):
        nvckpt.save([obj], io.BytesIO())  # 65 containers


# -- the write side: what a reader would refuse fails before anything is published ---------------------------

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


def test_an_int_too_large_for_a_reader_is_refused_at_save():
    # SPEC 16: a reader refuses big integers over 1024 bytes; save wrote them, and the file did not load.
    ok = io.BytesIO()
    nvckpt.save({"seed": 1 << 8190}, ok)  # 1024 bytes: the limit itself
    ok.seek(0)
    assert nvckpt.load(ok)["seed"] == 1 << 8190
    with pytest.raises(nvckpt.LimitError, match="integer at seed takes 1026 bytes"):
        nvckpt.save({"w": torch.ones(2), "seed": 2 ** 8200}, io.BytesIO())


# -- a large index: chunk tables as columns, decoded in pieces, within a memory bound ------------------------

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


@pytest.mark.slow
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


@pytest.mark.slow
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


# -- tensor sizes: max_tensor_bytes covers views, a huge legal tensor is a named error -----------------------

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


@pytest.mark.slow
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
