"""Lightning's own loading reads lazyckpt checkpoints: ``lazyckpt://`` URLs through fsspec, the
``LazyCheckpointIO`` plugin, and exports that ``torch.load(weights_only=True)`` accepts; no pickle is read."""

from __future__ import annotations

import argparse
import os
import pickle

import numpy as np
import pytest
import torch
from helpers.lightning_run import namespace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lazyckpt
from lazyckpt.integrations.lightning import export_checkpoint

omegaconf = pytest.importorskip("omegaconf")
pl, LazyCheckpoint = namespace("lightning")
QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
             accelerator="cpu")
CFG = {"dim": 8, "hidden": "${dim}"}


class ConfigModel(pl.LightningModule):
    """Hyper-parameters of the kinds users keep: an OmegaConf config, a Namespace, numpy values."""

    def __init__(self, cfg, extra=None):
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(4, 2)
        self.tested = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()

    def test_step(self, batch, batch_idx):
        self.tested.append(self.layer.weight.detach().clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(0))), batch_size=4)

    test_dataloader = train_dataloader


def new_model():
    extra = {"ns": argparse.Namespace(lr=0.1), "scale": np.float32(2.0), "ids": np.arange(3)}
    return ConfigModel(omegaconf.OmegaConf.create(CFG), extra)


@pytest.fixture
def trained(tmp_path, monkeypatch):
    """A run in ``runs/ckpt`` (relative to the working directory) that checkpointed steps 2, 4, 6, 8."""
    monkeypatch.chdir(tmp_path)
    callback = LazyCheckpoint("runs/ckpt", every_n_train_steps=2, save_top_k=-1, save_last=True)
    model = new_model()
    pl.Trainer(max_epochs=2, callbacks=[callback], **QUIET).fit(model)
    return model, callback


@pytest.fixture
def no_pickle(monkeypatch):
    """Any full unpickling (what ``torch.load(weights_only=False)`` does) fails the test."""
    class Refused:
        def __init__(self, *args, **kwargs):
            raise AssertionError("a pickle was read")

    for name in ("Unpickler", "load", "loads"):
        monkeypatch.setattr(pickle, name, Refused)


def test_load_from_checkpoint_reads_a_lazyckpt_url(trained, no_pickle):
    model, callback = trained
    assert os.path.relpath(callback.last_model_path) == os.path.join("runs", "ckpt", "last.ckpt")
    loaded = ConfigModel.load_from_checkpoint(f"lazyckpt://{os.path.relpath(callback.last_model_path)}")
    assert torch.equal(loaded.layer.weight, model.layer.weight)
    assert dict(loaded.hparams.cfg) == CFG, "the config comes back as plain data, its interpolation unresolved"
    assert loaded.hparams.extra == {"ns": {"lr": 0.1}, "scale": 2.0, "ids": [0, 1, 2]}
    absolute = ConfigModel.load_from_checkpoint(f"lazyckpt://{os.path.abspath(callback.last_model_path)}")
    assert torch.equal(absolute.layer.weight, model.layer.weight)


def test_a_fresh_trainer_tests_from_a_step_directory_url(trained, no_pickle):
    step_dir = os.path.join("runs", "ckpt", "step-0000004")
    expected = lazyckpt.load(step_dir)["state_dict"]["layer.weight"]
    model = new_model()
    pl.Trainer(**QUIET).test(model, ckpt_path=f"lazyckpt://{step_dir}", verbose=False)
    assert model.tested and torch.equal(model.tested[0], expected)


def test_a_missing_url_says_file_not_found(trained):
    with pytest.raises(FileNotFoundError):
        ConfigModel.load_from_checkpoint("lazyckpt://runs/ckpt/step-0000099")
    with pytest.raises(FileNotFoundError):
        pl.Trainer(**QUIET).test(new_model(), ckpt_path="lazyckpt://runs/ckpt", verbose=False)


def test_the_checkpoint_io_plugin_resumes_from_plain_paths_without_the_callback(trained, no_pickle):
    model, callback = trained
    resumed = new_model()
    trainer = pl.Trainer(max_epochs=3, plugins=[lazyckpt.LazyCheckpointIO()], enable_checkpointing=False, **QUIET)
    trainer.fit(resumed, ckpt_path=callback.last_model_path)
    assert trainer.global_step == 12
    tested = new_model()
    pl.Trainer(plugins=[lazyckpt.LazyCheckpointIO()], **QUIET).test(tested, ckpt_path="runs/ckpt/step-0000002",
                                                                     verbose=False)
    assert torch.equal(tested.tested[0], lazyckpt.load("runs/ckpt/step-0000002")["state_dict"]["layer.weight"])


def test_the_checkpoint_io_plugin_still_writes_plain_checkpoint_files(tmp_path):
    trainer = pl.Trainer(max_steps=2, plugins=[lazyckpt.LazyCheckpointIO()], default_root_dir=tmp_path, **QUIET)
    trainer.fit(new_model())
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    assert torch.load(tmp_path / "plain.ckpt", weights_only=False)["global_step"] == 2


def test_export_holds_only_what_weights_only_loading_accepts(trained, tmp_path):
    model, callback = trained
    out = export_checkpoint(callback.last_model_path, tmp_path / "model.ckpt")
    plain = torch.load(out, weights_only=True)
    assert plain["hyper_parameters"]["extra"] == {"ns": {"lr": 0.1}, "scale": 2.0, "ids": [0, 1, 2]}
    assert plain["hyper_parameters"]["cfg"] == CFG
    assert torch.equal(plain["state_dict"]["layer.weight"], model.layer.weight)


class FunctionModel(ConfigModel):
    def __init__(self, cfg, activation=torch.tanh):
        super().__init__(cfg)
        self.save_hyperparameters()
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return super().training_step(batch, batch_idx)


def test_an_unstorable_hyper_parameter_fails_before_training_with_the_fix(tmp_path):
    model = FunctionModel(CFG)
    trainer = pl.Trainer(max_epochs=1, callbacks=[LazyCheckpoint(tmp_path / "ckpt")], **QUIET)
    with pytest.raises(lazyckpt.UnsupportedValueError,
                       match=r"state\['activation'\].*save_hyperparameters\(ignore=\['activation'\]\)"):
        trainer.fit(model)
    assert model.steps == 0 and lazyckpt.latest(tmp_path / "ckpt") is None


@pytest.mark.parametrize("inner", ["s3://bucket/run/step-0000001", "http://example.invalid/step-0000001"])
def test_a_lazyckpt_url_wrapping_another_url_is_refused_before_any_request(inner):
    import fsspec

    with pytest.raises(ValueError, match="names a local lazyckpt checkpoint"):
        with fsspec.open(f"lazyckpt://{inner}", "rb") as f:
            f.read()
