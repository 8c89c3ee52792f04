"""The Hugging Face Accelerate recipe: the whole save_state / load_state through nvckpt (models, optimizers,
schedulers, the GradScaler, random states, registered objects), with real Accelerator objects."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

accelerate = pytest.importorskip("accelerate")

import nvckpt  # noqa: E402
from nvckpt.integrations.accelerate import use_nvckpt  # noqa: E402


class Counter:
    """An object registered for checkpointing (Accelerate saves its state_dict)."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def setup(seed: int, **kw):
    torch.manual_seed(seed)
    acc = accelerate.Accelerator(cpu=True, **kw)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(12, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, sched, counter


def steps(acc, model, opt, sched, counter, n: int) -> list[float]:
    """Steps whose data come from every generator a resume must restore: torch's (dropout, randn), NumPy's and
    Python's; the losses match only if all of them and the optimizer and scheduler states are back."""
    losses = []
    for _ in range(n):
        x = torch.randn(8, 6) + float(np.random.rand()) + random.random()
        loss = torch.nn.functional.mse_loss(model(x), x[:, :1])
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        sched.step()
        counter.seen += 1
        losses.append(loss.item())
    return losses


def test_save_state_writes_only_nvckpt_files_and_load_state_resumes_exactly(tmp_path):
    acc, model, opt, sched, counter = setup(0)
    use_nvckpt(acc)
    steps(acc, model, opt, sched, counter, 3)
    acc.save_state(str(tmp_path / "ckpt"))
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert files == ["custom_checkpoint_0.nvckpt", "model.nvckpt", "optimizer.nvckpt", "random_states_0.nvckpt",
                     "scheduler.nvckpt"], files  # no pickle, no safetensors beside them
    for name in files:
        assert (tmp_path / "ckpt" / name).read_bytes()[:8] == b"\x89NVCKPT\n"
    with nvckpt.open(tmp_path / "ckpt" / "model.nvckpt") as ck:
        assert set(ck.keys()) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    with nvckpt.open(tmp_path / "ckpt" / "optimizer.nvckpt") as ck:
        assert "state/0/exp_avg" in ck
    after = steps(acc, model, opt, sched, counter, 4)
    lr_after = sched.get_last_lr()

    acc2, model2, opt2, sched2, counter2 = setup(1)  # other weights and generators: load_state replaces them all
    use_nvckpt(acc2)
    random.seed(5), np.random.seed(5)
    acc2.load_state(str(tmp_path / "ckpt"))
    assert counter2.seen == 3
    assert steps(acc2, model2, opt2, sched2, counter2, 4) == after
    assert sched2.get_last_lr() == lr_after and counter2.seen == counter.seen


def test_automatic_checkpoint_naming_and_its_limit(tmp_path):
    config = accelerate.utils.ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True,
                                                   total_limit=2)
    acc, model, opt, sched, counter = setup(0, project_config=config)
    use_nvckpt(acc)
    for _ in range(3):
        steps(acc, model, opt, sched, counter, 1)
        acc.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    acc2, model2, opt2, sched2, counter2 = setup(1, project_config=config)
    use_nvckpt(acc2)
    acc2.load_state()  # the latest
    assert counter2.seen == 3 and torch.equal(model2[0].weight, model[0].weight)


def test_folders_accelerate_wrote_still_load(tmp_path):
    """A folder of Accelerate's own files (pickles, safetensors) loads through use_nvckpt's load_state, and so
    does the layout an earlier version of this module wrote (model.nvckpt beside Accelerate's other files)."""
    acc, model, opt, sched, counter = setup(0)
    steps(acc, model, opt, sched, counter, 2)
    acc.save_state(str(tmp_path / "plain"))  # Accelerate's own
    assert "optimizer.bin" in os.listdir(tmp_path / "plain")
    after = steps(acc, model, opt, sched, counter, 2)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name in os.listdir(tmp_path / "plain"):
        if name != "model.safetensors":
            (mixed / name).write_bytes((tmp_path / "plain" / name).read_bytes())
    from safetensors.torch import load_file
    nvckpt.save(load_file(tmp_path / "plain" / "model.safetensors"), mixed / "model.nvckpt")

    for folder in ("plain", "mixed"):
        acc2, model2, opt2, sched2, counter2 = setup(1)
        use_nvckpt(acc2)
        acc2.load_state(str(tmp_path / folder))
        assert steps(acc2, model2, opt2, sched2, counter2, 2) == after, folder


def test_hooks_and_keywords_behave_as_in_accelerate(tmp_path):
    """The user's own save/load pre-hooks run; load_state(dir, strict=False) is for model.load_state_dict
    (strict by default, as Accelerate's own loader); remove() gives Accelerate's own save_state back."""
    acc, model, opt, sched, counter = setup(0)
    seen = []
    acc.register_save_state_pre_hook(lambda models, weights, folder: seen.append(("save", len(weights))))
    handle = use_nvckpt(acc)
    acc.save_state(str(tmp_path / "ckpt"))
    assert seen == [("save", 1)]

    class Bigger(torch.nn.Sequential):
        def __init__(self) -> None:
            super().__init__(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(12, 1))
            self.extra = torch.nn.Parameter(torch.zeros(1))

    acc2 = accelerate.Accelerator(cpu=True)
    bigger = acc2.prepare(Bigger())
    acc2.register_for_checkpointing(Counter())
    use_nvckpt(acc2)
    acc2.register_load_state_pre_hook(lambda models, folder: seen.append(("load", len(models))))
    with pytest.raises(RuntimeError, match="extra"):
        acc2.load_state(str(tmp_path / "ckpt"))
    acc2.load_state(str(tmp_path / "ckpt"), strict=False)
    assert torch.equal(bigger[0].weight, model[0].weight) and ("load", 1) in seen
    with pytest.raises(ValueError, match="already"):
        use_nvckpt(acc)
    handle.remove()
    acc.save_state(str(tmp_path / "again"))
    assert "optimizer.bin" in os.listdir(tmp_path / "again")  # Accelerate's own again


def test_a_grad_scaler_state_is_saved_too(tmp_path):
    acc, model, opt, sched, counter = setup(0)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    acc.scaler.scale(torch.ones(1))  # makes its scale tensor
    acc.scaler.update(512.0)
    use_nvckpt(acc)
    acc.save_state(str(tmp_path / "ckpt"))
    acc2, *_ = setup(1)
    acc2.scaler = torch.amp.GradScaler("cpu")
    use_nvckpt(acc2)
    acc2.load_state(str(tmp_path / "ckpt"))
    assert acc2.scaler.state_dict() == acc.scaler.state_dict() and acc2.scaler.get_scale() == 512.0
