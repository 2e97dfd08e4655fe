"""A Lightning run whose loss turns nan at chosen batches, and its reference that never sees the lost batches.

Used in-process and, for DDP, as a script (``python tests/helpers/rollback_run.py --help``). Each rank has its own
fixed list of batches (no sampler, no shuffling), so a reference run is the same list without the lost batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import MixedPrecision

BATCHES = 12


class NanAtModel(pl.LightningModule):
    """Loss becomes nan at the 1-based batch numbers ``bad`` (on ``bad_rank`` only, when given)."""

    def __init__(self, bad: tuple[int, ...] = (), bad_rank: int | None = None, skip: tuple[int, ...] = ()):
        super().__init__()
        self.bad, self.bad_rank, self.skip = set(bad), bad_rank, set(skip)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        loss = self.net(batch).float().pow(2).mean()
        if batch_idx + 1 in self.bad and self.bad_rank in (None, self.global_rank):
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(100 + self.global_rank)
        data = [torch.randn(8, 6, generator=gen) for _ in range(BATCHES)]
        return DataLoader([x for i, x in enumerate(data, 1) if i not in self.skip], batch_size=None)


def fp16_plugin() -> MixedPrecision:
    """fp16 autocast with a GradScaler on CPU (Lightning makes a scaler only for CUDA by itself)."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))


def fit(dirpath, *, bad=(), bad_rank=None, skip=(), rollback: bool = True, devices: int = 1, callback_kwargs=None,
        trainer_kwargs=None, module: type[NanAtModel] = NanAtModel):
    """Train one epoch; ``rollback=False`` runs without any checkpointing (the reference). Returns the trainer."""
    from lazyckpt.integrations.lightning import LazyCheckpoint

    model = module(tuple(bad), bad_rank, tuple(skip))
    callbacks = []
    if rollback:
        options = {"every_n_train_steps": 3, "save_top_k": -1, "keep_in_memory": True,
                   "rollback_on_nonfinite": True, **(callback_kwargs or {})}
        callbacks.append(LazyCheckpoint(dirpath, **options))
    kwargs = dict(max_epochs=1, callbacks=callbacks, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=rollback, num_sanity_val_steps=0,
                  accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                  use_distributed_sampler=False, default_root_dir=os.fspath(dirpath))
    kwargs.update(trainer_kwargs or {})
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model)
    return trainer


def final_state(trainer) -> dict:
    """Weights, optimizer and scheduler states after the run (what must equal the reference bit for bit)."""
    module = trainer.lightning_module
    return {"model": {k: v.clone() for k, v in module.state_dict().items()},
            "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dirpath", required=True)
    parser.add_argument("--out", required=True, help="torch.save each rank's final state to OUT.rankN")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--bad", type=int, nargs="*", default=[])
    parser.add_argument("--bad-rank", type=int)
    parser.add_argument("--skip", type=int, nargs="*", default=[])
    parser.add_argument("--reference", action="store_true", help="no checkpointing, no rollback")
    args = parser.parse_args(argv)
    trainer = fit(args.dirpath, bad=args.bad, bad_rank=args.bad_rank, skip=args.skip, rollback=not args.reference,
                  devices=args.devices)
    torch.save(final_state(trainer), f"{args.out}.rank{trainer.global_rank}")
    if trainer.is_global_zero and not args.reference:
        with open(f"{args.out}.json", "w") as f:
            json.dump({"global_step": trainer.global_step}, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers.*
    main()
