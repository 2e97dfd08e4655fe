"""``LazyCheckpoint(rollback_on_nonfinite=True)``: translates Lightning events into the policy layer's
:class:`~lazyckpt.policy.StepVote` and :class:`~lazyckpt.policy.RollbackPolicy` (which decide), and their
outcome back into Lightning's objects.

The loss checked is what ``on_train_batch_end`` receives: the loss ``training_step`` returned (under manual
optimization its return value: a tensor, or a dict with a ``"loss"`` entry; return the value you passed to
``manual_backward``). The decision is taken when an optimizer step has happened (``global_step`` moved), the same
batch on every rank: with gradient accumulation, a non-finite loss in any micro-batch of the window makes its
step bad. Every rank votes (any non-finite loss rolls back all of them); rank 0 reads the target and, with DDP,
broadcasts it, since the replicated state is saved by rank 0 only.

Restored: the LightningModule's ``state_dict``, the optimizers, the LR schedulers and the precision plugin (AMP
scaler). Not restored, on purpose: the loops (``global_step`` keeps counting, the next batch comes next), the
callbacks and the RNG states (the data order goes on as if the lost batches had been seen).
"""

from __future__ import annotations

import warnings
from typing import Any

from lazyckpt.policy import CheckpointSession, Restored, RollbackPolicy, StepVote


class LightningRollback:
    """The rollback side of one ``LazyCheckpoint`` during one ``fit``, made at the start of training: the state then
    is the target of a rollback before the first snapshot."""

    def __init__(self, session: CheckpointSession, trainer: Any) -> None:
        share = (lambda restored: trainer.strategy.broadcast(restored, src=0)) if trainer.world_size > 1 else None
        self.policy = RollbackPolicy.of_session(session, is_source=trainer.is_global_zero, share=share)
        self.vote = StepVote(trainer.global_step)
        if self.policy.is_source:
            self.policy.remember_start(trainer.global_step, training_state(trainer))

    @staticmethod
    def check_options(rollback_on_nonfinite: bool, *, weights_only: bool) -> None:
        """Raise at construction when the callback's options cannot roll back."""
        if rollback_on_nonfinite and weights_only:
            raise ValueError("rollback_on_nonfinite=True needs save_weights_only=False: a rollback restores the "
                             "optimizers, LR schedulers and scaler too")

    def after_batch(self, trainer: Any, outputs: Any) -> bool:
        """Vote on this batch's loss; at an optimizer step, roll back if any rank saw a non-finite one.

        Returns True when the step was rolled back (it must not be checkpointed).
        """
        mine = self.vote.observe(outputs, trainer.global_step)
        if mine is None:
            return False  # inside an accumulation window: the step decides, on every rank at the same batch
        if not trainer.strategy.reduce_boolean_decision(mine, all=False):
            self.policy.drop_start_once_committed()
            return False
        restored = self.policy.restore(trainer.global_step, live=training_state(trainer),
                                       load=lambda state: load_training_state(trainer, state),
                                       optimizers=trainer.optimizers)
        self._report(trainer, restored)
        return True

    def _report(self, trainer: Any, restored: Restored) -> None:
        warnings.warn(f"lazyckpt: the training loss is non-finite at step {restored.bad_step}; rolled back to the "
                      f"snapshot of step {restored.step} (from {restored.source}); training continues with the next "
                      "batch", RuntimeWarning, stacklevel=4)
        for lg in trainer.loggers:
            lg.log_metrics({"lazyckpt/rollbacks": float(self.policy.total)}, step=restored.bad_step)


def training_state(trainer: Any) -> dict[str, Any]:
    """What a rollback restores, under the keys of a Lightning checkpoint (no user hooks run)."""
    strategy, precision = trainer.strategy, trainer.precision_plugin
    state = {"state_dict": strategy.lightning_module_state_dict(),
             "optimizer_states": [strategy.optimizer_state(o) for o in trainer.optimizers],
             "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]}
    scaler = precision.state_dict()
    if scaler:
        state[type(precision).__qualname__] = scaler
    return state


def load_training_state(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Load model, optimizers, LR schedulers and AMP scaler from a Lightning checkpoint dict."""
    strategy, precision = trainer.strategy, trainer.precision_plugin
    strategy.load_model_state_dict(checkpoint, strict=trainer.lightning_module.strict_loading)
    strategy.load_optimizer_state_dict(checkpoint)
    for config, saved in zip(trainer.lr_scheduler_configs, checkpoint["lr_schedulers"], strict=True):
        config.scheduler.load_state_dict(saved)
    if type(precision).__qualname__ in checkpoint:
        precision.load_state_dict(checkpoint[type(precision).__qualname__])
