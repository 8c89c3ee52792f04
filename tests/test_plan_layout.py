"""A save of a layout saved before (plan.layout): the entries and chunks reused, the derived tensors found
before checked instead of searched for, every file bit-exact whatever the values became."""

from __future__ import annotations

import io

import pytest
import torch

import nvckpt
from conftest import assert_tree_equal
from nvckpt.plan import layout
from nvckpt.plan.walk import plan_save


def training_like(n: int = 6, seed: int = 0) -> tuple[dict, list, list]:
    gen = torch.Generator().manual_seed(seed)
    master = [torch.randn(8, 16, generator=gen) for _ in range(n)] + [torch.randn(16, generator=gen)]
    weights = [m.to(torch.bfloat16) for m in master]
    steps = [torch.tensor(3.0) for _ in master]
    return {"model": weights, "master": master, "step": steps, "meta": {"lr": 0.1}}, master, weights


def step(master: list, weights: list, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for m, w in zip(master, weights):
        m.add_(torch.randn(m.shape, generator=gen))
        w.copy_(m.to(torch.bfloat16))


def derived_of(data: bytes) -> dict[str, tuple[str, str]]:
    with nvckpt.open(io.BytesIO(data)) as ck:
        ts = ck.index.tensors
        return {e.name: (e.derived["function"], ts[e.derived["source"]].name) for e in ts if e.derived}


def save(state: dict, **kw) -> tuple[bytes, nvckpt.SaveResult]:
    out = io.BytesIO()
    result = nvckpt.save(state, out, **kw)
    return out.getvalue(), result


REUSED = {"layout_reused": True, "derived_searched": False}  # a known layout, its hints checked, no search


def save_reused(state: dict, **kw) -> bytes:
    """A save that must reuse the known layout without a search; its file must load back as ``state``."""
    data, r = save(state, **kw)
    assert r.stats["plan"] == REUSED
    assert_tree_equal(nvckpt.load(io.BytesIO(data)), state)
    return data


def test_later_saves_reuse_the_layout_and_check_the_pairs_found():
    state, master, weights = training_like()
    first, r1 = save(state)
    assert r1.stats["plan"] == {"layout_reused": False, "derived_searched": True}
    for k in range(1, 4):
        step(master, weights, k)
        data = save_reused(state)
        assert derived_of(data) == derived_of(first)  # every bf16 a rounding, every step count a copy
    assert len(derived_of(first)) == 2 * len(master) - 1


def test_a_pair_that_no_longer_holds_is_stored_and_the_next_save_searches():
    state, master, weights = training_like()
    first, _ = save(state)
    weights[2].view(torch.int16)[0, 0] += 1  # in place: the same layout, no longer the rounding of its master
    data = save_reused(state)
    assert "model/2" not in derived_of(data)
    weights[2].copy_(master[2].to(torch.bfloat16))
    data = save_reused(state)  # model/2 is no hint now: it alone is searched for, and found
    assert derived_of(data) == derived_of(first)


def test_a_hinted_pair_that_fails_finds_another_source():
    state, master, weights = training_like()
    save(state)
    master[4].copy_(master[0])  # model/4 is the rounding of master/0 (and master/4) now, no longer of its old master
    weights[4].copy_(master[0].to(torch.bfloat16))
    master[4].add_(1)
    data, r = save(state)
    assert r.stats["plan"]["derived_searched"] is False
    assert derived_of(data)["model/4"] == ("bf16_rne", "master/0")
    assert_tree_equal(nvckpt.load(io.BytesIO(data)), state)


def test_a_copy_that_no_longer_holds_is_stored_exactly():
    state, master, weights = training_like()
    save(state)
    state["step"][1].fill_(5.0)  # in place: the same layout, no longer a copy of step/0
    data, r = save(state)
    assert r.stats["plan"]["layout_reused"] is True
    assert "step/1" not in derived_of(data)
    assert_tree_equal(nvckpt.load(io.BytesIO(data)), state)
    _, r = save(state)
    assert r.stats["plan"]["derived_searched"] is True


def test_a_pair_that_appears_later_is_found_at_once():
    state, master, weights = training_like()
    weights[0].view(torch.int16)[0, 0] += 1
    save(state)
    weights[0].copy_(master[0].to(torch.bfloat16))
    data, r = save(state)
    assert r.stats["plan"]["derived_searched"] is False
    assert derived_of(data)["model/0"] == ("bf16_rne", "master/0")
    assert_tree_equal(nvckpt.load(io.BytesIO(data)), state)


def test_a_copy_that_appears_later_is_found_by_a_periodic_search():
    state, master, weights = training_like()
    state["step"][5].fill_(9.0)
    save(state)
    state["step"][5].fill_(3.0)  # a copy of step/0 again
    searched = []
    for _ in range(layout.SEARCH_EVERY):
        data, r = save(state)
        searched.append(r.stats["plan"]["derived_searched"])
        assert_tree_equal(nvckpt.load(io.BytesIO(data)), state)
    assert searched == [False] * (layout.SEARCH_EVERY - 1) + [True]
    assert derived_of(data)["step/5"] == ("copy", "step/0")
    _, r = save(state, derive_bf16=True)  # bf16 roundings only: found exactly, so no periodic search
    for _ in range(layout.SEARCH_EVERY + 1):
        assert save(state, derive_bf16=True)[1].stats["plan"] == REUSED


def test_views_of_one_storage_and_tied_tensors_through_a_reused_layout():
    flat = torch.arange(64, dtype=torch.float32)
    tied = torch.randn(4, 4)
    state = {"a": flat[:40].view(5, 8), "b": flat[24:].view(4, 10), "c": flat[::3], "tied": tied, "again": tied}
    save(state)
    for k in range(3):
        flat.mul_(1.5).add_(k)
        tied.add_(1)
        data, r = save(state)
        assert r.stats["plan"]["layout_reused"] is True
        back = nvckpt.load(io.BytesIO(data))
        assert_tree_equal(back, state)
        assert back["tied"] is back["again"]


def test_another_chunk_size_cuts_the_chunks_again():
    state = {"w": torch.randn(1000)}
    small = plan_save(state, chunk_size=1024)
    again = plan_save(state, chunk_size=4096)
    assert again.layout_reused
    assert len(small.tensors[0].chunks) == 4 and len(again.tensors[0].chunks) == 1
    assert plan_save(state, chunk_size=1024).tensors[0].chunks == small.tensors[0].chunks


def test_derive_options_are_separate_layouts():
    state, _, _ = training_like()
    save(state)
    data, r = save(state, derive=False)
    assert r.stats["plan"]["layout_reused"] is False and derived_of(data) == {}
    data, r = save(state, derive=False)
    assert r.stats["plan"] == REUSED and derived_of(data) == {}


def test_tensors_that_moved_keep_the_layout():
    """Addresses are not the layout (a lazy save copies small tensors afresh each time; a model built again)."""
    state, master, weights = training_like()
    first, _ = save(state)
    state["step"] = [s.clone() for s in state["step"]]
    state["master"] = [m.clone() for m in master]
    assert derived_of(save_reused(state)) == derived_of(first)


def test_a_changed_tree_or_sharing_is_a_new_layout():
    state, _, _ = training_like()
    save(state)
    for change in (lambda s: s["model"].append(torch.zeros(2)), lambda s: s.update(extra=torch.ones(3)),
                   lambda s: s["master"].__setitem__(1, s["master"][0]),  # tied now
                   lambda s: s["master"].__setitem__(2, s["master"][3].view(-1)[:16])):  # a view of another
        change(state)
        data, r = save(state)
        assert r.stats["plan"]["layout_reused"] is False
        assert_tree_equal(nvckpt.load(io.BytesIO(data)), state)


@pytest.mark.slow
def test_only_a_few_layouts_are_kept_and_none_holds_a_tensor():
    import gc
    import weakref

    refs = []
    for i in range(layout.KEPT + 3):
        t = torch.randn(10 + i)
        refs.append(weakref.ref(t))
        save({"t": t})
        del t
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(layout._layouts) == layout.KEPT


@pytest.mark.parametrize("derive", [True, False])
def test_plan_of_a_reused_layout_equals_a_fresh_plan(derive):
    state, master, weights = training_like()
    plan_save(state, derive=derive, copies=derive).decide()
    step(master, weights, 7)
    reused = plan_save(state, derive=derive, copies=derive)
    layout.forget()
    fresh = plan_save(state, derive=derive, copies=derive)
    assert reused.layout_reused and not fresh.layout_reused
    assert reused.tree == fresh.tree and reused.required_features == fresh.required_features
    assert [t.entry for t in reused.tensors] == [t.entry for t in fresh.tensors]
    assert [t.chunks for t in reused.tensors] == [t.chunks for t in fresh.tensors]
    assert all((a.data is None and b.data is None) or a.data.data_ptr() == b.data.data_ptr()
               for a, b in zip(reused.tensors, fresh.tensors))


def test_saves_of_one_layout_in_several_threads_and_async():
    from concurrent.futures import ThreadPoolExecutor

    state, master, weights = training_like()
    expected = save(state)[0]

    def one(_: int) -> bytes:
        return save(state)[0]

    with ThreadPoolExecutor(4) as pool:
        files = list(pool.map(one, range(12)))
    futures = [nvckpt.async_save(state, io.BytesIO()) for _ in range(3)]
    for f in futures:
        f.result()
    assert all(derived_of(f) == derived_of(expected) for f in files)
    for f in files:
        assert_tree_equal(nvckpt.load(io.BytesIO(f)), state)


def test_a_plan_made_only_to_check_is_not_remembered():
    plan_save({"t": torch.ones(3)}, remember=False)
    assert len(layout._layouts) == 0
    state = {"t": torch.ones(3)}
    plan_save(state)
    assert not plan_save(state, remember=False).layout_reused and len(layout._layouts) == 1


def test_threads_cutting_one_layout_at_other_chunk_sizes_each_get_their_own():
    from concurrent.futures import ThreadPoolExecutor

    state = {f"w{i}": torch.randn(64, 64) for i in range(30)}

    def cut(size: int) -> bool:
        plan = plan_save(state, chunk_size=size)
        return all(all(n <= size for _, n in t.chunks) and sum(n for _, n in t.chunks) == t.data.nbytes
                   for t in plan.tensors)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(cut, [1024, 4096, 2048, 16384] * 25))
