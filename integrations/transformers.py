"""Hugging Face ``Trainer`` (and TRL's trainers, which subclass it): ``LazyCheckpointCallback`` takes over every
checkpoint the Trainer decides on and makes it lazy. What it reads from and restores into the Trainer's objects,
and the Trainer's own files it adds to each step directory, are in ``_transformers_state``.

Example (docs/transformers.md has the whole recipe):
    >>> trainer = Trainer(model, args, train_dataset=data, callbacks=[LazyCheckpointCallback()])  # doctest: +SKIP
    >>> trainer.train(resume_from_checkpoint=True)    # after a crash: the newest committed        # doctest: +SKIP

The request goes out at ``on_step_end`` once ``DefaultFlowCallback`` has decided (for ``save_strategy="best"`` at
``on_evaluate``), the Trainer's synchronous ``_save_checkpoint`` is never reached (``control.should_save`` is
cleared; the best metric is recorded by the Trainer's own rule first, so it finds nothing new to save), and the
barrier is ``on_pre_optimizer_step``. Each commit gets the Trainer's name, ``output_dir/checkpoint-N`` (a link to
the step directory), and the Trainer's retention (``save_total_limit``, the best one kept).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from lazyckpt.config import normalize_dirpath
from lazyckpt.format.files import step_dirname
from lazyckpt.levels.aliases import aliased_steps
from lazyckpt.pending import PendingCheckpoint
from lazyckpt.policy import CheckpointNames, CheckpointSession, SessionOptions, restore_rng
from lazyckpt.ranks.sharding import is_dtensor
from lazyckpt.read.load import load
from lazyckpt.storage import LocalStorage

from . import _transformers_state as trainer_state
from ._compat import inner_optimizer

logger = logging.getLogger(__name__)


class LazyCheckpointCallback(TrainerCallback):
    """Lazy asynchronous checkpoints for a ``transformers.Trainer``.

    Args:
        dirpath: where the step directories go; None: ``<output_dir>/lazyckpt``. Their names
            (``<output_dir>/checkpoint-N``) are where the Trainer looks for checkpoints.
        **options: the engine options ``LazyCheckpoint`` takes (``host_buffer_bytes``, ``copy_backend``,
            ``keep_in_memory``, ``remote``, ...). ``save_steps``, ``save_strategy``, ``save_total_limit``,
            ``save_only_model`` and ``load_best_model_at_end`` come from the ``TrainingArguments``.

    Raises:
        ValueError: an invalid option (the message names it).
    """

    def __init__(self, dirpath: str | os.PathLike[str] | None = None, **options: Any) -> None:
        self.options, _ = SessionOptions.from_keywords(options, owner="LazyCheckpointCallback", keep_last_k=None,
                                                       source="the TrainingArguments (save_total_limit)")
        self.dirpath = normalize_dirpath(dirpath) if dirpath is not None else None
        self.session: CheckpointSession | None = None
        self._names: CheckpointNames | None = None
        self._objects: dict[str, Any] = {}
        self._at_save: dict[int, trainer_state.AtSave] = {}
        self._saved: set[int] = set()
        self._rng_to_restore: tuple[str, dict[str, Any]] | None = None
        self._model_only = False
        self._adapter: dict[str, Any] | None = None
        self._names_dir = ""
        self._last_requested: int | None = None
        self._epoch_ended = False
        self._in_flow = False
        self._rotation_due = False
        self._model_files: tuple[list[str], str | None] | None = None

    # --- the run --------------------------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _refuse_unsupported(args, kwargs.get("model"))
        names_dir = normalize_dirpath(args.output_dir)
        dirpath = self.dirpath or os.path.join(names_dir, "lazyckpt")
        CheckpointSession.commit_host_leftovers(dirpath, self.options, rank=args.process_index,
                                                world_size=args.world_size)
        if args.process_index == 0:  # before train() looks for the newest checkpoint (every rank waits for it)
            repaired = trainer_state.name_unnamed_commits(
                LocalStorage(), dirpath, names_dir,
                load=lambda path: load(path, verify=False),
                config_json=trainer_state.config_json(kwargs.get("model")))
            if repaired:
                logger.info("lazyckpt: named the steps a crashed run had committed: %s", repaired)
        if args.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _refuse_unsupported(args, kwargs.get("model"))
        self._objects = {key: kwargs.get(key) for key in ("model", "optimizer", "lr_scheduler")}
        self._model_only = bool(args.save_only_model)
        self._adapter = trainer_state.adapter_layout(self._objects["model"])
        model = self._objects["model"]  # its keys and config.json are the same at every commit: made once
        self._model_files = None if model is None else (sorted(model.state_dict()), trainer_state.config_json(model))
        self._names_dir = normalize_dirpath(args.output_dir)
        dirpath = self.dirpath or os.path.join(self._names_dir, "lazyckpt")
        self.session = CheckpointSession(dirpath, self.options, rank=args.process_index,
                                         world_size=args.world_size, engine_retention=False)
        self._names = CheckpointNames(self.session, self._request, names_dir=self._names_dir,
                                      before_names=self._write_trainer_files)
        self._saved = set(aliased_steps(self.session.storage, self._names_dir, into=self.session.dirpath))
        if state.global_step > 0:
            self._resume(state)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_of_step_flow(args, state)  # before the epoch's loader draws its seed from the global RNG
        self._restore_rng(at="epoch")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_of_step_flow(args, state)
        self._epoch_ended = False
        self._restore_rng(at="step")  # after the Trainer fetched this step's batches, as its own resume does
        self._poll()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None:
            self.session.barrier()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._poll()
        self._in_flow = True  # the step's log, evaluation and save decisions follow
        self._take_over(args, state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_of_step_flow(args, state)
        self._in_flow = True
        self._take_over(args, state, control)
        self._epoch_ended = True
        self._settle_before_stop(args, control, evaluation_follows=control.should_evaluate)

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._take_over(args, state, control)  # a callback after DefaultFlowCallback may have asked to save
        self._refresh(args, state)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float] | None = None,
                    **kwargs: Any) -> None:
        if not self._in_flow:
            return  # eval_on_start, or trainer.evaluate() outside the training loop: not a save decision
        if metrics is not None and _saves_best(args) and _record_best(args, state, metrics):
            self._save(args, state)
        self._take_over(args, state, control)
        self._refresh(args, state)
        if self._epoch_ended:  # the evaluation after the last epoch's end
            self._settle_before_stop(args, control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_of_step_flow(args, state)
        self.close(step=state.global_step)

    def close(self, *, step: int | None = None) -> None:
        """Finish every checkpoint in flight and put its name in place (``on_train_end`` calls it). Idempotent."""
        names, self._names = self._names, None
        if names is not None:
            names.finish(step=step or 0)
            names.close(raise_errors=True)
        self.session = None

    def wait(self) -> None:
        """Block until every checkpoint requested so far is committed and named ``checkpoint-N`` (re-raises a
        failure): e.g. before handing a checkpoint to another process while training goes on."""
        if self._names is not None:
            self._names.submit()
            self._names.poll(block=True)
            self.session.engine.wait_staged()

    @property
    def stalls(self) -> dict[int, float]:
        """Training-thread seconds each checkpoint cost, by step (while the run is open)."""
        return {} if self.session is None else self.session.stalls

    # --- saves ----------------------------------------------------------------------------------------------

    def _poll(self) -> None:
        if self._names is not None:
            self._names.poll()

    def _take_over(self, args: Any, state: Any, control: Any) -> None:
        """The Trainer decided to save this step: save it lazily instead, and keep the Trainer from saving."""
        if control.should_save:
            control.should_save = False
            self._save(args, state)

    def _save(self, args: Any, state: Any) -> None:
        step = state.global_step
        if step == self._last_requested or self._names is None:
            return self._refresh(args, state)
        if self.session.rank != 0:  # only rank 0 publishes (and then frees) what it read at the save
            self._at_save = {s: v for s, v in self._at_save.items() if s == self._last_requested}
        self._last_requested = step
        self._at_save[step] = None  # type: ignore[assignment] - filled by _refresh right away
        self._refresh(args, state)
        with self._names.deciding():
            self._names.plan(step, os.path.join(self._names_dir, f"{trainer_state.PREFIX}-{step}"))
        self._rotation_due = True

    def _end_of_step_flow(self, args: Any, state: Any) -> None:
        """The step's log, evaluation and save decisions are over: read its TrainerState once more (the Trainer
        records a new best after the callbacks' ``on_evaluate``), then apply the Trainer's retention, as its own
        save does at that point."""
        if not self._in_flow:
            return
        self._in_flow = False
        self._refresh(args, state)
        if not self._rotation_due or self._names is None:
            return
        self._rotation_due = False
        kept = trainer_state.steps_to_keep([*self._saved, self._last_requested], limit=args.save_total_limit,
                                           best=state.best_global_step or None)
        for old in sorted(self._saved - kept):
            self._names.drop(os.path.join(self._names_dir, f"{trainer_state.PREFIX}-{old}"))
        self._saved = kept

    def _request(self, step: int) -> PendingCheckpoint | None:
        model, optimizer, scheduler = (self._objects[k] for k in ("model", "optimizer", "lr_scheduler"))
        at_save = lambda: self._at_save[step]  # noqa: E731 - read at the barrier, after the step's logging
        return self.session.save(
            step, replicated=lambda: trainer_state.replicated_state(model, optimizer, scheduler, _scaler(optimizer),
                                                                    at_save=at_save, model_only=self._model_only,
                                                                    adapter=self._adapter),
            per_rank=trainer_state.per_rank_state(self.session.rank, at_save),
            optimizers=[] if self._model_only else [inner_optimizer(optimizer)],
            if_committed="warn")

    def _refresh(self, args: Any, state: Any) -> None:
        """Read the TrainerState and RNG of a step being saved as the Trainer's own save would read them: after
        the step's logging and evaluation (each of those events reads them again)."""
        step = state.global_step
        if step in self._at_save:
            best = state.best_global_step
            best_dir = (os.path.join(self._names_dir, f"{trainer_state.PREFIX}-{best}")
                        if best and (best in self._saved or best == step) else None)
            if best_dir is not None:
                state.best_model_checkpoint = best_dir  # as the Trainer's own save sets it (load_best_model_at_end)
            self._at_save[step] = trainer_state.capture_at_save(state, best_dir)

    def _settle_before_stop(self, args: Any, control: Any, *, evaluation_follows: bool = False) -> None:
        """``load_best_model_at_end`` overwrites the weights right after the last event of the run: the copy in
        flight must be done and the best step named by then. The last event is the epoch's end, or the
        evaluation that follows it."""
        if not (control.should_training_stop and args.load_best_model_at_end and self._names is not None):
            return
        if not evaluation_follows:
            self.session.barrier()
            self._names.poll(block=True)

    def _write_trainer_files(self, step: int) -> None:
        at_save = self._at_save.pop(step, None)  # committed: its Deferred leaves were read at its barrier
        if at_save is None or self._model_files is None:
            return
        model_keys, config_json = self._model_files
        trainer_state.write_trainer_files(
            self.session.storage, os.path.join(self.session.dirpath, step_dirname(step)),
            trainer_state=at_save.trainer_state, model_keys=model_keys, config_json=config_json,
            adapter=self._adapter)

    # --- resume ---------------------------------------------------------------------------------------------

    def _resume(self, state: Any) -> None:
        """The Trainer loaded ``trainer_state.json`` (and the model) of step ``global_step``; restore the rest from
        this run's directory, or nothing when the Trainer resumed from a checkpoint of its own."""
        path = os.path.join(self.session.dirpath, step_dirname(state.global_step))
        if self.session.storage.stat(os.path.join(path, "manifest.json")) is None:
            logger.warning("lazyckpt: step %d is not in %s: the Trainer resumed from a checkpoint of its own (or of "
                           "another directory), so only what it holds was restored", state.global_step,
                           self.session.dirpath)
            return
        verify = self.session.engine.config.verify_on_load
        tree = self.session.load(path, verify=verify)
        own = tree if self.session.rank == 0 else self.session.load(path, verify=verify, rank=self.session.rank)
        model, optimizer, scheduler = (self._objects[k] for k in ("model", "optimizer", "lr_scheduler"))
        rng = trainer_state.restore(tree, own, model=model, optimizer=optimizer, scheduler=scheduler,
                                    scaler=_scaler(optimizer))
        if rng is not None:
            self._rng_to_restore = ("epoch" if float(state.epoch).is_integer() else "step", rng)
        self._saved.add(state.global_step)
        self.session.resumed(state.global_step, path)

    def _restore_rng(self, *, at: str) -> None:
        if self._rng_to_restore is not None and self._rng_to_restore[0] == at:
            restore_rng(self._rng_to_restore[1], {})
            self._rng_to_restore = None


def _refuse_unsupported(args: Any, model: Any) -> None:
    """DeepSpeed and sharded models (FSDP, tensor parallel) are not supported under the Trainer yet: the Trainer
    loads their weights through loaders of their own, which a lazyckpt step directory does not feed. Checked at
    ``on_init_end`` (before ``train()`` prepares and loads anything) and again at ``on_train_begin`` (a callback
    added later); FSDP may come from ``accelerate launch`` too, which only the accelerator's state shows."""
    from accelerate.state import AcceleratorState, is_initialized

    if getattr(args, "deepspeed", None):
        raise ValueError("LazyCheckpointCallback does not support DeepSpeed yet (TrainingArguments.deepspeed="
                         f"{args.deepspeed!r}); train without deepspeed= or drop the callback for now")
    sharded = model is not None and any(is_dtensor(p) for p in model.parameters())
    fsdp = is_initialized() and getattr(AcceleratorState(), "fsdp_plugin", None) is not None
    if getattr(args, "fsdp", None) or fsdp or sharded:
        raise ValueError("LazyCheckpointCallback does not support sharded models under the Trainer yet "
                         f"(TrainingArguments.fsdp={getattr(args, 'fsdp', None)!r}, an FSDP plugin: {fsdp}, DTensor "
                         f"parameters: {sharded}); train with DDP (no FSDP), or use LazyCheckpointHook with "
                         "Accelerate's FSDP2 plugin in a loop of your own (docs/accelerate.md)")


def _scaler(optimizer: Any) -> Any:
    """The AMP gradient scaler (fp16): callbacks get no accelerator, but its optimizer wrapper holds the scaler."""
    return getattr(optimizer, "scaler", None)


def _saves_best(args: Any) -> bool:
    return str(getattr(args.save_strategy, "value", args.save_strategy)) == "best"


def _record_best(args: Any, state: Any, metrics: dict[str, float]) -> bool:
    """The Trainer's own best-metric rule (``_determine_best_metric``), applied first under
    ``save_strategy="best"``: the Trainer then finds no new best, so it does not save synchronously. (Callbacks
    that compare with the best metric in their own ``on_evaluate``, as ``EarlyStoppingCallback`` does, go before
    this one in ``callbacks=``: docs/transformers.md.)"""
    name = args.metric_for_best_model
    if name is None:
        return False
    name = name if name.startswith("eval_") else f"eval_{name}"
    if name not in metrics:
        return False  # the Trainer raises its own KeyError, naming the metrics it has
    better = np.greater if args.greater_is_better else np.less
    if state.best_metric is None:
        state.best_metric = float("-inf") if args.greater_is_better else float("inf")
    if not better(metrics[name], state.best_metric):
        return False
    state.best_metric = metrics[name]
    state.best_global_step = state.global_step
    return True


__all__ = ["LazyCheckpointCallback"]
