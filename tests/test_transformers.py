"""A real transformers Trainer (a tiny GPT-2 on CPU) checkpoints its training state as nvckpt files and
resumes from them bit for bit; checkpoints written by Trainer itself still resume."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import nvckpt  # noqa: E402
from nvckpt.integrations.transformers import NvckptTrainer, NvckptTrainerMixin  # noqa: E402


@pytest.fixture(autouse=True)
def quiet():
    deterministic = torch.are_deterministic_algorithms_enabled()
    with warnings.catch_warnings():  # transformers' own notices about its defaults: not what these tests check
        warnings.simplefilter("ignore")
        yield
    torch.use_deterministic_algorithms(deterministic)


def tiny_model() -> "transformers.GPT2LMHeadModel":
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config)  # dropout on: the resumed run needs the RNG states back


def data() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (24, 16), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def args(out) -> "transformers.TrainingArguments":
    return transformers.TrainingArguments(output_dir=str(out), max_steps=8, save_steps=4, per_device_train_batch_size=4,
                                          learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, seed=0,
                                          logging_steps=1, report_to=[], use_cpu=True, dataloader_num_workers=0,
                                          disable_tqdm=True)


def losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


@pytest.mark.slow
def test_trainer_checkpoints_hold_nvckpt_files_and_resume_exactly(tmp_path):
    straight = NvckptTrainer(model=tiny_model(), args=args(tmp_path / "a"), train_dataset=data())
    straight.train()
    folder = tmp_path / "a" / "checkpoint-4"  # written halfway: the resumed run must redo steps 5-8 exactly
    files = set(os.listdir(folder))
    assert {"optimizer.nvckpt", "scheduler.nvckpt", "rng_state.nvckpt", "model.safetensors", "trainer_state.json"} <= files
    assert not files & {"optimizer.pt", "scheduler.pt", "rng_state.pth"}, files
    with nvckpt.open(folder / "optimizer.nvckpt") as ck:
        assert "state/0/exp_avg" in ck
    assert transformers.GPT2LMHeadModel.from_pretrained(folder) is not None  # the folder still loads as a model

    resumed = NvckptTrainer(model=tiny_model(), args=args(tmp_path / "b"), train_dataset=data())
    resumed.train(resume_from_checkpoint=str(folder))
    assert losses(resumed)[-4:] == losses(straight)[-4:]
    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_a_checkpoint_trainer_wrote_itself_still_resumes(tmp_path):
    straight = transformers.Trainer(model=tiny_model(), args=args(tmp_path / "a"), train_dataset=data())
    straight.train()
    assert "optimizer.pt" in os.listdir(tmp_path / "a" / "checkpoint-4")
    (tmp_path / "b").mkdir()
    os.rename(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4")  # resume_from_checkpoint=True finds it

    class Mine(NvckptTrainerMixin, transformers.Trainer):  # the mixin over any Trainer class
        pass

    resumed = Mine(model=tiny_model(), args=args(tmp_path / "b"), train_dataset=data(), nvckpt_options={"codec": "zstd"})
    resumed.train(resume_from_checkpoint=True)
    assert losses(resumed)[-4:] == losses(straight)[-4:]
    with nvckpt.open(tmp_path / "b" / "checkpoint-8" / "optimizer.nvckpt") as ck:
        assert any(p.describe().startswith("zstd") for p in ck.file.pipelines)
