"""Find values a checkpoint cannot store before training starts, not at the first save an epoch later.

Example:
    >>> check_storable(dict(module.hparams), what="the hyper-parameters",                     # doctest: +SKIP
    ...                fix="leave it out with self.save_hyperparameters(ignore=[{key!r}])")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lazyckpt.errors import UnsupportedValueError
from lazyckpt.tree.encode import flatten


def check_storable(state: Mapping[Any, Any], *, what: str = "the state",
                   fix: str = "convert it or leave it out of the checkpoint") -> None:
    """Raise now what ``save(state)`` would raise later for a value lazyckpt cannot store.

    Args:
        state: the mapping to check, e.g. a module's hyper-parameters or an object's ``state_dict()``.
        what: how messages name ``state``.
        fix: what to do about the offending top-level entry; ``{key!r}`` is replaced by its key.

    Raises:
        UnsupportedValueError: naming the key path of the first unsupported value (or key) and the fix.
    """
    for key, value in state.items():
        try:
            flatten({key: value})
        except UnsupportedValueError as e:
            raise UnsupportedValueError(f"lazyckpt cannot store {what}: {e}. Fix: {fix.format(key=key)}") from e


def check_hyperparameters(*owners: Any) -> None:
    """:func:`check_storable` for the ``hparams`` of each owner (a module, a data module; ``None`` is skipped)."""
    for owner in owners:
        hparams = getattr(owner, "hparams", None)
        if isinstance(hparams, dict):  # an OmegaConf config as a whole is always storable
            check_storable(hparams, what=f"the hyper-parameters of {type(owner).__name__}",
                           fix="leave it out with self.save_hyperparameters(ignore=[{key!r}]) or make it "
                               "plain data (numbers, strings, lists, dicts, tensors)")
