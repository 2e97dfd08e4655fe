"""The part of ``save()`` that follows from the state's structure alone, computed once per structure.

A training loop saves the same tensors (keys, dtypes, shapes, placements) at every checkpoint. Which of them this
rank writes, their boxes, the plan's signature and the file layout follow from that structure, and recomputing
them was most of ``save()``'s time on the training thread. What can change between two saves of one structure is
read at every save: the tensors themselves (their storages and versions) and which of them are lazy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lazyckpt.format.header import TensorEntry, dtype_name
from lazyckpt.ranks.sharding import Box, is_dtensor, local_shard, plan_ownership, plan_signature
from lazyckpt.tree.paths import path_str

_KEPT_STRUCTURES = 4
"""A loop may alternate a few structures (e.g. a model-only save between full ones); more is not a loop."""
_KEPT_LAYOUTS = 4
"""Layouts per structure, one per lazy/eager split (it changes when a tensor starts or stops sharing storage with
the optimizers' or the declared immutable tensors, e.g. a save with other ``optimizers=``)."""


@dataclass(frozen=True, slots=True)
class Written:
    """One tensor this rank writes: where it sits in the leaves and how it is stored."""

    index: int
    entry: TensorEntry
    """Its entry with ``lazy=False``; the lazy flag is decided at every save."""
    sharded: bool


@dataclass(slots=True)
class Structure:
    """What every save of one structure shares on this rank."""

    shape: tuple
    """What the rest was computed from (see :func:`structure_of`)."""
    written: tuple[Written, ...]
    boxes: dict[str, Box | None]
    signature: str
    layouts: dict[tuple[bool, ...], Any] = field(default_factory=dict)
    """Keyed by which written tensors are lazy: whatever the caller derives from the entries (a layout)."""

    def local_tensors(self, leaves: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
        """The tensor this rank writes for each written key, or None when one does not have the planned shape (a
        DTensor whose shard changed under an unchanged spec): then the structure must be planned again."""
        tensors = {}
        for w in self.written:
            tensor = leaves[w.index][1]
            if w.sharded:
                tensor = local_shard(tensor, w.entry.shape)
                if tuple(tensor.shape) != w.entry.shape:
                    return None
            tensors[w.entry.key] = tensor
        return tensors

    def layout(self, lazy: tuple[bool, ...], build: Callable[[tuple[TensorEntry, ...]], Any]) -> Any:
        """``build(entries)`` for this lazy/eager split, computed once per split."""
        found = self.layouts.get(lazy)
        if found is None:
            if len(self.layouts) >= _KEPT_LAYOUTS:
                self.layouts.clear()
            entries = tuple(dataclasses.replace(w.entry, lazy=is_lazy) for w, is_lazy in zip(self.written, lazy))
            found = self.layouts[lazy] = build(entries)
        return found


def structure_of(leaves: list[tuple[str, torch.Tensor]], per_rank: set[str], *, rank: int, world_size: int,
                 coordinated: bool) -> tuple:
    """Everything ownership and layout depend on, compared with ``==`` at every save.

    Meshes and placements are compared as objects (placements with their exact types): a training loop hands the
    same ones every time, so the comparison is mostly identity checks, and two equal ones plan alike anyway.
    """
    return (rank, world_size, coordinated, frozenset(per_rank), tuple(_leaf_shape(k, t) for k, t in leaves))


def _leaf_shape(key: str, tensor: torch.Tensor) -> tuple:
    if is_dtensor(tensor):
        # With their types: torch lets some placement subclasses (_StridedShard) compare equal to their base,
        # and the two place a shard at different offsets.
        return key, tensor.dtype, tensor.shape, tensor.device_mesh, tuple((type(p), p) for p in tensor.placements)
    return key, tensor.dtype, tensor.shape, None, None


def plan_structure(shape: tuple, leaves: list[tuple[str, torch.Tensor]], per_rank: set[str], *, rank: int,
                   world_size: int, coordinated: bool) -> tuple[Structure, dict[str, torch.Tensor]]:
    """Plan one structure (``shape`` is its :func:`structure_of`) from scratch, and the tensors this rank writes
    (raises what :func:`plan_ownership` and ``dtype_name`` raise)."""
    owned = plan_ownership(leaves, per_rank, rank=rank, world_size=world_size, coordinated=coordinated)
    written = tuple(
        Written(index, TensorEntry(o.key, dtype_name(o.local.dtype, path_str((o.key,))), tuple(o.local.shape),
                                   o.local.numel() * o.local.element_size()), o.sharded)
        for index, o in enumerate(owned) if o.writes)
    structure = Structure(shape, written, {o.key: o.box for o in owned if o.writes}, plan_signature(owned, dtype_name))
    return structure, {o.key: o.local for o in owned if o.writes}


class StructureCache:
    """The few structures saved most recently, the last one saved first (a hit moves to the front, so the
    structure a loop saves every time stays however many one-off structures come between)."""

    def __init__(self) -> None:
        self._kept: list[Structure] = []

    def get(self, leaves: list[tuple[str, torch.Tensor]], per_rank: set[str], *, rank: int, world_size: int,
            coordinated: bool) -> tuple[Structure, dict[str, torch.Tensor]]:
        """The plan of this structure (from the cache when it was saved recently) and the tensors this rank
        writes."""
        shape = structure_of(leaves, per_rank, rank=rank, world_size=world_size, coordinated=coordinated)
        structure = self.find(shape)
        tensors = None if structure is None else structure.local_tensors(leaves)
        if tensors is None:
            structure, tensors = plan_structure(shape, leaves, per_rank, rank=rank, world_size=world_size,
                                                coordinated=coordinated)
            self.keep(structure)
        return structure, tensors

    def find(self, shape: tuple) -> Structure | None:
        for index, structure in enumerate(self._kept):
            if structure.shape == shape:
                if index:
                    self._kept = [structure, *self._kept[:index], *self._kept[index + 1:]]
                return structure
        return None

    def keep(self, structure: Structure) -> None:
        self._kept = [structure] + [s for s in self._kept if s.shape != structure.shape][:_KEPT_STRUCTURES - 1]
