"""The one implementation behind ``LazyCheckpoint`` for ``lightning`` and for ``pytorch_lightning``.

``LazyCheckpointMixin`` is mixed into each namespace's ``ModelCheckpoint``, so every ModelCheckpoint option and
decision (triggers, top-k, ``last``, file-name templates) is Lightning's own. Only what a save *does* changes:

* ``_save_checkpoint`` requests a lazy snapshot from the engine (``LazyCheckpointer.save``) on every rank and
  returns at once. The engine copies parameters and optimizer state in the background while the next
  forward/backward runs; the barrier (``wait_staged``) runs in ``on_before_optimizer_step``.
* File names become symlinks to the step directory, created once that step is committed; removals that
  ModelCheckpoint asks for wait for the new checkpoint's commit (see ``_lightning_aliases``).
* A companion callback placed *first* in ``trainer.callbacks`` passes the barrier before any other callback can
  write parameters in place (weight averaging at validation start and train end).
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar
from weakref import proxy

import lazyckpt
from lazyckpt.config import CheckpointConfig, OnBusy
from lazyckpt.engine import LazyCheckpointer, PendingCheckpoint
from lazyckpt.errors import StepAlreadyCommittedError
from lazyckpt.format import step_dirname
from lazyckpt.job import CheckpointStats
from lazyckpt.retention import committed_steps

from ._lightning_aliases import (
    alias_step,
    aliased_steps,
    link_alias,
    resolve_step,
    steps_to_delete,
    unlink_alias,
)
from ._lightning_io import EXTRA_KEY, capture_rng, find_generators, restore_rng

logger = logging.getLogger(__name__)
_REFUSED = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy")
_WEIGHT_WRITERS = ("StochasticWeightAveraging", "WeightAveraging")
_ENGINE_OWNED = ("rank", "world_size", "keep_last_k")
_ENGINE_OBJECTS = ("storage", "backend")  # LazyCheckpointer arguments that are not CheckpointConfig fields


@dataclass(eq=False)
class _Request:
    """One lazy save of a step and the name changes that must wait for its commit."""

    step: int
    pending: PendingCheckpoint | None = None
    actions: list[tuple[str, str, int | None]] = field(default_factory=list)
    submitted: bool = False
    finished: bool = False
    skipped: bool = False


class LazyCheckpointMixin:
    """``ModelCheckpoint`` with lazy asynchronous saves (see docs/lightning.md).

    Args:
        dirpath: where checkpoints go (default: chosen like ``ModelCheckpoint``). Each checkpoint is a
            ``step-NNNNNNN/`` directory; ModelCheckpoint's file names (``epoch=1-step=40.ckpt``,
            ``last.ckpt``) are symlinks to them. ``lazyckpt.latest(dirpath)`` gives the newest.
        keep_last_k: also keep the newest k checkpoints whatever ``save_top_k`` says. A checkpoint is deleted
            only when neither keeps it (keeping wins). None: ``save_top_k``/``save_last`` alone decide.
        host_buffer_bytes, copy_backend, on_busy: the engine's options (``lazyckpt.CheckpointConfig``).
        engine_options: further ``LazyCheckpointer`` arguments (``fsync``, ``commit_timeout_s``, ``storage``, ...).
        log_stats: send each checkpoint's stall, copy and flush times and size to the trainer's loggers.
        **kwargs: every ``ModelCheckpoint`` argument (``filename``, ``monitor``, ``mode``, ``save_top_k``,
            ``save_last``, ``every_n_train_steps``, ``train_time_interval``, ``every_n_epochs``,
            ``save_on_train_epoch_end``, ``save_weights_only``, ...), with the same meaning.

    Example:
        >>> trainer = Trainer(callbacks=[LazyCheckpoint("runs/ckpt", every_n_train_steps=50)])   # doctest: +SKIP
        >>> trainer.fit(model, ckpt_path="last")                                               # doctest: +SKIP
    """

    _namespace: ClassVar[str]
    _io_class: ClassVar[type]
    _barrier_class: ClassVar[type]

    def __init__(self, dirpath: Any = None, *, keep_last_k: int | None = None, host_buffer_bytes: int | None = None,
                 copy_backend: str = "auto", on_busy: str = "wait", engine_options: dict[str, Any] | None = None,
                 log_stats: bool = True, **kwargs: Any) -> None:
        super().__init__(dirpath=dirpath, **kwargs)
        if keep_last_k is not None and (isinstance(keep_last_k, bool) or not isinstance(keep_last_k, int)
                                        or keep_last_k < 1):
            raise ValueError(f"keep_last_k={keep_last_k!r} must be a positive int or None")
        owned = sorted(set(engine_options or {}) & set(_ENGINE_OWNED))
        if owned:
            raise ValueError(f"engine_options must not set {owned}: LazyCheckpoint sets rank and world_size from "
                             "the trainer, and keep_last_k is its own argument")
        self.keep_last_k = keep_last_k
        self.engine_options = {"host_buffer_bytes": host_buffer_bytes, "copy_backend": copy_backend,
                               "on_busy": on_busy, **(engine_options or {})}
        config = {k: v for k, v in self.engine_options.items() if k not in _ENGINE_OBJECTS}
        self._on_busy = CheckpointConfig(**config).on_busy  # validates every option now, not mid-training
        self.log_stats = log_stats
        self.engine: LazyCheckpointer | None = None
        self.stats: list[CheckpointStats] = []
        """Timings and sizes of this rank's committed checkpoints (``lazyckpt.CheckpointStats``)."""
        self._trainer_ref: Any = _no_trainer
        self._requests: list[_Request] = []
        self._current: _Request | None = None
        self._aliases: dict[str, int] = {}
        self._loaded_extra: dict[str, Any] | None = None
        self._hooks: list[Any] = []
        self._barrier = self._barrier_class(self)
        self.wait_at_epoch_start = False

    @property
    def trainer(self) -> Any:
        return self._trainer_ref()

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the callbacks before setup(); the engine and hooks are per-process, made in setup().
        state = self.__dict__.copy()
        state.update(engine=None, _trainer_ref=_no_trainer, _requests=[], _current=None, _hooks=[])
        return state

    # --- setup and teardown ------------------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._refuse_unsupported(trainer)
        self._trainer_ref = weakref.ref(trainer)
        io = trainer.strategy.checkpoint_io
        if isinstance(io, self._io_class):
            io._owner = weakref.ref(self)
        else:
            trainer.strategy.checkpoint_io = self._io_class(io, owner=self)
        if self._barrier not in trainer.callbacks:
            # A new list, not insert(): Lightning is iterating over the old one while it calls setup().
            trainer.callbacks = [self._barrier, *trainer.callbacks]
        callbacks = importlib.import_module(f"{self._namespace}.callbacks")
        writers = tuple(getattr(callbacks, n) for n in _WEIGHT_WRITERS if hasattr(callbacks, n))
        self.wait_at_epoch_start = any(isinstance(cb, writers) for cb in trainer.callbacks)
        if stage == "fit" and self.engine is None:
            self.engine = LazyCheckpointer(self.dirpath, rank=trainer.global_rank, world_size=trainer.world_size,
                                           **self.engine_options)
            self._current = None
            trainer.strategy.barrier("lazyckpt.setup")  # rank 0 cleared crash leftovers before anyone writes

    def _refuse_unsupported(self, trainer: Any) -> None:
        strategies = importlib.import_module(f"{self._namespace}.strategies")
        refused = tuple(getattr(strategies, n) for n in _REFUSED if hasattr(strategies, n))
        strategy = trainer.strategy
        if isinstance(strategy, refused) or not isinstance(strategy, (strategies.SingleDeviceStrategy,
                                                                       strategies.DDPStrategy)):
            raise NotImplementedError(
                f"LazyCheckpoint does not support {type(strategy).__name__} yet: FSDP, DeepSpeed and ModelParallel "
                "checkpoints are sharded collectives that bypass its snapshot path. Supported: a single device "
                "(strategy='auto') and DDP (strategy='ddp'). Use ModelCheckpoint with those strategies.")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        if not pl_module.automatic_optimization:
            # Manual optimization calls step() after backward, so a torch pre-hook is a safe barrier there (it
            # also covers raw optimizers that bypass on_before_optimizer_step). Never in automatic mode: Lightning
            # runs forward/backward inside step(closure), after the pre-hook.
            for opt in trainer.optimizers:
                self._hooks.append(opt.register_step_pre_hook(lambda *_: self.wait_staged()))
        if self._loaded_extra is not None:
            self._restore_rng(trainer, self._loaded_extra)
            self._loaded_extra = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            super().on_exception(trainer, pl_module, exception)  # save_on_exception
            self._submit(trainer)
        finally:
            self._close(trainer, raise_errors=False)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        try:
            self._close(trainer, raise_errors=True)
        finally:
            super().teardown(trainer, pl_module, stage)

    def _close(self, trainer: Any, *, raise_errors: bool) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        engine, error = self.engine, None
        if engine is None:
            return
        try:
            self._poll(trainer, block=True)
        except BaseException as e:  # noqa: BLE001 - re-raised below or logged
            error = e
        finally:
            self.engine = None
            self._requests.clear()
            try:
                engine.close()
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is not None and raise_errors:
            raise error
        if error is not None:
            logger.error("lazyckpt: an in-flight checkpoint failed while the run was stopping: %r", error)

    # --- hooks that poll for finished checkpoints and drain them ---------------------------------------------

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._poll(trainer)
        with warnings.catch_warnings():
            # ModelCheckpoint warns that under manual optimization it saves the state *after* the step; that
            # state is exactly the consistent one a lazy snapshot wants.
            warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._submit(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._poll(trainer)
        super().on_train_epoch_end(trainer, pl_module)
        self._submit(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._poll(trainer)
        super().on_validation_end(trainer, pl_module)
        self._submit(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_end(trainer, pl_module)
        self._submit(trainer)
        self._poll(trainer, block=True)

    def wait_staged(self) -> None:
        """The barrier: return once the in-flight snapshot no longer reads the live tensors."""
        if self.engine is not None:
            self.engine.wait_staged()

    def wait(self) -> None:
        """Block until every requested checkpoint is committed (and its names are in place)."""
        self._poll(self.trainer, block=True)

    # --- RNG states ---------------------------------------------------------------------------------------------

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        checkpoint[EXTRA_KEY] = {"rng": capture_rng(find_generators(_train_loaders(trainer))),
                                 "rank": trainer.global_rank, "world_size": trainer.world_size,
                                 "version": lazyckpt.__version__}

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        extra = checkpoint.get(EXTRA_KEY)
        self._loaded_extra = extra if isinstance(extra, dict) and extra.get("rng") is not None else None

    def _restore_rng(self, trainer: Any, extra: dict[str, Any]) -> None:
        # Lightning created the train iterator (drawing from the RNGs) before on_train_start; restore the states
        # the checkpoint captured, then create the iterator again so its draws match the uninterrupted run. A
        # stateful loader already got its own state from Lightning: re-creating its iterator would lose it.
        loaders = _train_loaders(trainer)
        restore_rng(extra["rng"], find_generators(loaders))
        stateful = any(callable(getattr(dl, "load_state_dict", None)) for dl in loaders)
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if fetcher is not None and not stateful:
            iter(fetcher)

    # --- ModelCheckpoint's save, link and remove, made lazy ----------------------------------------------------

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        # Only plan here: ModelCheckpoint may save (top-k, then last) and update its own state several times in
        # one hook; the snapshot is requested once, when the hook returns (_submit), with the final state.
        step = trainer.global_step
        if self._current is None or self._current.step != step:
            self._current = _Request(step)
        if not self._current.skipped:  # a skipped step gets no names (nothing was written)
            self._aliases[filepath] = step
            self._add_action(self._current, ("link", filepath, step))
        self._last_global_step_saved = step
        self._last_checkpoint_saved = filepath

    def _link_checkpoint(self, trainer: Any, filepath: str, linkpath: str) -> None:
        step = self._aliases.get(filepath)
        if step is None or os.path.abspath(filepath) == os.path.abspath(linkpath):
            return
        self._aliases[linkpath] = step
        waiting = [r for r in (*self._requests, self._current) if r is not None and r.step == step]
        self._add_action(waiting[-1] if waiting else None, ("link", linkpath, step))

    def _remove_checkpoint(self, trainer: Any, filepath: str) -> None:
        self._aliases.pop(filepath, None)
        self._add_action(self._current, ("remove", filepath, None))

    def file_exists(self, filepath: Any, trainer: Any) -> bool:
        exists = trainer.is_global_zero and (self._fs.exists(filepath) or filepath in self._aliases)
        return trainer.strategy.reduce_boolean_decision(exists, all=False)

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        # ckpt_path="last": the newest committed checkpoint, whether or not save_last is set.
        dirpath = self._ModelCheckpoint__resolve_ckpt_dir(trainer)
        newest = lazyckpt.latest(dirpath) if dirpath and os.path.isdir(dirpath) else None
        return {newest} if newest else set()

    # --- requests and their completion ------------------------------------------------------------------------

    def _submit(self, trainer: Any) -> None:
        """Request the snapshot planned by this hook's saves; a skipped one drops its name changes."""
        request = self._current
        if request is None or request.submitted:
            return
        request.submitted = True
        request.pending = self._request(trainer, request.step)
        if request.pending is None or request.pending.skipped:
            for kind, alias, _ in request.actions:
                if kind == "link":
                    self._aliases.pop(alias, None)
            request.actions.clear()  # removals too: keep the older checkpoints the skipped one would replace
            request.finished = request.skipped = True
            return
        self._requests.append(request)
        self._poll(trainer)  # with on_busy="wait", save() may have finished the previous request

    def _request(self, trainer: Any, step: int) -> PendingCheckpoint | None:
        if self.engine is None:
            raise RuntimeError("LazyCheckpoint has no engine: it saves only while fitting, after setup()")
        busy = self._on_busy is OnBusy.SKIP and self.engine.in_flight is not None
        if self._on_busy is OnBusy.SKIP and trainer.strategy.reduce_boolean_decision(busy, all=False):
            warnings.warn(f"lazyckpt: skipped the checkpoint of step {step}: the previous one is still being "
                          "written (on_busy='skip')", RuntimeWarning, stacklevel=3)
            return None
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(self.save_weights_only)
        # DDP: the model and optimizer are replicated, so rank 0 writes them once; every rank writes its RNG states.
        state = checkpoint if trainer.is_global_zero else {EXTRA_KEY: checkpoint.get(EXTRA_KEY)}
        frozen = [p for p in trainer.lightning_module.parameters() if not p.requires_grad]
        try:
            return self.engine.save(state, step=step, optimizers=trainer.optimizers, immutable=frozen)
        except StepAlreadyCommittedError as e:
            warnings.warn(f"lazyckpt: not saving step {step}: {e}", RuntimeWarning, stacklevel=3)
            return None

    def _add_action(self, request: _Request | None, action: tuple[str, str, int | None]) -> None:
        if request is not None and not request.finished:
            request.actions.append(action)
        elif self.trainer is not None and self.trainer.is_global_zero:
            self._publish(self.trainer, _Request(-1, actions=[action], finished=True))

    def _poll(self, trainer: Any, *, block: bool = False) -> None:
        """Finish the requests that are committed (all of them when ``block``), oldest first."""
        while self._requests:
            request = self._requests[0]
            if not block and not request.pending.done():
                return
            self._requests.pop(0)
            request.finished = True
            if request.pending.failed:
                continue  # the engine raises the failure once, at its next call; its name changes are dropped
            if request.pending.wait() is None:  # None when the request was skipped
                continue
            stats = next((s for s in reversed(self.engine.stats) if s.step == request.step), None)
            if stats is not None:
                self.stats.append(stats)
            if trainer is not None and trainer.is_global_zero:
                self._publish(trainer, request, stats)

    def _publish(self, trainer: Any, request: _Request, stats: CheckpointStats | None = None) -> None:
        """Rank 0, after a commit: put names in place, drop replaced ones, delete what nothing keeps, report."""
        unnamed: set[int] = set()
        for kind, alias, step in request.actions:
            old = alias_step(alias) if kind == "link" else unlink_alias(alias)
            if kind == "link":
                link_alias(alias, os.path.join(self.dirpath, step_dirname(step)))
            if old is not None and old != step:
                unnamed.add(old)
        self._delete_unkept(trainer, unnamed)
        if stats is not None and self.log_stats:
            metrics = {"lazyckpt/stall_ms": 1e3 * stats.stall_s, "lazyckpt/save_ms": 1e3 * stats.save_s,
                       "lazyckpt/wait_ms": 1e3 * stats.wait_s, "lazyckpt/copy_s": stats.copy_s,
                       "lazyckpt/flush_s": stats.flush_s, "lazyckpt/size_mb": stats.nbytes / 1e6}
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=request.step)
        if request.pending is not None:
            for lg in trainer.loggers:
                lg.after_save_checkpoint(proxy(self))

    def _delete_unkept(self, trainer: Any, unnamed: set[int]) -> None:
        if not unnamed and self.keep_last_k is None:
            return
        protected = aliased_steps(self.dirpath) | set(self._aliases.values())
        committed = list(committed_steps(self.dirpath))
        protected |= {r.step for r in self._requests} | set(sorted(committed)[-1:])  # never the newest
        resumed = resolve_step(trainer.ckpt_path, self.dirpath)  # never delete what this run resumed from
        if resumed is not None:
            protected.add(resumed)
        for step in steps_to_delete(committed, unnamed, protected, self.keep_last_k):
            if self.engine.remove(step):
                logger.info("lazyckpt: removed step %d (no name or keep_last_k keeps it)", step)


def _no_trainer() -> None:
    return None


def _train_loaders(trainer: Any) -> list[Any]:
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    return list(combined.flattened) if combined is not None else []
