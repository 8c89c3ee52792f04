"""One naming scheme, both spellings: a value's path ("model/0.weight") and DCP's dotted name
("model.0.weight") find the same value; a name that finds nothing gets the nearest names; ``name in ck``,
``ck[name]`` and ``load(keys=name)`` agree on every name."""

from __future__ import annotations

import pytest
import torch

import nvckpt


@pytest.fixture()
def saved(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 12, "cfg": {"lr": 0.1}}
    path = tmp_path / "ckpt.nvckpt"
    nvckpt.save(state, path)
    return path, state


def test_a_dotted_name_finds_what_its_path_finds(saved):
    path, state = saved
    assert torch.equal(nvckpt.load(path, keys="model.0.weight"), state["model"]["0.weight"])
    assert torch.equal(nvckpt.load(path, keys="optimizer.state.0.exp_avg"), state["optimizer"]["state"][0]["exp_avg"])
    assert nvckpt.load(path, keys="cfg.lr") == 0.1
    with nvckpt.open(path) as ck:
        assert "model.2.bias" in ck and torch.equal(ck["model.2.bias"], state["model"]["2.bias"])
        assert torch.equal(ck.get_slice("model.0.weight")[1:3], state["model"]["0.weight"][1:3])
        assert ck.keys()[0] == "model/0.weight"  # names are listed in one scheme: paths


def test_an_exact_name_wins_over_a_dotted_reading_and_two_readings_find_nothing(tmp_path):
    path = tmp_path / "a.nvckpt"
    nvckpt.save({"a.b": torch.zeros(1), "a": {"b": torch.ones(1), "c": {"d": torch.full((1,), 2.0)}},
                 "c.d": {"e": torch.full((1,), 3.0)}, "c": {"d.e": torch.full((1,), 4.0)}}, path)
    with nvckpt.open(path) as ck:
        assert ck["a.b"].item() == 0 and ck["a/b"].item() == 1 and ck["a.c.d"].item() == 2
        assert "c.d.e" not in ck  # "c.d/e" and "c/d.e" both read so: neither is guessed
        with pytest.raises(nvckpt.TensorNotFoundError, match=r"did you mean .*'c\.d/e'"):
            ck["c.d.e"]


def test_in_getitem_and_load_agree_on_every_name(saved):
    path, state = saved
    with nvckpt.open(path) as ck:
        for name in ("step", "cfg", "cfg/lr", "model", "optimizer/param_groups/0/lr", "model/0.weight",
                     "optimizer.param_groups.0.betas"):
            assert name in ck, name
            value = nvckpt.load(path, keys=name)
            got = ck[name]
            assert type(got) is type(value) and (torch.equal(got, value) if isinstance(got, torch.Tensor)
                                                 else got.keys() == value.keys() if isinstance(got, dict)
                                                 else got == value), name
        for name in ("stp", "model/9.weight", "cfg/lr/x"):
            assert name not in ck, name
            with pytest.raises(nvckpt.TensorNotFoundError):
                ck[name]
            with pytest.raises(nvckpt.TensorNotFoundError):
                nvckpt.load(path, keys=name)
        assert ck["step"] == 12 and ck.get("step") == 12 and len(ck) == len(ck.keys())


def test_a_missing_name_gets_the_nearest_names(saved):
    path, _ = saved
    with pytest.raises(nvckpt.TensorNotFoundError, match=r"did you mean 'model/0\.weight'"):
        nvckpt.load(path, keys="model/0.wieght")
    with pytest.raises(nvckpt.TensorNotFoundError, match=r"did you mean 'step'"):
        nvckpt.load(path, keys="steps")
    with nvckpt.open(path) as ck:
        with pytest.raises(nvckpt.TensorNotFoundError, match=r"no tensor named 'model\.0\.weigth'; did you mean "
                                                             r"'model/0\.weight'"):
            ck.get_tensor("model.0.weigth")
        with pytest.raises(nvckpt.TensorNotFoundError) as info:
            ck.get_tensor("zzzzzz")
        assert "did you mean" not in str(info.value)  # nothing near: no guess


def test_get_tensor_of_another_value_says_what_is_there(saved):
    path, _ = saved
    with nvckpt.open(path) as ck:
        with pytest.raises(nvckpt.TensorNotFoundError, match=r"'step' holds the int 12 in the saved object, not a "
                                                             r"tensor: ck\['step'\] or nvckpt.load"):
            ck.get_tensor("step")
        with pytest.raises(nvckpt.TensorNotFoundError, match="'model' holds a dict of 4 entries"):
            ck.get_slice("model")


@pytest.mark.slow
def test_many_names_still_answer_a_miss_quickly(tmp_path):
    """Near matches over a large state: one miss in well under a second."""
    import time

    path = tmp_path / "big.nvckpt"
    nvckpt.save({"layers": {str(i): {"w": torch.zeros(1), "b": torch.zeros(1)} for i in range(20_000)}}, path)
    with nvckpt.open(path) as ck:
        t0 = time.perf_counter()
        with pytest.raises(nvckpt.TensorNotFoundError, match="did you mean"):
            ck.get_tensor("layers/17/ww")
        assert time.perf_counter() - t0 < 3.0
