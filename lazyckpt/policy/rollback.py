"""Roll back to the newest good snapshot when the loss goes non-finite: the framework-neutral policy.

Adapters (the Lightning callback, the Accelerate hook, a plain loop) translate *when* (the loss of a step is nan or
inf, agreed across ranks with the framework's collective) and how a state goes back into live objects. This
module decides *what*:

* the snapshot of the bad step itself is discarded, in memory and on disk (:meth:`LazyCheckpointer.discard`
  fails it through the job's state machine and its discard (:class:`~lazyckpt.write.commit.JobEnds`), or
  removes it once committed);
* the target is the newest snapshot taken strictly before the bad step: a request still in flight is finished
  first, then the memory level is read (``keep_in_memory=True``; copied straight into the live tensors when the
  adapter passes them), else the newest committed checkpoint on disk,
  else the state remembered when training started;
* a run that keeps failing stops: more than ``max_rollbacks`` rollbacks without a newer good checkpoint in
  between raise :class:`~lazyckpt.errors.RollbackLimitError`.

Example (a plain PyTorch loop):
    >>> policy = RollbackPolicy(ckpt, max_rollbacks=3)                                   # doctest: +SKIP
    >>> policy.remember_start(0, {"model": model.state_dict(), "opt": opt.state_dict()})  # doctest: +SKIP
    >>> if is_nonfinite(loss):                                                           # doctest: +SKIP
    ...     restored = policy.roll_back(bad_step=step, into={"model": model.state_dict(), "opt": opt.state_dict()})
    ...     model.load_state_dict(restored.state["model"]); opt.load_state_dict(restored.state["opt"])
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lazyckpt.errors import NothingToRollBackTo, RollbackLimitError
from lazyckpt.format.catalog import committed_steps
from lazyckpt.policy.options import check_max_rollbacks
from lazyckpt.read.load import load

if TYPE_CHECKING:
    from lazyckpt.engine import LazyCheckpointer
    from lazyckpt.policy.session import CheckpointSession

logger = logging.getLogger(__name__)


def is_nonfinite(loss: Any) -> bool:
    """True when ``loss`` (a tensor, a number, or a mapping with a ``"loss"`` entry) holds a nan or an inf.

    ``None`` (a skipped step) and values without a loss are finite: there is nothing to roll back for.
    """
    if isinstance(loss, dict):
        loss = loss.get("loss")
    if isinstance(loss, torch.Tensor):
        return bool(not torch.isfinite(loss.detach()).all())
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return not math.isfinite(loss)
    return False


class StepVote:
    """This rank's vote on the step being trained: did any of its micro-batches have a non-finite loss?

    With gradient accumulation several batches make one step; the decision is taken once the step completed
    (the step counter moved), at the same batch on every rank, so ranks can agree with one collective.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self._bad = False

    def observe(self, loss: Any, step: int) -> bool | None:
        """Record one batch's ``loss``; once ``step`` moved past the last decision, return this rank's vote for
        the completed step (True: roll back) and start the next one; None while the step is still open."""
        self._bad = self._bad or is_nonfinite(loss)
        if step == self.step:
            return None
        self.step = step
        bad, self._bad = self._bad, False
        return bad


@dataclass(frozen=True)
class Restored:
    """The outcome of a rollback: the state of ``step`` to load, for the non-finite ``bad_step``."""

    step: int
    bad_step: int
    source: str
    """``"memory"``, ``"disk"`` or ``"start"`` (the state remembered when training started)."""
    state: Any


class RollbackPolicy:
    """Chooses the rollback target of one checkpointer and counts rollbacks.

    Args:
        engine: the checkpointer whose snapshots are the targets.
        max_rollbacks: how many rollbacks may follow each other without a newer good checkpoint in between.
        is_source: whether this rank reads the target (False on the ranks that receive it through ``share``).
        share: with several ranks, sends the source rank's ``Restored`` (or None) to every rank, e.g. a
            broadcast from rank 0; every rank must call :meth:`roll_back` for the same bad step.
    """

    def __init__(self, engine: LazyCheckpointer, *, max_rollbacks: int = 3, is_source: bool = True,
                 share: Callable[[Restored | None], Restored | None] | None = None) -> None:
        check_max_rollbacks(max_rollbacks)
        self.engine = engine
        self.max_rollbacks = max_rollbacks
        self.is_source = is_source
        self.share = share
        self.total = 0
        """Rollbacks so far in this run."""
        self._in_a_row = 0
        self._last_step: int | None = None
        self._start: tuple[int, Any] | None = None

    @classmethod
    def of_session(cls, session: CheckpointSession, *, is_source: bool,
                   share: Callable[[Restored | None], Restored | None] | None) -> RollbackPolicy:
        """The policy of an integration's session: its engine, and ``max_rollbacks`` from its options."""
        return cls(session.engine, max_rollbacks=session.options.max_rollbacks, is_source=is_source, share=share)

    def remember_start(self, step: int, state: Any) -> None:
        """Keep a private CPU copy of the state at training start: the target before the first snapshot."""
        if self.is_source:
            self._start = (step, clone_to_cpu(state))

    def drop_start_once_committed(self) -> None:
        """Free the start copy once a checkpoint is committed: from then on one precedes every later bad step."""
        if self._start is not None and self.engine.stats:
            self._start = None

    def roll_back(self, bad_step: int, *, into: Any = None) -> Restored:
        """Discard the snapshot of ``bad_step`` and return the newest good state before it.

        ``into`` (optional) is the live state in the structure that was saved (tensors of the model and the
        optimizers at its leaves): a memory snapshot is copied straight into its tensors where they match (see
        :meth:`LazyCheckpointer.memory_snapshot`), so loading the returned state copies nothing more.

        Raises:
            RollbackLimitError: more than ``max_rollbacks`` rollbacks in a row without a newer good checkpoint.
            NothingToRollBackTo: there is no state before ``bad_step`` (no snapshot and no remembered start).
        """
        self.engine.wait_staged()  # the live tensors are about to be overwritten: no copy may still read them
        self.engine.discard(bad_step)
        pending = self.engine.in_flight
        if pending is not None and pending.step < bad_step:
            pending.wait()  # the newest snapshot before the bad step: let it commit, then it is the target
        restored = self._find(bad_step, into) if self.is_source else None
        if self.share is not None:
            restored = self.share(restored)
        if restored is None:
            raise NothingToRollBackTo(f"lazyckpt: the loss is non-finite at step {bad_step} and there is no state "
                                      "before it to roll back to (no snapshot, and the start of training was not "
                                      "remembered)")
        self._count(restored)
        logger.warning("lazyckpt: non-finite loss at step %d; rolled back to step %d (from %s)", bad_step,
                       restored.step, restored.source)
        return restored

    def restore(self, bad_step: int, *, live: Any, load: Callable[[Any], None],
                optimizers: Iterable[torch.optim.Optimizer]) -> Restored:
        """:meth:`roll_back` into the ``live`` state, hand the state to ``load`` (which puts it into the framework's
        objects), and clear the ``optimizers``' gradients: the bad step's must not leak into the next one.

        Raises:
            RollbackLimitError, NothingToRollBackTo: as :meth:`roll_back`.
        """
        restored = self.roll_back(bad_step, into=live)
        load(restored.state)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        return restored

    def _find(self, bad_step: int, into: Any) -> Restored | None:
        snapshot = self.engine.memory_snapshot(into=into, before=bad_step)
        if snapshot is not None:
            return Restored(snapshot[0], bad_step, "memory", snapshot[1])
        engine = self.engine
        kept = {**committed_steps(engine.retained_dir, engine.storage),  # the host level's disk directory,
                **committed_steps(engine.dirpath, engine.storage)}  # and its host folder's copy first
        before = {s: p for s, p in kept.items() if s < bad_step}
        if before:
            step = max(before)
            state = load(before[step], verify=engine.config.verify_on_load, rank=engine.config.rank,
                         storage=engine.storage)
            return Restored(step, bad_step, "disk", state)
        if self._start is not None and self._start[0] < bad_step:
            return Restored(self._start[0], bad_step, "start", self._start[1])
        return None

    def _count(self, restored: Restored) -> None:
        if self._last_step is None or restored.step > self._last_step:
            self._in_a_row = 0  # a newer good checkpoint since the last rollback
        self._in_a_row += 1
        self._last_step = restored.step
        if self._in_a_row > self.max_rollbacks:
            raise RollbackLimitError(
                f"lazyckpt: the loss is non-finite again at step {restored.bad_step}: {self._in_a_row} rollbacks in "
                f"a row to step {restored.step} without a newer good checkpoint (max_rollbacks={self.max_rollbacks})."
                " Training diverges from that state whatever the batch: lower the learning rate, inspect the data "
                "after that step, or raise max_rollbacks")
        self.total += 1


def clone_to_cpu(tree: Any) -> Any:
    """A copy of a nested state whose tensors are private CPU copies (other values are shared)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: clone_to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(clone_to_cpu(v) for v in tree)
    return tree
