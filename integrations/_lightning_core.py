"""``LazyCheckpoint`` for ``lightning`` and ``pytorch_lightning``: mixed into each namespace's ``ModelCheckpoint``,
so every decision (triggers, top-k, ``last``, file-name templates) is Lightning's own. It translates Lightning's
events into calls on the policy layer (:mod:`lazyckpt.policy`: the session, the names, the feedback);
``ModelCheckpoint``'s file operations, made lazy, are in :mod:`._lightning_files`.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
import weakref
from typing import Any, ClassVar, Literal

from typing_extensions import override

from lazyckpt.config import normalize_dirpath
from lazyckpt.engine import LazyCheckpointer
from lazyckpt.format.files import step_of_dir
from lazyckpt.policy import (NO_NAMES, CheckpointNames, CheckpointSession, EngineOptions, ResumedRng, RunFeedback,
                             SessionOptions, committed_copy, open_directories, run_directory, url_dirpath_levels)
from lazyckpt.tree.preflight import check_hyperparameters
from lazyckpt.write.stats import CheckpointStats

from . import _compat
from ._lightning_files import LazyFileOperationsMixin
from ._lightning_io import (EXTRA_KEY, per_rank_extra, request_snapshot, restore_train_rng, route_sharded_loads,
                            trainer_reporter)
from ._lightning_rollback import LightningRollback

_log = logging.getLogger(__name__)


class LazyCheckpointMixin(LazyFileOperationsMixin):
    """``ModelCheckpoint`` with lazy asynchronous saves (docs/lightning.md). Each checkpoint is a ``step-NNNNNNN/``
    directory; ModelCheckpoint's file names (``epoch=1-step=40.ckpt``, ``last.ckpt``) are links to them.

    Args:
        dirpath: where checkpoints go (default: chosen like ``ModelCheckpoint``); an fsspec URL (``s3://...``):
            every checkpoint is uploaded there, the names live in a local spool directory (``self.dirpath``).
        keep_last_k: also keep the newest k checkpoints whatever ``save_top_k`` says (keeping wins); None:
            ``save_top_k``/``save_last`` alone decide.
        host_buffer_bytes: host memory staging the lazy copies (None: one checkpoint's worth; less works, slower).
        copy_backend: how tensors are copied to host memory: ``auto``, ``cpu``, ``cuda`` or ``triton``.
        on_busy: a request while the previous checkpoint is still written: ``wait`` for it, or ``skip`` this one.
        engine_options: further ``lazyckpt.CheckpointConfig`` fields (``fsync``, ``verify_on_load``, ...).
        log_stats: send each checkpoint's stall, times and size, and the run's summary, to the trainer's loggers.
        keep_in_memory: ``True`` keeps the newest snapshot in host memory too (docs/rollback.md); ``"host"`` commits
            each checkpoint first in shared memory that outlives a crashed process, then in ``dirpath``
            (docs/memory.md).
        rollback_on_nonfinite: on a nan/inf training loss (any rank), restore model, optimizers, LR schedulers
            and AMP scaler from the newest snapshot before that step and go on (needs ``save_weights_only=False``).
        *args, **kwargs: every ``ModelCheckpoint`` argument, with its meaning, positional ones in its order
            (``LazyCheckpoint("runs/ckpt", "best-{epoch}", "val_loss")``); and ``remote``, ``remote_every_n``,
            ``remote_keep_last_k``, ``storage_options``, ``max_rollbacks`` (see ``lazyckpt.policy.SessionOptions``).

    Example:
        >>> trainer = Trainer(callbacks=[LazyCheckpoint("runs/ckpt", every_n_train_steps=50)])   # doctest: +SKIP
        >>> trainer.fit(model, ckpt_path="last")                                               # doctest: +SKIP
    """

    _namespace: ClassVar[str]
    _io_class: ClassVar[type]
    _barrier_class: ClassVar[type]

    def __init__(self, dirpath: str | os.PathLike[str] | None = None, *args: Any, keep_last_k: int | None = None,
                 host_buffer_bytes: int | None = None,
                 copy_backend: Literal["auto", "cpu", "cuda", "triton"] = "auto",
                 on_busy: Literal["wait", "skip"] = "wait", engine_options: EngineOptions | None = None,
                 log_stats: bool = True, keep_in_memory: bool | Literal["host"] = False,
                 rollback_on_nonfinite: bool = False,
                 **kwargs: Any) -> None:
        engine = {"host_buffer_bytes": host_buffer_bytes, "copy_backend": copy_backend, "on_busy": on_busy,
                  "keep_in_memory": keep_in_memory, **(engine_options or {})}
        options, kwargs = SessionOptions.from_keywords(kwargs, owner="LazyCheckpoint", source="the trainer",
                                                       keep_last_k=keep_last_k, engine=engine)
        dirpath, self.options = url_dirpath_levels(dirpath, options)  # ModelCheckpoint's names need a local dir
        super().__init__(dirpath, *args, **kwargs)  # positional ones in ModelCheckpoint's order (filename, ...)
        LightningRollback.check_options(rollback_on_nonfinite, weights_only=self.save_weights_only)
        self.rollback_on_nonfinite = rollback_on_nonfinite
        self._rollback: LightningRollback | None = None
        self.keep_last_k = keep_last_k
        self.log_stats = log_stats
        self.session: CheckpointSession | None = None
        self.stats: list[CheckpointStats] = []
        """Timings and sizes of this rank's committed checkpoints (``lazyckpt.CheckpointStats``)."""
        self._feedback = RunFeedback(self.stats)
        self._trainer_ref: Any = _no_trainer
        self._names: CheckpointNames = NO_NAMES  # outside a fit nothing is planned, requested or published
        self._resumed_rng = ResumedRng()
        self._barrier = self._barrier_class(self)

    @property
    def trainer(self) -> Any:
        return self._trainer_ref()

    @property
    def engine(self) -> LazyCheckpointer | None:
        """This rank's engine while fitting (None before ``setup`` and after ``teardown``)."""
        return None if self.session is None else self.session.engine

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the callbacks before setup(); the session and hooks are per-process, made in setup().
        state = self.__dict__.copy()
        state.update(session=None, _trainer_ref=_no_trainer, _names=NO_NAMES, _rollback=None)
        return state

    # --- setup and teardown ------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        _compat.refuse_unsupported_strategy(self._namespace, trainer.strategy)
        in_process = self.options.engine["keep_in_memory"] is True  # the host level is a directory: any strategy
        _compat.refuse_sharded_memory_level(trainer.strategy, keep_in_memory=in_process,
                                            rollback_on_nonfinite=self.rollback_on_nonfinite)
        super().setup(trainer, pl_module, stage)
        self._trainer_ref = weakref.ref(trainer)
        self._io_class.install(trainer, owner=self)
        route_sharded_loads(trainer.strategy)
        self._barrier.install(trainer, self._namespace)
        if stage == "fit":
            check_hyperparameters(pl_module, trainer.datamodule)  # fail now, not at the first save an epoch later
        if stage == "fit" and self.session is None:
            self._open(trainer, self._steps_dir(trainer, resumed_from=None))

    def _open(self, trainer: Any, steps_dir: str) -> None:
        self.session = CheckpointSession.shared(steps_dir, self.options, rank=trainer.global_rank,
                                                world_size=trainer.world_size, engine_retention=False)
        self._names = CheckpointNames(self.session, functools.partial(request_snapshot, self),
                                      lambda: getattr(self.trainer, "ckpt_path", None), names_dir=self.dirpath,
                                      feedback=self._feedback, reporter=trainer_reporter(self, self._namespace))
        trainer.strategy.barrier("lazyckpt.setup")  # rank 0 cleared crash leftovers before anyone writes

    def _steps_dir(self, trainer: Any, resumed_from: Any) -> str:
        """Where this fit's step directories go (rank 0 decides): ``dirpath``, or a run directory of its own below
        it when ``dirpath`` holds an earlier run's steps (:func:`lazyckpt.policy.run_directory`); a resume goes on
        next to the step it resumed from. With a remote level the directory stays ``dirpath`` (one remote run)."""
        if self.options.remote is not None:
            return self.dirpath
        chosen = run_directory(self.dirpath, resumed_from, taken=open_directories()) if (
            trainer.is_global_zero) else None
        return trainer.strategy.broadcast(chosen)

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        restore_train_rng(trainer, self._resumed_rng)
        if self.rollback_on_nonfinite:  # the state now is the target of a rollback before the first snapshot
            self._rollback = LightningRollback(self.session, trainer)

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            if self.session is not None:  # save_on_exception, while a run is open to save into
                super().on_exception(trainer, pl_module, exception)
                self._names.submit()
            elif _compat.would_save_on_exception(self, trainer):  # e.g. validate() after fit(): it would record a save
                _log.warning("lazyckpt: no checkpoint on %s: no lazyckpt session is open (saves happen only inside "
                             "fit())", type(exception).__name__)
        finally:
            self._close(raise_errors=False)

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        try:
            self._close(raise_errors=True)
        finally:
            super().teardown(trainer, pl_module, stage)

    def _close(self, *, raise_errors: bool) -> None:
        self._barrier.release()
        names, self._names, self.session, self._rollback = self._names, NO_NAMES, None, None
        names.close(raise_errors=raise_errors)

    # --- hooks where ModelCheckpoint decides: poll, let it decide, request ------------------------------------

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        with self._names.deciding(), warnings.catch_warnings():
            if self._rollback is not None and self._rollback.after_batch(trainer, outputs):
                return  # rolled back: ModelCheckpoint does not see the bad step, so nothing is planned or requested
            # ModelCheckpoint warns that under manual optimization it saves the state *after* the step (unless
            # the module follows its pre-step recipe: see _save_checkpoint); a lazy snapshot saves the same state.
            warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        with self._names.deciding():
            super().on_train_epoch_end(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        with self._names.deciding():
            super().on_validation_end(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_end(trainer, pl_module)
        self._names.finish(step=trainer.global_step)  # request what it planned, drain, the run's summary (rank 0)

    def wait_staged(self) -> None:
        """The barrier: return once the in-flight snapshot no longer reads the live tensors."""
        if self.session is not None:
            self.session.barrier()

    def wait(self) -> None:
        """Block until every requested checkpoint is committed (and its names are in place)."""
        self._names.poll(block=True)

    # --- RNG states ---------------------------------------------------------------------------------------------

    @override
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        checkpoint[EXTRA_KEY] = per_rank_extra(trainer)

    @override
    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        self._resumed_rng.loaded(checkpoint.get(EXTRA_KEY))
        if self.session is not None and self._names.fresh():  # setup() did not know the fit resumes: Lightning
            # loads after it. A resume of a step directory goes on next to it (today's run, today's directory).
            steps_dir = self._steps_dir(trainer, resumed_from=trainer.ckpt_path)
            if normalize_dirpath(steps_dir) != self.session.dirpath:
                self._close(raise_errors=True)  # saved nothing: leaves nothing
                self._open(trainer, steps_dir)
        if self.session is not None and trainer.ckpt_path:
            self._adopt_host_step(trainer, checkpoint.get("callbacks", {}).get(self.state_key, {}))

    def _adopt_host_step(self, trainer: Any, state: dict[str, Any]) -> None:
        """A resumed host step is committed in dirpath by now, and a clean close frees the host folder: the path
        the run shows (and protects) is its copy there, under the names its save planned (the crash came before
        they were put in place: those the saved state holds that are missing, and ``last``)."""
        copy = committed_copy(trainer.ckpt_path)
        if copy == trainer.ckpt_path:
            return
        _compat.replace_ckpt_path(trainer, copy)
        planned = [*state.get("best_k_models", {}), state.get("best_model_path"), state.get("kth_best_model_path")]
        missing = {n for n in planned if n and self.session.storage.stat(n) is None}
        self._names.adopt(step_of_dir(copy), sorted(missing | {n for n in [state.get("last_model_path")] if n}))


def _no_trainer() -> None:
    return None
