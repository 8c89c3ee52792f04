"""The typed extensions of the tree (SPEC 9.2) from hostile files: a device index beyond what torch holds is
refused, never loaded as another device, and typed values count against ``max_index_memory`` as they are
decoded, like the index's containers."""

from __future__ import annotations

import io
import tracemalloc

import msgpack
import pytest
import torch

import nvckpt
from conformance import craft


def _with_tree_value(value: msgpack.ExtType) -> bytes:
    """A typed file (required_features bit 1) whose tree's "d" is ``value``."""
    buf = io.BytesIO()
    nvckpt.save({"w": torch.arange(4.0), "d": torch.device("cuda:1")}, buf, codec="raw")
    nv = craft.parse(buf.getvalue())
    nv.index["tree"]["d"] = value
    return craft.build(nv)


@pytest.mark.parametrize("spec", ["cuda:128", "cuda:255", "cuda:65535", "cuda:999999999"])
def test_a_device_index_torch_cannot_hold_is_refused(spec):
    data = _with_tree_value(msgpack.ExtType(4, spec.encode()))
    with nvckpt.open(io.BytesIO(data)) as ck:  # the file is valid: its device is kept exactly as stored
        assert ck.index.tree["d"].spec == spec
        assert torch.equal(ck["w"], torch.arange(4.0))
    with pytest.raises(nvckpt.UnsupportedFeatureError, match=f"{spec}.*cannot represent"):
        nvckpt.load(io.BytesIO(data))


def test_a_device_index_torch_holds_loads_as_itself():
    for spec in ("cuda:0", "cuda:127", "cpu", "meta:3"):
        assert nvckpt.load(io.BytesIO(_with_tree_value(msgpack.ExtType(4, spec.encode()))))["d"] == torch.device(spec)


def _array(items: list[bytes]) -> bytes:
    return b"\xdd" + len(items).to_bytes(4, "big") + b"".join(items)


def _array_of(count: int, item: bytes) -> bytes:
    return _array([item] * count)


def _ext(code: int, data: bytes) -> bytes:
    return craft.pack(msgpack.ExtType(code, data))


def _file_with_raw_tree(tree: bytes) -> bytes:
    nv = craft.parse(_with_tree_value(msgpack.ExtType(4, b"cpu")))
    index = dict(nv.index)
    nv.index_frame().payload = (msgpack.Packer().pack_map_header(len(index)) + b"".join(
        craft.pack(k) + (tree if k == "tree" else craft.pack(v)) for k, v in index.items()))
    return craft.build(nv, fix_index=False)


N = 200_000
TYPED_BOMBS = {  # each a 0.5-2.4 MB tree whose values take 6-30 times their bytes as Python objects
    "device": _array_of(N, _ext(4, b"a")),
    "dtype": _array_of(N, _ext(3, b"a")),
    "complex": _array_of(N // 4, _ext(5, bytes(16))),
    "bigint": _array_of(N // 4, _ext(6, (2**64).to_bytes(9, "little"))),
    "frozenset": _array_of(N, _ext(8, b"\x91\xc0")),
    "set-of-ints": _array_of(N // 1000, _ext(7, _array([craft.pack(i) for i in range(1000)]))),
    "ext-under-unknown-key": None,  # built below: exts a reader ignores are kept, and counted
}


def _unknown_key_exts() -> bytes:
    nv = craft.parse(_with_tree_value(msgpack.ExtType(4, b"cpu")))
    index = dict(nv.index)
    nv.index_frame().payload = (msgpack.Packer().pack_map_header(len(index) + 1) + b"".join(
        craft.pack(k) + craft.pack(v) for k, v in index.items()) + craft.pack("x-future") + _array_of(N, _ext(9, b"")))
    return craft.build(nv, fix_index=False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(TYPED_BOMBS))
def test_typed_values_count_against_the_index_memory_bound(kind):
    data = _unknown_key_exts() if TYPED_BOMBS[kind] is None else _file_with_raw_tree(TYPED_BOMBS[kind])
    budget = 4 * len(data)
    tracemalloc.start()
    try:
        with pytest.raises(nvckpt.LimitError, match="max_index_memory"):
            nvckpt.open(io.BytesIO(data), untrusted=True, max_index_memory=budget)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # What decoding may hold beyond the budget: the payload itself and the array msgpack allocates for its
    # header's count (8 bytes an item, items of 1-3 bytes here); before the values were charged: up to 8x it.
    assert peak < budget + 4 * len(data), f"{kind}: {peak:,} bytes for a budget of {budget:,}"
    with nvckpt.open(io.BytesIO(data), untrusted=True) as ck:  # the default bound (1 GiB) holds them
        assert len(ck.index.tree if TYPED_BOMBS[kind] is not None else ck.index.tensors) > 0
