"""Hugging Face Accelerate: the whole ``Accelerator.save_state`` / ``load_state`` through nvckpt, no pickle.

    from accelerate import Accelerator
    from nvckpt.integrations.accelerate import use_nvckpt

    accelerator = Accelerator()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    use_nvckpt(accelerator)                     # once; nvckpt.save options as keywords (codec=..., ...)
    accelerator.save_state("ckpt/step-1000")    # every state Accelerate saves, as .nvckpt files
    accelerator.load_state("ckpt/step-1000")    # and back, bit-exact

A folder holds what Accelerate's would, under Accelerate's names with the extension ``.nvckpt``:
``model.nvckpt`` (``model_1.nvckpt``, ... for more models), ``optimizer.nvckpt``, ``scheduler.nvckpt``,
``scaler.nvckpt`` (mixed precision's GradScaler), ``sampler.nvckpt`` (a seedable sampler's seed and epoch),
``dl_state_dict.nvckpt`` (a stateful dataloader's state), ``random_states_<process>.nvckpt`` (Python's,
NumPy's, torch's and the accelerator's generators, and the step) and ``custom_checkpoint_<i>.nvckpt`` (what
``register_for_checkpointing`` registered: its ``state_dict()``).  Accelerate pickles all but the models
(the optimizer's state is twice the weights' bytes).  The main process writes everything but the random
states, which every process writes, as Accelerate does (``save_on_each_node`` too), and the hooks of
``register_save_state_pre_hook`` / ``register_load_state_pre_hook`` run as in Accelerate.

``load_state`` reads a folder that Accelerate wrote itself with Accelerate's own code, and one that an
earlier version of this module wrote (``model.nvckpt`` beside Accelerate's ``optimizer.bin``) file by file.
FSDP, DeepSpeed, Megatron-LM and XLA save through their own engines: ``use_nvckpt`` refuses them (FSDP2's
sharded states go through ``nvckpt.dcp``).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import torch

from ..api import load, save
from ..errors import UnsupportedFeatureError
from .random_state import numpy_state, set_numpy_state

EXTENSION = ".nvckpt"
_log = logging.getLogger(__name__)


def model_file(folder: str | os.PathLike, i: int) -> str:
    """Where model ``i`` of a ``save_state`` folder is written (Accelerate's own naming, .nvckpt)."""
    return _file(folder, "model", i)


def _file(folder: str | os.PathLike, stem: str, i: int = 0) -> str:
    """Accelerate's name for the ``i``-th file of a kind (``optimizer``, ``optimizer_1``, ...), as .nvckpt."""
    return os.path.join(folder, (stem if i == 0 else f"{stem}_{i}") + EXTENSION)


class Installed:
    """What ``use_nvckpt`` changed on an accelerator; ``remove()`` gives it Accelerate's own save and load back."""

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    def remove(self) -> None:
        """Accelerate's own ``save_state`` / ``load_state`` again."""
        for name in ("save_state", "load_state"):
            self._accelerator.__dict__.pop(name, None)


def use_nvckpt(accelerator: Any, **save_options: Any) -> Installed:
    """Make ``accelerator.save_state`` / ``load_state`` write and read every state as nvckpt files.

    ``save_options``: nvckpt.save keywords for every file (``codec``, ``zstd_level``, ...).  Returns a
    handle whose ``remove()`` undoes it.  Raises UnsupportedFeatureError for FSDP, DeepSpeed, Megatron-LM and
    XLA, which save through their own engines."""
    from accelerate.utils import DistributedType

    own = {DistributedType.FSDP: "FSDP (for FSDP2's sharded state use nvckpt.dcp with torch.distributed.checkpoint)",
           DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.MEGATRON_LM: "Megatron-LM",
           DistributedType.XLA: "XLA"}
    if accelerator.distributed_type in own:
        raise UnsupportedFeatureError(f"use_nvckpt: {own[accelerator.distributed_type]} saves its state through its "
                                      "own engine, not Accelerate's files; keep Accelerate's save_state there")
    if "save_state" in accelerator.__dict__:
        raise ValueError("use_nvckpt was already called on this accelerator")
    accelerate_save, accelerate_load = accelerator.save_state, accelerator.load_state

    @functools.wraps(accelerate_save)
    def save_state(output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> Path:
        return save_accelerator_state(accelerator, output_dir, save_options)

    @functools.wraps(accelerate_load)
    def load_state(input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        folder = _input_dir(accelerator, input_dir)
        if not any(name.endswith(EXTENSION) for name in os.listdir(folder)):
            return accelerate_load(folder, load_kwargs, **load_model_func_kwargs)  # a folder Accelerate wrote
        load_accelerator_state(accelerator, folder, load_kwargs, load_model_func_kwargs)

    accelerator.save_state, accelerator.load_state = save_state, load_state
    return Installed(accelerator)


# -- saving --------------------------------------------------------------------------------------------------

def save_accelerator_state(accelerator: Any, output_dir: str | os.PathLike | None,
                           save_options: dict[str, Any] | None = None) -> Path:
    """``accelerator.save_state(output_dir)`` with every file nvckpt's (see the module)."""
    folder = Path(_output_dir(accelerator, output_dir))
    options = dict(save_options or {})
    writes = accelerator.is_main_process or (accelerator.project_configuration.save_on_each_node
                                             and accelerator.is_local_main_process)

    weights = [accelerator.get_state_dict(model, unwrap=False) for model in accelerator._models]
    for hook in accelerator._save_model_state_pre_hook.values():  # the user's hooks, as Accelerate runs them
        hook(accelerator._models, weights, str(folder))
    if writes:
        for i, state in enumerate(weights):
            save(state, model_file(folder, i), **options)
        for i, opt in enumerate(accelerator._optimizers):
            save(opt.state_dict(), _file(folder, "optimizer", i), **options)
        for i, scheduler in enumerate(accelerator._schedulers):
            save(scheduler.state_dict(), _file(folder, "scheduler", i), **options)
        for i, dataloader in enumerate(accelerator._dataloaders):
            sampler = _seedable_sampler(dataloader)
            if sampler is not None:
                save({"initial_seed": sampler.initial_seed, "epoch": sampler.epoch}, _file(folder, "sampler", i),
                     **options)
            if getattr(dataloader, "use_stateful_dataloader", False):
                save(dataloader.state_dict(), _file(folder, "dl_state_dict", i), **options)
        if accelerator.scaler is not None:
            save(accelerator.scaler.state_dict(), os.path.join(folder, "scaler" + EXTENSION), **options)
        for i, obj in enumerate(accelerator._custom_objects):
            save(obj.state_dict(), _custom_file(folder, i), **options)
    save(_random_states(accelerator), _random_file(folder, accelerator.process_index), **options)
    accelerator.project_configuration.iteration += 1
    return folder


def _custom_file(folder: str | os.PathLike, i: int) -> str:
    return os.path.join(folder, f"custom_checkpoint_{i}{EXTENSION}")  # numbered from 0, as Accelerate's


def _random_file(folder: str | os.PathLike, process: int) -> str:
    return os.path.join(folder, f"random_states_{process}{EXTENSION}")


def _random_states(accelerator: Any) -> dict[str, Any]:
    states: dict[str, Any] = {"step": accelerator.step, "random_state": random.getstate(),
                              "numpy_random_seed": numpy_state(), "torch_manual_seed": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def _seedable_sampler(dataloader: Any) -> Any:
    """The SeedableRandomSampler whose seed and epoch Accelerate saves (of an IterableDatasetShard), or None."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    if isinstance(getattr(dataloader, "dataset", None), IterableDatasetShard):
        sampler = dataloader.get_sampler()
        if isinstance(sampler, SeedableRandomSampler):
            return sampler
    return None


def _output_dir(accelerator: Any, output_dir: str | os.PathLike | None) -> str:
    """Accelerate's choice of folder (automatic checkpoint naming and its total_limit included)."""
    config = accelerator.project_configuration
    if config.automatic_checkpoint_naming:
        root = os.path.join(accelerator.project_dir, "checkpoints")
        os.makedirs(root, exist_ok=True)
        folders = [os.path.join(root, f) for f in os.listdir(root)]
        if config.total_limit is not None and len(folders) + 1 > config.total_limit and accelerator.is_main_process:
            import shutil

            folders.sort(key=_iteration)
            for folder in folders[: len(folders) + 1 - config.total_limit]:
                shutil.rmtree(folder)
        output_dir = os.path.join(root, f"checkpoint_{accelerator.save_iteration}")
        if os.path.exists(output_dir):
            raise ValueError(f"Checkpoint directory {output_dir} ({accelerator.save_iteration}) already exists")
        accelerator.wait_for_everyone()
    if output_dir is None:
        raise ValueError("save_state needs output_dir (or ProjectConfiguration(automatic_checkpoint_naming=True))")
    os.makedirs(output_dir, exist_ok=True)
    return os.fspath(output_dir)


def _iteration(folder: str) -> int:
    return int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)[0])


# -- loading -------------------------------------------------------------------------------------------------

def _input_dir(accelerator: Any, input_dir: str | os.PathLike | None) -> str:
    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if not os.path.isdir(input_dir):
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
        return input_dir
    if accelerator.project_configuration.automatic_checkpoint_naming:
        root = os.path.join(accelerator.project_dir, "checkpoints")
        return sorted((os.path.join(root, f) for f in os.listdir(root)), key=_iteration)[-1]
    raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")


def load_accelerator_state(accelerator: Any, folder: str, load_kwargs: dict | None = None,
                           load_model_func_kwargs: dict[str, Any] | None = None) -> None:
    """``accelerator.load_state(folder)`` from nvckpt files; a file this folder lacks is read as Accelerate
    wrote it (a folder of an earlier version of this module: models in nvckpt, the rest Accelerate's)."""
    model_kwargs = dict(load_model_func_kwargs or {})
    where = model_kwargs.pop("map_location", None)
    if where not in (None, "cpu", "on_device"):
        raise TypeError("Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, or "
                        "`'on_device'`")
    if where is None:
        multi = accelerator.num_processes > 1 and accelerator.multi_device
        where = "on_device" if multi else "cpu"
    device = accelerator.device if where == "on_device" else torch.device("cpu")
    load_kwargs = dict(load_kwargs or {})

    models = list(accelerator._models)
    for hook in accelerator._load_model_state_pre_hook.values():  # may take models off the list
        hook(models, folder)
    for i, model in enumerate(models):
        model.load_state_dict(_read(folder, "model", i, device, load_kwargs, legacy=_legacy_model), **model_kwargs)
    for i, opt in enumerate(accelerator._optimizers):
        opt.load_state_dict(_read(folder, "optimizer", i, device, load_kwargs))
    for i, scheduler in enumerate(accelerator._schedulers):
        scheduler.load_state_dict(_read(folder, "scheduler", i, None, load_kwargs))
    for i, dataloader in enumerate(accelerator._dataloaders):
        sampler = _seedable_sampler(dataloader)
        if sampler is not None and os.path.isfile(_file(folder, "sampler", i)):
            state = load(_file(folder, "sampler", i))
            sampler.initial_seed, sampler.epoch = state["initial_seed"], state["epoch"]
        if getattr(dataloader, "use_stateful_dataloader", False) and os.path.isfile(_file(folder, "dl_state_dict", i)):
            dataloader.load_state_dict(load(_file(folder, "dl_state_dict", i)))
    if accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(_read(folder, "scaler", 0, None, load_kwargs))
    _load_random_states(accelerator, folder)
    custom = [f for f in os.listdir(folder) if re.fullmatch(r"custom_checkpoint_\d+\.(nvckpt|pkl)", f)]
    if len(custom) != len(accelerator._custom_objects):
        raise RuntimeError(f"Number of custom checkpoints in folder {folder} does not match the number of registered "
                           f"objects: found {len(custom)}, registered {len(accelerator._custom_objects)}")
    for i, obj in enumerate(accelerator._custom_objects):
        if os.path.isfile(_custom_file(folder, i)):
            obj.load_state_dict(load(_custom_file(folder, i)))
        else:
            from accelerate.checkpointing import load_custom_state

            load_custom_state(obj, folder, i)  # Accelerate's own pickle, read as Accelerate reads it


def _read(folder: str, stem: str, i: int, device: Any, load_kwargs: dict, legacy: Any = None) -> Any:
    """The state in ``stem``'s nvckpt file, else in the file Accelerate wrote for it."""
    path = _file(folder, stem, i)
    if os.path.isfile(path):
        return load(path, map_location=device)
    if legacy is not None:
        return legacy(folder, i, device)
    from accelerate.utils import load as accelerate_load

    name = "scaler.pt" if stem == "scaler" else (stem if i == 0 else f"{stem}_{i}") + ".bin"
    return accelerate_load(os.path.join(folder, name), map_location=device, **load_kwargs)


def _legacy_model(folder: str, i: int, device: Any) -> Any:
    suffix = "" if i == 0 else f"_{i}"
    safe = os.path.join(folder, f"model{suffix}.safetensors")
    if os.path.isfile(safe):
        from safetensors.torch import load_file

        return load_file(safe, device=str(device or "cpu"))
    from accelerate.utils import load as accelerate_load

    return accelerate_load(os.path.join(folder, f"pytorch_model{suffix}.bin"), map_location=device)


def _load_random_states(accelerator: Any, folder: str) -> None:
    path = _random_file(folder, accelerator.process_index)
    if not os.path.isfile(path):
        pickled = os.path.join(folder, f"random_states_{accelerator.process_index}.pkl")
        if os.path.isfile(pickled):  # Accelerate's own file: its loader, as it reads it
            from accelerate.utils import load as accelerate_load

            try:
                states = accelerate_load(pickled)
            except Exception:  # noqa: BLE001 - Accelerate goes on without them, and so does this
                _log.info("Could not load random states")
                return
        else:
            _log.info("Could not load random states: %s is missing", path)
            return
    else:
        states = load(path)
    if "step" in states:
        accelerator.step = states["step"]
    random.setstate(states["random_state"])
    set_numpy_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


__all__ = ["use_nvckpt", "model_file", "save_accelerator_state", "load_accelerator_state", "Installed", "EXTENSION"]
