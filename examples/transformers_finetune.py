"""Train a tiny GPT-2 with the Hugging Face Trainer and lazy checkpoints; crash on purpose; resume.

The model is a GPT-2 built from a ``GPT2Config`` (nothing is downloaded), the data generated sequences that count
up from a random start with a random stride (a GPT-2 learns them in a few dozen steps). ``LazyCheckpointCallback``
takes every save the Trainer decides on (``save_steps``) and makes it lazy. The end-to-end demo trains with the
Trainer's own save, then with the callback (uninterrupted), then crashes a run with ``os._exit`` and resumes it
with ``trainer.train(resume_from_checkpoint=True)``, each in its own process; it checks that the resumed run ends
with the same weights and optimizer state as the uninterrupted one, bit for bit, and prints the median stall per
save of both ways of saving::

    python examples/transformers_finetune.py --demo

or drive the pieces yourself::

    python examples/transformers_finetune.py --output-dir runs/hf --crash-at 28    # os._exit at step 28
    python examples/transformers_finetune.py --output-dir runs/hf --resume         # from the newest checkpoint-N
    python examples/transformers_finetune.py --output-dir runs/hf-own --trainer-save   # the Trainer's own save

The Trainer's own save is timed around ``_save_checkpoint`` (it does not fsync; lazyckpt's checkpoints are
fsynced before they are committed, so the comparison favours the Trainer). docs/transformers.md explains the
callback; docs/benchmarks.md ("Hugging Face Trainer") measures both on a bigger model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging as hf_logging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_task import demo_outcome, median_ms, run_demo_processes  # noqa: E402  (the demos' helpers)

from lazyckpt import LazyCheckpointCallback  # noqa: E402

VOCAB = 256


def build_model(layers: int, width: int, seq: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=seq, n_embd=width, n_layer=layers,
                                      n_head=max(1, width // 32)))


def counting_sequences(n: int, seq: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``start, start + stride, start + 2 * stride, ...`` modulo the vocabulary: learnable, generated here."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(VOCAB, (n, 1), generator=gen)
    stride = torch.randint(1, 8, (n, 1), generator=gen)
    ids = (start + stride * torch.arange(seq)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


class OwnSaveTrainer(Trainer):
    """The Trainer with its own synchronous save timed: how long each ``_save_checkpoint`` holds training up."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stalls: list[float] = []

    def _save_checkpoint(self, model, trial) -> None:
        started = time.monotonic()
        super()._save_checkpoint(model, trial)
        self.stalls.append(time.monotonic() - started)


class Progress(TrainerCallback):
    """A line every ``every`` steps (CPU steps of a bigger ``--width`` take a while), an ``os._exit`` at the start
    of step ``crash_at + 1`` (a node failure: no cleanup, no flush), and the lazy callback's stalls kept at the end
    (it closes its session in its own ``on_train_end``, which runs after this one's)."""

    def __init__(self, every: int, crash_at: int | None, lazy: LazyCheckpointCallback | None) -> None:
        self.every, self.crash_at, self.lazy = every, crash_at, lazy
        self.started = time.monotonic()
        self.stalls: dict[int, float] = {}
        self.loss: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.crash_at:
            print(f"crashing after step {self.crash_at} (os._exit)", flush=True)
            os._exit(17)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.loss = float(logs["loss"])
            if state.global_step % self.every == 0:
                print(f"  step {state.global_step}/{state.max_steps}  loss {self.loss:.3f}  "
                      f"{time.monotonic() - self.started:.1f} s", flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.lazy is not None:
            self.stalls = self.lazy.stalls


def train(args: argparse.Namespace) -> dict:
    """One run in this process; returns its report (and writes it to ``--report``)."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    lazy = None if args.trainer_save else LazyCheckpointCallback()
    progress = Progress(args.log_every, args.crash_at, lazy)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        save_strategy="steps", save_steps=args.save_steps, save_total_limit=2, logging_steps=1,
        learning_rate=3e-3, seed=args.seed, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer_class = OwnSaveTrainer if args.trainer_save else Trainer
    trainer = trainer_class(model=build_model(args.layers, args.width, args.seq), args=training_args,
                            train_dataset=counting_sequences(args.train_size, args.seq, args.seed),
                            callbacks=[progress] + ([lazy] if lazy else []))
    trainer.remove_callback(PrinterCallback)  # its dict per log line; Progress prints a line every --log-every
    # after the Trainer is built: the callback has named what a crashed run committed but had not named yet
    resumed_from = get_last_checkpoint(args.output_dir) if args.resume else None
    if args.resume:
        print(f"resuming from {resumed_from or 'nothing (no checkpoint yet): starting at step 0'}", flush=True)
    started = time.monotonic()
    trainer.train(resume_from_checkpoint=True if resumed_from else None)
    stalls = trainer.stalls if args.trainer_save else [progress.stalls[s] for s in sorted(progress.stalls)]
    report = {"global_step": trainer.state.global_step, "seconds": time.monotonic() - started, "stalls_s": stalls,
              "resumed_from": resumed_from, "loss": progress.loss,
              "checkpoints": sorted(n for n in os.listdir(args.output_dir) if n.startswith("checkpoint-"))}
    if args.out:
        torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict()}, args.out)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f)
    print(f"done: step {report['global_step']}, {len(stalls)} saves, median stall {median_ms(stalls)}, "
          f"final loss {report['loss']:.3f}, names {report['checkpoints']}", flush=True)
    return report


def demo(args: argparse.Namespace) -> int:
    """The Trainer's own save, the callback uninterrupted, a crashed run and its resume; then the summary."""
    root = args.output_dir or tempfile.mkdtemp(prefix="lazyckpt-hf-demo-")
    crash_at = args.crash_at if args.crash_at is not None else args.max_steps * 3 // 5
    common = ["--max-steps", args.max_steps, "--save-steps", args.save_steps, "--layers", args.layers,
              "--width", args.width, "--seq", args.seq, "--batch-size", args.batch_size, "--train-size",
              args.train_size, "--log-every", args.log_every, "--seed", args.seed]
    runs = [("the Trainer's own save (_save_checkpoint)", "own", ["--trainer-save"], 0),
            ("LazyCheckpointCallback, uninterrupted", "lazy", [], 0),
            (f"LazyCheckpointCallback, hard crash after step {crash_at}", "crashed", ["--crash-at", crash_at], 17),
            ("LazyCheckpointCallback, resume_from_checkpoint=True", "crashed", ["--resume"], 0)]
    reports = run_demo_processes(os.path.abspath(__file__), root, runs, dir_flag="--output-dir", common=common)
    if reports is None:
        return 1
    match, full, resumed_from = demo_outcome(root, reports)
    own, lazy = reports[0]["stalls_s"], reports[1]["stalls_s"] + reports[3]["stalls_s"]
    n_params = sum(v.numel() for k, v in full["model"].items() if k != "lm_head.weight")  # tied to the embedding
    print("\n=== lazyckpt Hugging Face Trainer demo: summary ===")
    print(f"model: GPT-2 from a config ({args.layers} layers, width {args.width}, {n_params / 1e6:.2f}M "
          f"parameters), {args.max_steps} steps, save_steps={args.save_steps}; files under {root}")
    print(f"after the crash the newest checkpoint was {resumed_from}; final loss {reports[1]['loss']:.3f} "
          f"(uninterrupted), {reports[3]['loss']:.3f} (resumed)")
    ratio = f": {statistics.median(own) / max(statistics.median(lazy), 1e-9):.0f}x less" if own and lazy else ""
    print(f"median stall per save: lazyckpt {median_ms(lazy)} (n={len(lazy)}) vs the Trainer's own save "
          f"{median_ms(own)} (n={len(own)}){ratio}")
    print(f"resumed run matches the uninterrupted run bit for bit: {'yes' if match else 'NO'}")
    return 0 if match else 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", help="the Trainer's output_dir (demo: root of its runs; default a temp dir)")
    p.add_argument("--demo", action="store_true", help="own save, lazy, crash, resume and compare (4 processes)")
    p.add_argument("--trainer-save", action="store_true", help="the Trainer's own save instead of the callback")
    p.add_argument("--crash-at", type=int, help="os._exit once this many steps are done")
    p.add_argument("--resume", action="store_true", help="train(resume_from_checkpoint=True) if a checkpoint exists")
    p.add_argument("--max-steps", type=int, default=48)
    p.add_argument("--save-steps", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=192, help="n_embd (a head every 32)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--train-size", type=int, default=256, help="sequences (256 / 8 = 32 steps an epoch)")
    p.add_argument("--log-every", type=int, default=8, help="print a progress line every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="torch.save the final model and optimizer state dicts to this file")
    p.add_argument("--report", help="the run's report as JSON (steps, stalls, the checkpoint resumed from)")
    args = p.parse_args(argv)
    if args.output_dir is None and not args.demo:
        p.error("--output-dir is required (or use --demo)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return demo(args) if args.demo else bool(train(args)) and 0


if __name__ == "__main__":
    sys.exit(main())
