"""Hugging Face transformers: a ``Trainer`` whose checkpoints hold the training state as nvckpt files.

    from transformers import Trainer
    from nvckpt.integrations.transformers import NvckptTrainerMixin

    class MyTrainer(NvckptTrainerMixin, Trainer):       # also over a Trainer subclass (TRL's SFTTrainer, ...)
        pass

    trainer = MyTrainer(model=model, args=args, train_dataset=data)   # nvckpt_options={"codec": ...} optional
    trainer.train(resume_from_checkpoint=True)                        # resumes bit-exact from checkpoint-N

(``NvckptTrainer`` is ``NvckptTrainerMixin`` over ``transformers.Trainer``.)  A ``checkpoint-N`` folder then
holds ``optimizer.nvckpt``, ``scheduler.nvckpt``, ``scaler.nvckpt`` (fp16) and ``rng_state.nvckpt``
(``rng_state_<process>.nvckpt`` in distributed training) where Trainer writes the pickles ``optimizer.pt``,
``scheduler.pt``, ``scaler.pt`` and ``rng_state.pth``; the model stays ``model.safetensors`` with its
``config.json`` (``from_pretrained`` reads the folder as before) and ``trainer_state.json`` stays JSON.
A resume reads the nvckpt files, and Trainer's own where a folder has no nvckpt file (a checkpoint
written before the switch).

A mixin, not a ``TrainerCallback``: a callback's ``on_save`` runs after Trainer has written its pickles, and a
resume restores the random states after skipping the batches of the resumed epoch, where no callback runs;
the mixin replaces the six methods that do those steps (``_save_optimizer_and_scheduler``, ``_save_scaler``,
``_save_rng_state`` and their ``_load_`` counterparts).  DeepSpeed, FSDP, XLA, SageMaker model parallelism and
the NPU/HPU/MLU/MUSA devices save through their own code: the mixin leaves those to Trainer.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch
import transformers
from transformers import Trainer

from ..api import load, save
from .random_state import numpy_state, set_numpy_state

_OTHER_DEVICES = ("is_torch_npu_available", "is_torch_hpu_available", "is_torch_mlu_available",
                  "is_torch_musa_available")


class NvckptTrainerMixin:
    """Put before ``transformers.Trainer`` (or a subclass of it) in a class's bases; see the module.

    ``nvckpt_options``: nvckpt.save keywords for every file it writes (``codec``, ``zstd_level``, ...)."""

    def __init__(self, *args: Any, nvckpt_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.nvckpt_options = dict(nvckpt_options or {})
        super().__init__(*args, **kwargs)

    def _nvckpt_handles(self) -> bool:
        """Does this run save through Trainer's plain files (not an engine's own checkpoint)?"""
        utils = transformers.utils
        own_engine = (getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False)
                      or utils.is_torch_xla_available() or utils.is_sagemaker_mp_enabled())
        return not own_engine and not any(getattr(utils, name, lambda: False)() for name in _OTHER_DEVICES)

    def _rng_file(self, folder: str) -> str:
        name = "rng_state" if self.args.world_size <= 1 else f"rng_state_{self.args.process_index}"
        return os.path.join(folder, name + ".nvckpt")

    # -- saving ---------------------------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._nvckpt_handles():
            return super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        if self.args.should_save:
            save(self.optimizer.state_dict(), os.path.join(output_dir, "optimizer.nvckpt"), **self.nvckpt_options)
            save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.nvckpt"), **self.nvckpt_options)

    def _save_scaler(self, output_dir: str) -> None:
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is None or not self._nvckpt_handles():
            return super()._save_scaler(output_dir)  # type: ignore[misc]
        if self.args.should_save:
            save(scaler.state_dict(), os.path.join(output_dir, "scaler.nvckpt"), **self.nvckpt_options)

    def _save_rng_state(self, output_dir: str) -> None:
        if not self._nvckpt_handles():
            return super()._save_rng_state(output_dir)  # type: ignore[misc]
        states: dict[str, Any] = {"python": random.getstate(), "numpy": numpy_state(),
                                  "cpu": torch.random.get_rng_state()}
        if torch.cuda.is_available():
            distributed = self.args.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED
            states["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
        # A process can get here before process 0 has made the folder (as in Trainer).
        os.makedirs(output_dir, exist_ok=True)
        save(states, self._rng_file(output_dir), **self.nvckpt_options)

    # -- loading --------------------------------------------------------------------------------------------
    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        optimizer, scheduler = (os.path.join(checkpoint, n) for n in ("optimizer.nvckpt", "scheduler.nvckpt"))
        if not (self._nvckpt_handles() and os.path.isfile(optimizer) and os.path.isfile(scheduler)):
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        # As Trainer: the optimizer's state onto the CPU for one process (its load_state_dict moves it to the
        # parameters' device), straight onto each GPU in distributed training.
        device = self.args.device
        where = device if self.args.world_size > 1 and device.type != "cpu" else "cpu"
        self.optimizer.load_state_dict(load(optimizer, map_location=where))
        self.lr_scheduler.load_state_dict(load(scheduler))

    def _load_scaler(self, checkpoint: str | None) -> None:
        path = os.path.join(checkpoint, "scaler.nvckpt") if checkpoint is not None else None
        if path is None or not os.path.isfile(path) or getattr(self.accelerator, "scaler", None) is None:
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        self.accelerator.scaler.load_state_dict(load(path))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        path = self._rng_file(checkpoint) if checkpoint is not None else None
        if path is None or not os.path.isfile(path) or not self._nvckpt_handles():
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        states = load(path)
        random.setstate(states["python"])
        set_numpy_state(states["numpy"])
        torch.random.set_rng_state(states["cpu"])
        if torch.cuda.is_available() and "cuda" in states:
            from transformers.trainer_pt_utils import set_rng_state_for_device

            distributed = self.args.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED
            set_rng_state_for_device("CUDA", torch.cuda, states, distributed)


class NvckptTrainer(NvckptTrainerMixin, Trainer):
    """``transformers.Trainer`` with its checkpoints' training state in nvckpt files (see the module)."""


__all__ = ["NvckptTrainerMixin", "NvckptTrainer"]
