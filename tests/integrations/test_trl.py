"""LazyCheckpointCallback under TRL's ``SFTTrainer`` (tiny GPT-2 from a config, a tokenizer built in code, random
tokens, offline): full fine-tuning and a PEFT LoRA adapter. A run killed with ``os._exit`` (its newest commit left
unnamed) resumes through ``trainer.train(resume_from_checkpoint=True)`` to the same final weights as a run that never
stopped; under LoRA the Trainer's own loader reads each checkpoint's adapter files (``model.load_adapter``), which
hold the checkpoint's own bytes, and ``load_best_model_at_end`` loads the best adapter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import lazyckpt

pytest.importorskip("trl")
peft = pytest.importorskip("peft")
from helpers.trainer_run import assert_same_weights, run_worker, uninterrupted_runs  # noqa: E402 - needs trl

pytestmark = pytest.mark.slow
SFT = ("--trl", "--epochs", "1")  # 12 steps, a save every 3
LORA = "base_model.model."  # a PeftModel's state_dict() keys start with it


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return uninterrupted_runs(tmp_path_factory.mktemp("uninterrupted"))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_crash_and_resume_is_bit_exact(tmp_path, uninterrupted, lora):
    config = (*SFT, "--lora") if lora else SFT
    run_worker(tmp_path / "out", tmp_path / "crashed.st", *config, "--crash-at", "8", expect=3)
    unname_the_newest(tmp_path / "out")
    run_worker(tmp_path / "out", tmp_path / "resumed.st", *config, "--resume", "true")
    assert_same_weights(uninterrupted(*config), tmp_path / "resumed.st")
    final = load_file(tmp_path / "resumed.st")
    assert all(key.startswith(LORA) for key in final) == lora
    if lora:  # the adapter trained, the frozen base did not
        start = lazyckpt.load(tmp_path / "out" / "checkpoint-3")
        trained = {key for key in final if not torch.equal(final[key], start[key])}
        assert trained and all(".lora_" in key for key in trained)
        for step in (3, 6, 9, 12):
            assert_adapter_files_hold_the_checkpoint(tmp_path / "out" / f"checkpoint-{step}")


def unname_the_newest(out) -> None:
    """What a crash right after a commit leaves: the step committed, its name and the Trainer's files not yet
    there; the next start writes them (the adapter's from the tree) and names it before the Trainer looks."""
    newest = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    (out / f"checkpoint-{newest}").unlink()
    for name in ("trainer_state.json", "model.safetensors.index.json", "config.json", "adapter_config.json",
                 "adapter_model.safetensors"):
        (out / "lazyckpt" / f"step-{newest:07d}" / name).unlink(missing_ok=True)


def assert_adapter_files_hold_the_checkpoint(step_dir) -> None:
    """What ``PeftModel.save_pretrained`` would write for the checkpoint's model (``get_peft_model_state_dict``),
    read back by PEFT's own loader from the checkpoint directory."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tree = lazyckpt.load(step_dir)
    config = json.loads((step_dir / "adapter_config.json").read_text())
    assert config["target_modules"] == ["c_attn"] and config["r"] == 4 and config["inference_mode"] is True
    base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    model = peft.PeftModel.from_pretrained(base, str(step_dir))  # reads adapter_config.json and the weights
    saved = load_file(step_dir / "adapter_model.safetensors")
    expected = peft.get_peft_model_state_dict(model, state_dict={key: tree[key] for key in model.state_dict()})
    assert saved.keys() == expected.keys() and len(saved) == 4
    for key, value in peft.get_peft_model_state_dict(model).items():
        assert torch.equal(saved[key], expected[key]) and torch.equal(value, expected[key]), key


def test_lora_with_load_best_model_at_end_loads_the_best_adapter(tmp_path):
    run_worker(tmp_path / "out", tmp_path / "final.st", *SFT, "--lora", "--best", "--limit", "1")
    state = json.loads((tmp_path / "out" / "checkpoint-12" / "trainer_state.json").read_text())
    best = state["best_global_step"]
    assert best != 12 and (tmp_path / "out" / f"checkpoint-{best}" / "adapter_model.safetensors").is_file()
    final, saved = load_file(tmp_path / "final.st"), lazyckpt.load(tmp_path / "out" / f"checkpoint-{best}")
    last = lazyckpt.load(tmp_path / "out" / "checkpoint-12")
    for key, value in final.items():  # the Trainer loaded the best adapter at the end
        assert torch.equal(saved[key], value), key
    assert any(not torch.equal(last[key], value) for key, value in final.items())
