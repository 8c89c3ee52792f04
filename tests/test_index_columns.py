"""The compiled index reader (nvckpt/format/_columns.c) against the Python one, its oracle.

An index is read in pieces (from bulk.STREAM_FROM bytes on, lowered to 0 here so that every file takes
that way) either by the compiled reader (plain one-chunk entries into columns, the tree's tensor paths
from its bytes) or by the Python steps it replaces.  For every conformance file and for generated
indexes (hypothesis: plain entries with one thing changed, trees of aliases, nested maps, int keys,
tuples, typed values, and bytes changed at random) both must give the same table (every entry, its
chunks, every path, the tree, the metadata) or the same error with the same message.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import struct

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import nvckpt
from conformance import craft
from nvckpt.format import bulk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILED = bulk.compiled

pytestmark = pytest.mark.skipif(COMPILED is None, reason="the compiled index reader is not built here")


@contextlib.contextmanager
def _reader(compiled: bool):
    saved = bulk.STREAM_FROM, bulk.compiled
    bulk.STREAM_FROM, bulk.compiled = 0, (COMPILED if compiled else None)
    try:
        yield
    finally:
        bulk.STREAM_FROM, bulk.compiled = saved


def _table(data: bytes, compiled: bool) -> tuple:
    """What opening ``data`` gives: the index as plain values, or the error's type and message."""
    with _reader(compiled):
        try:
            with nvckpt.open(io.BytesIO(data)) as ck:
                ix = ck.file.index
                entries = [(e.tensor_id, e.description(), e.chunks.to_json() if e.chunks is not None else None,
                            e.unsupported, e.kind) for e in ix.tensors]
                paths = list(ix.paths.items())
                looked_up = [ix.paths[p] for p, _ in paths] + [ix.paths.get(p + "~") for p, _ in paths[:3]]
                return ("ok", entries, paths, looked_up, len(ix.paths), sorted(ix.arrays),
                        repr(ix.tree), repr(ix.metadata), repr(ix.codecs), repr(ix.writer), ix.version)
        except nvckpt.NvckptError as exc:
            return (type(exc).__name__, str(exc))


def _agree(data: bytes) -> tuple:
    fast, slow = _table(data, True), _table(data, False)
    assert fast == slow
    return fast


# -- every conformance file ----------------------------------------------------------------------------

def _cases() -> list[str]:
    with open(os.path.join(ROOT, "conformance", "manifest.json")) as f:
        return [c["file"] for c in json.load(f)["cases"]]


def test_every_conformance_file_reads_as_the_python_reader_reads_it():
    outcomes = set()
    for name in _cases():
        with open(os.path.join(ROOT, "conformance", name), "rb") as f:
            outcomes.add(_agree(f.read())[0])
    assert {"ok", "FormatError", "LimitError"} <= outcomes


# -- generated indexes ---------------------------------------------------------------------------------

def _base() -> bytes:
    g = torch.Generator().manual_seed(5)
    state = {f"layer{i}.w": torch.randn(1 + i % 3, generator=g) for i in range(12)}
    state["h"] = torch.ones(2, 2, dtype=torch.bfloat16)
    state["step"] = torch.tensor(3)
    state["big"] = torch.randn(300, generator=g)  # several chunks: not a plain entry
    buf = io.BytesIO()
    nvckpt.save(state, buf, chunk_size=512, alignment=1)
    return buf.getvalue()


BASE = _base()
BASE_INDEX = craft.parse(BASE).index
N = len(BASE_INDEX["tensors"])


def _ref(tid: int, code: int = 1, size: int = 4) -> msgpack.ExtType:
    return msgpack.ExtType(code, struct.pack("<I", tid)[:size] + bytes(max(0, size - 4)))


ENTRY_CHANGES = {
    "name": ["layer1.w", "a/b~c", "é", "x" * 1100, "y" * 1025, "", b"bytes", 5],
    "dtype": ["float7", "bfloat16", "int8", 3, "float64"],
    "shape": [[], [0], [-1], [True], [(1 << 64) - 1], [1] * 65, [1.0], [2, 2], [4], [1, 1, 1]],
    "checksum": [None, -3, (1 << 64) - 1, "x", True, 0],
    "internal": [True, 1],
    "future": [{"k": [1, 2]}, None],
}
CHUNK_CHANGES = [(0, 0), (0, 71), (0, 1 << 40), (0, -1), (1, 0), (1, (16 << 20) + 1), (2, 4), (2, 0),
                 (3, 7), (3, -1), (3, 1 << 16), (4, -1), (4, (1 << 64) - 1), (4, True), (0, 1.5)]
TREE_CHANGES = ["empty-key", "alias", "nested", "int-keys", "mixed-keys", "tuple", "array-ref", "beyond", "escaped-keys",
                "scalars", "short-ref", "set", "same-path", "list", "float-key", "deep", "no-refs"]


def _change_entry(index: dict, tid: int, how: tuple) -> None:
    entry = index["tensors"][tid]
    kind = how[0]
    if kind == "entry":
        index["tensors"][tid] = how[1]
    if not isinstance(entry, dict) or kind == "entry":
        return
    if kind == "key":
        _, key, value = how
        entry[key] = value
    elif kind == "drop":
        entry.pop(how[1], None)
    elif kind == "chunk":
        _, field, value = how
        chunks = entry.get("chunks")
        if isinstance(chunks, list) and chunks and isinstance(chunks[0], list) and len(chunks[0]) > field:
            chunks[0][field] = value
    elif kind == "chunks":
        entry["chunks"] = how[1]
    elif kind == "duplicate":
        other = index["tensors"][how[1] % N]
        entry["name"] = other.get("name") if isinstance(other, dict) else other


def _change_tree(index: dict, how: str, tid: int) -> None:
    tree = index["tree"] if isinstance(index["tree"], dict) else index["tree"][0]
    if how == "empty-key":
        tree[""] = {"x": _ref(tid), "": [_ref(tid)]}
    elif how == "alias":
        tree["alias"] = _ref(tid)
    elif how == "nested":
        tree["sub"] = {"x": _ref(tid), "y": [_ref((tid + 1) % N), 2], "z": {"w": _ref(tid)}}
    elif how == "int-keys":
        tree["opt"] = {0: {"exp_avg": _ref(tid)}, 1: {"exp_avg": _ref((tid + 1) % N)}, -3: 4}
    elif how == "mixed-keys":
        tree["m"] = {1: _ref(tid), "1": _ref(tid if tid % 2 else (tid + 1) % N)}
    elif how == "tuple":
        tree["t"] = msgpack.ExtType(2, craft.pack([_ref(tid), 0.9, [_ref(tid)]]))
    elif how == "array-ref":
        tree["np"] = _ref(tid, code=9)
    elif how == "beyond":
        tree["far"] = _ref(N + tid)
    elif how == "escaped-keys":
        tree["a/b"] = {"~c": _ref(tid)}
    elif how == "scalars":
        tree["s"] = [1.5, None, b"bin", "str", True, -7, 1 << 63, {"k": []}]
    elif how == "short-ref":
        tree["short"] = _ref(tid, size=3)
    elif how == "set":
        tree["set"] = msgpack.ExtType(7, craft.pack([1, 2]))
    elif how == "same-path":
        tree["q"] = {"a/b": _ref(tid)}
        tree["q~1"] = _ref(tid)  # no clash: "q/a~1b" and "q~01"
    elif how == "list":
        index["tree"] = [tree, _ref(tid)]
    elif how == "float-key":
        tree[1.5] = _ref(tid)
    elif how == "deep":
        node = _ref(tid)
        for _ in range(70):
            node = {"d": node}
        tree["deep"] = node
    elif how == "no-refs":
        index["tree"] = {"step": 3}


entry_change = st.one_of(
    st.sampled_from([("key", k, v) for k, vs in ENTRY_CHANGES.items() for v in vs]),
    st.sampled_from([("drop", k) for k in ("name", "dtype", "shape", "chunks", "checksum")]),
    st.sampled_from([("chunk", f, v) for f, v in CHUNK_CHANGES]),
    st.sampled_from([("chunks", []), ("chunks", [[100, 1, 1, 0, 0]] * 2), ("chunks", [[100, 1, 4, 0, 0, 9]]),
                     ("chunks", {"0": 1}), ("chunks", [{"o": 1}])]),
    st.sampled_from([("entry", None), ("entry", []), ("entry", "x")]),
    st.integers(0, N).map(lambda k: ("duplicate", k)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.lists(st.tuples(st.integers(0, N - 1), entry_change), max_size=3),
       tree_changes=st.lists(st.tuples(st.sampled_from(TREE_CHANGES), st.integers(0, N - 1)), max_size=2),
       flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=2),
       bad_utf8=st.sampled_from([None, "entry", "key"]))
@example(changes=[(3, ("duplicate", 1))], tree_changes=[], flips=[], bad_utf8=None)
@example(changes=[(2, ("chunk", 3, 7)), (5, ("duplicate", 0))], tree_changes=[], flips=[], bad_utf8=None)
@example(changes=[], tree_changes=[("mixed-keys", 2)], flips=[], bad_utf8=None)
@example(changes=[], tree_changes=[("empty-key", 2)], flips=[], bad_utf8=None)
@example(changes=[(0, ("key", "name", "layer1.w"))], tree_changes=[], flips=[], bad_utf8="entry")
@example(changes=[], tree_changes=[], flips=[], bad_utf8="entry")
def test_generated_indexes_read_as_the_python_reader_reads_them(changes, tree_changes, flips, bad_utf8):
    index = craft.unpack(craft.pack(BASE_INDEX))
    for tid, how in changes:
        _change_entry(index, tid, how)
    for how, tid in tree_changes:
        _change_tree(index, how, tid)
    payload = bytearray(craft.pack(index))
    if bad_utf8:  # a name's first byte made 0xff: the entry's (first place) or the tree's key (last)
        name = craft.pack("layer4.w")
        at = payload.find(name) if bad_utf8 == "entry" else payload.rfind(name)
        payload[at + 1] = 0xFF
    for where, value in flips:
        payload[where % len(payload)] = value
    _agree(craft.with_index_payload(BASE, bytes(payload)))


@pytest.mark.parametrize("field, value", [(0, 1 << 40), (3, 9)])
def test_a_bad_chunk_where_every_entry_is_plain(field, value):
    """Entries all plain (the index's bytes let go before they are parsed), one with a chunk past the index or
    of a codec the table lacks: refused as the Python reader refuses it."""
    g = torch.Generator().manual_seed(1)
    buf = io.BytesIO()
    nvckpt.save({f"w{i}": torch.randn(2, generator=g) for i in range(40)}, buf)
    index = craft.parse(buf.getvalue()).index
    index["tensors"][17]["chunks"][0][field] = value
    assert _agree(craft.with_index_payload(buf.getvalue(), craft.pack(index)))[0] == "FormatError"


def test_paths_of_the_compiled_reader_are_a_mapping():
    with _reader(True):
        with nvckpt.open(io.BytesIO(BASE)) as ck:
            paths = ck.file.index.paths
            assert isinstance(paths, bulk.PathTable) and len(paths) == N
            assert paths["layer3.w"] == 3 and "layer3.w" in paths and "nope" not in paths and 3 not in paths
            assert paths.get("nope", -1) == -1 and paths.get("\udcff") is None
            assert dict(paths) == {p: i for p, i in zip(ck.keys(), paths.values())} == dict(paths.items())
            assert ck["layer3.w"].shape == (1,) and ck.keys()[:2] == ["layer0.w", "layer1.w"]
            assert dict(pickle.loads(pickle.dumps(paths))) == dict(paths)
            assert type(ck.file.index.stored_tree) is bulk.LazyTree
            tree = ck.file.index.tree
            assert ck.file.index.stored_tree is tree and isinstance(tree, dict) and len(tree) == N
