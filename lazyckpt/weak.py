"""Calls that do not keep their object alive.

A checkpointer's writer callbacks, and an integration's global optimizer hooks, hold their owner only weakly: one
dropped without ``close()`` is freed (and its directory lock released) at once, not at the next garbage collection
of a reference cycle, and its hook then does nothing.

Example:
    >>> hook = register_optimizer_step_pre_hook(weakly(plugin.before_update))                   # doctest: +SKIP
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weakly(method: Callable[..., Any]) -> Callable[..., None]:
    """A function calling the bound ``method`` with its arguments while its object lives, else nothing."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)
    return call
