"""``ModelCheckpoint``'s own file operations (save, link, remove, exists, find ``last``) made lazy: a save only plans
the step's snapshot and its file name; the names follow when the snapshot is committed
(:class:`~lazyckpt.policy.CheckpointNames`). Mixed into ``LazyCheckpoint`` by :mod:`._lightning_core`.
"""

from __future__ import annotations

import os
from typing import Any

from typing_extensions import override

from lazyckpt.policy import CheckpointNames, RunFeedback, SessionOptions, resume_target

from . import _compat


class LazyFileOperationsMixin:
    """The ``ModelCheckpoint`` methods that touch files, translated into calls on the run's names."""

    _names: CheckpointNames  # policy.NO_NAMES outside a fit
    _feedback: RunFeedback
    options: SessionOptions
    _verbose_at_commit: bool = False

    @override
    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        # Only plan here: ModelCheckpoint may save (top-k, then last) and update its own state several times in
        # one hook; the snapshot is requested once, when the hook returns (_submit), with the final state.
        self._names.plan(trainer.global_step, filepath)
        _compat.record_saved(self, trainer.global_step, filepath)
        self._announce_at_commit(trainer, filepath)
        if _compat.swaps_in_pre_step_weights(trainer.lightning_module):
            # ModelCheckpoint's manual-optimization recipe: the pre-step weights are in place for this save only
            # and are written back right after it, so request now and let the copy finish before that.
            self._names.submit()
            self.wait_staged()

    @override
    def _link_checkpoint(self, trainer: Any, filepath: str, linkpath: str) -> None:
        self._names.copy(filepath, linkpath)
        self._announce_at_commit(trainer, linkpath)

    @override
    def _update_best_and_save(self, current: Any, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        # ModelCheckpoint(verbose=True) says "saving model to ..." here, at the request; ours comes at the commit.
        self._verbose_at_commit, self.verbose = self.verbose, False
        try:
            super()._update_best_and_save(current, trainer, monitor_candidates)
        finally:
            self.verbose, self._verbose_at_commit = self._verbose_at_commit, False

    def _announce_at_commit(self, trainer: Any, name: str) -> None:
        if self.verbose or self._verbose_at_commit:
            score = self.best_k_models.get(name) if self.monitor else None  # now: top-k may evict it before the commit
            metric = "" if score is None else f", {self.monitor!r} {float(score):0.5f}"
            self._feedback.announce(trainer.global_step, f"Epoch {trainer.current_epoch:d}, global step "
                                                         f"{trainer.global_step:d}: saved {name!r} (committed{metric})")

    @override
    def _remove_checkpoint(self, trainer: Any, filepath: str) -> None:
        self._names.drop(filepath)

    @override
    def file_exists(self, filepath: Any, trainer: Any) -> bool:
        exists = trainer.is_global_zero and (self._names.taken(filepath)
                                             or _compat.model_checkpoint_fs(self).exists(filepath))
        return trainer.strategy.reduce_boolean_decision(exists, all=False)

    @override
    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        # ckpt_path="last": the newest committed checkpoint, whether or not save_last is set, or ModelCheckpoint's
        # last*.ckpt file when that is newer (a run switching to LazyCheckpoint resumes, never starts over).
        dirpath = _compat.resolve_checkpoint_dir(self, trainer)
        others = super()._find_last_checkpoints(trainer) if dirpath else set()
        newest = resume_target(os.fspath(dirpath), self.options, others) if dirpath else None
        if newest in others and self.save_last:
            self.last_model_path = newest  # the next last.ckpt replaces that file instead of becoming last-v1.ckpt
        return {newest} if newest else set()
