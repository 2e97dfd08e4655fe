"""A tiny Hugging Face Trainer run with LazyCheckpointCallback, in a process of its own: it can crash with
``os._exit`` at a chosen step and resume through ``trainer.train(resume_from_checkpoint=...)``; it writes the
final weights for the test to compare. The Trainer's own synchronous save raises if it is ever reached.
``--trl`` trains with TRL's ``SFTTrainer`` instead (a tokenizer and a dataset built here, no download), and
``--lora`` adds a PEFT LoRA adapter through its ``peft_config``. With ``--plain`` it is the same run under a plain
``Trainer``, without the callback and without lazyckpt imported (checked at the end): what someone given an
exported checkpoint runs. The tests start it with :func:`run_worker`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

VOCAB = 64


def run_worker(out: Path, weights: Path, *args: str, expect: int = 0, processes: int = 1) -> None:
    """This script in a fresh process (under torchrun with ``processes`` > 1), offline, its Hugging Face cache
    next to ``out``; asserts its exit status (``expect``: 3 when it crashes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(out.parent / "hf-home")}
    launcher = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                        "--standalone", "--nproc_per_node", str(processes)]
    result = subprocess.run([*launcher, __file__, "--out", str(out), "--weights", str(weights), *args],
                            env=env, capture_output=True, text=True, timeout=150, check=False)
    failed = result.returncode == 0 if processes > 1 and expect else result.returncode != expect  # torchrun: 1
    assert not failed, result.stdout[-3000:] + result.stderr[-5000:]


def uninterrupted_runs(base: Path) -> Callable[..., Path]:
    """The final weights of runs that never stopped, by configuration (each one run once, under ``base``)."""
    done: dict[tuple[str, ...], Path] = {}

    def get(*config: str) -> Path:
        if config not in done:
            out = base / f"run{len(done)}"
            run_worker(out, out.with_suffix(".st"), *config)
            done[config] = out.with_suffix(".st")
        return done[config]

    return get


def assert_same_weights(a: Path, b: Path) -> None:
    left, right = load_file(a), load_file(b)
    assert left.keys() == right.keys()
    for key in left:
        assert torch.equal(left[key], right[key]), key


class NoSyncSave:
    def _save_checkpoint(self, model, trial):  # the test's assertion: never reached with the callback
        raise AssertionError("the Trainer's own synchronous _save_checkpoint ran")


class NoSyncSaveTrainer(NoSyncSave, Trainer):
    pass


class CrashAt(TrainerCallback):
    """Kill the process at a step's beginning, once the checkpoints requested so far are committed and named (on a
    loaded machine the writer may lag several steps: the test needs one to resume from, whatever the timing).
    ``stalled``: the host level's copy of a step to ``dirpath`` never begins (:mod:`helpers.host_faults`); the
    crash comes once it would have, that step committed in the host folder only."""

    def __init__(self, step: int, lazy: LazyCheckpointCallback | None, stalled=None) -> None:
        self.step, self.lazy, self.stalled = step, lazy, stalled

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.stalled is not None:
            from helpers.host_faults import crash_once_stalled

            crash_once_stalled(self.stalled, 3)
        if state.global_step == self.step:
            if self.lazy is not None:
                self.lazy.wait()
            os._exit(3)


def dataset(n: int = 48, length: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, VOCAB, (n, length), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def tokenizer():
    """A word-level tokenizer over the model's vocabulary, built in code (token 0 pads, 1 ends)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<eos>")


def sft_trainer(a, model, arguments: dict, callbacks: list, eval_n: int | None):
    """TRL's SFTTrainer on already tokenized rows (``input_ids``; SFT builds the labels), LoRA with ``--lora``."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    peft_config = None
    if a.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn"],
                                 fan_in_fan_out=True, task_type="CAUSAL_LM")
    rows = lambda n: Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in dataset(n)]})  # noqa: E731
    trainer_class = type("NoSyncSaveSFTTrainer", (NoSyncSave, SFTTrainer), {})
    return trainer_class(model=model, args=SFTConfig(**arguments, max_length=32), train_dataset=rows(48),
                         eval_dataset=rows(eval_n) if eval_n else None, processing_class=tokenizer(),
                         peft_config=peft_config, callbacks=callbacks)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--weights", required=True)
    p.add_argument("--strategy", default="steps")
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--best", action="store_true", help="evaluate every 3 steps and load the best model at the end")
    p.add_argument("--scaler", action="store_true", help="fp16-style loss scaling: a GradScaler whose scale grows")
    p.add_argument("--trl", action="store_true", help="TRL's SFTTrainer")
    p.add_argument("--lora", action="store_true", help="with a PEFT LoRA adapter (with --trl)")
    p.add_argument("--plain", action="store_true", help="a plain Trainer: no callback, lazyckpt never imported")
    p.add_argument("--host-memory-dir", help="keep_in_memory='host' with this host_memory_dir")
    p.add_argument("--stall-copy-of", type=int, help="the host level's copy of this step to dirpath never begins; "
                   "--crash-at waits until it would have")
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                       **(dict(bos_token_id=1, eos_token_id=1, pad_token_id=0) if a.trl else {})))
    arguments = dict(output_dir=a.out, num_train_epochs=a.epochs, per_device_train_batch_size=4,
                     gradient_accumulation_steps=a.accum, save_strategy=a.strategy, save_steps=3,
                     save_total_limit=a.limit, logging_steps=2, report_to=[], use_cpu=True, seed=0,
                     learning_rate=1e-3, disable_tqdm=True, dataloader_num_workers=0,
                     **(dict(eval_strategy="steps", eval_steps=3, load_best_model_at_end=True,
                             metric_for_best_model="eval_loss", greater_is_better=False) if a.best else {}))
    lazy = stalled = None
    if not a.plain:
        from lazyckpt import LazyCheckpointCallback

        host = {"keep_in_memory": "host", "host_memory_dir": a.host_memory_dir} if a.host_memory_dir else {}
        lazy = LazyCheckpointCallback(**host)
    if a.stall_copy_of is not None:
        from helpers.host_faults import stall_copy_to_disk

        stalled = stall_copy_to_disk(a.stall_copy_of)
    callbacks = ([] if lazy is None else [lazy]) + ([CrashAt(a.crash_at, lazy, stalled)] if a.crash_at is not None
                                                    else [])
    if a.trl:
        trainer = sft_trainer(a, model, arguments, callbacks, eval_n=8 if a.best else None)
    else:
        trainer = (Trainer if a.plain else NoSyncSaveTrainer)(
            model=model, args=TrainingArguments(**arguments), train_dataset=dataset(),
            eval_dataset=dataset(8) if a.best else None, callbacks=callbacks)
    if a.scaler:  # fp16 needs a GPU; the CPU GradScaler takes the same path (accelerator.backward, the optimizer's step)
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    resume = {"true": True, None: None}.get(a.resume, a.resume)
    trainer.train(resume_from_checkpoint=resume)
    if a.plain:
        assert not any(name.split(".")[0] == "lazyckpt" for name in sys.modules), "the plain run imported lazyckpt"
    if a.best:
        print("best:", trainer.state.best_model_checkpoint, trainer.state.best_global_step)
    if trainer.is_world_process_zero():  # the tied output embedding is the input one: saved once
        save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()
                   if not k.endswith("lm_head.weight")}, a.weights)
    if torch.distributed.is_initialized():  # under torchrun: a group left open may abort the process at exit
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers.*
    main()
