"""Hugging Face Accelerate integration: ``LazyCheckpointHook`` translates the events of a plain Accelerate loop into
calls on the policy layer (:mod:`lazyckpt.policy`); what it reads from and restores into Accelerate's objects, and
the torch hooks that call its :class:`~lazyckpt.policy.UpdateLoop`, are in ``_accelerate_state``. A step is one
real optimizer update (not a micro-batch, not an update AMP skipped).

Example (docs/accelerate.md has the whole loop, and where to start it on resume):
    >>> hook = LazyCheckpointHook("runs/ckpt", every_n_steps=100, keep_last_k=3)      # doctest: +SKIP
    >>> model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)            # doctest: +SKIP
    >>> step = hook.register(accelerator).resume()                                    # doctest: +SKIP
    >>> hook.close()            # after the loop, before accelerator.end_training()   # doctest: +SKIP

A checkpoint of step N is the state after iteration N (docs/accelerate.md, "The capture rule"): RNG and loader
positions are read at the optimizer post-hook, the request goes out at the first forward afterwards, and the
barrier is the inner optimizer's pre-hook before the next update.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from lazyckpt.config import normalize_dirpath
from lazyckpt.engine import LazyCheckpointer
from lazyckpt.errors import CheckpointMismatchError
from lazyckpt.pending import PendingCheckpoint
from lazyckpt.policy import CheckpointSession, Reporter, SessionOptions, UpdateLoop, project_defaults
from lazyckpt.tree.preflight import check_storable

from . import _compat
from ._accelerate_rollback import AccelerateRollback
from ._accelerate_state import Boundary, PreparedRun

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger(__name__)


class LazyCheckpointHook:
    """Lazy asynchronous checkpoints of an Accelerate training loop.

    Args:
        dirpath: the checkpoint directory (one ``step-NNNNNNN/`` per checkpoint) or an fsspec URL (docs/remote.md).
            None: ``<project_dir>/lazyckpt`` of the accelerator's ``ProjectConfiguration``.
        every_n_steps: request a checkpoint after every n-th optimizer update; None: only on :meth:`save`.
        keep_last_k: keep only the newest k checkpoints. None: the project's ``total_limit``, else keep all.
        **options: the fields of ``lazyckpt.policy.SessionOptions`` (``remote``, ``max_rollbacks``, ...) and the
            other ``LazyCheckpointer`` options (``host_buffer_bytes``, ``keep_in_memory``, ``fsync``, ...);
            ``rank`` and ``world_size`` come from the accelerator.

    Raises:
        ValueError: an invalid option (the message names it).
    """

    def __init__(self, dirpath: str | os.PathLike[str] | None = None, *, every_n_steps: int | None = None,
                 keep_last_k: int | None = None, **options: Any) -> None:
        self.options, _ = SessionOptions.from_keywords(options, owner="LazyCheckpointHook", keep_last_k=keep_last_k,
                                                       source="the accelerator in hook.register()")
        self.dirpath = normalize_dirpath(dirpath) if dirpath is not None else None
        self.every_n_steps = every_n_steps
        self._run: PreparedRun | None = None
        self._loop: UpdateLoop[Boundary] = UpdateLoop(every_n_steps)

    # --- the public surface ---------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer updates counted so far (restored by :meth:`resume`)."""
        return self._loop.step

    @property
    def checkpointer(self) -> LazyCheckpointer:
        """The engine (its ``stats`` list the committed checkpoints); exists after :meth:`register`."""
        if self._loop.session is None:
            raise RuntimeError("call hook.register(accelerator) before using hook.checkpointer")
        return self._loop.session.engine

    @property
    def stalls(self) -> dict[int, float]:
        """Training-thread seconds each checkpoint cost, by step: capture, request and barrier wait."""
        return {} if self._loop.session is None else self._loop.session.stalls

    def register(self, accelerator: Accelerator) -> LazyCheckpointHook:
        """Hook every prepared model and optimizer of ``accelerator``; call it after ``accelerator.prepare``.

        Also hooks ``accelerator.save_state()``/``load_state()`` (they drain pending copies and carry the step).

        Raises:
            RuntimeError: already registered, or nothing was prepared.
            ValueError: an unsupported distributed type or option, or no directory (nor ``project_dir``).
            UnsupportedValueError: a registered ``state_dict()`` holds a value no checkpoint can store (its key).
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
        session = CheckpointSession(self.dirpath, self.options, rank=accelerator.process_index,
                                    world_size=accelerator.num_processes)
        self._loop.start(session, save=lambda boundary: run.request(session, boundary),
                         reporter=Reporter(logger.info, metrics=accelerator.log),
                         rollback=AccelerateRollback(session, run))
        self._run = run
        run.hook_into(self._loop)
        return self

    def resume(self, path: str | os.PathLike[str] | None = None) -> int:
        """Restore the newest committed checkpoint (or ``path``) into everything registered; returns its step.

        Call it on every process, after :meth:`register`. Returns 0 and changes nothing when there is no
        committed checkpoint, or when it does not fit. docs/accelerate.md says where to start the loop.

        Raises:
            CheckpointMismatchError: written for other models, optimizers, ... (the message lists each).
            CheckpointCorruptError: a checksum does not match (the message names the file and tensor).
            CheckpointNotFoundError: ``path`` is not a committed checkpoint.
        """
        run = self._require_registered("resume")
        self._loop.drain()  # a lazy copy may still read the live tensors the restore overwrites
        session = self._loop.session
        resolved = os.fspath(path) if path is not None else run.newest(session)
        if resolved is None:
            logger.info("lazyckpt: no committed checkpoint in %s; starting from step 0", self.dirpath)
            return 0
        step = run.restore_from(resolved, verify=session.engine.config.verify_on_load, load=session.load)["step"]
        self._loop.resumed(step, resolved)
        return step

    def save(self) -> PendingCheckpoint | None:
        """Request a checkpoint of the current step now (lazily); call it between iterations, on every process.

        Returns:
            The handle (``wait()`` gives the committed directory); the same one when this step was requested
            already; None when this step's checkpoint was committed by an earlier run (after :meth:`resume`).
        """
        return self._loop.request(self._require_registered("save").boundary)

    def rollback(self) -> int | None:
        """Restore everything registered from the newest snapshot before this iteration's update, because its
        loss is nan/inf; returns the step restored, or None when there is none (docs/rollback.md). Call it in
        that iteration, before or after ``optimizer.step()``, on every process, then go on with the next batch.

        Raises:
            RollbackLimitError: more than ``max_rollbacks`` rollbacks in a row without a newer good checkpoint.
        """
        self._require_registered("rollback")
        return self._loop.roll_back()

    def close(self) -> None:
        """Issue a pending request, drain every checkpoint, remove the hooks and log the run's summary (one line,
        and ``accelerator.log`` for its trackers). Idempotent.

        Call it before ``accelerator.end_training()``: multi-process commits need every process alive.
        """
        self._loop.close(release=lambda: self._run.unhook())

    def __enter__(self) -> LazyCheckpointHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, int]:
        """The step counter, for ``accelerator.save_state()`` (registered through ``register_for_checkpointing``)."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the step counter from ``accelerator.load_state()``."""
        self._loop.restart(int(state["step"]))

    # --- helpers --------------------------------------------------------------------------------------------

    def _require_registered(self, what: str) -> PreparedRun:
        if self._run is None:
            raise RuntimeError(f"call hook.register(accelerator) before hook.{what}()")
        if self._loop.closed:
            raise RuntimeError(f"this LazyCheckpointHook is closed; cannot {what}()")
        return self._run

    def __repr__(self) -> str:
        return (f"LazyCheckpointHook({self.dirpath!r}, every_n_steps={self.every_n_steps}, step={self.step}, "
                f"registered={self._run is not None}, closed={self._loop.closed})")


__all__ = ["CheckpointMismatchError", "LazyCheckpointHook"]
