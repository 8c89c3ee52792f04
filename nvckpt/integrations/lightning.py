"""Lightning: every checkpoint a ``Trainer`` writes, through nvckpt, named ``.nvckpt``.

    from nvckpt.integrations.lightning import NvckptModelCheckpoint
    trainer = Trainer(callbacks=[NvckptModelCheckpoint(save_last=True)])   # ModelCheckpoint's arguments
    trainer.fit(model, ckpt_path="last")                                  # resumes from last.nvckpt

``NvckptModelCheckpoint`` is Lightning's ``ModelCheckpoint`` whose files are named ``.nvckpt`` (``extension=``)
and written by ``NvckptCheckpointIO``: it makes that the Trainer's checkpoint IO at setup, unless one is given
as a plugin (``plugins=[NvckptCheckpointIO(async_save=True)]`` for its options).  The extension has to be the
callback's from the start: Lightning resolves ``ckpt_path="last"`` before any callback runs.
``Trainer(plugins=[NvckptCheckpointIO()])`` alone also works, keeping Lightning's names (``last.ckpt``, nvckpt
inside).

What a Lightning checkpoint holds: ``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``loops``,
``callbacks`` (ModelCheckpoint's scores and paths), ``epoch``, ``global_step``, the precision plugin's
scaler state, and ``hyper_parameters`` (what ``save_hyperparameters()`` captured).  All of it is tensors and
plain data except what a user puts in the hyper-parameters (a ``pathlib.Path``, an ``nn.Module``, a function,
a dataclass) or adds in ``on_save_checkpoint``.  torch.save pickles those (and loading them runs code); nvckpt
never pickles, so by default saving such a checkpoint fails, naming the path (``hyper_parameters/loss_fn``)
and the fix (``str(path)``, ``dataclasses.asdict``, ...); ``NvckptModelCheckpoint`` checks the
hyper-parameters at setup and the whole checkpoint (built once, as Lightning builds it) at fit start, so that
this stops the run before its first step, not at its first checkpoint.  ``unsupported="drop"`` saves the
checkpoint without those values instead (a dict leaves the key out; a list or tuple holds None in its place,
so the other elements keep their positions), warning once, and records their paths in the file's metadata
(``lightning.dropped``).  A state_dict's ``_metadata`` (module versions) is not kept; Lightning and
``load_state_dict`` do not need it for current modules.

``Model.load_from_checkpoint(path)`` is Lightning's own reader (it calls ``torch.load`` and never asks the
CheckpointIO), so it cannot read an nvckpt file; ``load_from_checkpoint(Model, path, ...)`` here takes the
same arguments and does (and reads torch.save checkpoints too).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

try:
    from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint
except ImportError:  # the standalone pytorch_lightning package
    from lightning_fabric.plugins import CheckpointIO, TorchCheckpointIO  # type: ignore[no-redef]
    from pytorch_lightning.callbacks import ModelCheckpoint  # type: ignore[no-redef]

from ..api import async_save, load, save
from ..errors import UnsupportedObjectError
from ..format.sniff import sniff_format
from ..format.tree import escape
from ..plan.walk import fix_for
from ..session.async_save import SaveFuture

DROPPED = "lightning.dropped"
EXTENSION = ".nvckpt"
_DROP_HINT = ('; or NvckptCheckpointIO(unsupported="drop") saves the checkpoint without such values (their paths in '
              f"its metadata, {DROPPED!r})")


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
        """Write ``checkpoint`` to ``path`` with nvckpt (in the background with ``async_save``)."""
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict of nvckpt.save options, got {type(storage_options).__name__}")
        path = _local(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        options = {**self.save_options, **(storage_options or {})}
        if self.unsupported == "drop":
            checkpoint, dropped = _storable(checkpoint)
            if dropped:
                options["metadata"] = {**(options.get("metadata") or {}), DROPPED: [p for p, _ in dropped]}
                self._warn_dropped(dropped)
        self._wait(path)
        try:
            if self.async_save:
                self._wait_all()  # one background save at a time: the snapshots would otherwise pile up
                self._pending[path] = async_save(checkpoint, path, **options)
            else:
                save(checkpoint, path, **options)
        except UnsupportedObjectError as exc:
            if self.unsupported == "error":
                exc.reason += _DROP_HINT
                exc.located()
            raise

    def check(self, checkpoint: dict[str, Any]) -> None:
        """Raise (or, with ``unsupported="drop"``, warn) now for what saving ``checkpoint`` would refuse, naming
        its path and the fix; writes nothing.  NvckptModelCheckpoint calls it before training starts."""
        _, dropped = _storable(checkpoint)
        if not dropped:
            return
        if self.unsupported == "drop":
            self._warn_dropped(dropped)
            return
        where, value = dropped[0]
        more = f" (and {len(dropped) - 1} more: {', '.join(p for p, _ in dropped[1:4])}{', ...' if len(dropped) > 4 else ''})" \
            if len(dropped) > 1 else ""
        if isinstance(value, _Key):
            what, fix = f"the dict key {value.key!r}", "keys must be str, int, float, bool or None"
        else:
            what, fix = f"{type(value).__module__}.{type(value).__qualname__}", fix_for(value)
        raise UnsupportedObjectError(f"cannot store {what} at {where}{more}: {fix + '; ' if fix else ''}nvckpt never "
                                     f"pickles{_DROP_HINT}")

    def _warn_dropped(self, dropped: list[tuple[str, Any]]) -> None:
        if not self._warned:
            paths = [p for p, _ in dropped]
            warnings.warn(f"nvckpt: not saved (no pickle): {', '.join(paths[:5])}{', ...' if len(paths) > 5 else ''}",
                          stacklevel=3)
            self._warned = True

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint at ``path``: an nvckpt file, or a torch.save one written before the switch."""
        path = _local(path)
        self._wait(path)
        if not os.path.exists(path):
            raise FileNotFoundError(2, "No such checkpoint", path)
        if sniff_format(path) == "torch":  # a checkpoint written before the switch: Lightning's own reader
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return load(path, map_location=map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (after its pending background save)."""
        path = _local(path)
        self._wait(path)
        if os.path.isfile(path):
            os.remove(path)

    def teardown(self) -> None:
        """Wait for every pending background save (Lightning calls it at the end of fit)."""
        self._wait_all()

    # -- pending async saves -------------------------------------------------
    def _wait(self, path: str) -> None:
        future = self._pending.pop(path, None)
        if future is not None:
            future.result()

    def _wait_all(self) -> None:
        while self._pending:
            self._wait(next(iter(self._pending)))


class NvckptModelCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (every argument of it), writing nvckpt files named ``*.nvckpt``.

    ``extension``: the files' extension (".nvckpt"; ".ckpt" keeps Lightning's names).
    ``checkpoint_io``: the NvckptCheckpointIO to write with, when the Trainer was given none as a plugin
    (default ``NvckptCheckpointIO()``; a plugin given to the Trainer wins).
    ``check``: at setup, check the hyper-parameters, and at fit start the whole checkpoint Lightning would
    save (built once by Lightning, its ``on_save_checkpoint`` hooks included), so that a value nvckpt cannot
    store stops the run before its first step (True by default)."""

    def __init__(self, *args: Any, extension: str = EXTENSION, checkpoint_io: "NvckptCheckpointIO | None" = None,
                 check: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(extension, str) or not extension.startswith(".") or os.sep in extension:
            raise ValueError(f"extension must be a file extension such as '.nvckpt', got {extension!r}")
        if checkpoint_io is not None and not isinstance(checkpoint_io, NvckptCheckpointIO):
            raise TypeError(f"checkpoint_io must be an NvckptCheckpointIO, got {type(checkpoint_io).__qualname__}")
        self.FILE_EXTENSION = extension
        self._io = checkpoint_io
        self._check = check

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Lightning's setup; then the NvckptCheckpointIO made the Trainer's, and (fitting) the hyper-parameters
        checked."""
        super().setup(trainer, pl_module, stage)
        io = self.checkpoint_io(trainer)
        if self._check and stage == "fit":
            for obj in (pl_module, trainer.datamodule):
                hparams = getattr(obj, "hparams", None) if obj is not None else None
                if hparams:
                    io.check({"hyper_parameters": dict(hparams)})

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """The whole checkpoint Lightning will save, checked before the first step (``check=False``: not)."""
        super().on_fit_start(trainer, pl_module)
        if self._check:
            # The checkpoint as Lightning will build it at every save (callbacks' and the module's
            # on_save_checkpoint included): references to the live state, nothing copied or written.
            io = self.checkpoint_io(trainer)
            io.check(trainer._checkpoint_connector.dump_checkpoint(weights_only=self.save_weights_only))

    def checkpoint_io(self, trainer: Any) -> "NvckptCheckpointIO":
        """The trainer's NvckptCheckpointIO, made its checkpoint IO here if it has Lightning's default."""
        try:
            from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
        except ImportError:  # pragma: no cover - the standalone pytorch_lightning package
            from pytorch_lightning.plugins.io.wrapper import _WrappingCheckpointIO  # type: ignore[no-redef]

        strategy = trainer.strategy
        current = strategy.checkpoint_io
        inner = current.checkpoint_io if isinstance(current, _WrappingCheckpointIO) else current
        if isinstance(inner, NvckptCheckpointIO):
            return inner
        if type(inner) is not TorchCheckpointIO:  # the user's own CheckpointIO: not ours to replace
            raise ValueError(f"NvckptModelCheckpoint writes nvckpt files, but the Trainer has the checkpoint IO "
                             f"{type(inner).__qualname__}: give it NvckptCheckpointIO as a plugin, or use "
                             "ModelCheckpoint")
        if self._io is None:
            self._io = NvckptCheckpointIO()
        if isinstance(current, _WrappingCheckpointIO):  # AsyncCheckpointIO around Lightning's default
            current._checkpoint_io = self._io
        else:
            strategy.checkpoint_io = self._io
        return self._io


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
    # The pickle was made just now from what an nvckpt file holds (tensors, containers, numbers, dtypes, devices,
    # NumPy arrays, pathlib paths: no code), so reading it back in full is safe; torch.load's weights_only
    # refuses the arrays and paths (SPEC 9.3) that a checkpoint's hyper-parameters and RNG states hold.
    kwargs.setdefault("weights_only", False)
    return cls.load_from_checkpoint(buffer, map_location=map_location, **kwargs)


def _local(path: Any) -> str:
    path = os.fspath(path)
    if "://" in path and not path.startswith("file://"):
        raise UnsupportedObjectError(f"{path}: NvckptCheckpointIO writes local files (mount the storage, or use "
                                     "Lightning's own CheckpointIO for remote URLs)")
    return path.removeprefix("file://")


def _storable(node: Any, parts: tuple[str, ...] = ()) -> tuple[Any, list[tuple[str, Any]]]:
    """``node`` without the values nvckpt cannot store, and those values with their paths."""
    import torch

    dropped: list[tuple[str, Any]] = []

    def keep(value: Any, where: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if not _storable_key(k):  # a tuple or object key: the entry goes, whatever its value
                    dropped.append(("/".join(where + (escape(str(k)),)), _Key(k)))
                    continue
                kept = keep(v, where + (escape(k),))
                if kept is not _DROP:
                    out[k] = kept
            return out
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            # A dropped element becomes None: the others keep their positions (and the paths recorded).
            items = [None if v is _DROP else v for v in (keep(v, where + (str(i),)) for i, v in enumerate(value))]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
            return value
        if not _storable_leaf(value):
            dropped.append(("/".join(where), value))
            return _DROP
        return value

    return keep(node, parts), dropped


class _Key:
    """A dict key the tree cannot hold (a tuple), as a dropped value."""

    def __init__(self, key: Any) -> None:
        self.key = key


_DROP = object()
_PLAIN = frozenset((str, int, float, bool, type(None), bytes))  # the common leaves: no need to ask plan_save


def _storable_key(key: Any) -> bool:
    from ..plan.walk import plan_save

    if type(key) is str:
        return True
    try:
        plan_save({key: None}, remember=False)  # the tree's own rule for keys (str, int, float, bool, None; their enums)
    except UnsupportedObjectError:
        return False
    return True


def _storable_leaf(value: Any) -> bool:
    from ..plan.walk import plan_save

    try:
        plan_save([value], remember=False)  # the one authority on what the tree holds
    except UnsupportedObjectError:
        return False
    return True


__all__ = ["NvckptCheckpointIO", "NvckptModelCheckpoint", "DROPPED", "EXTENSION", "load_from_checkpoint"]
