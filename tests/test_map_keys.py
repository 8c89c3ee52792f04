"""SPEC 1, "the same key", for keys of every kind (nil, bool, int, float, str, bin, ext, timestamp, array,
map): nvckpt's decoder and the independent reader (conformance/reference_reader.py) agree on every pair of
keys, and neither fails on a key it is told to ignore."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nvckpt
from conformance import reference_reader
from nvckpt.format.tree import unpackb


def _map(pairs: list[tuple[bytes, bytes]]) -> bytes:
    return msgpack.Packer().pack_map_header(len(pairs)) + b"".join(k + v for k, v in pairs)


_numbers = st.one_of(
    st.booleans().map(msgpack.packb),
    st.integers(-(2**63), 2**64 - 1).map(msgpack.packb),
    st.sampled_from([0.0, -0.0, 1.0, 2.0**53, 2.0**64, float("nan"), float("inf"), 0.5]).map(
        lambda x: b"\xcb" + struct.pack(">d", x)),
    st.integers(0, 2**32 - 1).map(lambda bits: b"\xca" + struct.pack(">I", bits)),  # float 32, NaNs included
)
_scalars = st.one_of(
    st.just(b"\xc0"), _numbers, st.sampled_from(["", "a", "1", "ab"]).map(msgpack.packb),
    st.sampled_from([b"", b"a", b"ab"]).map(lambda b: msgpack.packb(b, use_bin_type=True)),
    st.tuples(st.integers(0, 3), st.sampled_from([b"", b"x", b"\x91\x01"])).map(
        lambda t: msgpack.packb(msgpack.ExtType(*t))),
    st.sampled_from([b"\xd6\xff" + struct.pack(">I", 7), b"\xd7\xff" + struct.pack(">Q", 7),
                     b"\xd6\xff" + struct.pack(">I", 8), b"\xd4\xfe\x00"]),  # timestamps 7 s (two forms), 8 s; ext -2
)
_keys = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3).map(lambda items: msgpack.Packer().pack_array_header(len(items)) + b"".join(items)),
    st.lists(st.tuples(_scalars, inner), max_size=2).map(_map)), max_leaves=6)


def _nvckpt_same(payload: bytes) -> bool:
    try:
        unpackb(payload)
    except nvckpt.FormatError:
        return True  # the only fault these maps can have: one key twice (or, within a key, a map that has)
    return False


def _reference_same(payload: bytes) -> bool:
    try:
        reference_reader.unpack_one(payload)
    except reference_reader.FormatError:
        return True
    return False


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(_keys, _keys)
def test_both_readers_call_the_same_pairs_of_keys_the_same(k1, k2):
    payload = _map([(k1, b"\x01"), (k2, b"\x02")])
    assert _nvckpt_same(payload) == _reference_same(payload), payload.hex()


@pytest.mark.parametrize("k1, k2, same", [
    (msgpack.packb(b"ab", use_bin_type=True), msgpack.packb(b"ab", use_bin_type=True), True),
    (msgpack.packb(b"ab", use_bin_type=True), msgpack.packb("ab"), False),
    (msgpack.packb(msgpack.ExtType(9, b"x")), msgpack.packb(msgpack.ExtType(9, b"x")), True),
    (msgpack.packb(msgpack.ExtType(9, b"x")), msgpack.packb(msgpack.ExtType(10, b"x")), False),
    (msgpack.packb(msgpack.ExtType(2, msgpack.packb([1]))), msgpack.packb(msgpack.ExtType(2, msgpack.packb([1.0]))), False),
    (msgpack.packb([1, "a"]), msgpack.packb([True, "a"]), True),
    (msgpack.packb([1]), msgpack.packb([1.5]), False),
    (msgpack.packb({"a": 1, "b": 2}), msgpack.packb({"b": 2, "a": 1.0}), True),
    (msgpack.packb({"a": 1}), msgpack.packb({"a": 2}), False),
    (b"\xd6\xff" + struct.pack(">I", 7), b"\xd7\xff" + struct.pack(">Q", 7), True),
])
def test_the_same_key_of_every_kind(k1, k2, same):
    payload = _map([(k1, b"\x01"), (k2, b"\x02")])
    assert _nvckpt_same(payload) is same and _reference_same(payload) is same


def test_a_single_array_or_map_key_decodes():
    """A value a reader ignores may hold such keys (msgpack-python's dict cannot: unhashable type 'list')."""
    for key in (msgpack.packb([1, 2]), msgpack.packb({"a": [1]}), msgpack.packb([[{"b": 1}]])):
        value = unpackb(_map([(key, b"\x01")]))
        assert len(value) == 1
