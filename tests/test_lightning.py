"""A real Lightning Trainer saves and resumes through NvckptCheckpointIO, and the losses continue exactly."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings

import numpy as np
import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import nvckpt  # noqa: E402
from nvckpt.integrations.lightning import (DROPPED, NvckptCheckpointIO, NvckptModelCheckpoint,  # noqa: E402
                                           load_from_checkpoint)


class Net(pl.LightningModule):
    def __init__(self, lr: float = 0.05, note: object = "plain") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=16)  # the same order every epoch, resumed or not


def trainer(tmp_path, epochs: int, plugin, **kw) -> "pl.Trainer":
    return pl.Trainer(default_root_dir=tmp_path, max_epochs=epochs, plugins=[plugin], accelerator="cpu", devices=1,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)], **kw)


@pytest.fixture(autouse=True)
def quiet_lightning():
    # Lightning warns about its own defaults (few dataloader workers, ...): not what this test checks.
    # A Trainer also sets process-wide torch flags: give them back to the other tests.
    deterministic = torch.are_deterministic_algorithms_enabled()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"lightning\..*")
        warnings.filterwarnings("ignore", message=r".*(num_workers|does not have many workers|LeafSpec).*")
        yield
    torch.use_deterministic_algorithms(deterministic)


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_trainer_saves_and_resumes_through_nvckpt(tmp_path, async_save):
    pl.seed_everything(0, verbose=False)
    straight = Net()
    trainer(tmp_path / "a", 4, NvckptCheckpointIO()).fit(straight)

    pl.seed_everything(0, verbose=False)
    first = Net()
    trainer(tmp_path / "b", 2, NvckptCheckpointIO(async_save=async_save)).fit(first)
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    assert last.read_bytes()[:8] == b"\x89NVCKPT\n"  # an nvckpt file, under Lightning's name
    with nvckpt.open(last) as ck:
        assert "state_dict/net.0.weight" in ck and "optimizer_states/0/state/0/exp_avg" in ck

    pl.seed_everything(0, verbose=False)
    resumed = Net()
    trainer(tmp_path / "b", 4, NvckptCheckpointIO()).fit(resumed, ckpt_path=str(last))
    assert len(straight.losses) == len(first.losses) + len(resumed.losses) == 16
    assert first.losses + resumed.losses == straight.losses  # bit for bit: model, AdamW, StepLR, BatchNorm


@pytest.mark.slow
def test_what_the_tree_cannot_hold_is_refused_by_name_or_dropped(tmp_path):
    pl.seed_everything(0, verbose=False)
    model = Net(note=Config())  # a hyper-parameter torch.save would pickle
    with pytest.raises(nvckpt.UnsupportedObjectError, match="hyper_parameters/note"):
        trainer(tmp_path / "a", 1, NvckptCheckpointIO()).fit(model)

    pl.seed_everything(0, verbose=False)
    model = Net(note=Config())
    with pytest.warns(UserWarning, match="hyper_parameters/note"):
        trainer(tmp_path / "b", 1, NvckptCheckpointIO(unsupported="drop")).fit(model)
    with nvckpt.open(tmp_path / "b" / "ckpt" / "last.ckpt") as ck:
        assert ck.metadata()[DROPPED] == ["hyper_parameters/note"]
        assert ck.load("hyper_parameters") == {"lr": 0.05}


def test_dropped_list_elements_leave_the_others_in_place(tmp_path):
    """A dropped element of a list or tuple becomes None: layers[1] is still 64, and the recorded path still
    names what is missing."""
    path = tmp_path / "d.ckpt"
    ckpt = {"state_dict": {"w": torch.ones(2)},
            "hyper_parameters": {"layers": [Config(), 64, 128], "pair": (1, print), "fn": print}}
    with pytest.warns(UserWarning):
        NvckptCheckpointIO(unsupported="drop").save_checkpoint(ckpt, path)
    back = NvckptCheckpointIO().load_checkpoint(path)
    assert back["hyper_parameters"] == {"layers": [None, 64, 128], "pair": (1, None)}
    with nvckpt.open(path) as ck:
        assert sorted(ck.metadata()[DROPPED]) == ["hyper_parameters/fn", "hyper_parameters/layers/0",
                                                  "hyper_parameters/pair/1"]


@pytest.mark.slow
def test_load_from_checkpoint_reads_nvckpt_files(tmp_path):
    """Lightning's Net.load_from_checkpoint calls torch.load only; the module's load_from_checkpoint takes the
    same arguments and reads an nvckpt .ckpt (and a torch.save one), hyper-parameters and overrides included."""
    pl.seed_everything(0, verbose=False)
    model = Net(lr=0.07)
    trainer(tmp_path, 1, NvckptCheckpointIO()).fit(model)
    last = tmp_path / "ckpt" / "last.ckpt"
    with pytest.raises(Exception):
        Net.load_from_checkpoint(last)  # what the module's helper is for
    back = load_from_checkpoint(Net, last, note="given")
    assert back.hparams.lr == 0.07 and back.hparams.note == "given"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": {"lr": 0.03, "note": "plain"},
                "pytorch-lightning_version": pl.__version__}, tmp_path / "old.ckpt")
    assert load_from_checkpoint(Net, tmp_path / "old.ckpt").hparams.lr == 0.03


def test_a_key_the_tree_cannot_hold_drops_its_entry(tmp_path):
    """unsupported="drop" also drops a dict entry whose key is not storable (a tuple key in a hyper-parameter
    dict), instead of refusing the whole checkpoint."""
    path = tmp_path / "k.ckpt"
    ckpt = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"lr": 0.1, "weights": {(0, 1): 0.5, "b": 2}}}
    with pytest.warns(UserWarning):
        NvckptCheckpointIO(unsupported="drop").save_checkpoint(ckpt, path)
    assert NvckptCheckpointIO().load_checkpoint(path)["hyper_parameters"] == {"lr": 0.1, "weights": {"b": 2}}
    with nvckpt.open(path) as ck:
        assert ck.metadata()[DROPPED] == ["hyper_parameters/weights/(0, 1)"]


def test_old_torch_checkpoints_still_load_and_remove_works(tmp_path):
    io = NvckptCheckpointIO()
    old = tmp_path / "old.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3}, old)
    assert io.load_checkpoint(old)["epoch"] == 3
    new = tmp_path / "new.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 4}, new)
    assert io.load_checkpoint(new, map_location=lambda s, loc: s)["epoch"] == 4
    io.remove_checkpoint(new)
    assert not new.exists()
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, new, storage_options="fast")
    with pytest.raises(nvckpt.UnsupportedObjectError, match="local files"):
        io.save_checkpoint({}, "s3://bucket/x.ckpt")
    assert os.listdir(tmp_path) == ["old.ckpt"]


def named_trainer(tmp_path, epochs: int, *plugins, **kw) -> "pl.Trainer":
    """A Trainer whose checkpoints NvckptModelCheckpoint writes (no plugin needed)."""
    callback = NvckptModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, **kw)
    return pl.Trainer(default_root_dir=tmp_path, max_epochs=epochs, plugins=list(plugins), accelerator="cpu",
                      devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[callback])


@pytest.mark.slow
def test_model_checkpoint_names_files_nvckpt_and_resumes_from_last(tmp_path):
    """NvckptModelCheckpoint alone: files named .nvckpt (nvckpt inside), ckpt_path="last" finds last.nvckpt in a
    new Trainer, and the resumed run continues bit for bit; the best-k files are removed as Lightning's are."""
    pl.seed_everything(0, verbose=False)
    straight = Net()
    trainer(tmp_path / "a", 4, NvckptCheckpointIO()).fit(straight)

    pl.seed_everything(0, verbose=False)
    first = Net()
    named_trainer(tmp_path / "b", 2, save_top_k=1, monitor="step", mode="max").fit(first)
    files = sorted(os.listdir(tmp_path / "b" / "ckpt"))
    assert files == ["epoch=1-step=8.nvckpt", "last.nvckpt"], files  # top-1 kept: the epoch-0 file was removed
    assert (tmp_path / "b" / "ckpt" / "last.nvckpt").read_bytes()[:8] == b"\x89NVCKPT\n"

    pl.seed_everything(0, verbose=False)
    resumed = Net()
    named_trainer(tmp_path / "b", 4, save_top_k=1, monitor="step", mode="max").fit(resumed, ckpt_path="last")
    assert first.losses + resumed.losses == straight.losses  # "last" was resolved by Lightning before any callback ran
    back = load_from_checkpoint(Net, tmp_path / "b" / "ckpt" / "last.nvckpt")  # the documented one-liner
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), back.state_dict().values()))


def test_model_checkpoint_extension_and_plugin_options(tmp_path):
    """extension= keeps Lightning's names; a plugin given to the Trainer (its options) is the one that writes."""
    io = NvckptCheckpointIO(async_save=True, metadata={"run": "x"})
    pl.seed_everything(0, verbose=False)
    named_trainer(tmp_path, 1, io, extension=".ckpt").fit(Net())
    last = tmp_path / "ckpt" / "last.ckpt"
    with nvckpt.open(last) as ck:
        assert ck.metadata()["run"] == "x"
    with pytest.raises(ValueError, match="extension"):
        NvckptModelCheckpoint(extension="nvckpt")
    with pytest.raises(ValueError, match="NvckptCheckpointIO as a plugin"):  # another CheckpointIO: not replaced
        pl.Trainer(default_root_dir=tmp_path, max_epochs=1, plugins=[OtherIO()], logger=False, accelerator="cpu",
                   enable_progress_bar=False, callbacks=[NvckptModelCheckpoint(dirpath=tmp_path / "o")]).fit(Net())


class OtherIO(pl.plugins.TorchCheckpointIO):
    pass


def test_what_cannot_be_stored_stops_the_run_before_its_first_step(tmp_path):
    """A Path in the hyper-parameters is refused at setup, before any training step, naming the fix and the
    plugin's unsupported="drop"; with "drop" the run goes on, warned once at fit start."""
    pl.seed_everything(0, verbose=False)
    model = Net(note=Config())
    with pytest.raises(nvckpt.UnsupportedObjectError,
                       match=r"hyper_parameters/note: store dataclasses.asdict\(obj\).*unsupported=\"drop\""):
        named_trainer(tmp_path / "a", 1).fit(model)
    assert model.losses == []  # not one step ran
    assert not (tmp_path / "a" / "ckpt").exists() or not os.listdir(tmp_path / "a" / "ckpt")

    pl.seed_everything(0, verbose=False)
    model = Net(note=Config())
    with pytest.warns(UserWarning, match="hyper_parameters/note") as caught:
        named_trainer(tmp_path / "b", 1, NvckptCheckpointIO(unsupported="drop")).fit(model)
    assert len([w for w in caught if "not saved" in str(w.message)]) == 1
    with nvckpt.open(tmp_path / "b" / "ckpt" / "last.nvckpt") as ck:
        assert ck.metadata()[DROPPED] == ["hyper_parameters/note"]


class WithExtras(Net):
    def on_save_checkpoint(self, checkpoint):
        checkpoint["extras"] = {"config": Config(), "ok": 1}


@dataclasses.dataclass
class Config:
    layers: int = 2


def test_what_on_save_checkpoint_adds_is_checked_at_fit_start(tmp_path):
    """The whole checkpoint Lightning would save (the module's on_save_checkpoint included) is checked at fit
    start: a dataclass there is named with its fix before the first step; the plugin alone says the same at
    the first save."""
    pl.seed_everything(0, verbose=False)
    model = WithExtras()
    with pytest.raises(nvckpt.UnsupportedObjectError, match=r"extras/config: store dataclasses.asdict\(obj\)"):
        named_trainer(tmp_path / "a", 1).fit(model)
    assert model.losses == []
    model = WithExtras()
    with pytest.raises(nvckpt.UnsupportedObjectError, match=r"extras/config.*dataclasses.asdict.*unsupported=\"drop\""):
        trainer(tmp_path / "b", 1, NvckptCheckpointIO()).fit(model)
    assert len(model.losses) == 4  # the plugin alone learns it at the first save, after an epoch


class NoisyNet(Net):
    """Draws from NumPy's global generator every step (data augmentation does) and keeps its state in the
    checkpoint, as a user's on_save_checkpoint does: np.random.get_state() holds a uint32 array."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x + torch.from_numpy(np.random.standard_normal(x.shape).astype(np.float32)) * 0.01
        return super().training_step((x, y), batch_idx)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["numpy_rng"] = np.random.get_state()

    def on_load_checkpoint(self, checkpoint):
        np.random.set_state(checkpoint["numpy_rng"])


@pytest.mark.slow
def test_paths_and_numpy_states_save_and_resume_through_nvckpt(tmp_path):
    """save_hyperparameters() with a pathlib.Path and np.random.get_state() in the checkpoint: saved as what they
    are (SPEC 9.3), loaded back as the same types, and a resumed run draws the same numbers as a straight one."""
    data_dir = pathlib.Path("/data/run") / "shards"
    pl.seed_everything(0, verbose=False)
    np.random.seed(0)
    straight = NoisyNet(note=data_dir)
    trainer(tmp_path / "a", 4, NvckptCheckpointIO()).fit(straight)

    pl.seed_everything(0, verbose=False)
    np.random.seed(0)
    first = NoisyNet(note=data_dir)
    trainer(tmp_path / "b", 2, NvckptCheckpointIO()).fit(first)
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    with nvckpt.open(last) as ck:
        note = ck["hyper_parameters/note"]
        assert type(note) is type(data_dir) and note == data_dir
        state = ck["numpy_rng"]
        assert isinstance(state[1], np.ndarray) and state[1].dtype == np.uint32 and state[1].shape == (624,)
        assert ck.get_tensor("numpy_rng/1").dtype == torch.uint32  # stored as a tensor entry
    back = load_from_checkpoint(NoisyNet, last)
    assert back.hparams.note == data_dir and type(back.hparams.note) is type(data_dir)

    pl.seed_everything(0, verbose=False)
    np.random.seed(123)  # the checkpoint's state, not this one, must drive the resumed run
    resumed = NoisyNet(note=data_dir)
    trainer(tmp_path / "b", 4, NvckptCheckpointIO()).fit(resumed, ckpt_path=str(last))
    assert first.losses + resumed.losses == straight.losses  # bit for bit, the NumPy noise included
