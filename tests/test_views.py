"""Non-contiguous views and tensors that share storage."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import nvckpt
from conftest import assert_tensor_equal, assert_tree_equal


def round_trip(obj, **kwargs):
    stream = io.BytesIO()
    nvckpt.save(obj, stream, **kwargs)
    stream.seek(0)
    return nvckpt.load(stream), stream


def entries(stream):
    stream.seek(0)
    with nvckpt.open(stream) as ck:
        return {e.name: e for e in ck.index.tensors}, ck.keys()


def file_size(obj, **kwargs) -> int:
    return nvckpt.save(obj, io.BytesIO(), codec="raw", alignment=1, **kwargs).file_bytes


@pytest.mark.parametrize("make", [
    lambda x: x.t(),
    lambda x: x[::2, 1::3],
    lambda x: x[:, 2],
    lambda x: x[1:, :].t()[::3],
    lambda x: x.unsqueeze(0).expand(3, -1, -1),  # stride 0
    lambda x: x.reshape(-1)[5:40:7],
    lambda x: x.as_strided((4, 4), (1, 5), 3),  # overlapping windows of one storage
    lambda x: x[3:4, 2],  # size-1 dim with stride 9: "contiguous", yet view() refuses it
    lambda x: x[0:0, 2],  # empty, stride 9
    lambda x: x[2, 3],  # 0-d at an offset
], ids=["transpose", "step-slices", "column", "transpose-step", "expand", "flat-step", "as_strided", "one-of-column",
        "empty-column", "0-d"])
def test_single_non_contiguous_view_loads_right_values(make):
    x = torch.randn(12, 9)
    view = make(x)
    back, _ = round_trip({"v": view})
    assert_tensor_equal(back["v"], view)


def test_view_stores_only_its_elements():
    big = torch.randn(100_000)
    small_view = big[500:510]
    assert file_size({"v": small_view}) < file_size({"v": torch.randn(10)}) + 64
    back, _ = round_trip({"v": small_view})
    assert_tensor_equal(back["v"], small_view)


def test_same_tensor_twice_is_one_object_stored_once():
    t = torch.randn(256, 64)
    back, stream = round_trip({"a": t, "b": [t, {"c": t}]})
    assert back["a"] is back["b"][0] is back["b"][1]["c"]
    assert_tensor_equal(back["a"], t)
    by_name, keys = entries(stream)
    assert list(by_name) == ["a"]
    assert keys == ["a", "b/0", "b/1/c"]
    once, twice = file_size({"a": t}), file_size({"a": t, "b": t})
    assert twice - once < 100, (once, twice)  # stored once: only the tree grows


def test_state_dict_tied_weights_load_tied():
    emb = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    sd = model.state_dict()
    assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
    back, stream = round_trip(sd)
    assert back["emb.weight"] is back["head.weight"]
    assert_tree_equal(back, sd)
    _, keys = entries(stream)
    assert keys == ["emb.weight", "head.weight"]
    stream.seek(0)
    with nvckpt.open(stream) as ck:
        assert_tensor_equal(ck.get_tensor("head.weight"), sd["head.weight"])  # the alias path
    # loading into a fresh model keeps it working (and tied)
    fresh = torch.nn.ModuleDict({"emb": torch.nn.Embedding(50, 16), "head": torch.nn.Linear(16, 50, bias=False)})
    fresh["head"].weight = fresh["emb"].weight
    fresh.load_state_dict(back)
    assert torch.equal(fresh["head"].weight, emb.weight)


def test_overlapping_views_share_memory_after_load():
    base = torch.arange(20, dtype=torch.float32)
    a, b = base[0:12], base[8:20]
    back, stream = round_trip({"a": a, "b": b})
    assert_tensor_equal(back["a"], a)
    assert_tensor_equal(back["b"], b)
    back["a"][9] = 100.0  # element 9 of a is element 1 of b
    assert back["b"][1] == 100.0
    assert back["a"].untyped_storage().data_ptr() == back["b"].untyped_storage().data_ptr()
    by_name, keys = entries(stream)
    assert keys == ["a", "b"]
    assert by_name["a@base"].internal and by_name["a@base"].shape == (20,)
    assert by_name["a"].view is not None and by_name["b"].view is not None
    stream.seek(0)
    with nvckpt.open(stream) as ck:  # the internal base is read by name, so `in` finds it too; keys() leaves it out
        assert "a@base" in ck and torch.equal(ck["a@base"], base) and "a@base" not in ck.keys()
        assert "c@base" not in ck and 3 not in ck
    stream.seek(0)
    some = nvckpt.load(stream, keys=["b", "a"])  # by keys: still views of one base
    assert some["a"].untyped_storage().data_ptr() == some["b"].untyped_storage().data_ptr()
    # the spanned elements are stored once: 20k, not 12k + 12k
    big = torch.randn(20_000)
    size = file_size({"a": big[:12_000], "b": big[8_000:]})
    assert 80_000 < size < 80_000 + 2_000, size


def test_weight_and_its_rows_and_transpose_share():
    w = torch.randn(8, 6)
    state = {"w": w, "row": w[3], "wt": w.t(), "col": w[:, 1], "window": w[2:5, 1:4]}
    back, stream = round_trip(state)
    assert_tree_equal(back, state)
    back["w"][3, 1] = 42.0
    assert back["row"][1] == 42.0 and back["wt"][1, 3] == 42.0 and back["col"][3] == 42.0 and back["window"][1, 0] == 42.0
    _, keys = entries(stream)
    assert keys == ["w", "row", "wt", "col", "window"]


def test_views_of_one_storage_with_different_dtypes():
    x = torch.randn(16)
    as_int = x.view(torch.int32)
    as_bf16 = x.view(torch.bfloat16)  # 32 halves of the same bytes
    c = torch.randn(5, dtype=torch.complex64)
    state = {"x": x, "as_int": as_int, "as_bf16": as_bf16[3:11], "c": c, "c_real": torch.view_as_real(c)}
    back, _ = round_trip(state)
    assert_tree_equal(back, state)


def test_views_of_each_dtype_share_a_base_when_the_storage_has_views_of_several():
    """The format's views share their base's dtype: a storage viewed as floats and as ints keeps the float
    views' sharing (one base) and the int views' (one more), and only the sharing between the two is lost."""
    x = torch.randn(4000)
    state = {"x": x, "head": x[:3000], "as_int": x.view(torch.int32), "int_tail": x.view(torch.int32)[1000:],
             "again": x.view(torch.int32)[1000:], "as_bytes": x.view(torch.uint8)}
    back, stream = round_trip(state, codec="raw")
    assert_tree_equal(back, state)
    assert back["int_tail"] is back["again"]  # one tensor (tied), as saved
    ptr = lambda k: back[k].untyped_storage().data_ptr()  # noqa: E731
    assert ptr("head") == ptr("x") and ptr("int_tail") == ptr("as_int") and ptr("as_int") != ptr("x")
    back["x"][1] = 5.0
    assert back["head"][1] == 5.0
    by_name, _ = entries(stream)
    assert by_name["x@base"].internal and by_name["as_int@base"].internal
    assert by_name["as_bytes"].view is None and not by_name["as_bytes"].internal
    # 4000 floats stored twice (as floats and as ints) and once as bytes: each dtype's base once.
    assert sum(e.nbytes for e in by_name.values() if e.is_data) == 3 * x.nbytes


def test_views_in_a_multichunk_base():
    base = torch.randn(4000)
    state = {"head": base[:3000], "tail": base[1000:], "strided": base[::7]}
    back, stream = round_trip(state, chunk_size=1024)
    assert_tree_equal(back, state)
    by_name, _ = entries(stream)
    assert len(by_name["head@base"].chunks) > 10


def test_optimizer_state_with_shared_and_viewed_params_round_trips():
    flat = torch.zeros(30)
    p1 = torch.nn.Parameter(flat[:20].view(4, 5))
    p2 = torch.nn.Parameter(flat[20:])
    opt = torch.optim.AdamW([p1, p2], lr=0.1)
    for _ in range(2):
        (p1.sum() * 2 + (p2 ** 2).sum()).backward()
        opt.step()
        opt.zero_grad()
    state = {"params": [p1.detach(), p2.detach()], "opt": opt.state_dict()}
    back, _ = round_trip(state)
    assert_tree_equal(back, state)


def test_lazy_conjugate_and_negative_views_store_the_values_they_show():
    c = torch.randn(6, dtype=torch.complex64)
    r = torch.randn(5)
    state = {"c": c, "c_conj": c.conj(), "conj_alone": torch.randn(3, dtype=torch.complex128).conj(),
             "r": r, "r_neg": torch._neg_view(r), "conj_t": torch.randn(3, 4, dtype=torch.complex64).conj().t()}
    assert state["c_conj"].is_conj() and state["r_neg"].is_neg()
    expected = {k: v.resolve_conj().resolve_neg() for k, v in state.items()}
    back, _ = round_trip(state)
    assert_tree_equal(back, expected)
    assert not back["c_conj"].is_conj()


@st.composite
def strided_views(draw, numel: int):
    """(offset, shape, stride) of an in-bounds as_strided view of a 1-D storage of ``numel`` elements."""
    rank = draw(st.integers(0, 3))
    shape = [draw(st.integers(1, 6)) for _ in range(rank)]
    stride = [draw(st.integers(0, 12)) for _ in range(rank)]
    span = sum((s - 1) * t for s, t in zip(shape, stride))
    offset = draw(st.integers(0, max(0, numel - 1 - span)))
    assume(offset + span < numel)
    return offset, tuple(shape), tuple(stride)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]),
       chunk_size=st.sampled_from([16, 100, 4096]))
def test_random_views_of_one_storage(data, dtype, chunk_size):
    base = torch.arange(120).to(dtype)
    views = data.draw(st.lists(strided_views(120), min_size=1, max_size=5))
    state = {f"v{i}": base.as_strided(shape, stride, offset) for i, (offset, shape, stride) in enumerate(views)}
    back, stream = round_trip(state, chunk_size=chunk_size)
    assert_tree_equal(back, state)
    distinct = {(o, s, t) for o, s, t in views}
    storages = {back[k].untyped_storage().data_ptr() for k in back}
    if len(distinct) > 1:
        assert len(storages) == 1, "views of one storage must load as views of one storage"
    for i, j in ((i, j) for i in range(len(views)) for j in range(len(views))):
        if views[i] == views[j]:
            assert back[f"v{i}"] is back[f"v{j}"]


def test_storages_that_begin_at_one_address_with_different_sizes_are_saved_whole(tmp_path):
    """torch.from_numpy of an array and of a slice of it (or frombuffer with and without count) are two
    storage objects at one address: the base is cut from the larger, whichever comes first."""
    import numpy as np

    arr = np.arange(10, dtype=np.float32)
    for state in ({"head": torch.from_numpy(arr[:4]), "all": torch.from_numpy(arr)},
                  {"all": torch.from_numpy(arr), "head": torch.from_numpy(arr[:4])},
                  {"head": torch.from_numpy(arr[:4]), "tail": torch.from_numpy(arr)[6:], "mid": torch.from_numpy(arr[2:8])}):
        path = tmp_path / "s.nvckpt"
        nvckpt.save(state, path)
        back = nvckpt.load(path)
        for k, v in state.items():
            assert torch.equal(back[k], v), k


def test_an_int_dict_key_beyond_64_bits_is_named_as_a_key():
    with pytest.raises(nvckpt.UnsupportedObjectError, match=r"dict key 18446744073709551616 at rng/table is an int"):
        nvckpt.save({"rng": {"table": {2 ** 64: 1}}}, io.BytesIO())
    nvckpt.save({"seed": 2 ** 70, "k": {2 ** 64 - 1: 1, -2 ** 63: 2}}, io.BytesIO())  # values, and keys in range


def test_get_tensor_of_a_slice_of_a_flat_buffer_decodes_only_its_elements(tmp_path):
    """f[k] for every view of a flat buffer (the safe_open idiom) decoded the whole base once per view and kept
    a copy of it alive in each: N views, N x the buffer in memory."""
    flat = torch.arange(1 << 18, dtype=torch.float32)
    state = {f"p{i}": flat[i * 1024:(i + 1) * 1024].view(32, 32) for i in range(256)}
    path = tmp_path / "flat.nvckpt"
    nvckpt.save(state, path, chunk_size=16 << 10)
    with nvckpt.open(path) as f:
        got = {k: f[k] for k in f.keys()}
        assert all(t.untyped_storage().nbytes() == 4096 for t in got.values())
        for k, t in got.items():
            assert torch.equal(t, state[k])
        transposed_ok = f.get_tensor("p3")
        assert torch.equal(transposed_ok, state["p3"])


def test_bool_tensors_with_odd_bytes_stay_tied_and_views_of_one_another():
    """Each odd bool leaf was normalized into a copy of its own: a tied pair and a view came back as three."""
    m = torch.tensor([0, 2, 1, 5, 0, 9], dtype=torch.uint8).view(torch.bool)
    state = {"a": m, "b": m, "v": m[1:], "t": m.view(2, 3).t(), "src": m.view(torch.uint8)}
    data = io.BytesIO()
    nvckpt.save(state, data)
    out = nvckpt.load(io.BytesIO(data.getvalue()))
    assert out["a"] is out["b"]
    assert out["v"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()
    assert out["t"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()
    for k in ("a", "v", "t"):
        assert torch.equal(out[k], state[k]) and set(out[k].view(torch.uint8).flatten().tolist()) <= {0, 1}
    assert torch.equal(out["src"], state["src"])  # the bytes as bytes: another dtype, stored as they are


def test_a_views_base_takes_a_name_no_tensor_of_the_state_has():
    # SPEC 14.3: "<first view>@base", else another unique name; a tensor named "w@base" made the save fail.
    buf = torch.arange(20.0)
    state = {"w": buf[:10], "v": buf[5:15], "w@base": torch.ones(3), "w@base1": torch.zeros(2)}
    out = io.BytesIO()
    nvckpt.save(state, out)
    out.seek(0)
    got = nvckpt.load(out)
    for k, v in state.items():
        assert_tensor_equal(got[k], v)
    got["w"][7] = -1.0  # still views of one storage
    assert float(got["v"][2]) == -1.0
    out.seek(0)
    with nvckpt.open(out) as f:
        assert "w@base2" in {e.name for e in f._file.index.tensors}


@pytest.mark.parametrize("make", [
    lambda x: x.expand(4096, -1),  # a row broadcast: stride 0
    lambda x: x.reshape(64, 1, 64).expand(-1, 64, -1),  # stride 0 inside
    lambda x: x.as_strided((4000, 64), (1, 1)),  # overlapping windows of one tensor
], ids=["expand", "expand-middle", "windows"])
def test_a_tensor_that_repeats_elements_is_stored_as_a_view_of_them(make):
    """An ``expand()``ed tensor (SPEC 14.3) takes the bytes of the elements it addresses, not of its shape, and
    loads as torch.load gives it: a view with the same strides, bit-exact."""
    small = torch.randn(1, 4096)
    t = make(small)
    assert file_size({"t": t}) < small.nbytes + 1024 < t.nbytes // 16
    back, stream = round_trip({"t": t, "other": torch.ones(3)})
    assert_tensor_equal(back["t"], t)
    assert back["t"].stride() == t.stride() and back["t"].untyped_storage().nbytes() <= small.nbytes
    by_name, keys = entries(stream)
    assert keys == ["t", "other"] and by_name["t"].view is not None and by_name["t@base"].internal


def test_a_tied_expanded_tensor_is_one_view():
    t = torch.randn(3).expand(1000, 3)
    back, stream = round_trip({"a": t, "b": t})
    assert back["a"] is back["b"] and back["a"].stride() == (0, 1)
    assert file_size({"a": t, "b": t}) < 1024
