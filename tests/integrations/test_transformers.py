"""LazyCheckpointCallback under a real Hugging Face Trainer (tiny GPT-2 from a config, random tokens): a run killed
with ``os._exit`` resumes through ``trainer.train(resume_from_checkpoint=...)`` to the same final weights as a run
that never stopped; the Trainer's own synchronous save is never reached (the worker's Trainer raises in it)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import lazyckpt

pytest.importorskip("transformers")
from helpers.trainer_run import assert_same_weights, uninterrupted_runs  # noqa: E402 - needs transformers
from helpers.trainer_run import run_worker as run  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Final weights of runs that never stopped, by configuration."""
    return uninterrupted_runs(tmp_path_factory.mktemp("uninterrupted"))


@pytest.mark.parametrize("config", [("--strategy", "steps"), ("--strategy", "epoch", "--accum", "2"),
                                    ("--strategy", "steps", "--scaler")],
                         ids=["steps", "epoch-accumulation", "amp-scaler"])
def test_crash_and_resume_newest_is_bit_exact(tmp_path, uninterrupted, config):
    crash_at = "8" if config[1] == "steps" else "10"
    run(tmp_path / "out", tmp_path / "crashed.st", *config, "--crash-at", crash_at, expect=3)
    assert any(p.name.startswith("checkpoint-") for p in (tmp_path / "out").iterdir())
    run(tmp_path / "out", tmp_path / "resumed.st", *config, "--resume", "true")
    assert_same_weights(uninterrupted(*config), tmp_path / "resumed.st")


def test_resume_from_a_named_path_and_from_the_step_directory(tmp_path, uninterrupted):
    run(tmp_path / "out", tmp_path / "crashed.st", "--crash-at", "8", expect=3)
    for i, path in enumerate([tmp_path / "out" / "checkpoint-3", tmp_path / "out" / "lazyckpt" / "step-0000003"]):
        copy = tmp_path / f"copy{i}"
        subprocess.run(["cp", "-a", str(tmp_path / "out"), str(copy)], check=True)
        resumed = copy / path.relative_to(tmp_path / "out")
        for later in copy.glob("lazyckpt/step-*"):  # the resumed run saves those steps again
            if later.name != "step-0000003":
                subprocess.run(["rm", "-rf", str(later)], check=True)
        run(copy, tmp_path / f"resumed{i}.st", "--resume", str(resumed))
        assert_same_weights(uninterrupted("--strategy", "steps"), tmp_path / f"resumed{i}.st")


def test_the_step_directory_is_a_checkpoint_the_trainer_reads(tmp_path):
    run(tmp_path / "out", tmp_path / "final.st")
    step = tmp_path / "out" / "checkpoint-24"
    assert step.is_symlink() and os.readlink(step) == os.path.join("lazyckpt", "step-0000024")
    for name in ("trainer_state.json", "model.safetensors.index.json", "config.json", "manifest.json"):
        assert (step / name).is_file(), name
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.trainer_utils import load_sharded_checkpoint

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    result = load_sharded_checkpoint(model, str(step), strict=True)  # the Trainer's own loader
    assert not result.missing_keys and not result.unexpected_keys
    final = load_file(tmp_path / "final.st")
    for key, value in final.items():
        assert torch.equal(model.state_dict()[key], value), key


def test_save_total_limit_keeps_the_newest_names_and_steps(tmp_path):
    run(tmp_path / "out", tmp_path / "final.st", "--limit", "2")
    names = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
    steps = sorted(p.name for p in (tmp_path / "out" / "lazyckpt").glob("step-*"))
    assert names == ["checkpoint-21", "checkpoint-24"]
    assert steps == ["step-0000021", "step-0000024"]


def test_a_commit_the_crash_left_unnamed_gets_its_name_at_the_next_start(tmp_path, uninterrupted):
    run(tmp_path / "out", tmp_path / "crashed.st", "--crash-at", "8", expect=3)
    named = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*"))
    # what a crash right after step 6's commit leaves: step 6 committed, its name and Trainer files not yet there
    subprocess.run(["rm", "-f", str(tmp_path / "out" / f"checkpoint-{named[-1]}")], check=True)
    for name in ("trainer_state.json", "model.safetensors.index.json", "config.json"):
        (tmp_path / "out" / "lazyckpt" / f"step-{named[-1]:07d}" / name).unlink()
    for later in (tmp_path / "out" / "lazyckpt").glob("step-*"):
        if later.name.endswith(".partial"):
            subprocess.run(["rm", "-rf", str(later)], check=True)
    run(tmp_path / "out", tmp_path / "resumed.st", "--resume", "true")
    for name in ("trainer_state.json", "config.json"):  # config.json: the resumed run's model's
        assert (tmp_path / "out" / f"checkpoint-{named[-1]}" / name).is_file(), name
    assert_same_weights(uninterrupted("--strategy", "steps"), tmp_path / "resumed.st")


def test_best_strategy_with_load_best_model_at_end_resumes_bit_exact(tmp_path, uninterrupted):
    config = ("--best", "--strategy", "best")
    run(tmp_path / "out", tmp_path / "crashed.st", *config, "--crash-at", "8", expect=3)
    run(tmp_path / "out", tmp_path / "resumed.st", *config, "--resume", "true")
    assert_same_weights(uninterrupted(*config), tmp_path / "resumed.st")


def test_save_total_limit_keeps_the_best_and_the_best_model_is_loaded_at_the_end(tmp_path):
    run(tmp_path / "out", tmp_path / "final.st", "--best", "--strategy", "steps", "--limit", "1")
    state = json.loads((tmp_path / "out" / "checkpoint-24" / "trainer_state.json").read_text())
    best = state["best_global_step"]
    assert state["best_model_checkpoint"] == str(tmp_path / "out" / f"checkpoint-{best}")
    names = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
    assert names == sorted({f"checkpoint-{best}", "checkpoint-24"})
    saved = lazyckpt.load(tmp_path / "out" / f"checkpoint-{best}")
    for key, value in load_file(tmp_path / "final.st").items():  # the Trainer loaded the best model at the end
        assert torch.equal(saved[key], value), key


@pytest.fixture(scope="module")
def two_processes_uninterrupted(tmp_path_factory) -> Path:
    """Final weights of a two-process run that never stopped."""
    out = tmp_path_factory.mktemp("two-processes") / "full"
    run(out, out.with_suffix(".st"), processes=2)
    return out.with_suffix(".st")


def test_two_processes_crash_and_resume_bit_exact(tmp_path, two_processes_uninterrupted):
    run(tmp_path / "out", tmp_path / "crashed.st", "--crash-at", "8", expect=3, processes=2)
    run(tmp_path / "out", tmp_path / "resumed.st", "--resume", "true", processes=2)
    assert_same_weights(two_processes_uninterrupted, tmp_path / "resumed.st")
    manifest = json.loads((tmp_path / "out" / "checkpoint-12" / "manifest.json").read_text())
    assert manifest["world_size"] == 2


# --- lazyckpt export --format transformers: the Trainer's own folder, for people without lazyckpt ---------------

TRAINER_FILES = ["config.json", "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt",
                 "trainer_state.json"]


def export_newest(out: Path, into: Path) -> Path:
    """The newest committed checkpoint of the run in ``out``, exported through the CLI."""
    from lazyckpt.cli import main

    newest = lazyckpt.latest(out / "lazyckpt")
    assert newest is not None, "the crashed run committed no checkpoint"
    assert main(["export", newest, str(into), "--format", "transformers"]) == 0
    return into


@pytest.mark.parametrize("config", [("--strategy", "steps"), ("--strategy", "epoch", "--accum", "2")],
                         ids=["steps-mid-epoch", "epoch-end-accumulation"])
def test_an_exported_checkpoint_resumes_in_a_plain_trainer_bit_exact(tmp_path, uninterrupted, config):
    """The export of a crashed run's newest checkpoint, resumed by a Trainer without the callback in a process
    that never imports lazyckpt (the worker checks), ends with the weights of the run that never stopped."""
    crash_at = "8" if config[1] == "steps" else "10"
    run(tmp_path / "out", tmp_path / "crashed.st", *config, "--crash-at", crash_at, expect=3)
    exported = export_newest(tmp_path / "out", tmp_path / "handed-over")
    assert sorted(p.name for p in exported.iterdir()) == TRAINER_FILES
    run(tmp_path / "plain", tmp_path / "resumed.st", *config, "--plain", "--resume", str(exported))
    assert_same_weights(uninterrupted(*config), tmp_path / "resumed.st")


def test_from_pretrained_loads_the_exported_model(tmp_path, uninterrupted):
    from transformers import AutoModelForCausalLM

    from lazyckpt.cli import main

    checkpoint = uninterrupted("--strategy", "steps").with_suffix("") / "checkpoint-24"

    assert main(["export", str(checkpoint), str(tmp_path / "model"), "--format", "transformers"]) == 0
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"], "the class recorded, as save_pretrained does"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert type(model).__name__ == "GPT2LMHeadModel"
    saved = lazyckpt.load(checkpoint)
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_two_processes_exported_resume_in_a_plain_trainer_bit_exact(tmp_path, two_processes_uninterrupted):
    run(tmp_path / "out", tmp_path / "crashed.st", "--crash-at", "8", expect=3, processes=2)
    exported = export_newest(tmp_path / "out", tmp_path / "handed-over")
    assert sorted(p.name for p in exported.iterdir()) == sorted(
        [n for n in TRAINER_FILES if n != "rng_state.pth"] + ["rng_state_0.pth", "rng_state_1.pth"])
    run(tmp_path / "plain", tmp_path / "resumed.st", "--plain", "--resume", str(exported), processes=2)
    assert_same_weights(two_processes_uninterrupted, tmp_path / "resumed.st")
