"""Counting training steps from optimizer events, when a checkpoint is due, and the request a step owes.

A step is one real update of the model: every optimizer of the run has stepped. Gradient-accumulation
micro-batches and updates a mixed-precision scaler skipped never reach an optimizer's post-hook, so they do not
count. Pure bookkeeping: testable without a framework.

Example:
    >>> counter = StepCounter(every_n_steps=2)
    >>> [counter.updated(0, optimizers=1) for _ in range(4)]
    [False, True, False, True]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from lazyckpt.pending import PendingCheckpoint


class _HasStep(Protocol):
    step: int


C = TypeVar("C", bound=_HasStep)


class StepCounter:
    """Steps completed so far, and whether the one just completed is due for a checkpoint.

    Args:
        every_n_steps: a checkpoint is due after every n-th step; None: never (only on explicit requests).

    Raises:
        ValueError: ``every_n_steps`` is not a positive int or None.
    """

    def __init__(self, every_n_steps: int | None) -> None:
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ValueError(f"every_n_steps={every_n_steps!r} must be a positive int or None (only hook.save())")
        self.every_n_steps = every_n_steps
        self.step = 0
        self._stepped: set[int] = set()

    def updated(self, index: int, *, optimizers: int) -> bool:
        """Optimizer ``index`` (of ``optimizers``) has updated; True when that completed a step that is due."""
        self._stepped.add(index)
        if len(self._stepped) < optimizers:
            return False
        self._stepped.clear()
        self.step += 1
        return self.every_n_steps is not None and self.step % self.every_n_steps == 0

    def restart(self, step: int) -> None:
        """Continue counting from ``step`` (after a restore); updates of a half-finished step are forgotten."""
        self.step = step
        self._stepped.clear()


class StepRequests(Generic[C]):
    """The checkpoints a loop driven by optimizer updates owes: steps counted by a :class:`StepCounter`, the state
    captured at the end of a due step, requested at the next safe point (a lazy request must not race the loop's
    own end-of-step updates), and the last request made.

    ``C`` is whatever the integration captured at the step's end (it has a ``step``).

    Example:
        >>> requests = StepRequests(every_n_steps=100)
        >>> requests.updated(0, optimizers=1, capture=lambda step: Captured(step))   # doctest: +SKIP
        >>> requests.issue(lambda captured: session.save(captured.step, ...))        # doctest: +SKIP
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        self._counter = StepCounter(every_n_steps)
        self.waiting: C | None = None
        """Captured, not requested yet."""
        self.requested_step: int | None = None
        self.pending: PendingCheckpoint | None = None
        self._warned_late = False

    @property
    def step(self) -> int:
        """Steps completed so far."""
        return self._counter.step

    def updated(self, index: int, *, optimizers: int, capture: Callable[[int], C]) -> bool:
        """Optimizer ``index`` (of ``optimizers``) has updated; a step it completed is captured when due. Returns
        whether it completed a step."""
        before = self._counter.step
        if self._counter.updated(index, optimizers=optimizers):
            self.waiting = capture(self._counter.step)
        return self._counter.step != before

    def capture_unless_requested(self, step: int, capture: Callable[[int], C]) -> None:
        """Capture ``step`` now (an explicit request) unless it waits already or was requested."""
        if self.waiting is None and self.requested_step != step:
            self.waiting = capture(step)

    def issue(self, save: Callable[[C], PendingCheckpoint], *, late: str | None = None) -> PendingCheckpoint | None:
        """Request the waiting capture with ``save``; returns the newest request's handle. ``late``: this point is
        later than the safe one (the copy cannot overlap training), a warning given once if it issues a request."""
        if self.waiting is not None:
            if late is not None and not self._warned_late:
                self._warned_late = True
                warnings.warn(late, RuntimeWarning, stacklevel=3)
            captured, self.waiting = self.waiting, None
            self.requested_step = captured.step  # before: a save() that raises an earlier failure took it too
            self.pending = save(captured)
        return self.pending

    def drop(self, step: int) -> None:
        """Never request ``step`` (its update was bad)."""
        if self.waiting is not None and self.waiting.step == step:
            self.waiting = None

    def restart(self, step: int, *, committed: bool) -> None:
        """Count on from ``step`` and forget everything owed (the state was restored); ``committed``: ``step`` is
        a committed checkpoint already (a resume), so an explicit request of it saves nothing."""
        self._counter.restart(step)
        self.waiting, self.pending, self.requested_step = None, None, step if committed else None
