"""Accelerate's DeepSpeed plugin (``distributed_type=DEEPSPEED``): the prepared model is a ``DeepSpeedEngine``,
which owns the model's and the optimizer's state (ZeRO partitions).

``LazyCheckpointHook`` saves them as DeepSpeed hands them to its checkpoint engine: at each request the engine's
``save_checkpoint`` runs in capture mode (:meth:`LazyCheckpointEngine.capture`), and this process's files go into
the step with the hook's own values (``files``, per process; the step's tag is ``checkpoint``). The base
optimizer's parameters and state and the module's parameters are copied lazily. Resume is DeepSpeed's own
``engine.load_checkpoint(step)``, reading the files through lazyckpt; the hook then restores the rest (schedulers,
loaders, RNG states, registered objects).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lazyckpt.integrations._deepspeed_files import STEP_TAG

__all__ = ["STEP_TAG", "attach", "files", "is_deepspeed", "optimizers_and_immutable", "restore"]


def is_deepspeed(accelerator: Any) -> bool:
    return str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper() == "DEEPSPEED"


def attach(models: list[Any]) -> Any:
    """The ``LazyCheckpointEngine`` of the one prepared ``DeepSpeedEngine`` (its loads and its barrier)."""
    from lazyckpt.integrations.deepspeed import use_lazy_checkpoints  # imports DeepSpeed: only when it is used

    if len(models) != 1:
        raise ValueError(f"LazyCheckpointHook under DeepSpeed checkpoints one prepared model (the DeepSpeedEngine), "
                         f"this accelerator prepared {len(models)}; prepare the others without DeepSpeed")
    return use_lazy_checkpoints(models[0])


def files(lazy: Any, dirpath: str) -> dict[str, Any]:
    """This process's DeepSpeed files of the current state (every process calls it at the same request)."""
    return lazy.capture(dirpath, client_state={})


def optimizers_and_immutable(engine: Any) -> tuple[list[torch.optim.Optimizer], list[torch.nn.Module]]:
    from lazyckpt.integrations.deepspeed import lazy_parts

    return lazy_parts(engine)


def restore(engine: Any, path: str) -> None:
    """DeepSpeed's own load of the step at ``path`` (its model, optimizer and LR scheduler states)."""
    loaded, _ = engine.load_checkpoint(os.fspath(path), tag=STEP_TAG)
    if loaded is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint in {path} (its {STEP_TAG!r} tag)")
