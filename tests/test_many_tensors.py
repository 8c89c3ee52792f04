"""States of very many small tensors: their index entries are parsed a column at a time (by the compiled
reader, nvckpt/format/_columns.c, or nvckpt.format.entry.plain_entries, decoded in batches by
bulk.LazyEntries.plain), and every file is
accepted or refused exactly as the one-entry-at-a-time checks accept or refuse it, with the same message."""

from __future__ import annotations

import io
import struct

import pytest
import torch

import nvckpt
from conformance import craft
from conftest import assert_tree_equal
from nvckpt.format import index as index_module

N = 5000  # more than one batch (nvckpt.format.index._BATCH)


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    state = {f"layer{i}.w": torch.randn(1 + i % 3, generator=g) for i in range(N)}
    state["big"] = torch.randn(4096, generator=g)  # several chunks: a run breaks here
    state["step"] = torch.tensor(7)  # a 0-d tensor: shape []
    state["empty"] = torch.zeros(0, 3)  # no chunk
    flat = torch.arange(10.0)
    state["views"] = [flat[:4], flat[3:9]]  # view entries on an internal base
    state["half"] = torch.ones(3, dtype=torch.bfloat16)
    state["more"] = {f"m{i}": torch.full((2, 2), float(i), dtype=torch.float64) for i in range(N // 2)}
    return state


@pytest.fixture(scope="module")
def saved() -> tuple[dict, bytes]:
    state = _state()
    buf = io.BytesIO()
    nvckpt.save(state, buf, chunk_size=1024, alignment=1)
    return state, buf.getvalue()


def _one_at_a_time(monkeypatch) -> None:
    """Every entry through parse_entry: neither the compiled column reader nor plain_entries' runs."""
    from nvckpt.format import bulk

    monkeypatch.setattr(bulk, "compiled", None)
    monkeypatch.setattr(index_module, "plain_entries", lambda *args, **kwargs: [])


def test_a_state_of_many_small_tensors_loads_whole(saved, index_decoding):
    state, data = saved
    with nvckpt.open(io.BytesIO(data)) as ck:
        assert len(ck.keys()) == N + N // 2 + 6
        assert ck.file.index.tensors[0].shape == (1,) and ck.file.index.tensors[3].shape is ck.file.index.tensors[0].shape
        assert_tree_equal(ck.load(), state)


def test_entries_parsed_by_columns_are_those_of_the_one_at_a_time_checks(saved, monkeypatch, index_decoding):
    _, data = saved
    with nvckpt.open(io.BytesIO(data)) as ck:
        fast = [e.description() | {"chunks": e.chunks.to_json() if e.chunks is not None else None}
                for e in ck.file.index.tensors]
    _one_at_a_time(monkeypatch)
    with nvckpt.open(io.BytesIO(data)) as ck:
        slow = [e.description() | {"chunks": e.chunks.to_json() if e.chunks is not None else None}
                for e in ck.file.index.tensors]
    assert fast == slow


def _bad(entry: dict, how: str, nv: craft.NvFile) -> None:
    chunk = entry["chunks"][0]
    if how == "duplicate-name":
        entry["name"] = nv.index["tensors"][1]["name"]
    elif how == "raw-length":
        chunk[2] += 4
    elif how == "raw-over-limit":
        chunk[2] = (1 << 30) + 4
        entry["shape"] = [chunk[2] // 4]
    elif how == "codec-id":
        chunk[3] = 99
    elif how == "past-the-index":
        chunk[0] = 1 << 40
    elif how == "checksum-type":
        entry["checksum"] = True
    elif how == "negative":
        chunk[1] = -1
    elif how == "dimension-bool":
        entry["shape"] = [True]
    elif how == "name-type":
        entry["name"] = b"bytes"
    elif how == "unknown-key":
        entry["future"] = {"k": [1, 2]}
    elif how == "dtype-unknown":
        entry["dtype"] = "float7"
    elif how == "overlap":
        chunk[0] = nv.index["tensors"][2]["chunks"][0][0]


CASES = ["duplicate-name", "raw-length", "raw-over-limit", "codec-id", "past-the-index", "checksum-type",
         "negative", "dimension-bool", "name-type", "unknown-key", "dtype-unknown", "overlap"]


@pytest.mark.parametrize("how", CASES)
@pytest.mark.parametrize("at", [0, 7, 4100])  # at a batch's start, inside a run, in the second batch
def test_a_bad_entry_in_a_run_is_refused_as_one_at_a_time(saved, monkeypatch, index_decoding, how, at):
    """One entry changed amid thousands of plain ones (checksums made to match): the same outcome and the same
    message as the per-entry checks give."""
    _, data = saved
    nv = craft.parse(data)
    _bad(nv.index["tensors"][at], how, nv)
    nv.index_frame().payload = craft.pack(nv.index)  # as changed (build's fix_index would restore the chunks)
    changed = craft.build(nv, fix_index=False)

    def outcome() -> str:
        try:
            with nvckpt.open(io.BytesIO(changed)) as ck:
                try:
                    ck.get_tensor(nv.index["tensors"][at]["name"])
                except (nvckpt.NvckptError, KeyError) as exc:
                    return f"read: {type(exc).__name__}: {exc}"
                return "ok"
        except nvckpt.NvckptError as exc:
            return f"open: {type(exc).__name__}: {exc}"

    fast = outcome()
    _one_at_a_time(monkeypatch)
    assert fast == outcome()
    assert fast != "ok" or how == "unknown-key"


@pytest.mark.parametrize("change,message", [
    (lambda t: t.__setitem__("layer0.w", craft.msgpack.ExtType(1, struct.pack("<I", 10**6))),
     "tree refers to tensor 1000000"),
    (lambda t: t["more"].__setitem__(b"key", t["more"]["m0"]), "tree map key of type bytes"),
])
def test_a_tree_of_many_references_is_checked_as_one_of_few(saved, index_decoding, change, message):
    """The tree's dicts of references are checked a container at a time: a reference past the index, or a key
    of a type a tree may not have, is still refused."""
    _, data = saved
    nv = craft.parse(data)
    change(nv.index["tree"])
    nv.index_frame().payload = craft.pack(nv.index)
    with pytest.raises(nvckpt.FormatError, match=message):
        nvckpt.open(io.BytesIO(craft.build(nv, fix_index=False)))
