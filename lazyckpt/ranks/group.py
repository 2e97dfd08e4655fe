"""Where this process stands among the ranks: the one place that asks ``torch.distributed`` for its rank, the
number of ranks and the key-value store they meet through.

Example:
    >>> rank_and_size()            # outside a process group
    (0, 1)
"""

from __future__ import annotations

from typing import Any


def _group() -> Any | None:
    """``torch.distributed`` when its default process group is initialized, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_and_size(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """This process's rank and the number of ranks: those given, else the default process group's (0 and 1
    outside one)."""
    dist = _group()
    return (rank if rank is not None else dist.get_rank() if dist else 0,
            world_size if world_size is not None else dist.get_world_size() if dist else 1)


def default_store() -> Any | None:
    """The store of the initialized default process group, or None outside one."""
    if _group() is None:
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()
