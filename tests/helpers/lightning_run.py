"""A small LightningModule with every kind of state a resume must restore, and a runner the Lightning tests
use in-process and as a subprocess (``python tests/helpers/lightning_run.py --help``).

The module has dropout (global torch RNG), BatchNorm (buffers written in forward), a frozen layer (``immutable``
tensors), AdamW state, a step-wise LR scheduler and a shuffled train loader driven by its own generator.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def namespace(name: str = "lightning"):
    """``(pl, LazyCheckpoint)`` for ``"lightning"`` or ``"pytorch_lightning"``."""
    if name == "lightning":
        pl = importlib.import_module("lightning.pytorch")
        return pl, importlib.import_module("lazyckpt.integrations.lightning").LazyCheckpoint
    pl = importlib.import_module("pytorch_lightning")
    return pl, importlib.import_module("lazyckpt.integrations.pytorch_lightning").LazyCheckpoint


def make_module_class(pl):
    class TinyModel(pl.LightningModule):
        def __init__(self, manual: bool = False, n_optimizers: int = 1, hidden: int = 16, samples: int = 64,
                     stateful_loader: bool = False, batch_norm: bool = True):
            super().__init__()
            self.save_hyperparameters()
            self.automatic_optimization = not manual
            self.frozen = nn.Linear(8, 8).requires_grad_(False)
            norm = nn.BatchNorm1d(hidden) if batch_norm else nn.Identity()
            self.net = nn.Sequential(nn.Linear(8, hidden), norm, nn.ReLU(), nn.Dropout(0.3))
            self.head = nn.Linear(hidden, 2)
            self.losses: list[float] = []

        def forward(self, x):
            return self.head(self.net(self.frozen(x)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.log("train_loss", loss)
            self.losses.append(loss.item())
            if self.automatic_optimization:
                return loss
            opts = self.optimizers()
            opts = opts if isinstance(opts, list) else [opts]
            for opt in opts:
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in opts:
                opt.step()
            scheds = self.lr_schedulers() or []
            for sched in scheds if isinstance(scheds, list) else [scheds]:
                sched.step()
            return loss

        def configure_model(self):
            mesh = getattr(self, "device_mesh", None)
            if mesh is not None and mesh["tensor_parallel"].size() > 1:  # tensor parallel: the first two layers
                # (run without BatchNorm: on CPU its replicated parameters drift apart across the tensor-parallel
                # ranks, and a checkpoint keeps one copy of each replicated parameter)
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                parallelize_module(self, mesh["tensor_parallel"], {"frozen": ColwiseParallel(),
                                                                   "net.0": RowwiseParallel()})
            elif mesh is not None:  # ModelParallelStrategy: FSDP2 over the data-parallel ranks
                from torch.distributed.fsdp import fully_shard

                for module in (self.frozen, self.net, self.head):
                    fully_shard(module, mesh=mesh["data_parallel"])

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self(x), y))

        def configure_optimizers(self):
            if self.hparams.n_optimizers == 2:
                opts = [torch.optim.AdamW(self.net.parameters(), lr=1e-2),
                        torch.optim.SGD(self.head.parameters(), lr=0.1, momentum=0.9)]
                return opts, [torch.optim.lr_scheduler.StepLR(o, 2, 0.9) for o in opts]
            opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            gen = torch.Generator().manual_seed(1234)
            cls = StatefulLoader if self.hparams.stateful_loader else DataLoader
            return cls(_dataset(self.hparams.samples, 0), batch_size=8, shuffle=True, generator=gen)

        def val_dataloader(self):
            return DataLoader(_dataset(32, 1), batch_size=16)

    return TinyModel


class StatefulLoader(DataLoader):
    """A loader that resumes mid-epoch through Lightning's own mechanism (``state_dict``/``load_state_dict``):
    its state is the shuffling generator's state at the start of the epoch and how many batches it yielded."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._epoch_start, self._yielded, self._resume = None, 0, None

    def __iter__(self):
        return self._batches()

    def _batches(self):  # a generator: runs at the first next(), after every restore hook
        skip = 0
        if self._resume is not None:
            self.generator.set_state(self._resume["generator"].clone())
            skip, self._resume = self._resume["yielded"], None
        self._epoch_start, self._yielded = self.generator.get_state(), 0
        for i, batch in enumerate(DataLoader.__iter__(self)):
            self._yielded = i + 1
            if i >= skip:
                yield batch

    def state_dict(self):
        return {"generator": self._epoch_start, "yielded": self._yielded}

    def load_state_dict(self, state):
        self._resume = state


def _dataset(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long())


def make_crash_callback(pl, crash_at: int, stall_copy_of: int | None = None):
    """With ``stall_copy_of`` (the host level), that step's copy to ``dirpath`` never begins and the crash waits
    until it would have (:mod:`helpers.host_faults`): the step is then in the host folder only."""
    stalled = None
    if stall_copy_of is not None:
        from helpers.host_faults import stall_copy_to_disk

        stalled = stall_copy_to_disk(stall_copy_of)

    class CrashAt(pl.Callback):
        """Hard-exit (no cleanup, no atexit) when the loop is about to run the given step."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == crash_at and stalled is not None:
                from helpers.host_faults import crash_once_stalled

                crash_once_stalled(stalled, 17)
            if trainer.global_step == crash_at:
                os._exit(17)

    return CrashAt()


def make_state_at_start_callback(pl, out: str):
    class StateAtStart(pl.Callback):
        """Save the restored state (``final_state``) as training starts, before any update: rank 0 to ``out``,
        rank r > 0 to ``out.rank<r>``."""

        def on_train_start(self, trainer, pl_module):
            state = final_state(pl_module, trainer)
            torch.save(state, out if trainer.is_global_zero else f"{out}.rank{trainer.global_rank}")

    return StateAtStart()


def make_top_k_report_callback(pl, out: str):
    class TopKReport(pl.Callback):
        """Write (rank 0) the checkpoint callback's top-k state as restored (at the start of training) and at the
        end, as JSON to ``out``: {"restored": ..., "final": ...}, each {score, path, best_k}."""

        def __init__(self):
            self.report = {}

        def _top_k(self, trainer):
            checkpoint = next(c for c in trainer.callbacks if isinstance(c, pl.callbacks.ModelCheckpoint))
            score = checkpoint.best_model_score
            return {"score": None if score is None else float(score), "path": checkpoint.best_model_path,
                    "best_k": {k: float(v) for k, v in checkpoint.best_k_models.items()}}

        def on_train_start(self, trainer, pl_module):
            self.report["restored"] = self._top_k(trainer)

        def on_train_end(self, trainer, pl_module):
            self.report["final"] = self._top_k(trainer)
            if trainer.is_global_zero:
                with open(out, "w") as f:
                    json.dump(self.report, f)

    return TopKReport()


def final_state(model, trainer) -> dict:
    """The full model and optimizer state (collective under ModelParallelStrategy: every rank calls it)."""
    if getattr(model, "device_mesh", None) is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        full, optimizers = get_state_dict(model, trainer.optimizers, options=StateDictOptions(full_state_dict=True))
        return {"model": full, "optimizers": optimizers if isinstance(optimizers, list) else [optimizers],
                "global_step": trainer.global_step, "losses": list(model.losses)}
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizers": [o.state_dict() for o in trainer.optimizers],
            "global_step": trainer.global_step, "losses": list(model.losses)}


def run(dirpath: str, *, ns: str = "lightning", max_epochs: int = 3, max_steps: int = -1, crash_at: int | None = None,
        stall_copy_of: int | None = None, resume: str | None = None, devices: int = 1, strategy: str = "ddp", seed: int = 0,
        callback_kwargs: dict | None = None, out_at_start: str | None = None,
        trainer_kwargs: dict | None = None, model_kwargs: dict | None = None, model_checkpoint: bool = False,
        top_k_report: str | None = None):
    """Train ``TinyModel`` with a ``LazyCheckpoint`` (``model_checkpoint``: Lightning's ``ModelCheckpoint`` and the
    ``LazyCheckpointIO`` plugin instead); returns ``(trainer, model, callback)``."""
    pl, lazy_checkpoint = namespace(ns)
    pl.seed_everything(seed, verbose=False)
    model = make_module_class(pl)(**(model_kwargs or {}))
    callback = (pl.callbacks.ModelCheckpoint if model_checkpoint else lazy_checkpoint)(dirpath, **(callback_kwargs or {}))
    callbacks = [callback] + ([make_crash_callback(pl, crash_at, stall_copy_of)] if crash_at is not None else [])
    callbacks += [make_state_at_start_callback(pl, out_at_start)] if out_at_start is not None else []
    callbacks += [make_top_k_report_callback(pl, top_k_report)] if top_k_report is not None else []
    if model_checkpoint:
        trainer_kwargs = {"plugins": [importlib.import_module("lazyckpt").LazyCheckpointIO()], **(trainer_kwargs or {})}
    kwargs = dict(max_epochs=max_epochs, max_steps=max_steps, callbacks=callbacks, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  accelerator="cpu", devices=devices, strategy=_strategy(pl, strategy, devices))
    kwargs.update(trainer_kwargs or {})
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, ckpt_path=resume)
    return trainer, model, callback


def _strategy(pl, name: str, devices: int):
    if name == "model_parallel":
        return pl.strategies.ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    if name == "tensor_parallel":
        return pl.strategies.ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=devices)
    return name if devices > 1 else "auto"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dirpath", required=True)
    parser.add_argument("--out", help="torch.save the final model/optimizer state here (rank 0)")
    parser.add_argument("--out-at-start", help="torch.save the restored state as training starts (rank 0)")
    parser.add_argument("--ns", default="lightning", choices=["lightning", "pytorch_lightning"])
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--every-n-train-steps", type=int)
    parser.add_argument("--stateful-loader", action="store_true")
    parser.add_argument("--keep-in-memory", action="store_true")
    parser.add_argument("--host-memory-dir", help="keep_in_memory='host' with this host_memory_dir")
    parser.add_argument("--stall-copy-of", type=int, help="the host level's copy of this step to dirpath never "
                        "begins; --crash-at waits until it would have")
    parser.add_argument("--remote", help="the remote level's URL")
    parser.add_argument("--storage-options", type=json.loads, help="its fsspec storage_options, as JSON")
    parser.add_argument("--model-checkpoint", action="store_true",
                        help="Lightning's ModelCheckpoint (and the LazyCheckpointIO plugin) instead of LazyCheckpoint")
    parser.add_argument("--top-k-report", help="monitor val_loss, save_top_k=1, and write the top-k state here")
    args = parser.parse_args(argv)
    cb_kwargs = {"save_top_k": -1, "save_last": True}
    if not args.model_checkpoint:
        cb_kwargs["keep_in_memory"] = args.keep_in_memory
    if args.host_memory_dir:
        cb_kwargs.update(keep_in_memory="host", engine_options={"host_memory_dir": args.host_memory_dir})
    if args.top_k_report:
        cb_kwargs.update(monitor="val_loss", save_top_k=1)
    if args.remote:
        cb_kwargs.update(remote=args.remote, storage_options=args.storage_options)
    if args.every_n_train_steps:
        cb_kwargs["every_n_train_steps"] = args.every_n_train_steps
    trainer, model, callback = run(args.dirpath, ns=args.ns, max_epochs=args.max_epochs, crash_at=args.crash_at,
                            stall_copy_of=args.stall_copy_of,
                            resume=args.resume, devices=args.devices, strategy=args.strategy, callback_kwargs=cb_kwargs,
                            model_kwargs={"stateful_loader": args.stateful_loader,
                                          "batch_norm": args.strategy != "tensor_parallel"},
                            out_at_start=args.out_at_start, model_checkpoint=args.model_checkpoint,
                            top_k_report=args.top_k_report)
    state = final_state(model, trainer) if args.out else None
    if args.out and trainer.is_global_zero:  # and the paths a user sees after the run
        torch.save({**state, "ckpt_path": trainer.ckpt_path, "best_model_path": callback.best_model_path}, args.out)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Lightning leaves the group up; torn down at interpreter exit, gloo's threads now and then abort the
        # process ("terminate called without an active exception") after the run succeeded.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers.*
    main()
