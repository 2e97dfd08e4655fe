"""A tiny Hugging Face Trainer run with LazyCheckpointCallback, in a process of its own: it can crash with
``os._exit`` at a chosen step and resume through ``trainer.train(resume_from_checkpoint=...)``; it writes the
final weights for the test to compare. The Trainer's own synchronous save raises if it is ever reached.

With ``--plain`` it is the same run under a plain ``Trainer``, without the callback and without lazyckpt imported
(checked at the end): what someone given an exported checkpoint runs."""

from __future__ import annotations

import argparse
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class NoSyncSaveTrainer(Trainer):
    def _save_checkpoint(self, model, trial):  # the test's assertion: never reached with the callback
        raise AssertionError("the Trainer's own synchronous _save_checkpoint ran")


class CrashAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os._exit(3)


def dataset(n: int = 48, length: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 64, (n, length), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


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
    p.add_argument("--plain", action="store_true", help="a plain Trainer: no callback, lazyckpt never imported")
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    args = TrainingArguments(output_dir=a.out, num_train_epochs=a.epochs, per_device_train_batch_size=4,
                             gradient_accumulation_steps=a.accum, save_strategy=a.strategy, save_steps=3,
                             save_total_limit=a.limit, logging_steps=2, report_to=[], use_cpu=True, seed=0,
                             learning_rate=1e-3, disable_tqdm=True, dataloader_num_workers=0,
                             **(dict(eval_strategy="steps", eval_steps=3, load_best_model_at_end=True,
                                     metric_for_best_model="eval_loss", greater_is_better=False) if a.best else {}))
    callbacks = [CrashAt(a.crash_at)] if a.crash_at is not None else []
    if not a.plain:
        from lazyckpt import LazyCheckpointCallback

        callbacks.insert(0, LazyCheckpointCallback())
    trainer = (Trainer if a.plain else NoSyncSaveTrainer)(model=model, args=args, train_dataset=dataset(),
                                                          eval_dataset=dataset(8) if a.best else None,
                                                          callbacks=callbacks)
    resume = {"true": True, None: None}.get(a.resume, a.resume)
    trainer.train(resume_from_checkpoint=resume)
    if a.plain:
        assert not any(name.split(".")[0] == "lazyckpt" for name in sys.modules), "the plain run imported lazyckpt"
    if a.best:
        print("best:", trainer.state.best_model_checkpoint, trainer.state.best_global_step)
    if trainer.is_world_process_zero():
        save_file({k: v.contiguous() for k, v in model.state_dict().items()
                   if k != "lm_head.weight"}, a.weights)


if __name__ == "__main__":
    main()
