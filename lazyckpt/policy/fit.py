"""Does a checkpoint fit the run resuming from it? One check for every integration, one exception naming every
difference (:class:`~lazyckpt.CheckpointMismatchError`), raised before anything is restored.

Example:
    >>> here = RunLayout(models={"model 0 (Net)": model.state_dict()})              # doctest: +SKIP
    >>> check_fits(path, RunLayout(models={"model 0 (Net)": saved}), here)          # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lazyckpt.errors import CheckpointMismatchError


@dataclass(kw_only=True)
class RunLayout:
    """The shape of a run, as far as a checkpoint must match it; ``None`` and empty fields are not compared."""

    world_size: int | None = None
    """Processes that wrote (or will read) per-process state."""
    kinds: dict[str, list[str]] = field(default_factory=dict)
    """Class names (or generator names) of what is registered, by role: ``"optimizers": ["AdamW"]``."""
    models: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    """State dicts by a readable name (``"model 0 (Net)"``); keys, shapes (and dtypes) are compared."""
    param_groups: list[list[int]] | None = None
    """Per optimizer: how many parameters each of its groups holds."""
    dataloaders: int | None = None


def differences(saved: RunLayout, here: RunLayout, *, strict: bool = True, dtypes: bool = True) -> list[str]:
    """Every way ``saved`` differs from ``here`` (pure; empty when it fits).

    Args:
        strict: also report keys that only one side has (else only shapes of the common keys).
        dtypes: also report tensors whose dtype differs (a loader that converts dtypes passes False).
    """
    problems = []
    if None not in (saved.world_size, here.world_size) and saved.world_size != here.world_size:
        problems.append(f"it was written by {saved.world_size} process(es), this run has {here.world_size} "
                        "(RNG and sampler states are per process; resume with the same number of processes)")
    for role in sorted(set(saved.kinds) & set(here.kinds), key=list(here.kinds).index):
        if saved.kinds[role] != here.kinds[role]:
            problems.append(f"{role}: the checkpoint holds {saved.kinds[role]}, this run registered {here.kinds[role]}")
    if None not in (saved.dataloaders, here.dataloaders) and saved.dataloaders != here.dataloaders:
        problems.append(f"dataloaders: the checkpoint holds {saved.dataloaders}, this run prepared {here.dataloaders}")
    for name, state in here.models.items():
        if name in saved.models:
            problems += _model_differences(name, saved.models[name], state, strict=strict, dtypes=dtypes)
    for index, (was, now) in enumerate(zip(saved.param_groups or [], here.param_groups or [])):
        if was != now:
            problems.append(f"optimizer {index}: parameter groups hold {was} parameters in the checkpoint and "
                            f"{now} here")
    return problems


def check_fits(path: str, saved: RunLayout, here: RunLayout, *, strict: bool = True, dtypes: bool = True,
               problems: Sequence[str] = ()) -> None:
    """Raise :class:`~lazyckpt.CheckpointMismatchError` listing ``problems`` and every difference, if any."""
    found = [*problems, *differences(saved, here, strict=strict, dtypes=dtypes)]
    if found:
        raise CheckpointMismatchError(f"{path} does not match this run:\n  - " + "\n  - ".join(found))


def _model_differences(name: str, saved: Mapping[str, Any], here: Mapping[str, Any], *, strict: bool,
                       dtypes: bool) -> list[str]:
    problems = []
    if strict:
        missing, unexpected = sorted(set(here) - set(saved)), sorted(set(saved) - set(here))
        if missing:
            problems.append(f"{name}: keys missing from the checkpoint: {_few(missing)}")
        if unexpected:
            problems.append(f"{name}: keys only in the checkpoint: {_few(unexpected)}")
    for key in sorted(set(saved) & set(here)):
        got, want = saved[key], here[key]
        if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
            continue
        if got.shape != want.shape or (dtypes and got.dtype != want.dtype):
            problems.append(f"{name}: {key!r} is {_spelled(got)} in the checkpoint and {_spelled(want)} here")
    return problems


def _spelled(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _few(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
