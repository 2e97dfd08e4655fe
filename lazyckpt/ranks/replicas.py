"""Which tensors of a "replicated" state really are the same on every rank.

A data-parallel run keeps its parameters and optimizer state identical across ranks (gradients are averaged), so
those are written once, split across ranks. Nothing keeps the other tensors identical: BatchNorm statistics under
FSDP2, a DDP rank's buffers between two broadcasts, a callback's unsynchronized metric. Taking one rank's value for
every rank would resume them wrongly, so they stay :class:`~lazyckpt.PerRank` and each rank gets its own back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from lazyckpt.ranks.sharding import is_dtensor
from lazyckpt.tree.encode import PerRank


def window_tensors(optimizers: Iterable[torch.optim.Optimizer],
                   immutable: Iterable[torch.Tensor | torch.nn.Module]) -> Iterator[torch.Tensor]:
    """Every tensor of the immutability window: the optimizers' parameters and state tensors, the ``immutable``
    tensors and the parameters of the ``immutable`` modules. They stay unchanged until the next update, so a save
    copies them lazily, and a data-parallel run keeps them the same on every rank.

    Raises:
        TypeError: an optimizer is not a torch optimizer, or an ``immutable`` item neither tensor nor module.
    """
    for opt in optimizers:
        if not hasattr(opt, "param_groups"):
            raise TypeError(f"optimizers must hold torch optimizers; got {type(opt).__name__}")
        for group in opt.param_groups:
            yield from group["params"]
        for per_param in opt.state.values():
            yield from (v for v in per_param.values() if isinstance(v, torch.Tensor))
    for item in immutable:
        if isinstance(item, torch.nn.Module):
            yield from item.parameters()
        elif isinstance(item, torch.Tensor):
            yield item
        else:
            raise TypeError(f"immutable must hold tensors or nn.Modules; got {type(item).__name__}")


def synchronized_storages(optimizers: Iterable[torch.optim.Optimizer], immutable: Iterable[Any]) -> set[int]:
    """Storage addresses of the window's plain tensors (:func:`window_tensors`; DTensors are sharded state)."""
    return {_address(t) for t in window_tensors(optimizers, immutable) if not is_dtensor(t)}


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
