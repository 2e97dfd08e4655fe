"""Restoring a model sharded across ranks (FSDP2 ``fully_shard``, tensor parallel) and its optimizers.

The targets come from ``torch.distributed.checkpoint.state_dict`` on the live model and optimizers, so the
checkpoint is resharded to this run's mesh and world size; :func:`lazyckpt.load_into` fills them in place and
``set_*_state_dict`` hands them back. The framework only names where the model and optimizer states sit in its
checkpoint dict.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from lazyckpt.reshard import load_into


def restore_sharded(path: str | os.PathLike[str], module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                    *, model_key: str, optimizers_key: str, verify: bool = True) -> dict[str, Any]:
    """Fill ``module`` and ``optimizers`` from the checkpoint at ``path``; return the rest of its tree.

    ``model_key`` and ``optimizers_key``: where the checkpoint holds the model's state dict and the list of the
    optimizers' (as ``get_model_state_dict`` / ``get_optimizer_state_dict`` key them). The returned dict holds the
    target state dicts at those keys, the checkpoint's other values, and this rank's ``PerRank`` values.

    Raises:
        CheckpointMismatchError: a parameter or optimizer state of this run is not in the checkpoint.
    """
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    targets = {model_key: get_model_state_dict(module),
               optimizers_key: [get_optimizer_state_dict(module, opt) for opt in optimizers]}
    loaded = load_into(path, targets, verify=verify)
    set_model_state_dict(module, loaded[model_key])
    for opt, state in zip(optimizers, loaded[optimizers_key]):
        set_optimizer_state_dict(module, opt, state)
    return loaded
