"""Hugging Face Accelerate: ``Accelerator.save_state`` / ``load_state`` with the models' weights as nvckpt files.

    from accelerate import Accelerator
    from nvckpt.integrations.accelerate import use_nvckpt

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)
    use_nvckpt(accelerator)                     # once; nvckpt.save options as keywords (codec=..., ...)
    accelerator.save_state("ckpt/step-1000")    # ckpt/step-1000/model.nvckpt (model_1.nvckpt, ... for more models)
    accelerator.load_state("ckpt/step-1000")    # reads them back into the prepared models

The hooks are Accelerate's own (``register_save_state_pre_hook`` / ``register_load_state_pre_hook``): they
write each model's state_dict with nvckpt and take it off Accelerate's list, so Accelerate writes no
``model.safetensors`` for it.  The optimizer, scheduler, sampler and RNG states stay Accelerate's files.  A
``transformers.Trainer`` user who wants the whole training state in one nvckpt file saves it from a
``TrainerCallback.on_save``: ``nvckpt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
"scheduler": scheduler.state_dict(), "step": state.global_step}, path)``.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

from ..api import load, save


def model_file(folder: str, i: int) -> str:
    """Where model ``i`` of a ``save_state`` folder is written (Accelerate's own naming, .nvckpt)."""
    return os.path.join(folder, "model.nvckpt" if i == 0 else f"model_{i}.nvckpt")


def use_nvckpt(accelerator: Any, **save_options: Any) -> tuple[Any, Any]:
    """Register the save and load hooks on ``accelerator``; returns their handles (``handle.remove()`` undoes)."""

    def save_models(models: list, weights: list, output_dir: str) -> None:
        if accelerator.is_main_process:
            for i, state in enumerate(weights):
                save(state, model_file(output_dir, i), **save_options)
        weights.clear()  # saved: Accelerate must not write them again

    # Accelerate gives a load pre-hook only (models, input_dir); the keywords of load_state(dir, strict=False)
    # are for model.load_state_dict, so the call is wrapped to hand them to the hook as well.
    asked: list[dict[str, Any]] = []
    load_state = accelerator.load_state
    try:  # load_state's own named parameters (input_dir, load_kwargs, ...): the rest is load_state_dict's
        own = {p.name for p in inspect.signature(load_state).parameters.values()
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    except (TypeError, ValueError):
        own = set()
    own |= {"input_dir", "load_kwargs", "map_location"}

    @functools.wraps(load_state)
    def load_state_with_keywords(*args: Any, **kwargs: Any) -> Any:
        asked.append({k: v for k, v in kwargs.items() if k not in own})
        try:
            return load_state(*args, **kwargs)
        finally:
            asked.pop()

    accelerator.load_state = load_state_with_keywords

    def load_models(models: list, input_dir: str) -> None:
        kept = []
        for i, model in enumerate(models):
            path = model_file(input_dir, i)
            if os.path.exists(path):
                accelerator.unwrap_model(model).load_state_dict(load(path), **(asked[-1] if asked else {}))
            else:
                kept.append(model)  # a folder Accelerate wrote itself: it loads that model
        models[:] = kept

    return accelerator.register_save_state_pre_hook(save_models), accelerator.register_load_state_pre_hook(load_models)


__all__ = ["use_nvckpt", "model_file"]
