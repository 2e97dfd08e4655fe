"""``CheckpointSession``: the checkpoint policy of one training run, whatever framework drives it.

The Lightning callback and the Accelerate hook translate framework events into calls on this object; everything
they would otherwise both decide lives here or in its sibling modules: which rank writes what
(:meth:`CheckpointSession.save`), the barrier and the training-thread time each checkpoint cost
(:meth:`~CheckpointSession.barrier`, :attr:`~CheckpointSession.stalls`) and retention with steps to protect
(:meth:`~CheckpointSession.purge`). Options are validated by :class:`~lazyckpt.policy.SessionOptions`, RNG and
loader generators are found by :mod:`lazyckpt.policy.randomness`, the fit check is :mod:`lazyckpt.policy.fit`.

Example:
    >>> session = CheckpointSession("runs/ckpt", options, rank=0, world_size=1)          # doctest: +SKIP
    >>> session.save(5, replicated={"model": model.state_dict()}, per_rank={"rng": rng},  # doctest: +SKIP
    ...              optimizers=[opt])
    >>> session.barrier()             # right before the next optimizer step            # doctest: +SKIP
    >>> session.close()                                                                  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch

from lazyckpt.config import normalize_dirpath
from lazyckpt.engine import LazyCheckpointer, PendingCheckpoint
from lazyckpt.job import CheckpointStats
from lazyckpt.policy.options import SessionOptions
from lazyckpt.retention import committed_steps, steps_to_purge
from lazyckpt.storage import Storage

logger = logging.getLogger(__name__)


class CheckpointSession:
    """The engine of one process of one training run, and the policy around it.

    Args:
        dirpath: the checkpoint directory.
        options: the integration's validated options.
        rank, world_size: this process and how many write each checkpoint (from the framework).
        engine_retention: the engine applies ``keep_last_k`` after each commit; False when the caller decides
            with steps to protect (:meth:`purge`), e.g. because names keep checkpoints too.
    """

    def __init__(self, dirpath: Any, options: SessionOptions, *, rank: int, world_size: int,
                 engine_retention: bool = True) -> None:
        self.dirpath = normalize_dirpath(dirpath)
        self.options = options
        self.rank = rank
        arguments = options.engine_arguments(rank=rank, world_size=world_size, retention=engine_retention)
        # store=None: the session itself decides who writes what (rank 0 the replicated state, every rank its
        # per-rank values), so the ranks meet through the shared directory as separate states.
        self.engine = LazyCheckpointer(self.dirpath, store=None, **arguments)
        self._stalls: dict[int, float] = {}
        self._awaiting_barrier: int | None = None

    @property
    def storage(self) -> Storage:
        return self.engine.storage

    @property
    def stalls(self) -> dict[int, float]:
        """Training-thread seconds each checkpoint cost, by step: capture, request and the first barrier."""
        return dict(self._stalls)

    def save(self, step: int, *, replicated: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
             per_rank: Mapping[str, Any],
             optimizers: Iterable[torch.optim.Optimizer] = (), immutable: Iterable[Any] = (),
             started: float | None = None) -> PendingCheckpoint:
        """Request the checkpoint of ``step`` on this rank.

        ``replicated`` values are the same on every rank (a DDP model, its optimizer), so rank 0 alone writes them,
        with their ``optimizers`` and ``immutable`` tensors copied lazily; every rank writes its ``per_rank`` values
        (RNG states, loader positions) into its own file of the same checkpoint. ``replicated`` may be a function:
        then only rank 0 builds it.

        Args:
            started: when capturing this checkpoint began (``time.monotonic()``), if before this call; that time
                counts towards its stall.
        """
        started = time.monotonic() if started is None else started
        if self.rank == 0:
            shared = replicated() if callable(replicated) else replicated
            state, optimizers, immutable = {**shared, **per_rank}, list(optimizers), list(immutable)
        else:
            state, optimizers, immutable = dict(per_rank), [], []
        pending = self.engine.save(state, step=step, optimizers=optimizers, immutable=immutable)
        if not pending.skipped:
            self._awaiting_barrier = step
            self._add_stall(step, time.monotonic() - started)
        return pending

    def barrier(self) -> None:
        """Return once the in-flight snapshot no longer reads the live tensors (right before an update)."""
        started = time.monotonic()
        self.engine.wait_staged()
        if self._awaiting_barrier is not None:  # the first barrier after a request is part of its stall
            self._add_stall(self._awaiting_barrier, time.monotonic() - started)
            self._awaiting_barrier = None

    def purge(self, *, released: Collection[int] = (), protected: Collection[int] = ()) -> list[int]:
        """Delete the committed checkpoints retention lets go (rank 0; see :func:`lazyckpt.retention.steps_to_purge`):
        ``released`` ones and those beyond the newest ``keep_last_k``, never a ``protected`` one or the newest.
        Returns the steps deleted."""
        committed = list(committed_steps(self.dirpath))
        if not committed:
            return []
        doomed = steps_to_purge(committed, self.options.keep_last_k, just_committed=max(committed),
                                protected=protected, released=released)
        removed = [step for step in doomed if self.engine.remove(step)]
        for step in removed:
            logger.info("lazyckpt: removed step %d (nothing keeps it)", step)
        return removed

    def resumed(self, step: int, path: str) -> None:
        """Note that the run continues from ``step`` (restored from ``path``); warns when newer checkpoints exist,
        because saving a step that is already committed fails."""
        newer = [s for s in committed_steps(self.dirpath) if s > step]
        if newer:
            warnings.warn(f"lazyckpt: resumed {path}, but step {max(newer)} is newer in {self.dirpath}; saving a step "
                          "that is already committed fails, so move the newer checkpoints away before training on",
                          RuntimeWarning, stacklevel=3)
        logger.info("lazyckpt: resumed step %d from %s", step, path)

    def close(self) -> None:
        """Finish the checkpoints in flight and release the directory (re-raises a background failure)."""
        self.engine.close()

    def _add_stall(self, step: int, seconds: float) -> None:
        self._stalls[step] = self._stalls.get(step, 0.0) + seconds


def checkpoint_metrics(stats: CheckpointStats) -> dict[str, float]:
    """One committed checkpoint's costs as logger metrics (milliseconds of stall, seconds of background work)."""
    return {"lazyckpt/stall_ms": 1e3 * stats.stall_s, "lazyckpt/save_ms": 1e3 * stats.save_s,
            "lazyckpt/wait_ms": 1e3 * stats.wait_s, "lazyckpt/copy_s": stats.copy_s,
            "lazyckpt/flush_s": stats.flush_s, "lazyckpt/size_mb": stats.nbytes / 1e6}
