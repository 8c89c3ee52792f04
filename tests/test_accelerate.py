"""The Hugging Face Accelerate recipe: save_state / load_state write and read the models as nvckpt files."""

from __future__ import annotations

import os

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

import nvckpt  # noqa: E402
from nvckpt.integrations.accelerate import use_nvckpt  # noqa: E402


def setup(seed: int):
    torch.manual_seed(seed)
    acc = accelerate.Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def steps(model, opt, n: int) -> list[float]:
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(n):
        x = torch.randn(8, 6, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_save_state_writes_nvckpt_and_load_state_resumes(tmp_path):
    acc, model, opt = setup(0)
    use_nvckpt(acc)
    steps(model, opt, 3)
    acc.save_state(str(tmp_path / "ckpt"))
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert "model.nvckpt" in files and not any(f.startswith(("model.safetensors", "pytorch_model")) for f in files)
    with nvckpt.open(tmp_path / "ckpt" / "model.nvckpt") as ck:
        assert set(ck.keys()) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    after = steps(model, opt, 3)

    acc2, model2, opt2 = setup(1)  # other initial weights: load_state must replace them
    use_nvckpt(acc2)
    acc2.load_state(str(tmp_path / "ckpt"))
    assert steps(model2, opt2, 3) == after  # weights from nvckpt, AdamW state from Accelerate's own file


def test_load_state_keywords_reach_load_state_dict(tmp_path):
    """load_state(dir, strict=False) is for model.load_state_dict: the nvckpt hook honours it as Accelerate's
    own loader does (strict by default)."""
    acc, model, opt = setup(0)
    use_nvckpt(acc)
    acc.save_state(str(tmp_path / "ckpt"))

    class Bigger(torch.nn.Sequential):
        def __init__(self) -> None:
            super().__init__(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
            self.extra = torch.nn.Parameter(torch.zeros(1))

    acc2 = accelerate.Accelerator(cpu=True)
    bigger = acc2.prepare(Bigger())
    use_nvckpt(acc2)
    with pytest.raises(RuntimeError, match="extra"):
        acc2.load_state(str(tmp_path / "ckpt"))
    acc2.load_state(str(tmp_path / "ckpt"), strict=False)
    assert torch.equal(bigger[0].weight, model[0].weight)
    acc2.load_state(input_dir=str(tmp_path / "ckpt"), strict=False)  # load_state's own keywords stay its own
