"""Which tensors of a "replicated" state really are the same on every rank.

A data-parallel run keeps its parameters and optimizer state identical across ranks (gradients are averaged), so
those are written once, split across ranks. Nothing keeps the other tensors identical: BatchNorm statistics under
FSDP2, a DDP rank's buffers between two broadcasts, a callback's unsynchronized metric. Taking one rank's value for
every rank would resume them wrongly, so they stay :class:`~lazyckpt.PerRank` and each rank gets its own back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lazyckpt.sharding import is_dtensor
from lazyckpt.tree.encode import PerRank


def synchronized_storages(optimizers: Iterable[torch.optim.Optimizer], immutable: Iterable[Any]) -> set[int]:
    """Storage addresses of the optimizers' parameters and state, and of the ``immutable`` tensors and modules."""
    tensors: list[torch.Tensor] = []
    for opt in optimizers:
        for group in opt.param_groups:
            tensors.extend(group["params"])
        for per_param in opt.state.values():
            tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    for item in immutable:
        tensors.extend(item.parameters() if isinstance(item, torch.nn.Module) else [item])
    return {_address(t) for t in tensors if not is_dtensor(t)}


def keep_unsynchronized_per_rank(value: Any, synchronized: set[int]) -> Any:
    """``value`` with each plain tensor outside ``synchronized`` wrapped in ``PerRank`` (DTensors are sharded
    state and ``PerRank`` values are per rank already: both stay as they are)."""
    if isinstance(value, PerRank) or (isinstance(value, torch.Tensor) and is_dtensor(value)):
        return value
    if isinstance(value, torch.Tensor):
        return value if _address(value) in synchronized else PerRank(value)
    if isinstance(value, dict):
        return type(value)((k, keep_unsynchronized_per_rank(v, synchronized)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(keep_unsynchronized_per_rank(v, synchronized) for v in value)
    return value


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
