"""LazyCheckpoint keeps ModelCheckpoint's decisions: same names, same top-k, same "last", same triggers."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
from helpers.lightning_run import make_module_class, namespace

import lazyckpt

pl, LazyCheckpoint = namespace("lightning")
ModelCheckpoint = pl.callbacks.ModelCheckpoint
TinyModel = make_module_class(pl)


def _names(dirpath) -> set[str]:
    return {n for n in os.listdir(dirpath) if n.endswith(".ckpt")}


def _fit_both(tmp_path, max_epochs=4, trainer_kwargs=None, **options):
    """One trainer with a ModelCheckpoint and a LazyCheckpoint given the same options (same metrics, same
    decisions); returns both callbacks after fit."""
    pl.seed_everything(0, verbose=False)
    plain = ModelCheckpoint(dirpath=tmp_path / "plain", **options)
    lazy = LazyCheckpoint(tmp_path / "lazy", **options)
    trainer = pl.Trainer(max_epochs=max_epochs, callbacks=[plain, lazy], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, **(trainer_kwargs or {}))
    trainer.fit(TinyModel())
    return plain, lazy


@pytest.mark.parametrize("options", [
    pytest.param(dict(monitor="val_loss", mode="min", save_top_k=2), id="top-k-monitor-min"),
    pytest.param(dict(monitor="val_loss", mode="max", save_top_k=1, save_last=True), id="top-1-max-save-last"),
    pytest.param(dict(every_n_epochs=2, save_top_k=-1), id="every-2-epochs"),
    pytest.param(dict(every_n_train_steps=5, save_top_k=-1, save_last=True), id="every-5-steps-save-last"),
    pytest.param(dict(every_n_train_steps=3, save_top_k=1, save_last="link"), id="save-last-link"),
    pytest.param(dict(train_time_interval=timedelta(seconds=0), save_top_k=-1), id="train-time-interval"),
    pytest.param(dict(filename="{epoch:02d}-{val_loss:.3f}", monitor="val_loss", save_top_k=3), id="filename"),
    pytest.param(dict(save_on_train_epoch_end=True, save_last=True), id="save-on-train-epoch-end"),
])
def test_lazy_checkpoint_keeps_the_same_names_as_model_checkpoint(tmp_path, options):
    plain, lazy = _fit_both(tmp_path, **options)
    assert _names(tmp_path / "lazy") == _names(tmp_path / "plain")
    assert os.path.basename(lazy.best_model_path) == os.path.basename(plain.best_model_path)
    assert {os.path.basename(k) for k in lazy.best_k_models} == {os.path.basename(k) for k in plain.best_k_models}
    for name in _names(tmp_path / "lazy"):  # every name is a committed checkpoint of the step in its name
        state = lazyckpt.load(tmp_path / "lazy" / name)
        assert torch.equal(state["state_dict"]["head.weight"], torch.load(
            tmp_path / "plain" / name, weights_only=True)["state_dict"]["head.weight"])


def test_top_k_removal_deletes_unnamed_step_directories(tmp_path):
    _, lazy = _fit_both(tmp_path, max_epochs=5, monitor="val_loss", save_top_k=1)
    steps = sorted(n for n in os.listdir(tmp_path / "lazy") if n.startswith("step-"))
    assert len(steps) == 1 and os.path.realpath(lazy.best_model_path).endswith(steps[0])


def test_keep_last_k_keeps_the_newest_in_addition_to_the_top_k(tmp_path):
    pl.seed_everything(0, verbose=False)
    lazy = LazyCheckpoint(tmp_path, monitor="val_loss", save_top_k=1, keep_last_k=2)
    trainer = pl.Trainer(max_epochs=5, callbacks=[lazy], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(TinyModel())
    committed = sorted(int(n.split("-")[1]) for n in os.listdir(tmp_path) if n.startswith("step-"))
    best = lazyckpt.checkpoint_step(lazy.best_model_path)
    assert set(committed) == {best, 32, 40}  # the best one (save_top_k) plus the newest two (keep_last_k)
    assert _names(tmp_path) == {os.path.basename(lazy.best_model_path)}  # names follow save_top_k alone
    assert lazyckpt.latest(tmp_path).endswith("step-0000040")


def test_save_weights_only_stores_no_optimizer_state(tmp_path):
    _, lazy = _fit_both(tmp_path, max_epochs=1, save_weights_only=True)
    state = lazyckpt.load(lazy.best_model_path)
    assert "optimizer_states" not in state and "state_dict" in state


def test_default_dirpath_is_chosen_like_model_checkpoint(tmp_path):
    pl.seed_everything(0, verbose=False)
    lazy = LazyCheckpoint()
    trainer = pl.Trainer(max_epochs=1, callbacks=[lazy], default_root_dir=tmp_path, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(TinyModel())
    assert lazy.dirpath == str(tmp_path / "checkpoints")
    assert lazyckpt.latest(lazy.dirpath).endswith("step-0000008")


def test_invalid_options_fail_at_construction(tmp_path):
    with pytest.raises(ValueError, match="keep_last_k=0"):
        LazyCheckpoint(tmp_path, keep_last_k=0)
    with pytest.raises(ValueError, match="on_busy='later'"):
        LazyCheckpoint(tmp_path, on_busy="later")
    with pytest.raises(ValueError, match="rank"):
        LazyCheckpoint(tmp_path, engine_options={"rank": 1})
    with pytest.raises(pl.utilities.exceptions.MisconfigurationException, match="save_top_k=2"):
        LazyCheckpoint(tmp_path, save_top_k=2)  # ModelCheckpoint's own validation still applies


def test_every_argument_has_help_that_lightning_cli_shows_and_engine_options_are_typed(capsys):
    jsonargparse = pytest.importorskip("jsonargparse")
    from lazyckpt.integrations.lightning import LazyCheckpoint as Callback

    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(Callback, "cb")
    helps = {a.dest.removeprefix("cb."): a.help for a in parser._actions if a.dest.startswith("cb.")}
    ours = ["dirpath", "keep_last_k", "host_buffer_bytes", "copy_backend", "on_busy", "engine_options", "log_stats"]
    assert set(ours) < set(helps) and "every_n_train_steps" in helps, "ModelCheckpoint's arguments too"
    assert [name for name, text in helps.items() if not text] == []
    config = parser.parse_args(["--cb.engine_options", '{"fsync": false, "commit_timeout_s": 5}',
                                "--cb.copy_backend", "cpu"])
    assert config.cb.engine_options == {"fsync": False, "commit_timeout_s": 5.0}
    with pytest.raises((jsonargparse.ArgumentError, SystemExit)):
        parser.parse_args(["--cb.engine_options", '{"fsinc": false}'])
    with pytest.raises((jsonargparse.ArgumentError, SystemExit)):
        parser.parse_args(["--cb.on_busy", "later"])


def test_model_checkpoint_arguments_are_accepted_positionally_in_its_order(tmp_path):
    import inspect

    positional = list(inspect.signature(ModelCheckpoint.__init__).parameters)[2:]  # after self, dirpath
    values = dict(filename="best-{epoch}", monitor="val_loss", verbose=False, save_last=True, save_top_k=2)
    args = [values[name] for name in positional[:positional.index("save_top_k") + 1]]
    plain, lazy = ModelCheckpoint(str(tmp_path), *args), LazyCheckpoint(str(tmp_path), *args)
    for name, value in values.items():
        assert getattr(lazy, name) == getattr(plain, name) == value, name


def test_a_fit_that_saved_nothing_leaves_no_directory_and_no_lock(tmp_path):
    dirpath = tmp_path / "ckpt"
    callback = LazyCheckpoint(dirpath, every_n_train_steps=100)
    pl.Trainer(max_steps=2, callbacks=[callback], logger=False, enable_progress_bar=False,
               enable_model_summary=False, num_sanity_val_steps=0).fit(TinyModel())
    assert not dirpath.exists(), sorted(os.listdir(dirpath))
    kept = tmp_path / "made-by-the-user"
    kept.mkdir()
    pl.Trainer(max_steps=2, callbacks=[LazyCheckpoint(kept, every_n_train_steps=100)], logger=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0).fit(TinyModel())
    assert kept.is_dir() and os.listdir(kept) == [], "a directory the user made stays, emptied of the lock"


class PreStepRecipe(pl.LightningModule):
    """ModelCheckpoint's documented recipe under manual optimization: ``training_step`` keeps the weights of
    ``self.layer`` before ``optimizer.step()`` in ``self.saved_models``; ModelCheckpoint saves those."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(4, 2)
        self.saved_models = {}

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.layer(x).pow(2).mean()
        self.saved_models[batch_idx] = {k: v.detach().clone() for k, v in self.layer.state_dict().items()}
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4)), batch_size=2)


def test_manual_optimization_saves_what_model_checkpoints_recipe_saves(tmp_path):
    options = dict(every_n_train_steps=2, save_top_k=-1)
    plain, lazy = ModelCheckpoint(tmp_path / "plain", **options), LazyCheckpoint(tmp_path / "lazy", **options)
    pl.seed_everything(0, verbose=False)
    model = PreStepRecipe()
    pl.Trainer(max_epochs=1, callbacks=[plain, lazy], logger=False, enable_progress_bar=False,
               enable_model_summary=False).fit(model)
    names = sorted(_names(tmp_path / "plain"))
    assert names == sorted(_names(tmp_path / "lazy")) and len(names) == 3
    for name in names:
        saved = torch.load(tmp_path / "plain" / name, weights_only=True)["state_dict"]
        assert_weights = lazyckpt.load(str(tmp_path / "lazy" / name))["state_dict"]
        for key, value in saved.items():
            assert torch.equal(assert_weights[key], value), (name, key)
    assert not torch.equal(saved["layer.weight"], model.layer.weight.detach()), "the pre-step weights"
