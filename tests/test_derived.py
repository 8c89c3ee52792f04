"""Derived tensors: bf16 weights stored as bf16_rne of their fp32 masters (zero bytes), bit-exact."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nvckpt
from conftest import assert_tensor_equal, assert_tree_equal
from nvckpt.plan.derived import bf16_rne


def spec_bf16_rne(master: torch.Tensor) -> torch.Tensor:
    """bf16_rne as SPEC.md defines it, written here independently of nvckpt (numpy, uint32 arithmetic)."""
    x = master.contiguous().view(torch.int32).numpy().view(np.uint32).astype(np.uint64)
    nan = (x & 0x7FFFFFFF) > 0x7F800000
    rounded = ((x + 0x7FFF + ((x >> 16) & 1)) & 0xFFFFFFFF) >> 16
    bits = np.where(nan, (x >> 16) | 0x0040, rounded).astype(np.uint16)
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).reshape(master.shape)


def masters() -> torch.Tensor:
    """fp32 values with every case of the rounding: ties to even, NaN payloads, inf, -0, overflow, denormals."""
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(64, 64, generator=gen)
    bits = m.view(torch.int32).reshape(-1)
    special = [
        0x3F808000,  # tie, even below: rounds down
        0x3F818000,  # tie, odd below: rounds up
        0x3F808001, 0x3F807FFF, 0x00000000, 0x80000000,  # just above/below a tie, +0, -0
        0x7F800000, 0xFF800000,  # +-inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0x7FC12345, 0xFF80FFFF,  # NaNs: quiet, signalling, payloads
        0x7F7FFFFF, 0xFF7FFFFF,  # max finite: rounds to inf
        0x00000001, 0x807FFFFF, 0x00008000, 0x00018000,  # denormals and denormal ties
    ]
    bits[: len(special)] = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in special], dtype=torch.int32)
    return m


def test_spec_rounding_agrees_with_torch_on_numbers():
    m = masters()
    finite = ~torch.isnan(m)
    ours = spec_bf16_rne(m)
    assert torch.equal(ours[finite].view(torch.int16), m.to(torch.bfloat16)[finite].view(torch.int16))
    # the two tie cases, by hand
    assert ours.view(torch.int16).reshape(-1)[0] == 0x3F80 and ours.view(torch.int16).reshape(-1)[1] == 0x3F82


def save_bytes(state, **kwargs) -> bytes:
    stream = io.BytesIO()
    nvckpt.save(state, stream, **kwargs)
    return stream.getvalue()


def test_bf16_rounding_of_master_is_stored_derived(rounding_check):
    m = masters()
    w = spec_bf16_rne(m)
    other = torch.randn(64, 64).to(torch.bfloat16)  # not the rounding of any master
    state = {"master": {"w": m}, "model": {"w": w, "other": other}}
    derived = save_bytes(state, derive_bf16=True, codec="raw", alignment=1)
    plain = save_bytes(state, derive_bf16=False, codec="raw", alignment=1)
    saved = len(plain) - len(derived)
    print(f"derived saves {saved} bytes of {w.numel() * 2}")
    assert w.numel() * 2 <= saved <= w.numel() * 2 + 200

    with nvckpt.open(io.BytesIO(derived)) as ck:
        entries = {e.name: e for e in ck.index.tensors}
        assert entries["model/w"].derived == {"function": "bf16_rne", "source": entries["master/w"].tensor_id}
        assert entries["model/w"].chunks is None
        assert entries["model/other"].derived is None and entries["model/other"].chunks
        assert_tensor_equal(ck.get_tensor("model/w"), w)
        assert_tensor_equal(ck.get_slice("model/w")[3:9, ::2], w[3:9, ::2])
        assert_tree_equal(ck.load(keys=["model/w"]), {"model/w": w})
    assert_tree_equal(nvckpt.load(io.BytesIO(derived)), state)
    assert_tree_equal(nvckpt.load(io.BytesIO(plain)), state)


@pytest.fixture(params=["kernel", "cast", "integer"])
def rounding_check(request, monkeypatch):
    """Every way the derived-tensor search compares: the compiled check of CPU pairs (_derived.c), torch's cast first
    (where it is the SPEC rounding), or integers only."""
    from nvckpt.plan import derived

    if request.param == "kernel":
        if derived._kernel is None:
            pytest.skip("nvckpt/plan/_derived.c is not built here")
    else:
        monkeypatch.setattr(derived, "_kernel", None)
    if request.param == "integer":
        monkeypatch.setattr(derived, "_cast_is_rne", lambda device: False)
    return request.param


@pytest.fixture(params=["kernel", "torch"])
def copy_check(request, monkeypatch):
    """Both ways copies are compared on the host: the compiled memcmp, or torch ops."""
    from nvckpt.plan import derived

    if request.param == "kernel" and derived._kernel is None:
        pytest.skip("nvckpt/plan/_derived.c is not built here")
    if request.param == "torch":
        monkeypatch.setattr(derived, "_kernel", None)
    return request.param


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=9000), st.integers(0, 8999), st.integers(1, 0xFFFF))
def test_the_compiled_check_agrees_with_the_spec_rounding(words, at, flip):
    """_derived.rne_differs against SPEC 14.2 written out in numpy, for any bits (NaNs, ties, inf, denormals),
    with the candidate equal and with one word changed anywhere (across the kernel's 4096-element blocks)."""
    from nvckpt.plan import derived

    if derived._kernel is None:
        pytest.skip("nvckpt/plan/_derived.c is not built here")
    src = torch.from_numpy(np.array(words, dtype=np.uint32).view(np.int32).copy()).view(torch.float32)
    cand = spec_bf16_rne(src)
    k = derived._kernel
    assert not k.rne_differs(src.view(torch.int32).numpy(), cand.view(torch.int16).numpy())
    bad = cand.view(torch.int16).clone()
    i = at % len(words)
    bad[i] = int(np.int16(np.uint16((int(bad[i]) & 0xFFFF) ^ flip)))
    assert k.rne_differs(src.view(torch.int32).numpy(), bad.numpy())
    raw = src.view(torch.uint8).numpy()
    assert not k.differ(raw, raw.copy()) and k.differ(raw, raw[:-1].copy())
    other = raw.copy()
    other[(4 * i) % raw.size] ^= 1
    assert k.differ(raw, other)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.sampled_from(["same", "rne", "flip", "strided"])),
                min_size=1, max_size=40), st.integers(0, 2**32 - 1))
def test_many_small_pairs_are_decided_in_one_call_as_one_by_one(specs, seed):
    """The batch checks (pairs by address, one call) decide every pair as the per-pair checks do: copies and
    bf16 roundings, equal or one element off, of any size (empty ones too), non-contiguous ones beside them."""
    from nvckpt.plan import derived
    from nvckpt.tensors import flat_bytes

    if derived._kernel is None or not hasattr(derived._kernel, "differ_many"):
        pytest.skip("nvckpt/plan/_derived.c (with its batch checks) is not built here")
    gen = torch.Generator().manual_seed(seed)

    class T:  # what the checks read of a PlannedTensor
        def __init__(self, data):
            self.data = data

        def flat_bytes(self):
            return flat_bytes(self.data)

    copies, roundings = [], []
    for n, kind in specs:
        src = torch.randn(n, generator=gen)
        if kind == "strided":
            src = torch.randn(n, 2, generator=gen)[:, 0]
        same = src.clone() if kind != "strided" else src.clone().contiguous()
        rne = spec_bf16_rne(src)
        if kind == "flip" and n:
            same[n // 2] = same[n // 2] + 1
            rne.view(torch.int16)[n // 2] ^= 1
        copies.append((T(same), T(src)))
        roundings.append((T(rne), T(src)))
    contiguous = [k for k, (a, b) in enumerate(copies) if a.data.is_contiguous() and b.data.is_contiguous()]
    one_by_one = [derived._bytes_differ_on_host(copies[k]) for k in contiguous]
    assert derived._bytes_differ_on_host_many([copies[k] for k in contiguous]) == one_by_one
    assert derived._rne_differs_on_host_many([roundings[k] for k in contiguous]) == \
        [derived._rne_differs_on_host(roundings[k]) for k in contiguous]
    assert one_by_one == [specs[k][1] == "flip" and specs[k][0] > 0 for k in contiguous]
    # Through _differing, which sends the contiguous pairs to the batch and the others one by one.
    got = derived._differing(copies, derived._bytes_differ, lambda p: derived._bytes_differ([p]), quick_is_exact=True,
                             size=lambda p: p[0].data.numel(), small=lambda p: True,
                             host=derived._bytes_differ_on_host, host_many=derived._bytes_differ_on_host_many)
    assert got == [kind == "flip" and n > 0 for n, kind in specs]


def test_the_batch_checks_refuse_arrays_of_other_lengths():
    from nvckpt.plan import derived

    if derived._kernel is None or not hasattr(derived._kernel, "differ_many"):
        pytest.skip("nvckpt/plan/_derived.c (with its batch checks) is not built here")
    a = np.zeros(3, np.uint64)
    for check in (derived._kernel.differ_many, derived._kernel.rne_differs_many):
        with pytest.raises(ValueError, match="one uint64 per pair"):
            check(a, a, np.zeros(2, np.uint64), np.zeros(3, np.uint8))
        with pytest.raises(ValueError, match="one flag per pair"):
            check(a, a, a, np.zeros(2, np.uint8))
        check(a, a, a, np.zeros(3, np.uint8))  # three empty pairs: nothing is read


def test_the_compiled_checks_refuse_mismatched_buffers():
    from nvckpt.plan import derived

    if derived._kernel is None:
        pytest.skip("nvckpt/plan/_derived.c is not built here")
    with pytest.raises(ValueError, match="same number of elements"):
        derived._kernel.rne_differs(np.zeros(4, np.int32), np.zeros(3, np.int16))
    with pytest.raises(ValueError, match="contiguous"):
        derived._kernel.differ(np.zeros(8, np.uint8)[::2], np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match="same number of elements"):
        derived._kernel.rne(np.zeros(4, np.int32), np.zeros(3, np.int16))
    with pytest.raises(ValueError, match="contiguous"):
        derived._kernel.rne(np.zeros(8, np.int32)[::2], np.zeros(4, np.int16))
    with pytest.raises(TypeError):  # the output must be writable
        derived._kernel.rne(np.zeros(4, np.int32), bytes(8))


def test_the_compiled_checks_are_built_where_a_compiler_is():
    """An install that found a C compiler must not fall back to torch's checks without a word."""
    import shutil
    import sysconfig

    from nvckpt.plan import derived

    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(compiler):
        pytest.skip(f"no C compiler ({compiler}) here")
    assert derived._kernel is not None, "nvckpt/plan/_derived.c was not built: pip install -e . builds it"


@pytest.mark.parametrize("change", ["one_ulp", "nan_payload", "sign_of_zero", "truncated_not_rounded", "shape",
                                    "torch_cast"])
def test_bf16_that_is_not_the_rounding_is_stored_as_is(change, rounding_check):
    m = masters()
    w = spec_bf16_rne(m)
    flat = w.view(torch.int16).reshape(-1)
    if change == "one_ulp":
        flat[2000] += 1
    elif change == "nan_payload":
        flat[8] = 0x7FC1  # master 0x7FC00000 rounds to 0x7FC0
    elif change == "sign_of_zero":
        flat[4] = -0x8000  # master +0.0 -> bf16 -0.0
    elif change == "truncated_not_rounded":
        w = (m.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)  # round toward zero: differs on ties up
    elif change == "shape":
        w = w.reshape(32, 128)
    elif change == "torch_cast":  # equal to the SPEC rounding except at NaNs with a payload
        w = m.to(torch.bfloat16)
        assert torch.equal(w[~torch.isnan(m)].view(torch.int16), spec_bf16_rne(m)[~torch.isnan(m)].view(torch.int16))
    state = {"master": m, "w": w}
    data = save_bytes(state, derive_bf16=True)
    with nvckpt.open(io.BytesIO(data)) as ck:
        entry = ck.index.tensors[ck.index.paths["w"]]
        assert entry.derived is None and entry.chunks
    assert_tree_equal(nvckpt.load(io.BytesIO(data)), state)


def test_many_small_pairs_each_decided_on_its_own(rounding_check):
    """Small pairs are compared a group at a time: a difference or a NaN in one flags the group, and every
    pair in it is then decided by itself (the others stay derived; the changed ones are stored as they are)."""
    from nvckpt.plan import derived

    gen = torch.Generator().manual_seed(5)
    masters_ = {f"b{i}": torch.randn(96 + i, generator=gen) for i in range(40)}
    masters_["nan"] = masters().reshape(-1)[:300].clone()  # NaN payloads: the cast alone cannot decide
    models = {k: spec_bf16_rne(v) for k, v in masters_.items()}
    models["b7"].view(torch.int16)[50] += 1  # one ulp off
    models["b21"] = masters_["b21"].to(torch.bfloat16)  # exact: no NaN, the cast is the rounding
    models["nan_cast"] = masters_["nan"].to(torch.bfloat16)  # the cast drops NaN payloads: not the rounding
    masters_["nan_cast"] = masters_["nan"].clone()
    state = {"master": masters_, "model": models}
    data = save_bytes(state, derive=True)
    with nvckpt.open(io.BytesIO(data)) as ck:
        stored = {e.name for e in ck.index.tensors if e.derived is None or e.derived["function"] != "bf16_rne"}
    assert {n for n in stored if n.startswith("model/")} == {"model/b7", "model/nan_cast"}
    assert_tree_equal(nvckpt.load(io.BytesIO(data)), state)
    assert derived._GROUP_PAIR >= 400 and 40 * 140 < derived._GROUP_ELEMENTS  # the pairs above were grouped


def test_derived_on_by_default_off_when_asked_and_with_views():
    m = torch.randn(100)
    w = spec_bf16_rne(m)
    state = {"m": m, "w": w, "w_again": w}
    data = save_bytes(state, derive=False)
    with nvckpt.open(io.BytesIO(data)) as ck:
        assert all(e.derived is None for e in ck.index.tensors)
    data = save_bytes(state)
    with nvckpt.open(io.BytesIO(data)) as ck:
        assert [e.derived["function"] for e in ck.index.tensors if e.derived] == ["bf16_rne"]
    back = nvckpt.load(io.BytesIO(data))
    assert_tree_equal(back, state)
    assert back["w"] is back["w_again"]


def test_training_state_with_bf16_copies(training_state):
    """A mixed-precision state: bf16 model weights + fp32 masters and moments."""
    fp32 = training_state["model"]
    rounded: dict[int, torch.Tensor] = {}  # by storage, so the tied pair stays tied in bf16 too
    model = {k: rounded.setdefault(v.data_ptr(), spec_bf16_rne(v)) for k, v in fp32.items()}
    state = {
        "model": model,
        "master": fp32,
        "optimizer": training_state["optimizer"],
    }
    with_derived = save_bytes(state, derive_bf16=True)
    without = save_bytes(state, derive=False)
    with nvckpt.open(io.BytesIO(with_derived)) as ck:
        ndrv = sum(e.derived is not None for e in ck.index.tensors)
    assert ndrv == len({v.data_ptr() for v in fp32.values()})  # one per distinct tensor (tied counted once)
    assert len(with_derived) < len(without)
    back = nvckpt.load(io.BytesIO(with_derived))
    assert_tree_equal(back, state)
    assert back["model"]["head.weight"] is back["model"]["embed.weight"]


def test_the_cpu_engine_codes_other_tensors_while_the_candidates_are_verified(tmp_path, monkeypatch):
    """Verifying the candidates (a pass over every bf16 tensor and its master) runs on a worker beside the
    coding of the tensors it cannot change, not before it (which left every other core idle): here the
    verification waits until the engine has coded a chunk.  The candidates' frames come last, a stored one
    (one ulp off its master) with its chunks, and the file is valid front to back and loads bit-exact."""
    import threading

    from nvckpt.engines import cpu as cpu_engine
    from nvckpt.format.constants import FRAME_TENSOR
    from nvckpt.format.frames import iter_frames
    from nvckpt.io.source import LocalFile
    from nvckpt.plan import derived
    from nvckpt.tools.verify import verify

    coded = threading.Event()
    seen: list[bool] = []
    encode_group, verify_candidates = cpu_engine._encode_group, derived.DerivedSearch.verify

    def encode_group_(items, buffers):
        out = encode_group(items, buffers)
        coded.set()
        return out

    def verify_(self):
        seen.append(coded.wait(timeout=20))
        verify_candidates(self)

    monkeypatch.setattr(cpu_engine, "_encode_group", encode_group_)
    monkeypatch.setattr(derived.DerivedSearch, "verify", verify_)
    gen = torch.Generator().manual_seed(11)
    masters_ = {f"m{i}": torch.randn(300, 200, generator=gen) for i in range(3)}
    state = {"adam": {f"v{i}": torch.randn(400, 300, generator=gen) for i in range(4)}, "master": masters_,
             "model": {k: spec_bf16_rne(v) for k, v in masters_.items()}}
    state["model"]["m1"].view(torch.int16).view(-1)[123] += 1  # one ulp off: stays a stored tensor
    path = tmp_path / "s.nvckpt"
    nvckpt.save(state, path, chunk_size=64 << 10, workers=2)  # two: the verification waits on one of them
    assert seen == [True]
    with nvckpt.open(path) as ck:
        names = [e.name for e in ck.index.tensors]
        kinds = {e.name: (e.derived or {}).get("function") for e in ck.index.tensors}
    assert kinds["model/m0"] == kinds["model/m2"] == "bf16_rne" and kinds["model/m1"] is None
    source = LocalFile(path)
    try:
        order = [names[h.tensor_id] for _, h in iter_frames(source) if h.frame_type == FRAME_TENSOR]
    finally:
        source.close()
    assert order[-3:] == ["model/m0", "model/m1", "model/m2"]
    report = verify(path)
    assert report.ok and report.tensor_checksums >= 8
    assert_tree_equal(nvckpt.load(path), state)


def test_a_cpu_load_derives_each_tensor_as_soon_as_its_source_is_decoded(monkeypatch):
    """A derived tensor is computed on the decode thread that finished its source (bytes still in cache,
    beside the other tensors' decoding), not one by one after every chunk is decoded; what the load returns
    is the same, also for a derived tensor whose source is a view's base or loaded alone."""
    from nvckpt.read import reader as file_mod
    from nvckpt.session import load as load_mod

    mapping = [False]
    at_derive: list[bool] = []
    file_map, derive = file_mod.ChunkReader.map, load_mod._derive

    def map_(self, fn, items):
        mapping[0] = True
        try:
            return file_map(self, fn, items)
        finally:
            mapping[0] = False

    def derive_(*args):
        at_derive.append(mapping[0])
        return derive(*args)

    monkeypatch.setattr(file_mod.ChunkReader, "map", map_)
    monkeypatch.setattr(load_mod, "_derive", derive_)
    gen = torch.Generator().manual_seed(12)
    masters_ = {f"m{i}": torch.randn(256, 300, generator=gen) for i in range(4)}
    state = {"master": masters_, "model": {k: spec_bf16_rne(v) for k, v in masters_.items()},
             "other": torch.randn(1000, generator=gen)}
    data = save_bytes(state, chunk_size=64 << 10)
    with nvckpt.open(io.BytesIO(data)) as ck:
        assert sum(e.derived is not None for e in ck.index.tensors) == 4
    back = nvckpt.load(io.BytesIO(data))
    assert at_derive == [True] * 4
    assert_tree_equal(back, state)
    at_derive.clear()
    with nvckpt.open(io.BytesIO(data)) as ck:
        assert_tensor_equal(ck["model/m2"], state["model"]["m2"])  # its source is not returned: the same path
    assert at_derive == [True]


def test_transposed_master():
    m = masters().t()  # a non-contiguous fp32 master: its C-order values are what bf16_rne applies to
    w = spec_bf16_rne(m.contiguous())
    data = save_bytes({"m": m, "w": w}, derive_bf16=True)
    with nvckpt.open(io.BytesIO(data)) as ck:
        assert ck.index.tensors[ck.index.paths["w"]].derived is not None
    assert_tree_equal(nvckpt.load(io.BytesIO(data)), {"m": m, "w": w})


def test_exact_copies_are_stored_once_and_load_as_tensors_of_their_own(copy_check):
    w = torch.randn(64, 32)
    nan = torch.full((16,), float("nan"))
    state = {"w": w, "w_clone": w.clone(), "other": w + 1, "ids": torch.arange(40), "ids2": torch.arange(40),
             "nan": nan, "nan2": nan.clone(), "neg": torch.zeros(8), "pos": -torch.zeros(8)}
    data = save_bytes(state)
    with nvckpt.open(io.BytesIO(data)) as ck:
        copies = {e.name: ck.index.tensors[e.derived["source"]].name for e in ck.index.tensors
                  if e.derived and e.derived["function"] == "copy"}
    assert copies == {"w_clone": "w", "ids2": "ids", "nan2": "nan"}  # -0.0 is not a copy of 0.0: bytes compared
    back = nvckpt.load(io.BytesIO(data))
    assert_tree_equal(back, state)
    back["w_clone"].add_(1)  # its own storage, as in the saved state
    assert torch.equal(back["w"], w)
    plain = save_bytes(state, derive=False)
    assert len(data) < len(plain)


def test_ratio_counts_every_tensor_the_file_restores(tmp_path):
    m = torch.randn(256, 64)
    state = {"m": m, "w": spec_bf16_rne(m), "m2": m.clone()}
    res = nvckpt.save(state, tmp_path / "s.nvckpt", codec="raw")
    assert res.raw_bytes == m.nbytes * 2 + m.nbytes // 2  # the bf16 rounding and the copy count, stored or not
    assert res.ratio > 2.4
    flat = torch.randn(1000)
    res = nvckpt.save({"a": flat[:600], "b": flat[400:]}, tmp_path / "v.nvckpt", codec="raw")
    assert res.raw_bytes == (600 + 600) * 4  # two views of one 1000-element storage: 4000 bytes stored


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(1 << 31), (1 << 31) - 1), min_size=1, max_size=300), st.integers(0, 0xFFFF))
def test_bf16_rne_is_the_spec_rounding_for_any_bits(words, upper):
    """nvckpt's rounding (int32 arithmetic, blocked) against the SPEC's, on arbitrary bit patterns, and on
    every upper half with one lower half (all signs, exponents, NaN payloads; the carry into the exponent)."""
    every = torch.arange(1 << 16, dtype=torch.int64) << 16 | (upper & 0xFFFF)
    bits = torch.cat([torch.tensor(words, dtype=torch.int64), every])
    m = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    from nvckpt.plan import derived

    expected = spec_bf16_rne(m).view(torch.int16)
    assert torch.equal(bf16_rne(m).view(torch.int16), expected)  # the compiled kernel, where it is built
    assert torch.equal(bf16_rne(m.reshape(-1, 1).expand(-1, 2)[:, 0]).view(torch.int16), expected)  # strided
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(derived, "_kernel", None)
        assert torch.equal(bf16_rne(m).view(torch.int16), expected)  # torch's cast, NaNs fixed
        mp.setattr(derived, "_cast_is_rne", lambda device: False)  # integer arithmetic only
        assert torch.equal(bf16_rne(m).view(torch.int16), expected)
    # the candidates' heads are rounded on the host in numpy (uint32 arithmetic)
    heads = derived._rne_bits_numpy(m.view(torch.int32).numpy().view("<u4"))
    assert np.array_equal(heads.view(np.int16), expected.numpy())


def test_copies_among_tensors_whose_first_bytes_agree(copy_check):
    """Same shape, same first 64 bytes: equal ones become copies of the first stored equal one, the others
    are stored (the comparison runs in rounds over what is still undecided)."""
    base = torch.zeros(4, 100)
    variants = [base.clone() for _ in range(7)]
    variants[2][3, 99] = 1.0  # differs after the head
    variants[4][3, 99] = 1.0  # equal to variants[2]
    variants[5][2, 50] = 2.0  # differs from every other
    state = {f"t{i}": v for i, v in enumerate(variants)}
    data = save_bytes(state)
    with nvckpt.open(io.BytesIO(data)) as ck:
        source = {e.name: (ck.index.tensors[e.derived["source"]].name if e.derived else None) for e in ck.index.tensors}
    assert source == {"t0": None, "t1": "t0", "t2": None, "t3": "t0", "t4": "t2", "t5": None, "t6": "t0"}
    assert_tree_equal(nvckpt.load(io.BytesIO(data)), state)


def test_many_step_counts_and_large_copies(copy_check):
    """An optimizer's hundreds of equal step counts are compared a group at a time; a group with one that
    differs is decided pair by pair; tensors above the group size are compared alone."""
    steps = {f"p{i}": torch.tensor(30.0) for i in range(120)}
    steps["p17"] = torch.tensor(31.0)
    steps["p90"] = torch.tensor(-0.0)  # -0.0 == 0.0 as numbers; bytes differ
    steps["p91"] = torch.tensor(0.0)
    big = torch.randn(400_000)  # above the group size
    state = {"step": steps, "big": big, "big2": big.clone(), "big3": big + 1}
    data = save_bytes(state)
    with nvckpt.open(io.BytesIO(data)) as ck:
        source = {e.name: ck.index.tensors[e.derived["source"]].name for e in ck.index.tensors
                  if e.derived and e.derived["function"] == "copy"}
    assert source == {**{f"step/p{i}": "step/p0" for i in range(1, 120) if i not in (17, 90, 91)}, "big2": "big"}
    assert_tree_equal(nvckpt.load(io.BytesIO(data)), state)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 400), st.sampled_from(["rne", "ulp", "nan", "cast", "alone"])), min_size=1,
                max_size=24), st.integers(0, 2**31 - 1))
def test_derived_found_exactly_whatever_the_grouping(rounding_check, pairs, seed):
    """Property: a bf16 tensor is stored derived iff some fp32 tensor of its shape rounds to it bit for bit
    (checked here by numpy), however the pairs fall into comparison groups."""
    gen = torch.Generator().manual_seed(seed)
    state, expect = {"m": {}, "w": {}}, set()
    for i, (n, kind) in enumerate(pairs):
        m = torch.randn(n, generator=gen)
        if kind == "nan":
            m.view(torch.int32)[n // 2] = 0x7FC12345  # a NaN with a payload: the cast alone cannot decide
        w = spec_bf16_rne(m).clone()
        if kind == "ulp":
            w.view(torch.int16)[n - 1] += 1
        elif kind == "cast":
            w = m.to(torch.bfloat16)  # the rounding wherever no NaN
        elif kind == "alone":
            w = torch.randn(n, generator=gen).to(torch.bfloat16)
        state["m"][f"{i}"], state["w"][f"{i}"] = m, w
    masters_ = list(state["m"].values())
    for i, w in enumerate(state["w"].values()):
        if any(s.shape == w.shape and torch.equal(spec_bf16_rne(s).view(torch.int16), w.view(torch.int16)) for s in masters_):
            expect.add(f"w/{i}")
    data = save_bytes(state, derive=True)
    with nvckpt.open(io.BytesIO(data)) as ck:
        found = {e.name for e in ck.index.tensors if e.derived and e.derived["function"] == "bf16_rne"}
    assert found == expect
    assert_tree_equal(nvckpt.load(io.BytesIO(data)), state)


def test_is_bf16_rne_of_empty_and_mismatched():
    from nvckpt.plan.derived import is_bf16_rne_of

    assert is_bf16_rne_of(torch.empty(0, 3, dtype=torch.bfloat16), torch.empty(0, 3))
    m = masters()
    assert is_bf16_rne_of(spec_bf16_rne(m), m)
    assert not is_bf16_rne_of(m.to(torch.bfloat16), m)  # NaN payloads differ
    assert not is_bf16_rne_of(spec_bf16_rne(m).reshape(32, 128), m)


_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", _DEVICES)
@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["float32", "bfloat16", "float16", "int64", "bool", "uint8", "complex64",
                                           "float8_e4m3fn"]),
                          st.lists(st.integers(1, 9), min_size=0, max_size=3),
                          st.sampled_from(["contiguous", "transposed", "sliced", "offset"])),
                min_size=1, max_size=12), st.integers(0, 2**31 - 1))
def test_heads_gathered_by_address_equal_the_heads_of_views(device, specs, seed):
    """Property: the candidates' keys (first 64 elements, their rounding, first 64 bytes) read in one gather by
    address are those of a view per tensor, for any dtypes, shapes (0-d, fewer than 64 elements) and layouts
    (transposed, sliced, at an offset in their storage)."""
    from nvckpt.plan import derived as D
    from nvckpt.plan.walk import PlannedTensor

    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for i, (dtype, shape, layout) in enumerate(specs):
        base = torch.randint(0, 256, (16 * (int(np.prod(shape)) + 8),), dtype=torch.uint8, generator=gen)
        dt = getattr(torch, dtype)
        size = torch.empty((), dtype=dt).element_size()
        values = base[: base.numel() // size * size].view(dt) if dt is not torch.bool else base.to(torch.bool)
        n = int(np.prod(shape))
        if layout == "offset":
            t = values[3: 3 + n].reshape(shape)
        elif layout == "transposed" and len(shape) >= 2:
            t = values[:n].reshape(shape[::-1]).transpose(0, -1)
        elif layout == "sliced" and len(shape) >= 1:
            t = values[: 2 * n].reshape([2 * shape[0], *shape[1:]])[::2]
        else:
            t = values[:n].reshape(shape)
        t = t.to(device)
        if layout == "offset":
            t = torch.cat([torch.zeros(5, dtype=t.dtype, device=device), t.reshape(-1)])[5:].reshape(shape)
        tensors.append(PlannedTensor(i, {"name": str(i), "dtype": dtype, "shape": list(shape)}, t))
    stored = [(t, t.entry["dtype"], tuple(t.entry["shape"]), t.data.device) for t in tensors]

    def keys(heads):
        out = {}
        for t, dtype, _, _ in stored:
            out[t.tensor_id] = (heads.raw(t), heads.rne(t) if dtype == "float32" else None,
                                heads.bits(t) if dtype == "bfloat16" else None)
        return out

    gathered = keys(D._Heads(stored))
    original = D._gather_heads
    D._gather_heads = lambda *a, **k: None  # the per-tensor views of other devices
    try:
        viewed = keys(D._Heads(stored))
    finally:
        D._gather_heads = original
    assert gathered == viewed
    for t, dtype, _, _ in stored:  # and both are the tensor's own first bytes
        head = t.data.reshape(-1)[:64]
        first = torch.empty(head.numel(), dtype=head.dtype).copy_(head)
        assert gathered[t.tensor_id][0] == (first.to(torch.uint8) if dtype == "bool" else first).view(torch.uint8).numpy()[:max(64, first.element_size())].tobytes()


def test_heads_fall_back_to_views_where_the_gather_cannot_be_made(monkeypatch):
    """A numpy or ctypes that refuses the span by address: the candidates come from a view per tensor, same result."""
    import types

    from nvckpt.plan import derived as D

    torch.manual_seed(5)
    master = {f"w{i}": torch.randn(64, 32) for i in range(3)}
    state = {"master": master, "model": {k: v.to(torch.bfloat16) for k, v in master.items()}, "copy": master["w1"].clone()}
    expected = save_bytes(state)

    class Refusing:
        def __mul__(self, n):
            raise OverflowError("array too large")

    monkeypatch.setattr(D, "ctypes", types.SimpleNamespace(c_char=Refusing()))
    assert D._gather_heads([torch.ones(3)], torch.device("cpu"), 64) is None
    assert save_bytes(state) == expected  # the same derived tensors, found through the views
