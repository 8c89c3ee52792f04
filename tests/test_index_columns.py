"""The compiled index reader (nvckpt/format/_columns.c) against the Python one, its oracle.

An index is read in pieces (from bulk.STREAM_FROM bytes on, lowered to 0 here so that every file takes
that way) either by the compiled reader (data, view and derived entries into columns, the tree's tensor
paths from its bytes) or by the Python steps it replaces.  For every conformance file and for generated
indexes (hypothesis: plain entries with one thing changed, trees of aliases, nested maps, int keys,
tuples, typed values, and bytes changed at random; indexes of every entry kind, multi-chunk, derived by
each function, views of an internal base, empty tensors, with their fields changed, dropped, reordered
or added) both must give the same table (every entry, its chunks, every path, the tree, the metadata)
or the same error with the same message.
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
from hypothesis import HealthCheck, event, example, given, settings
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
                # (repr: a view's or derived map's keys in the order the file gives them; chunks with their raw starts)
                entries = [(e.tensor_id, repr(e.description()), list(map(tuple, e.chunks)) if e.chunks is not None
                            else None, e.unsupported, e.kind) for e in ix.tensors]
                paths = list(ix.paths.items())
                looked_up = [ix.paths[p] for p, _ in paths] + [ix.paths.get(p + "~") for p, _ in paths[:3]]
                return ("ok", entries, ck.file.index.tensors.not_internal(), paths, looked_up, len(ix.paths),
                        sorted(ix.arrays),
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
    state["big"] = torch.randn(300, generator=g)  # several chunks
    return _saved(state)


def _saved(state: dict) -> bytes:
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


# -- indexes of every entry kind -----------------------------------------------------------------------

def _every_kind() -> bytes:
    """A state with an entry of each kind a writer makes: one-chunk and multi-chunk data entries, an empty
    tensor, tensors derived by bf16_rne and by copy, views of an internal base."""
    g = torch.Generator().manual_seed(7)
    master = {f"m{i}": torch.randn(2 + i % 3, 4, generator=g) for i in range(4)}
    flat = torch.randn(40, generator=g)
    state = {"master": master, "model": {k: v.to(torch.bfloat16) for k, v in master.items()},
             "step": {i: torch.tensor(3.0) for i in range(3)},
             "views": {"a": flat[:8].view(2, 4), "b": flat[8:20], "t": flat[20:].view(4, 5).t()},
             "big": torch.randn(300, generator=g), "empty": torch.empty(0, 3), "w": torch.ones(3, dtype=torch.int16)}
    return _saved(state)


KINDS = _every_kind()
KINDS_INDEX = craft.parse(KINDS).index
KINDS_N = len(KINDS_INDEX["tensors"])
MULTI = next(i for i, e in enumerate(KINDS_INDEX["tensors"]) if len(e.get("chunks", ())) > 1)
EMPTY = next(i for i, e in enumerate(KINDS_INDEX["tensors"]) if e.get("chunks") == [])


def test_the_state_of_every_kind_has_every_kind():
    tensors = KINDS_INDEX["tensors"]
    assert {e["derived"]["function"] for e in tensors if "derived" in e} == {"bf16_rne", "copy"}
    assert any("view" in e for e in tensors) and any(e.get("internal") for e in tensors) and MULTI and EMPTY
    # every entry a writer made is read into the columns
    columns = COMPILED.entries(craft.pack(tensors), bulk._DTYPES, bulk.DERIVED_FUNCTIONS)
    assert columns["in_columns"] == b"\x01" * KINDS_N
    assert _agree(KINDS)[0] == "ok"


REF_VALUES = [0, 1, 3, 11, 12, 15, 16, 17, KINDS_N, (1 << 24), (1 << 24) + 1, -1, True, "x", None, 1.0]
KIND_CHANGES = (
    [("derived", "function", v) for v in ["copy", "bf16_rne", "future_fn", "", 3, None, b"copy"]]
    + [("derived", "source", v) for v in REF_VALUES]
    + [("view", "base", v) for v in REF_VALUES]
    + [("view", "offset", v) for v in [0, 7, 28, 39, 40, 1 << 62, (1 << 62) + 1, -1, 1.0, True]]
    + [("view", "stride", v) for v in [[], [1], [1, 1], [0, 0], [4, 1, 1], [-1, 1], [1 << 62, 1], [(1 << 62) + 1, 1],
                                       "x", [True, 1], [1.0, 1], [1] * 65]]
    + [("view", "future", {"k": [1]}), ("derived", "future", 1)]
    + [(k, "drop", f) for k, fs in (("view", ("base", "offset", "stride")), ("derived", ("function", "source")))
       for f in fs]
    + [(k, "reorder", None) for k in ("view", "derived")]
    + [(k, "as", v) for k in ("view", "derived") for v in ([1, 2], "x", None, {})]
)
_DEEP: object = 1
for _ in range(70):
    _DEEP = [_DEEP]
KIND_ENTRY_CHANGES = {
    "name": ["master/m0", "views/a@base", "é", "x" * 4096, "x" * 4097, "é" * 2048 + "x", "", b"n", 5],
    "dtype": ["float32", "bfloat16", "int16", "float64", "uint8", "float7", 3],
    "shape": [[], [0], [0, 0], [2, 4], [3, 4], [40], [12], [1 << 31, 1 << 30], [1 << 40, 1 << 30], [1 << 62],
              [(1 << 62) + 1], [(1 << 64) - 1, 0], [0, 1 << 63], [-1], [True], [1] * 64, [1] * 65],
    "checksum": [None, -1, 0, (1 << 64) - 1, -(1 << 63), "x", True],
    "internal": [True, False, 1, None, "true"],
    "future": [{"k": [1, 2]}, None, _DEEP],
    "chunks": [[], [[100, 1, 1, 0, 0]] * 2],
    "view": [{"base": 11, "offset": 0, "stride": []}],
    "derived": [{"function": "copy", "source": 8}],
}
KIND_CHUNK_CHANGES = [(0, 71), (0, 72), (0, 1 << 40), (0, -1), (1, 0), (1, 1 << 24), (1, (1 << 24) + 1),
                      (2, 1), (2, 2), (2, 0), (2, 1 << 24), (3, 1), (3, 0xFFFF), (3, 1 << 16), (3, -1),
                      (4, -1), (4, -(1 << 63)), (4, True), (0, 1.5)]

kind_change = st.one_of(
    st.sampled_from([("key", k, v) for k, vs in KIND_ENTRY_CHANGES.items() for v in vs]),
    st.sampled_from([("drop", k) for k in ("name", "dtype", "shape", "chunks", "view", "derived", "checksum",
                                           "internal")]),
    st.sampled_from(KIND_CHANGES).map(lambda c: ("kind", *c)),
    st.sampled_from(KIND_CHANGES).map(lambda c: ("kind", *c)),  # (twice as often: the references' checks)
    st.tuples(st.integers(0, 3), st.sampled_from(KIND_CHUNK_CHANGES)).map(lambda c: ("chunk", c[0], *c[1])),
    st.sampled_from([("chunks-op", op) for op in ("drop-last", "swap", "repeat", "merge", "split")]),
    st.sampled_from([("reorder", None), ("entry", None), ("entry", [])]),
    st.integers(0, KINDS_N).map(lambda k: ("duplicate", k)),
)


def _change_kind_entry(tensors: list, tid: int, how: tuple) -> None:
    entry = tensors[tid]
    op = how[0]
    if op == "entry":
        tensors[tid] = how[1]
    elif not isinstance(entry, dict):
        return
    elif op == "key":
        entry[how[1]] = how[2]
    elif op == "drop":
        entry.pop(how[1], None)
    elif op == "reorder":  # (the entry's keys in another order: the same entry)
        tensors[tid] = dict(reversed(list(entry.items())))
    elif op == "duplicate":
        other = tensors[how[1] % KINDS_N]
        entry["name"] = other.get("name") if isinstance(other, dict) else "x"
    elif op == "kind":
        _, kind, field, value = how
        inner = entry.get(kind)
        if not isinstance(inner, dict):
            return
        if field == "drop":
            inner.pop(value, None)
        elif field == "reorder":
            entry[kind] = dict(reversed(list(inner.items())))
        elif field == "as":
            entry[kind] = value
        else:
            inner[field] = value
    elif op == "chunk":
        _, at, field, value = how
        chunks = entry.get("chunks")
        if isinstance(chunks, list) and chunks:
            chunks[at % len(chunks)][field] = value
    elif op == "chunks-op":
        chunks = entry.get("chunks")
        if not isinstance(chunks, list) or not chunks:
            return
        kind = how[1]
        if kind == "drop-last":
            chunks.pop()
        elif kind == "swap":
            chunks.reverse()
        elif kind == "repeat":  # the same stored bytes twice: an overlap (SPEC 8.4)
            chunks.append(list(chunks[-1]))
        elif kind == "merge" and len(chunks) > 1:  # raw lengths moved between chunks: still adds up
            chunks[0][2] += chunks[1][2] - 4
            chunks[1][2] = 4
        elif kind == "split":  # a raw length that is not a multiple of the item size
            chunks[0][2] -= 1
            chunks.append([chunks[-1][0] + chunks[-1][1], 1, 1, 0, 0])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.lists(st.tuples(st.integers(0, KINDS_N - 1), kind_change), max_size=3),
       flips=st.one_of(st.just([]), st.just([]), st.just([]),  # (a byte changed at random in a quarter of them)
                       st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=1)))
@example(changes=[], flips=[])
@example(changes=[(4, ("kind", "derived", "source", 4))], flips=[])
@example(changes=[(12, ("kind", "view", "offset", 33))], flips=[])
@example(changes=[(13, ("kind", "view", "base", 12))], flips=[])
@example(changes=[(9, ("kind", "derived", "function", "future_fn"))], flips=[])
@example(changes=[(15, ("chunk", 1, 3, 1))], flips=[])
@example(changes=[(15, ("chunks-op", "merge")), (3, ("reorder", None))], flips=[])
@example(changes=[(6, ("key", "shape", [1 << 31, 1 << 30]))], flips=[])
@example(changes=[(12, ("kind", "view", "base", 0))], flips=[])  # a 2-D base
@example(changes=[(12, ("kind", "view", "base", 15))], flips=[])  # another 1-D base, long enough
@example(changes=[(12, ("key", "dtype", "bfloat16"))], flips=[])  # a base of another dtype
@example(changes=[(13, ("key", "shape", [0]))], flips=[])  # a view of no element
@example(changes=[(4, ("kind", "derived", "source", 5))], flips=[])  # a source that is not stored
@example(changes=[(4, ("kind", "derived", "source", 1))], flips=[])  # a source of another shape
@example(changes=[(9, ("kind", "derived", "function", "bf16_rne"))], flips=[])
@example(changes=[(9, ("kind", "derived", "source", 40))], flips=[])
@example(changes=[(11, ("key", "internal", False)), (8, ("key", "internal", True))], flips=[])
def test_indexes_of_every_entry_kind_read_as_the_python_reader_reads_them(changes, flips):
    index = craft.unpack(craft.pack(KINDS_INDEX))
    for tid, how in changes:
        _change_kind_entry(index["tensors"], tid, how)
    payload = bytearray(craft.pack(index))
    for where, value in flips:
        payload[where % len(payload)] = value
    outcome = _agree(craft.with_index_payload(KINDS, bytes(payload)))
    event(outcome[0] if outcome[0] == "ok" else outcome[0] + ": " + outcome[1][:60])


@pytest.mark.parametrize("tid, how", [(15, ("chunk", 2, 0, 1 << 40)), (15, ("chunk", 1, 3, 9)),
                                      (12, ("kind", "view", "base", 40))])
def test_a_bad_entry_where_every_entry_is_in_the_columns(tid, how):
    """Every entry in the columns (the index's bytes let go before they are parsed), one wrong only in a way
    the columns check a column at a time (a chunk past the index or of a codec the table lacks, a view's
    base that is not there): refused as the Python reader refuses it."""
    index = craft.unpack(craft.pack(KINDS_INDEX))
    _change_kind_entry(index["tensors"], tid, how)
    assert _agree(craft.with_index_payload(KINDS, craft.pack(index)))[0] == "FormatError"
