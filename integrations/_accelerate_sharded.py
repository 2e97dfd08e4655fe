"""Accelerate's FSDP plugin, version 2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``): the prepared model's
parameters and its optimizer's state are DTensors, sharded over the processes.

Each process saves its own shards: the model and optimizer states come from
``torch.distributed.checkpoint.state_dict`` (they share storage with the live tensors, so the copy stays lazy), and
the optimizer state is keyed by parameter name. Resume fills the live shards in place through
:func:`lazyckpt.policy.restore_sharded`, resharded to this run's number of processes; only the bytes each process
needs are read. Accelerate's FSDP version 1 keeps refusing (its sharded state dict all-gathers every parameter on
the training thread at each save).
"""

from __future__ import annotations

from typing import Any

import torch

from lazyckpt.policy import RunLayout, restore_sharded
from lazyckpt.policy.sharded import set_sharded_states as set_states, sharded_states
from lazyckpt.read.reader import CheckpointReader
from lazyckpt.storage.urls import storage_for

RUN_KEYS = ("rng",)
"""Per-process values a process the checkpoint was not saved by keeps as they are: its RNG states. It takes
process 0's loader positions (their epoch counters agree on every process)."""


def is_fsdp2(accelerator: Any) -> bool:
    """The accelerator shards with FSDP version 2 (``Accelerator.is_fsdp2``: an Accelerate without that property
    has no FSDP2 plugin, and its FSDP is refused as version 1)."""
    return bool(getattr(accelerator, "is_fsdp2", False))


def check_supported(models: list[torch.nn.Module], *, keep_in_memory: bool) -> None:
    """Optimizer states are keyed by the names of one model's parameters: FSDP2 runs prepare exactly one. The
    in-memory level (rollback) keeps what each process wrote, which under FSDP2 is not the whole state."""
    if len(models) != 1:
        raise ValueError(f"LazyCheckpointHook under FSDP version 2 checkpoints one prepared model, this accelerator "
                         f"prepared {len(models)}; prepare the others without FSDP or wrap them in one nn.Module")
    if keep_in_memory:
        raise ValueError("LazyCheckpointHook(keep_in_memory=True) is not supported under FSDP version 2: the "
                         "in-memory snapshot and rollback serve replicated (DDP) state only; drop keep_in_memory")


def outline(path: str, storage_options: dict[str, Any] | None) -> Any:
    """Process 0's tree with each tensor a placeholder of its global shape (nothing read): for the fit check."""
    return CheckpointReader(*storage_for(path, None, storage_options)).outline(0)


def any_world_size(layout: RunLayout) -> RunLayout:
    """``layout`` without its number of processes: sharded state reshards to any."""
    layout.world_size = None
    return layout


def restore(path: str, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], *, rank: int,
            world_size: int, verify: bool, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """Fill the model's and optimizers' shards in place; the checkpoint's tree as this process sees it."""
    return restore_sharded(path, model, optimizers, model_key=("models", 0), optimizers_key="optimizers",
                           run_keys=RUN_KEYS, rank=rank, world_size=world_size, verify=verify,
                           storage_options=storage_options)
