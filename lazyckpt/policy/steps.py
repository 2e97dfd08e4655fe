"""Counting training steps from optimizer events, and when a checkpoint is due.

A step is one real update of the model: every optimizer of the run has stepped. Gradient-accumulation
micro-batches and updates a mixed-precision scaler skipped never reach an optimizer's post-hook, so they do not
count. Pure bookkeeping: testable without a framework.

Example:
    >>> counter = StepCounter(every_n_steps=2)
    >>> [counter.updated(0, optimizers=1) for _ in range(4)]
    [False, True, False, True]
"""

from __future__ import annotations


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
