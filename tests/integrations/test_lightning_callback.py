"""LazyCheckpoint in-process: consistent snapshots, errors, loading and exporting, both namespaces."""

from __future__ import annotations

import copy
import errno
import os
import shutil

import pytest
import torch
from helpers.lightning_run import make_module_class, namespace, run
from lazyckpt.integrations.lightning import export_checkpoint, load_from_checkpoint, load_weights

import lazyckpt
from lazyckpt.errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from lazyckpt.storage import LocalStorage

pl, LazyCheckpoint = namespace("lightning")
TinyModel = make_module_class(pl)
QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


class Probe(pl.Callback):
    """Records the model and optimizer state each time global_step changes, at the moment the request fires
    (it runs before LazyCheckpoint: Lightning moves checkpoint callbacks to the end)."""

    def __init__(self):
        self.states, self._last = {}, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self._last:
            self._last = trainer.global_step
            self.states[trainer.global_step] = copy.deepcopy({
                "state_dict": pl_module.state_dict(),
                "optimizer_states": [o.state_dict() for o in trainer.optimizers]})


def assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("setup", [
    pytest.param(dict(trainer=dict(accumulate_grad_batches=3)), id="gradient-accumulation"),
    pytest.param(dict(model=dict(manual=True)), id="manual-optimization"),
    pytest.param(dict(model=dict(manual=True, n_optimizers=2)), id="manual-two-optimizers"),
    pytest.param(dict(trainer=dict(precision="bf16-mixed")), id="bf16-mixed"),
])
def test_every_checkpoint_holds_exactly_the_state_at_its_request(tmp_path, setup):
    probe = Probe()
    trainer_kwargs = {"callbacks": None, **setup.get("trainer", {})}
    trainer_kwargs.pop("callbacks")
    pl.seed_everything(0, verbose=False)
    callback = LazyCheckpoint(tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = pl.Trainer(max_epochs=2, callbacks=[probe, callback], **QUIET, **trainer_kwargs)
    trainer.fit(TinyModel(**setup.get("model", {})))
    steps = sorted(lazyckpt.checkpoint_step(os.path.join(tmp_path, n)) for n in os.listdir(tmp_path)
                   if n.startswith("step-"))
    assert steps == sorted(probe.states) and len(steps) >= 5
    for step in steps:
        saved = lazyckpt.load(os.path.join(tmp_path, f"step-{step:07d}"))
        assert saved["global_step"] == step
        assert_same(saved["state_dict"], probe.states[step]["state_dict"], f"step {step} state_dict")
        assert_same(saved["optimizer_states"], probe.states[step]["optimizer_states"], f"step {step} optimizer")


def _trained(tmp_path, **kwargs):
    trainer, model, callback = run(str(tmp_path / "ckpt"), max_epochs=2,
                                   callback_kwargs={"save_top_k": -1, "save_last": True}, **kwargs)
    return trainer, model, callback


def test_a_bad_ckpt_path_gives_a_clear_error(tmp_path):
    _, _, callback = _trained(tmp_path)
    good = lazyckpt.latest(callback.dirpath)

    def resume(path, **model_kwargs):
        trainer = pl.Trainer(max_epochs=3, callbacks=[LazyCheckpoint(tmp_path / "other")], **QUIET)
        trainer.fit(TinyModel(**model_kwargs), ckpt_path=path)

    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        resume(tmp_path / "ckpt" / "step-0000099")
    partial = tmp_path / "ckpt" / "step-0000024.partial"
    shutil.copytree(good, partial)
    os.remove(partial / "manifest.json")
    with pytest.raises(CheckpointNotFoundError, match="still partial"):
        resume(tmp_path / "ckpt" / "step-0000024")
    with pytest.raises(CheckpointNotFoundError, match="not a committed lazyckpt checkpoint"):
        resume(partial)
    with pytest.raises(CheckpointNotFoundError, match="directory of checkpoints.*step-0000016"):
        resume(tmp_path / "ckpt")
    with pytest.raises(CheckpointMismatchError, match=r"model \(TinyModel\): 'net\.0\.weight' is float32\[16, 8\] "
                       r"in the checkpoint and float32\[32, 8\] here"):
        resume(good, hidden=32)
    data_file = next(f for f in os.listdir(good) if f.endswith(".safetensors"))
    with open(os.path.join(good, data_file), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointCorruptError, match="corrupt"):
        resume(good)


def test_resume_from_last_continues_where_training_stopped(tmp_path):
    trainer, _, callback = _trained(tmp_path)
    assert trainer.global_step == 16
    resumed, model, _ = run(callback.dirpath, max_epochs=3, resume="last")
    assert resumed.global_step == 24 and len(model.losses) == 8  # only the third epoch ran


def test_pytorch_lightning_namespace_resumes_a_lightning_checkpoint(tmp_path):
    _, _, callback = _trained(tmp_path)
    trainer, model, pl_callback = run(callback.dirpath, ns="pytorch_lightning", max_epochs=3, resume="last")
    assert type(pl_callback).__module__ == "lazyckpt.integrations.pytorch_lightning"
    assert trainer.global_step == 24 and len(model.losses) == 8
    assert lazyckpt.latest(callback.dirpath).endswith("step-0000024")


def test_weights_load_into_a_module_and_export_to_a_plain_ckpt(tmp_path):
    trainer, model, callback = _trained(tmp_path)
    fresh = TinyModel()
    load_weights(fresh, callback.last_model_path)
    assert_same(fresh.state_dict(), model.state_dict())
    out = export_checkpoint(callback.last_model_path, tmp_path / "export" / "model.ckpt")
    plain = torch.load(out, weights_only=True)  # only tensors and plain values, RNG states included
    assert plain["global_step"] == 16 and "rng" in plain["lazyckpt"]
    assert_same(TinyModel.load_from_checkpoint(out).state_dict(), model.state_dict())
    assert_same(load_from_checkpoint(TinyModel, callback.last_model_path).state_dict(), model.state_dict())
    plain_trainer = pl.Trainer(max_epochs=3, default_root_dir=tmp_path, enable_checkpointing=False, **QUIET)
    plain_trainer.fit(TinyModel(), ckpt_path=out)
    assert plain_trainer.global_step == 24


def test_direct_save_checkpoint_is_blocking_and_plain(tmp_path):
    trainer, model, _ = _trained(tmp_path)
    trainer.save_checkpoint(tmp_path / "direct.ckpt")
    saved = torch.load(tmp_path / "direct.ckpt", weights_only=True)
    assert_same(saved["state_dict"], model.state_dict())


def test_checkpoint_metrics_go_to_the_logger(tmp_path):
    logger = pl.loggers.CSVLogger(tmp_path / "logs", name="run")
    run(str(tmp_path / "ckpt"), max_epochs=1, callback_kwargs={"every_n_train_steps": 4},
        trainer_kwargs={"logger": logger})
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        header = f.readline()
    for column in ("lazyckpt/stall_ms", "lazyckpt/copy_s", "lazyckpt/flush_s", "lazyckpt/size_mb"):
        assert column in header


class FullDisk(LocalStorage):
    def open_write(self, path):
        if "step-0000016" in path:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return super().open_write(path)


def test_a_background_failure_stops_training_and_keeps_older_checkpoints(tmp_path):
    with pytest.raises(OSError, match="injected") as info:
        run(str(tmp_path), max_epochs=3, callback_kwargs={"engine_options": {"storage": FullDisk()}})
    assert any("step 16" in note for note in getattr(info.value, "__notes__", []))
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == ["step-0000008"]
    assert lazyckpt.load(lazyckpt.latest(tmp_path))["global_step"] == 8


def test_save_on_exception_outside_a_fit_lets_the_exception_through_and_says_nothing_was_saved(tmp_path, caplog):
    class FailingValidation(TinyModel):
        fail = False

        def validation_step(self, batch, batch_idx):
            if self.fail:
                raise KeyError("validation failed")
            return super().validation_step(batch, batch_idx)

    model = FailingValidation()
    trainer = pl.Trainer(max_steps=3, limit_val_batches=1, **QUIET,
                         callbacks=[LazyCheckpoint(tmp_path, every_n_train_steps=5, save_on_exception=True)])
    trainer.fit(model)
    model.fail = True
    with pytest.raises(KeyError, match="validation failed"), caplog.at_level("WARNING"):
        trainer.validate(model)  # not fitting: ModelCheckpoint would still save on the exception
    assert "no checkpoint on KeyError: no lazyckpt session is open (saves happen only inside fit())" in caplog.text
    assert lazyckpt.latest(tmp_path) is None


@pytest.mark.parametrize("name", ["FSDPStrategy", "DeepSpeedStrategy"])
def test_fsdp1_and_deepspeed_are_refused_with_what_is_supported(tmp_path, name):
    strategy = getattr(pl.strategies, name).__new__(getattr(pl.strategies, name))  # DeepSpeed needs its package
    trainer = type("T", (), {"strategy": strategy})()
    why = "shard with FSDP2 instead: ModelParallelStrategy" if name == "FSDPStrategy" else "its own checkpoint"
    with pytest.raises(NotImplementedError, match=f"{why}.*Supported: a single device.*DDP.*ModelParallelStrategy"):
        LazyCheckpoint(tmp_path).setup(trainer, None, "fit")


def test_the_barrier_goes_first_and_also_waits_at_epoch_start_only_next_to_weight_averaging(tmp_path):
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import StochasticWeightAveraging

    callback = lazyckpt.LazyCheckpoint(tmp_path)
    plain, averaging = SimpleNamespace(callbacks=[callback]), SimpleNamespace(
        callbacks=[StochasticWeightAveraging(swa_lrs=0.1), callback])
    callback._barrier.install(plain, "lightning.pytorch")
    assert plain.callbacks[0] is callback._barrier and not callback._barrier.at_epoch_start
    callback._barrier.install(averaging, "lightning.pytorch")
    assert averaging.callbacks[0] is callback._barrier and callback._barrier.at_epoch_start


@pytest.mark.parametrize("option", ["keep_in_memory", "rollback_on_nonfinite"])
def test_model_parallel_refuses_the_memory_level_and_rollback_at_setup(tmp_path, option):
    # Both restore one rank's whole copy of the state; under ModelParallelStrategy a rank holds only its shards.
    strategy = pl.strategies.ModelParallelStrategy.__new__(pl.strategies.ModelParallelStrategy)
    trainer = type("T", (), {"strategy": strategy})()
    with pytest.raises(ValueError, match=rf"LazyCheckpoint\({option}=True\) is not supported under "
                                         rf"ModelParallelStrategy.*Drop {option}.*strategy='ddp'"):
        LazyCheckpoint(tmp_path, **{option: True}).setup(trainer, None, "fit")


def test_wait_puts_the_names_the_callback_reports_on_disk_at_once(tmp_path):
    lazy = LazyCheckpoint(tmp_path / "ckpt", monitor="val_loss", save_top_k=1, save_last=True,
                          every_n_train_steps=3)
    seen = []

    class NeedsTheFile(pl.Callback):  # runs before LazyCheckpoint in each hook
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if lazy.last_model_path:
                lazy.wait()
                seen.append(trainer.global_step)
                for path in (lazy.best_model_path, lazy.last_model_path, *lazy.best_k_models):
                    assert os.path.isfile(os.path.join(path, "manifest.json")), path

    pl.Trainer(max_epochs=2, callbacks=[NeedsTheFile(), lazy], **QUIET).fit(TinyModel())
    assert seen, "the names were checked during training"
