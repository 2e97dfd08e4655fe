"""Hugging Face Accelerate integration: lazy checkpoints from one ``hook.register(accelerator)``.

``LazyCheckpointHook`` translates the events of a plain Accelerate loop into calls on the run's
:class:`~lazyckpt.policy.CheckpointSession`; what it reads from and restores into Accelerate's objects is in
``_accelerate_state``. A step is one real optimizer update: gradient-accumulation micro-batches and updates
skipped by mixed precision do not count.

Example:
    >>> hook = LazyCheckpointHook("runs/ckpt", every_n_steps=100, keep_last_k=3)      # doctest: +SKIP
    >>> model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)            # doctest: +SKIP
    >>> hook.register(accelerator)                                                    # doctest: +SKIP
    >>> start_epoch = hook.resume() // len(dl)                                        # doctest: +SKIP
    >>> for epoch in range(start_epoch, epochs):                                      # doctest: +SKIP
    ...     for batch in dl:
    ...         accelerator.backward(model(batch).loss)
    ...         opt.step(); sched.step(); opt.zero_grad()
    >>> hook.close()                                                                  # doctest: +SKIP
    >>> accelerator.end_training()                                                    # doctest: +SKIP

A checkpoint of step N is the state after iteration N (docs/accelerate.md, "The capture rule"): RNG and loader
positions are read at the optimizer post-hook, the request goes out at the first forward afterwards, and the
barrier is the inner optimizer's pre-hook before the next update.
"""

from __future__ import annotations

import logging
import os
import warnings
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from lazyckpt import CheckpointMismatchError, LazyCheckpointer, PendingCheckpoint
from lazyckpt.config import normalize_dirpath
from lazyckpt.policy import CheckpointSession, SessionOptions, StepCounter, project_defaults
from lazyckpt.preflight import check_storable

from . import _compat
from ._accelerate_rollback import AccelerateRollback
from ._accelerate_state import Boundary, PreparedRun

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger(__name__)


class LazyCheckpointHook:
    """Lazy asynchronous checkpoints of an Accelerate training loop.

    Args:
        dirpath: directory of the checkpoints (one ``step-NNNNNNN/`` per committed checkpoint), or an fsspec
            URL (``s3://bucket/run``: a local spool directory, every checkpoint uploaded; docs/remote.md). None:
            ``<project_dir>/lazyckpt`` of the accelerator's ``ProjectConfiguration`` (set in :meth:`register`).
        every_n_steps: request a checkpoint after every n-th optimizer update; None: only on :meth:`save`.
        keep_last_k: keep only the newest k committed checkpoints. None: the ``ProjectConfiguration``'s
            ``total_limit`` when set, else keep all.
        **options: ``max_rollbacks`` (see :meth:`rollback`) and the other :class:`~lazyckpt.LazyCheckpointer`
            options (``host_buffer_bytes``, ``copy_backend``, ``on_busy``, ``keep_in_memory``, ``verify_on_load``,
            ``fsync``, ``storage``, ``remote``, ``storage_options``, ...). ``rank`` and ``world_size`` come from the
            accelerator. With ``remote``, :meth:`resume` takes the newest checkpoint of either level.

    Raises:
        ValueError: an invalid option (the message names it).
    """

    def __init__(self, dirpath: str | os.PathLike[str] | None = None, *, every_n_steps: int | None = None,
                 keep_last_k: int | None = None, **options: Any) -> None:
        self._counter = StepCounter(every_n_steps)
        ours, engine = SessionOptions.split(options)
        self.options = SessionOptions(owner="LazyCheckpointHook", source="the accelerator in hook.register()",
                                      keep_last_k=keep_last_k, engine=engine, **ours)
        self.dirpath = normalize_dirpath(dirpath) if dirpath is not None else None
        self.every_n_steps = every_n_steps
        self._session: CheckpointSession | None = None
        self._run: PreparedRun | None = None
        self._rollback: AccelerateRollback | None = None
        self._handles: list[Any] = []
        self._closed = False
        self._boundary: Boundary | None = None
        self._pending: PendingCheckpoint | None = None
        self._requested_step: int | None = None
        self._warned_no_forward = False

    # --- the public surface ---------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer updates counted so far (restored by :meth:`resume`)."""
        return self._counter.step

    @property
    def checkpointer(self) -> LazyCheckpointer:
        """The engine (its ``stats`` list the committed checkpoints); exists after :meth:`register`."""
        if self._session is None:
            raise RuntimeError("call hook.register(accelerator) before using hook.checkpointer")
        return self._session.engine

    @property
    def stalls(self) -> dict[int, float]:
        """Training-thread seconds each checkpoint cost, by step: capture, request and barrier wait."""
        return {} if self._session is None else self._session.stalls

    def register(self, accelerator: Accelerator) -> LazyCheckpointHook:
        """Hook every prepared model and optimizer of ``accelerator``; call it after ``accelerator.prepare``.

        Also registers Accelerate's ``save_state``/``load_state`` pre-hooks (they drain pending copies) and
        ``register_for_checkpointing(self)``, so ``accelerator.save_state()``/``load_state()`` carry the step.

        Raises:
            RuntimeError: already registered, or nothing was prepared.
            ValueError: a distributed type or option this hook does not support, or no directory (``dirpath``
                and the project's ``project_dir`` both None).
            UnsupportedValueError: a registered object's ``state_dict()`` holds a value no checkpoint can store
                (found now, before training, with its key path).
        """
        if self._run is not None:
            raise RuntimeError("this LazyCheckpointHook is registered already; create one hook per Accelerator")
        _compat.refuse_unsupported_accelerator(accelerator)
        project = accelerator.project_configuration
        self.dirpath, self.options = project_defaults(
            self.dirpath, self.options, project_dir=project.project_dir, total_limit=project.total_limit,
            missing="pass dirpath, or Accelerator(project_config=ProjectConfiguration(project_dir=...))")
        run = PreparedRun.of(accelerator, self)
        check_storable(run.replicated(), what="the state LazyCheckpointHook saves", fix="return plain data "
                       "(numbers, strings, lists, dicts, tensors) from the state_dict() of what holds it")
        self._session = CheckpointSession(self.dirpath, self.options, rank=accelerator.process_index,
                                          world_size=accelerator.num_processes)
        self._run = run
        for index, optimizer in enumerate(self._run.optimizers):
            self._handles.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
            self._handles.append(optimizer.register_step_post_hook(partial(self._after_optimizer_step, index)))
        for model in self._run.models:
            self._handles.append(model.register_forward_pre_hook(self._on_forward))
        # Both first issue a request waiting for its iteration's end and pass the barrier: load_state overwrites
        # the live tensors a lazy copy may still read.
        self._handles.append(accelerator.register_save_state_pre_hook(lambda *_: self._drain_copies()))
        self._handles.append(accelerator.register_load_state_pre_hook(lambda *_: self._drain_copies()))
        accelerator.register_for_checkpointing(self)
        self._rollback = AccelerateRollback(self._session, self._run)
        self._rollback.remember_start(self.step)
        return self

    def resume(self, path: str | os.PathLike[str] | None = None) -> int:
        """Restore the newest committed checkpoint (or ``path``) into everything registered; returns its step.

        Call it on every process, after :meth:`register`. Returns 0 and changes nothing when ``dirpath`` holds
        no committed checkpoint. Nothing is changed either when the checkpoint does not fit.

        Raises:
            CheckpointMismatchError: the checkpoint was written for other models, optimizers, schedulers,
                registered objects, dataloaders or another number of processes (the message lists each).
            CheckpointCorruptError: a checksum does not match (the message names the file and tensor).
            CheckpointNotFoundError: ``path`` is not a committed checkpoint.
        """
        self._require_registered("resume")
        self._drain_copies()
        resolved = os.fspath(path) if path is not None else self._run.newest(self._session)
        if resolved is None:
            logger.info("lazyckpt: no committed checkpoint in %s; starting from step 0", self.dirpath)
            return 0
        step = self._run.restore_from(resolved, verify=self._session.engine.config.verify_on_load,
                                      load=self._session.load)["step"]
        self._counter.restart(step)
        self._requested_step, self._pending, self._boundary = step, None, None
        self._session.resumed(step, resolved)
        self._rollback.remember_start(step)
        return step

    def save(self) -> PendingCheckpoint | None:
        """Request a checkpoint of the current step now (lazily); call it between iterations, on every process.

        Returns:
            The handle (``wait()`` gives the committed directory); the same one when this step was requested
            already; None when this step's checkpoint was committed by an earlier run (after :meth:`resume`).
        """
        run = self._require_registered("save")
        if self._boundary is None and self._requested_step != self.step:
            self._boundary = run.boundary(self.step)
        if self._boundary is not None:
            self._issue()
        return self._pending

    def rollback(self) -> int | None:
        """Restore models, optimizers, schedulers, scaler and registered objects from the newest snapshot
        before this iteration's update, because its loss is non-finite; returns the step restored, or None.

        Call it in the iteration whose loss is nan/inf, before or after ``optimizer.step()``, then go on with the
        next batch (``hook.step`` keeps counting). The snapshot comes from memory (``keep_in_memory=True``), else
        from the newest committed checkpoint on disk, else (``keep_in_memory=True``) the state at ``register``
        or ``resume``; None when there is none. With several processes, call it on every process together.

        Example:
            >>> if not torch.isfinite(loss):          # doctest: +SKIP
            ...     hook.rollback(); continue

        Raises:
            RollbackLimitError: more than ``max_rollbacks`` rollbacks in a row without a newer good checkpoint.
        """
        self._require_registered("rollback")
        bad_step = self._rollback.bad_step(self.step)
        if self._boundary is not None and self._boundary.step == bad_step:
            self._boundary = None  # the bad update's request is never issued
        return self._rollback.roll_back(bad_step)

    def close(self) -> None:
        """Issue a pending request, drain every checkpoint and remove the hooks. Idempotent.

        Call it before ``accelerator.end_training()``: multi-process commits need every process alive.
        """
        if self._closed or self._session is None:
            self._closed = True
            return
        self._closed = True
        try:
            if self._boundary is not None:
                self._issue()
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self._session.close()

    def __enter__(self) -> LazyCheckpointHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, int]:
        """The step counter, for ``accelerator.save_state()`` (registered through ``register_for_checkpointing``)."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the step counter from ``accelerator.load_state()``."""
        self._counter.restart(int(state["step"]))
        self._boundary, self._requested_step = None, None

    # --- framework events -----------------------------------------------------------------------------------

    def _after_optimizer_step(self, index: int, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        before = self.step
        if self._counter.updated(index, optimizers=len(self._run.prepared_optimizers)):
            self._boundary = self._run.boundary(self.step)
        if self.step != before:
            self._rollback.on_step()

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        # The first forward after the step: the loop's scheduler step and other end-of-iteration updates are done.
        self._rollback.stepped = False
        if self._boundary is not None:
            self._issue()

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._boundary is not None:
            if not self._warned_no_forward:
                self._warned_no_forward = True
                warnings.warn("lazyckpt: no forward of a prepared model ran between two optimizer steps, so the "
                              "checkpoint was requested at the next step and copied without overlap",
                              RuntimeWarning, stacklevel=2)
            self._issue()
        self._session.barrier()

    # --- helpers --------------------------------------------------------------------------------------------

    def _issue(self) -> None:
        boundary, self._boundary = self._boundary, None
        self._pending = self._session.save(boundary.step, replicated=self._run.replicated,
                                           per_rank=boundary.per_process, optimizers=self._run.optimizers,
                                           immutable=self._run.models, started=boundary.started)
        self._requested_step = boundary.step

    def _drain_copies(self) -> None:
        """Issue a request waiting for its iteration's end, then pass the barrier of the one in flight."""
        self._require_registered("drain")
        if self._boundary is not None:
            self._issue()
        self._session.barrier()

    def _require_registered(self, what: str) -> PreparedRun:
        if self._run is None:
            raise RuntimeError(f"call hook.register(accelerator) before hook.{what}()")
        if self._closed:
            raise RuntimeError(f"this LazyCheckpointHook is closed; cannot {what}()")
        return self._run

    def __repr__(self) -> str:
        return (f"LazyCheckpointHook({self.dirpath!r}, every_n_steps={self.every_n_steps}, step={self.step}, "
                f"registered={self._run is not None}, closed={self._closed})")


__all__ = ["CheckpointMismatchError", "LazyCheckpointHook"]
