"""Switching and sharing: ModelCheckpoint and LazyCheckpoint in one directory resume from the newest checkpoint of
either kind (nothing starts over silently); LazyCheckpoint callbacks sharing a directory share its engine."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers.lightning_run import make_module_class, namespace, run

import lazyckpt
from lazyckpt.format.catalog import committed_steps
from lazyckpt.policy import newest_checkpoint

pl, LazyCheckpoint = namespace("lightning")
QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
             accelerator="cpu")


def model_checkpoint_run(dirpath, max_steps):
    """A run with Lightning's own ModelCheckpoint: a last.ckpt file every 2 steps."""
    pl.seed_everything(0, verbose=False)
    callback = pl.callbacks.ModelCheckpoint(dirpath, every_n_train_steps=2, save_last=True, save_top_k=0)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[callback], **QUIET)
    trainer.fit(make_module_class(pl)())
    return trainer


def test_fit_last_resumes_from_model_checkpoints_last_ckpt_and_takes_over_the_name(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    model_checkpoint_run(dirpath, max_steps=4)
    assert os.listdir(dirpath) == ["last.ckpt"] and os.path.isfile(os.path.join(dirpath, "last.ckpt"))

    trainer, model, _ = run(dirpath, max_steps=8, resume="last",
                            callback_kwargs=dict(every_n_train_steps=2, save_last=True, save_top_k=-1))
    assert trainer.ckpt_path == os.path.join(dirpath, "last.ckpt")
    assert len(model.losses) == 4, "steps 5 to 8 ran, not 1 to 8"
    assert sorted(committed_steps(dirpath)) == [6, 8]
    assert os.readlink(os.path.join(dirpath, "last.ckpt")) == "step-0000008", "the file became lazyckpt's name"
    assert not any(name.startswith("last-v") for name in os.listdir(dirpath))


def test_fit_last_resumes_from_a_lazyckpt_checkpoint_newer_than_a_stale_last_ckpt(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    model_checkpoint_run(dirpath, max_steps=2)
    stale = os.path.join(dirpath, "last.ckpt")
    os.utime(stale, (1_000_000, 1_000_000))
    os.rename(stale, os.path.join(dirpath, "last-v3.ckpt"))  # a name ModelCheckpoint's version counter makes
    run(dirpath, max_steps=4, callback_kwargs=dict(every_n_train_steps=2, save_top_k=-1))

    trainer, model, _ = run(dirpath, max_steps=6, resume="last",
                            callback_kwargs=dict(every_n_train_steps=2, save_top_k=-1))
    assert trainer.ckpt_path == os.path.join(dirpath, "step-0000004")
    assert len(model.losses) == 2
    assert os.path.isfile(os.path.join(dirpath, "last-v3.ckpt")), "a file LazyCheckpoint does not own stays"


def test_newest_checkpoint_compares_commit_and_file_times_and_skips_links(tmp_path):
    dirpath = str(tmp_path)
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        step_dir = ckpt.save({"w": torch.ones(2)}, step=3).wait()
    manifest = os.path.join(step_dir, "manifest.json")
    other = tmp_path / "last.ckpt"
    other.write_bytes(b"not read")
    link = tmp_path / "last-v1.ckpt"
    link.symlink_to("step-0000003")
    for older, newer in ((other, manifest), (manifest, other)):
        os.utime(older, (1_000, 1_000))
        os.utime(newer, (2_000, 2_000))
        expected = step_dir if newer == manifest else str(other)
        assert newest_checkpoint(dirpath, others=[str(other), str(link)]) == expected
    assert newest_checkpoint(str(tmp_path / "missing"), others=[]) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert newest_checkpoint(str(empty), others=[str(other)]) == str(other)


@pytest.mark.parametrize("save_last", [True, False])
def test_no_checkpoint_of_either_kind_starts_a_first_run_with_lightnings_warning(tmp_path, save_last):
    with pytest.warns(UserWarning, match="no last checkpoint"):
        trainer, model, _ = run(str(tmp_path / "ckpt"), max_steps=2, resume="last",
                                callback_kwargs=dict(every_n_train_steps=2, save_last=save_last))
    assert trainer.ckpt_path is None and len(model.losses) == 2


def test_two_callbacks_on_one_directory_share_the_engine(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    best = LazyCheckpoint(dirpath, monitor="val_loss", save_top_k=1, filename="best-{step}")
    every = LazyCheckpoint(dirpath, every_n_train_steps=4, save_top_k=-1, filename="every-{step}", save_last=True)
    engines = []

    class SeeEngines(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            engines.extend([best.engine, every.engine])

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_epochs=2, callbacks=[best, every, SeeEngines()], **QUIET)
    trainer.fit(make_module_class(pl)())
    assert engines[0] is engines[1] is not None
    assert sorted(committed_steps(dirpath)) == [4, 8, 12, 16]
    names = {n: os.readlink(os.path.join(dirpath, n)) for n in os.listdir(dirpath) if n.endswith(".ckpt")}
    assert {n: t for n, t in names.items() if n.startswith("every")} == {
        f"every-step={s}.ckpt": f"step-{s:07d}" for s in (4, 8, 12, 16)}
    assert names["last.ckpt"] == "step-0000016"
    assert [n for n in names if n.startswith("best")] == [os.path.basename(best.best_model_path)]
    assert names[os.path.basename(best.best_model_path)] in {"step-0000008", "step-0000016"}


def test_callbacks_on_one_directory_must_agree_on_retention(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    callbacks = [LazyCheckpoint(dirpath, every_n_train_steps=2), LazyCheckpoint(dirpath, keep_last_k=1)]
    with pytest.raises(ValueError, match="same keep_last_k"):
        pl.Trainer(max_steps=2, callbacks=callbacks, **QUIET).fit(make_module_class(pl)())
    assert all(c.session is None for c in callbacks)
    run(dirpath, max_steps=2, callback_kwargs=dict(keep_last_k=1, every_n_train_steps=2))


@pytest.mark.parametrize("resume", ["last.ckpt", "step-0000008"])
def test_the_step_a_run_resumed_from_is_kept_only_while_retention_keeps_it(tmp_path, resume):
    dirpath = str(tmp_path / "ckpt")
    options = dict(every_n_train_steps=4, save_top_k=0, save_last=True)
    run(dirpath, max_steps=8, callback_kwargs=options)
    assert sorted(committed_steps(dirpath)) == [8], "last.ckpt moved on from step 4, which nothing else keeps"
    _, model, _ = run(dirpath, max_steps=16, resume=os.path.join(dirpath, resume), callback_kwargs=options)
    assert len(model.losses) == 8, "resumed at step 8"
    assert sorted(committed_steps(dirpath)) == [16], "step 8 went the way of step 12 once nothing named it"
    assert os.readlink(os.path.join(dirpath, "last.ckpt")) == "step-0000016"


def test_verbose_says_saved_when_the_checkpoint_is_committed_not_when_it_is_requested(tmp_path, monkeypatch):
    from lazyckpt.integrations import _lightning_io

    seen = []

    def record(namespace, message):  # Lightning's rank_zero_info, as LazyCheckpoint calls it
        name = message.split("'")[1] if "'" in message else None
        seen.append((message, name is not None and os.path.isfile(os.path.join(name, "manifest.json"))))

    monkeypatch.setattr(_lightning_io, "rank_zero_info", record)
    requested = []
    handler = logging.Handler()
    handler.emit = lambda record: requested.append(record.getMessage())
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero_logger.addHandler(handler)
    try:
        run(str(tmp_path / "ckpt"), max_epochs=2,
            callback_kwargs=dict(monitor="val_loss", save_top_k=1, verbose=True, save_last=True))
    finally:
        rank_zero_logger.removeHandler(handler)
    assert not [m for m in requested if "saving model to" in m]
    saved = [(m, durable) for m, durable in seen if "saved" in m or "saving" in m]
    assert not [m for m, _ in saved if "saving model to" in m]
    assert [m.split(":")[0] for m, _ in saved] == ["Epoch 0, global step 8"] * 2 + ["Epoch 1, global step 16"] * 2
    assert all(durable for _, durable in saved), "each name is a committed checkpoint when it is announced"
    assert "'val_loss' " in saved[0][0] and "committed" in saved[0][0]


def test_fit_ends_with_a_summary_through_the_loggers_and_one_line(tmp_path, monkeypatch):
    from lazyckpt.integrations import _lightning_io
    from lightning.pytorch.loggers import Logger

    class Recorder(Logger):
        name, version = "recorder", 0
        metrics: list = []

        def log_metrics(self, metrics, step=None):
            self.metrics.append((dict(metrics), step))

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    lines = []
    monkeypatch.setattr(_lightning_io, "rank_zero_info", lambda namespace, message: lines.append(message))
    recorder = Recorder()
    _, _, callback = run(str(tmp_path / "ckpt"), max_steps=8, callback_kwargs=dict(every_n_train_steps=2),
                         trainer_kwargs=dict(logger=recorder))
    summaries = [(m, step) for m, step in recorder.metrics if "lazyckpt/checkpoints" in m]
    assert len(summaries) == 1 and summaries[0][1] == 8
    summary = summaries[0][0]
    assert summary["lazyckpt/checkpoints"] == 4 == len(callback.stats)
    assert summary["lazyckpt/written_mb"] == pytest.approx(sum(s.nbytes for s in callback.stats) / 1e6)
    assert summary["lazyckpt/stall_max_ms"] == pytest.approx(1e3 * max(s.stall_s for s in callback.stats))
    assert [line for line in lines if line.startswith("lazyckpt: 4 checkpoints committed")]


def _top_k_fit(callback_class, dirpath, max_epochs, resume=None, plugins=()):
    pl.seed_everything(0, verbose=False)
    callback = callback_class(dirpath, monitor="val_loss", save_top_k=1, save_last=True)
    trainer = pl.Trainer(max_epochs=max_epochs, callbacks=[callback], plugins=list(plugins), **QUIET)
    trainer.fit(make_module_class(pl)(), ckpt_path=resume)
    return callback


@pytest.mark.filterwarnings("error:Be aware that when using")  # Lightning asking for the callback that saved it
@pytest.mark.parametrize("first, then", [
    pytest.param(pl.callbacks.ModelCheckpoint, LazyCheckpoint, id="model-checkpoint-to-lazy"),
    pytest.param(LazyCheckpoint, pl.callbacks.ModelCheckpoint, id="lazy-to-model-checkpoint"),
])
def test_switching_callbacks_keeps_the_top_k_state_of_the_same_options(tmp_path, first, then):
    dirpath = str(tmp_path / "ckpt")
    earlier = _top_k_fit(first, dirpath, max_epochs=2)
    plugins = [lazyckpt.LazyCheckpointIO()] if then is pl.callbacks.ModelCheckpoint else []
    resumed = []

    class SeeRestored(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            checkpoint = next(c for c in trainer.callbacks if isinstance(c, pl.callbacks.ModelCheckpoint))
            resumed.append((checkpoint.best_model_score, checkpoint.best_model_path, dict(checkpoint.best_k_models)))

    pl.seed_everything(0, verbose=False)
    later = then(dirpath, monitor="val_loss", save_top_k=1, save_last=True)
    trainer = pl.Trainer(max_epochs=4, callbacks=[later, SeeRestored()], plugins=plugins, **QUIET)
    trainer.fit(make_module_class(pl)(), ckpt_path="last")
    score, path, best_k = resumed[0]
    assert float(score) == float(earlier.best_model_score) and path == earlier.best_model_path
    assert {k: float(v) for k, v in best_k.items()} == {k: float(v) for k, v in earlier.best_k_models.items()}
    kept = {n for n in os.listdir(dirpath) if n.endswith(".ckpt") and not n.startswith("last")}
    assert kept == {os.path.basename(later.best_model_path)}, "save_top_k=1 keeps one top-k file"
    assert float(later.best_model_score) <= float(earlier.best_model_score)


def test_two_callbacks_with_the_same_file_names_in_one_directory_keep_both_like_model_checkpoint(tmp_path):
    pairs = {kind: [cls(tmp_path / kind, monitor="val_loss", save_top_k=1), cls(tmp_path / kind, every_n_train_steps=2)]
             for kind, cls in (("plain", pl.callbacks.ModelCheckpoint), ("lazy", LazyCheckpoint))}
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=8, val_check_interval=2, callbacks=[*pairs["plain"], *pairs["lazy"]], **QUIET)
    trainer.fit(make_module_class(pl)())
    names = {kind: sorted(os.listdir(tmp_path / kind)) for kind in pairs}
    assert {n for n in names["lazy"] if n.endswith(".ckpt")} == set(names["plain"]), names
    for kind, callbacks in pairs.items():
        for callback in callbacks:
            assert os.path.exists(callback.best_model_path), (kind, callback.best_model_path)
    assert [os.path.basename(c.best_model_path) for c in pairs["lazy"]] == [
        os.path.basename(c.best_model_path) for c in pairs["plain"]]


def _weights(path):
    if os.path.isdir(path):
        return lazyckpt.load(path)["state_dict"]
    return torch.load(path, weights_only=True)["state_dict"]


@pytest.mark.parametrize("options", [
    pytest.param(dict(every_n_train_steps=2, save_top_k=1, save_last=True), id="versioned-names"),
    pytest.param(dict(monitor="val_loss", save_top_k=2, save_last=True, enable_version_counter=False),
                 id="no-version-counter"),
    pytest.param(dict(monitor="val_loss", save_top_k=2, save_last=True), id="top-k-monitor"),
])
def test_a_new_fit_into_a_used_directory_behaves_as_model_checkpoint(tmp_path, options):
    dirs = {"plain": tmp_path / "plain", "lazy": tmp_path / "lazy"}
    # the second run's steps are lower than every step the first one kept; the third's collide with both
    for max_steps in (16, 4, 8):
        callbacks = {"plain": pl.callbacks.ModelCheckpoint(dirs["plain"], **options),
                     "lazy": LazyCheckpoint(dirs["lazy"], **options)}
        pl.seed_everything(max_steps, verbose=False)
        pl.Trainer(max_steps=max_steps, val_check_interval=2, callbacks=list(callbacks.values()),
                   **QUIET).fit(make_module_class(pl)())
        names = {kind: sorted(n for n in os.listdir(d) if n.endswith(".ckpt")) for kind, d in dirs.items()}
        assert names["lazy"] == names["plain"], max_steps
        for name in names["plain"]:  # the same weights behind every name: no name is left on the other run's
            for key, value in _weights(str(dirs["plain"] / name)).items():
                assert torch.equal(_weights(str(dirs["lazy"] / name))[key], value), (max_steps, name, key)
        plain, lazy = callbacks["plain"], callbacks["lazy"]
        for attribute in ("best_model_path", "last_model_path", "kth_best_model_path"):
            assert os.path.basename(getattr(lazy, attribute)) == os.path.basename(getattr(plain, attribute))
        assert sorted(map(os.path.basename, lazy.best_k_models)) == sorted(map(os.path.basename, plain.best_k_models))
    assert sorted(committed_steps(dirs["lazy"] / "run-002")) == sorted(
        {int(os.readlink(dirs["lazy"] / n).rsplit("-", 1)[1]) for n in os.listdir(dirs["lazy"])
         if n.endswith(".ckpt") and os.readlink(dirs["lazy"] / n).startswith("run-002/")})
    trainer = pl.Trainer(max_steps=10, val_check_interval=2, callbacks=[LazyCheckpoint(dirs["lazy"], **options)],
                         **QUIET)
    trainer.fit(make_module_class(pl)(), ckpt_path="last")
    assert trainer.ckpt_path == os.path.join(dirs["lazy"], "run-002", "step-0000008"), "the newest commit"
    assert trainer.checkpoint_callback.session is None and (dirs["lazy"] / "run-002" / "step-0000010").is_dir()
