"""Who writes which bytes: pure ownership planning for sharded, replicated and per-rank tensors.

* A ``DTensor`` leaf: each rank writes its local shard; its *box* (offsets and lengths in the global shape)
  comes from torch's own placement math. A shard replicated over some mesh dimensions (e.g. the data-parallel
  dimension of a dp x tp mesh) is written by exactly one of its replicas, picked from the key so that different
  tensors land on different replicas.
* A plain tensor is *replicated*: identical on every rank, written once in total. Owners are assigned by bytes,
  greedily and deterministically, so every rank computes the same plan without communicating.
* A tensor under :class:`~lazyckpt.PerRank` belongs to its rank alone and comes back to that rank.

Nothing here touches bytes or talks to other ranks; the signature of a plan is what ranks compare to detect
state that is not the same on every rank.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lazyckpt.errors import UnsupportedValueError
from lazyckpt.tree.paths import path_str


@dataclass(frozen=True, slots=True)
class Box:
    """Where a stored tensor sits in its global tensor: ``offsets`` per dimension; lengths are its own shape."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Owned:
    """One leaf as this rank sees it: the tensor it would write, where that sits, and whether it writes it."""

    key: str
    local: torch.Tensor
    box: Box | None
    """None for a per-rank tensor (it has no global identity)."""
    writes: bool
    sharded: bool


def is_dtensor(tensor: torch.Tensor) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


@functools.cache
def _dtensor_type() -> type | None:
    """Imported once: ``save()`` asks for every leaf, and the import machinery showed up in its profile."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return None
    return DTensor


def shard_of(key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, Box, bool]:
    """The local shard of a DTensor, its box, and whether this rank is the replica that writes it.

    Raises:
        UnsupportedValueError: a ``Partial`` placement (the value is a pending sum, not a stored one), or this
            rank is not part of the tensor's mesh.
    """
    from torch.distributed.tensor import Partial

    placements = tuple(tensor.placements)
    if any(isinstance(p, Partial) for p in placements):
        raise UnsupportedValueError(
            f"{path_str((key,))} is a DTensor with a Partial placement {placements}: its value is a pending reduction, "
            "not stored data; call .redistribute(placements=[Replicate()] or [Shard(d)]) or .full_tensor() first")
    where = _placement(tuple(tensor.shape), tensor.device_mesh, placements)
    if where is None:
        raise UnsupportedValueError(f"{path_str((key,))} is a DTensor on a mesh this rank is not part of; pass only "
                                    "tensors this rank holds")
    local_shape, offsets, replicas, index = where
    writer = zlib.crc32(key.encode("utf-8")) % replicas
    return local_shard(tensor, local_shape), Box(tuple(tensor.shape), offsets), index == writer


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor that holds a DTensor's bytes (the tensor itself otherwise)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def local_block(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A DTensor's shard on this rank (without padding) and its offsets in the global tensor. A rank outside the
    tensor's mesh holds none of it: its empty local tensor and no offsets (a reader fills nothing there)."""
    where = _placement(tuple(tensor.shape), tensor.device_mesh, tuple(tensor.placements))
    if where is None:
        return tensor.to_local(), ()
    local_shape, offsets, _, _ = where
    return local_shard(tensor, local_shape), offsets


def local_shard(tensor: torch.Tensor, local_shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes of a DTensor's shard of ``local_shape`` on this rank, without the padding some owners add."""
    local = tensor.to_local()
    if tuple(local.shape) != local_shape:  # uneven shards padded by the owner (e.g. FSDP2)
        local = local.narrow(0, 0, local_shape[0]) if local.dim() else local
    return local


@functools.lru_cache(maxsize=4096)
def _placement(global_shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...],
               ) -> tuple[tuple[int, ...], tuple[int, ...], int, int] | None:
    """This rank's local shape and offsets in a tensor of ``global_shape`` placed so on ``mesh``, the number of
    replicas of its shard and which of them this rank is; None when this rank is not in the mesh.

    Cached: a training loop saves the same few shapes and placements every time, and torch's placement math (with
    the mesh coordinate) was most of what planning a sharded ``save()`` cost on the training thread.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    local_shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    replicas, index = 1, 0
    for d, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            replicas, index = replicas * mesh.size(d), index * mesh.size(d) + coordinate[d]
    return tuple(local_shape), tuple(offsets), replicas, index


def assign_replicated(sizes: Iterable[tuple[str, int]], world_size: int) -> dict[str, int]:
    """Owner rank of each replicated tensor: largest first, each to the least-loaded rank (ties: lowest rank)."""
    loads = [(0, r) for r in range(world_size)]
    owners = {}
    for key, nbytes in sorted(sizes, key=lambda kv: (-kv[1], kv[0])):
        load, rank = heapq.heappop(loads)
        owners[key] = rank
        heapq.heappush(loads, (load + nbytes, rank))
    return owners


def plan_ownership(leaves: list[tuple[str, torch.Tensor]], per_rank: set[str], *, rank: int,
                   world_size: int, coordinated: bool) -> list[Owned]:
    """Every leaf, with the tensor this rank would write and whether it writes it (same order as ``leaves``).

    ``coordinated``: the ranks agree on one global state (a store to meet through, or a single rank). Without
    it, every rank's tensors are its own, as if each were under :class:`~lazyckpt.PerRank`, and DTensors are refused.
    """
    owned: dict[str, Owned] = {}
    replicated = []
    for key, tensor in leaves:
        if not coordinated and is_dtensor(tensor):
            raise UnsupportedValueError(
                f"{path_str((key,))} is a DTensor, but the {world_size} ranks have no store to agree through: initialize "
                "the default process group (torch.distributed.init_process_group) before building the "
                "LazyCheckpointer, or pass store=...")
        if key in per_rank or not coordinated:
            owned[key] = Owned(key, tensor, None, True, False)
        elif is_dtensor(tensor):
            local, box, writes = shard_of(key, tensor)
            owned[key] = Owned(key, local, box, writes, True)
        else:
            replicated.append((key, tensor))
    owners = assign_replicated(((k, t.numel() * t.element_size()) for k, t in replicated), world_size)
    for key, tensor in replicated:
        box = Box(tuple(tensor.shape), (0,) * tensor.dim())
        owned[key] = Owned(key, tensor, box, owners[key] == rank, False)
    return [owned[key] for key, _ in leaves]


def plan_signature(owned: list[Owned], dtype_of: Any) -> str:
    """A digest of what must agree on every rank: each global tensor's key, kind, dtype and global shape."""
    parts = sorted(f"{o.key}|{'shard' if o.sharded else 'replica'}|{dtype_of(o.local.dtype)}|{list(o.box.global_shape)}"
                   for o in owned if o.box is not None)
    return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()
