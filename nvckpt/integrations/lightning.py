"""Lightning: every checkpoint a ``Trainer`` writes, through nvckpt.

    from nvckpt.integrations.lightning import NvckptCheckpointIO
    trainer = Trainer(plugins=[NvckptCheckpointIO()])              # or NvckptCheckpointIO(async_save=True)
    trainer.fit(model, ckpt_path="last")                          # resumes from an nvckpt (or torch.save) .ckpt

What a Lightning checkpoint holds: ``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``loops``,
``callbacks`` (ModelCheckpoint's scores and paths), ``epoch``, ``global_step``, the precision plugin's
scaler state, and ``hyper_parameters`` (what ``save_hyperparameters()`` captured).  All of it is tensors and
plain data except what a user puts in the hyper-parameters: a ``pathlib.Path``, an ``nn.Module``, a function,
a Namespace.  torch.save pickles those (and loading them runs code); nvckpt never pickles, so by default
saving such a checkpoint fails, naming the path (``hyper_parameters/loss_fn``); ``unsupported="drop"`` saves
the checkpoint without those values instead (a dict leaves the key out; a list or tuple holds None in its place,
so the other elements keep their positions), warning once, and records their paths in the file's metadata
(``lightning.dropped``).  A state_dict's ``_metadata`` (module versions) is not kept; Lightning and
``load_state_dict`` do not need it for current modules.

``Model.load_from_checkpoint(path)`` is Lightning's own reader (it calls ``torch.load`` and never asks the
CheckpointIO), so it cannot read an nvckpt file; ``load_from_checkpoint(Model, path, ...)`` here takes the
same arguments and does.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

try:
    from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
except ImportError:  # the standalone pytorch_lightning package
    from lightning_fabric.plugins import CheckpointIO, TorchCheckpointIO  # type: ignore[no-redef]

from ..api import async_save, load, save
from ..errors import UnsupportedObjectError
from ..format.tree import escape
from ..session.async_save import SaveFuture
from ..tools._util import sniff_format

DROPPED = "lightning.dropped"


class NvckptCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes nvckpt files (atomically, compressed, checksummed).

    ``async_save``: return from ``save_checkpoint`` once the state is snapshotted and write in the
    background (a later save, ``remove_checkpoint`` of that path and ``teardown`` wait for it).
    ``unsupported``: "error" (default) or "drop", for values the tree cannot hold (see the module).
    ``save_options``: nvckpt.save keywords (``codec``, ``derive_bf16``, ...), also per call through
    ``Trainer.save_checkpoint(..., storage_options={...})``."""

    def __init__(self, *, async_save: bool = False, unsupported: str = "error", **save_options: Any) -> None:
        if unsupported not in ("error", "drop"):
            raise ValueError(f"unsupported must be 'error' or 'drop', got {unsupported!r}")
        self.async_save = async_save
        self.unsupported = unsupported
        self.save_options = save_options
        self._pending: dict[str, SaveFuture] = {}
        self._warned = False

    # -- CheckpointIO --------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict of nvckpt.save options, got {type(storage_options).__name__}")
        path = _local(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        options = {**self.save_options, **(storage_options or {})}
        if self.unsupported == "drop":
            checkpoint, dropped = _storable(checkpoint)
            if dropped:
                options["metadata"] = {**(options.get("metadata") or {}), DROPPED: dropped}
                if not self._warned:
                    warnings.warn(f"nvckpt: not saved (no pickle): {', '.join(dropped[:5])}"
                                  f"{', ...' if len(dropped) > 5 else ''}", stacklevel=2)
                    self._warned = True
        self._wait(path)
        if self.async_save:
            self._wait_all()  # one background save at a time: the snapshots would otherwise pile up
            self._pending[path] = async_save(checkpoint, path, **options)
        else:
            save(checkpoint, path, **options)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        path = _local(path)
        self._wait(path)
        if not os.path.exists(path):
            raise FileNotFoundError(2, "No such checkpoint", path)
        if sniff_format(path) == "torch":  # a checkpoint written before the switch: Lightning's own reader
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return load(path, map_location=map_location)

    def remove_checkpoint(self, path: Any) -> None:
        path = _local(path)
        self._wait(path)
        if os.path.isfile(path):
            os.remove(path)

    def teardown(self) -> None:
        self._wait_all()

    # -- pending async saves -------------------------------------------------
    def _wait(self, path: str) -> None:
        future = self._pending.pop(path, None)
        if future is not None:
            future.result()

    def _wait_all(self) -> None:
        while self._pending:
            self._wait(next(iter(self._pending)))


def load_from_checkpoint(cls: Any, checkpoint_path: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for an nvckpt ``.ckpt`` (or a torch.save one).

    Lightning's classmethod reads with ``torch.load`` only; this loads the nvckpt file and hands Lightning
    the same checkpoint dict as an in-memory torch file, so hyper-parameters, ``strict``, ``hparams_file``
    and the ``on_load_checkpoint`` hooks behave exactly as Lightning's (it holds the state twice meanwhile)."""
    import io

    import torch

    path = _local(checkpoint_path)
    if sniff_format(path) == "torch":
        return cls.load_from_checkpoint(path, map_location=map_location, **kwargs)
    buffer = io.BytesIO()
    torch.save(load(path, map_location=map_location), buffer)
    buffer.seek(0)
    return cls.load_from_checkpoint(buffer, map_location=map_location, **kwargs)


def _local(path: Any) -> str:
    path = os.fspath(path)
    if "://" in path and not path.startswith("file://"):
        raise UnsupportedObjectError(f"{path}: NvckptCheckpointIO writes local files (mount the storage, or use "
                                     "Lightning's own CheckpointIO for remote URLs)")
    return path.removeprefix("file://")


def _storable(node: Any, parts: tuple[str, ...] = ()) -> tuple[Any, list[str]]:
    """``node`` without the values nvckpt cannot store, and their paths."""
    import torch

    from ..plan.walk import plan_save

    dropped: list[str] = []

    def keep(value: Any, where: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if not _storable_key(k):  # a tuple or object key: the entry goes, whatever its value
                    dropped.append("/".join(where + (escape(str(k)),)))
                    continue
                kept = keep(v, where + (escape(k),))
                if kept is not _DROP:
                    out[k] = kept
            return out
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            # A dropped element becomes None: the others keep their positions (and the paths recorded).
            items = [None if v is _DROP else v for v in (keep(v, where + (str(i),)) for i, v in enumerate(value))]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, torch.Tensor):
            return value
        try:
            plan_save([value], remember=False)  # the one authority on what the tree holds
        except UnsupportedObjectError:
            dropped.append("/".join(where))
            return _DROP
        return value

    return keep(node, parts), dropped


_DROP = object()


def _storable_key(key: Any) -> bool:
    from ..plan.walk import plan_save

    try:
        plan_save({key: None}, remember=False)  # the tree's own rule for keys (str, int, float, bool, None; their enums)
    except UnsupportedObjectError:
        return False
    return True


__all__ = ["NvckptCheckpointIO", "DROPPED", "load_from_checkpoint"]
