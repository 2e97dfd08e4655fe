"""The checkpoint policy of a training loop driven by optimizer updates (the Accelerate hook; any loop whose only
events are torch's optimizer and forward hooks): the order of capture, request and barrier around each update,
which update a rollback undoes and when its start state is taken, resume, and close with the run's summary.

The adapter reads the framework (what a step's end captures, what a checkpoint holds) and calls this object from
its hooks: :meth:`UpdateLoop.updated` from the optimizers' post-hooks, :meth:`~UpdateLoop.forward` from the models'
forward pre-hooks (the iteration's end-of-step updates are done: the safe point of the request),
:meth:`~UpdateLoop.before_update` from the optimizers' pre-hooks (the barrier). Pure sequencing over
:class:`~lazyckpt.policy.StepRequests`, :class:`~lazyckpt.policy.CheckpointSession` and
:class:`~lazyckpt.policy.RunFeedback`.

Example:
    >>> loop = UpdateLoop(every_n_steps=100)                                               # doctest: +SKIP
    >>> loop.start(session, save=lambda captured: session.save(captured.step, ...))        # doctest: +SKIP
    >>> loop.updated(0, optimizers=1, capture=capture)    # in the optimizer's post-hook   # doctest: +SKIP
    >>> loop.forward()                                    # the next forward: the request  # doctest: +SKIP
    >>> loop.close(release=remove_hooks)                  # drain, then the run's summary  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, Protocol

from lazyckpt.policy.feedback import Reporter, RunFeedback
from lazyckpt.policy.steps import C, StepRequests

if TYPE_CHECKING:
    from lazyckpt.pending import PendingCheckpoint
    from lazyckpt.policy.session import CheckpointSession


class LoopRollback(Protocol):
    """The framework's side of a rollback (restoring its objects); the loop says when each is called."""

    def remember_start(self, step: int) -> None:
        """The state now, of ``step``, is the target of a rollback before the first snapshot."""

    def on_step(self) -> None:
        """A step completed (the start state may go once a newer checkpoint is committed)."""

    def roll_back(self, bad_step: int) -> int | None:
        """Restore the newest state before ``bad_step``; its step, or None when there is none."""


class UpdateLoop(Generic[C]):
    """The requests a loop's updates owe and the session that writes them (from :meth:`start` on).

    Args:
        every_n_steps: a checkpoint is due after every n-th step; None: only on explicit requests.

    Raises:
        ValueError: ``every_n_steps`` is not a positive int or None.
    """

    def __init__(self, every_n_steps: int | None) -> None:
        self.requests: StepRequests[C] = StepRequests(every_n_steps)
        self.feedback = RunFeedback()
        self.session: CheckpointSession | None = None
        self._save: Callable[[C], PendingCheckpoint] | None = None
        self._reporter = Reporter()
        self._rollback: LoopRollback | None = None
        self.stepped = False
        """True between a completed update and the next forward: a rollback then undoes that update."""
        self.closed = False
        """:meth:`close` was called (also before :meth:`start`)."""

    @property
    def step(self) -> int:
        """Updates counted so far."""
        return self.requests.step

    def start(self, session: CheckpointSession, save: Callable[[C], PendingCheckpoint], *,
              reporter: Reporter = Reporter(), rollback: LoopRollback | None = None) -> None:
        """From now on ``save`` requests a capture's checkpoint through ``session``; the run's summary goes to
        ``reporter`` (on rank 0), and ``rollback`` (if any) remembers the state now as its start."""
        self.session, self._save = session, save
        self._reporter, self._rollback = reporter.on_rank(session.rank), rollback
        if rollback is not None:
            rollback.remember_start(self.step)

    # --- the loop's events ------------------------------------------------------------------------------------

    def updated(self, index: int, *, optimizers: int, capture: Callable[[int], C]) -> bool:
        """Optimizer ``index`` (of ``optimizers``) has updated; a due step it completed is captured now (the
        request waits for the next forward). Returns whether it completed a step."""
        completed = self.requests.updated(index, optimizers=optimizers, capture=capture)
        self.stepped = self.stepped or completed
        if completed and self._rollback is not None:
            self._rollback.on_step()
        return completed

    def forward(self) -> None:
        """The first forward after an update: the iteration's end-of-step updates are done, so request now."""
        self.stepped = False
        self.issue()

    def before_update(self, late: str) -> None:
        """Right before an update: request what still waits (``late``: the warning that no forward came between
        two updates, so the copy cannot overlap), then pass the barrier of the snapshot in flight."""
        self.issue(late=late)
        self.session.barrier()

    def drain(self) -> None:
        """Request what waits, then pass the barrier: the live tensors may be overwritten after this."""
        self.issue()
        self.session.barrier()

    def request(self, capture: Callable[[int], C]) -> PendingCheckpoint | None:
        """An explicit request of the current step (captured now unless it waits or was requested already)."""
        self.requests.capture_unless_requested(self.step, capture)
        return self.issue()

    def issue(self, late: str | None = None) -> PendingCheckpoint | None:
        """Request the step captured at its iteration's end, if any; the newest request's handle."""
        self.feedback.follow(self.session.engine.stats)  # warns when the write falls behind
        return self.requests.issue(self._save, late=late)

    # --- rollback, resume, close ------------------------------------------------------------------------------

    def roll_back(self) -> int | None:
        """Undo the bad update (:meth:`bad_step`) with the ``rollback`` given to :meth:`start`; returns the step
        restored, or None when there is none."""
        step = self._rollback.roll_back(self.bad_step())
        if step is not None:
            self.stepped = False
        return step

    def bad_step(self) -> int:
        """The update a rollback now undoes: the one just made (its request is dropped, never issued), or the
        coming one when called before it."""
        bad = self.step if self.stepped else self.step + 1
        self.requests.drop(bad)
        return bad

    def resumed(self, step: int, path: str) -> None:
        """Count on from ``step``, restored from the committed checkpoint at ``path`` (the new rollback start)."""
        self.requests.restart(step, committed=True)
        self.session.resumed(step, path)
        if self._rollback is not None:
            self._rollback.remember_start(step)

    def restart(self, step: int) -> None:
        """Count on from ``step``, restored from a state that is not a committed checkpoint of this run."""
        self.requests.restart(step, committed=False)

    def close(self, release: Callable[[], None]) -> dict[str, float]:
        """Issue a waiting request, ``release`` the framework's hooks, finish every checkpoint (re-raises a
        background failure), then report the run's summary at the current step; returns its metrics ({} on a
        rank that does not report). Idempotent; before :meth:`start` it only marks the loop closed."""
        if self.closed or self.session is None:
            self.closed = True
            return {}
        self.closed = True
        try:
            self.issue()
        finally:
            release()
            self.session.close()
        self.feedback.follow(self.session.engine.stats)  # the last commits
        return self.feedback.finish(self._reporter, step=self.step)
