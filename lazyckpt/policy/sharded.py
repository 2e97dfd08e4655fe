"""Restoring a model sharded across ranks (FSDP2 ``fully_shard``, tensor parallel) and its optimizers, on any
number of ranks.

The targets come from ``torch.distributed.checkpoint.state_dict`` on the live model and optimizers, so the
checkpoint is resharded to this run's mesh and world size; :func:`lazyckpt.load_into` fills them in place and
``set_*_state_dict`` hands them back. The framework only names where the model and optimizer states sit in its
checkpoint dict, and which of its values belong to one rank's run (RNG states, loader positions).

When the number of ranks changed, :func:`per_rank_source` decides where each rank's per-rank values come from:
sharded tensors always reshard exactly; a rank the checkpoint has no part for takes rank 0's per-rank tensors
of the model and optimizers (the statistics nothing synchronizes, such as BatchNorm's, the way DDP broadcasts
rank 0's buffers) and keeps its own current values of the run's per-rank keys, with a warning naming them.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lazyckpt.ranks.group import rank_and_size
from lazyckpt.read.reader import CheckpointReader
from lazyckpt.read.reshard import load_into
from lazyckpt.storage.urls import storage_for


@dataclass(frozen=True, slots=True)
class PerRankSource:
    """Where one rank's per-rank values come from when restoring a checkpoint saved by ``saved`` ranks."""

    rank: int
    """The saved rank whose per-rank tensors this rank reads (its own, or 0 for a rank that did not exist)."""
    own: bool
    """This rank existed when the checkpoint was saved: its per-rank values (RNG states, ...) come back."""
    unused: tuple[int, ...]
    """Saved ranks no rank of this run reads (reported once, by rank 0)."""


def per_rank_source(rank: int, world_size: int, saved: int) -> PerRankSource:
    """The per-rank restore plan of ``rank`` in a run of ``world_size`` ranks, from a checkpoint of ``saved``."""
    unused = tuple(range(world_size, saved)) if rank == 0 else ()
    return PerRankSource(rank=rank if rank < saved else 0, own=rank < saved, unused=unused)


def restore_sharded(path: str | os.PathLike[str], module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                    *, model_key: str | tuple[str, int], optimizers_key: str, run_keys: Collection[str] = (),
                    rank: int | None = None, world_size: int | None = None, verify: bool = True,
                    storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fill ``module`` and ``optimizers`` from the checkpoint at ``path``; return the rest of its tree.

    Args:
        model_key: where the checkpoint holds the model's state dict (as ``get_model_state_dict`` keys it): a
            top-level key, or ``(key, index)`` for the index-th of a list of models.
        optimizers_key: where it holds the list of the optimizers' (``get_optimizer_state_dict``).
        run_keys: top-level keys holding this rank's run state (RNG states, loader positions): None in the
            returned dict on a rank the checkpoint was not saved by, which then keeps its current values.
        rank: this process's rank; world_size: the number of ranks restoring (any number: see the module doc).
            Default: the default process group's (0 and 1 without one).
        storage_options: passed to fsspec when ``path`` is a URL (a remote level): each rank reads only the byte
            ranges of the shards it needs, nothing is fetched.

    Returns:
        The target state dicts at ``model_key`` and ``optimizers_key``, the checkpoint's other values, and the
        per-rank values ``per_rank_source`` chose.

    Raises:
        CheckpointMismatchError: a parameter or optimizer state of this run is not in the checkpoint.
    """
    rank, world_size = rank_and_size(rank, world_size)
    saved = CheckpointReader(*storage_for(os.fspath(path), None, storage_options)).world_size
    source = per_rank_source(rank, world_size, saved)
    key, index = (model_key, None) if isinstance(model_key, str) else model_key
    model_state, optimizer_states = sharded_states(module, optimizers)
    targets = {key: model_state if index is None else [{}] * index + [model_state], optimizers_key: optimizer_states}
    loaded = load_into(path, targets, verify=verify, rank=source.rank, storage_options=storage_options)
    set_sharded_states(module, optimizers, loaded[key] if index is None else loaded[key][index], loaded[optimizers_key])
    _report_changed_ranks(os.fspath(path), source, rank, world_size, run_keys, loaded)
    return loaded


def sharded_states(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[dict, list[dict]]:
    """The model's and optimizers' state dicts with DTensor leaves (each rank's shards), keyed by name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return get_model_state_dict(module), [get_optimizer_state_dict(module, opt) for opt in optimizers]


def set_sharded_states(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], model_state: dict[str, Any],
                       optimizer_states: list[dict[str, Any]]) -> None:
    """Load state dicts keyed as :func:`sharded_states` keys them (a filled target, a rollback's snapshot)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(module, model_state)
    for optimizer, state in zip(optimizers, optimizer_states):
        set_optimizer_state_dict(module, optimizer, state)


def _report_changed_ranks(path: str, source: PerRankSource, rank: int, world_size: int, run_keys: Collection[str],
                          loaded: dict[str, Any]) -> None:
    if not source.own:
        for key in run_keys:
            loaded[key] = None
        warnings.warn(f"lazyckpt: {path} was saved by fewer ranks than the {world_size} restoring it; rank {rank} "
                      "took rank 0's per-rank model and optimizer tensors (e.g. BatchNorm statistics) and keeps its "
                      f"current {', '.join(map(repr, sorted(run_keys))) or 'run state'} (not restored: it belongs to "
                      "one rank's run, e.g. its RNG states)", RuntimeWarning, stacklevel=3)
    if source.unused:
        warnings.warn(f"lazyckpt: {path} was saved by more ranks than the {world_size} restoring it; the per-rank "
                      f"values of saved ranks {list(source.unused)} (RNG states, unsynchronized statistics) are not "
                      "used", RuntimeWarning, stacklevel=3)
