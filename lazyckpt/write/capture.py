"""What happens inside ``save()`` on the training thread: flatten, classify lazy/eager, plan, copy eager tensors.

A tensor is *lazy* when it shares storage with a parameter or state tensor of the given optimizers, or with a
tensor the caller declared immutable: those stay unchanged until the next ``optimizer.step()``, which the barrier
orders after their copy. Everything else (buffers mutated by forward, RNG states, unknown tensors) is copied
*eagerly* here, so the snapshot holds its request-time value.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lazyckpt.config import CheckpointConfig
from lazyckpt.format.checksum import format_checksum, num_chunks
from lazyckpt.format.files import PARTIAL_SUFFIX, step_dirname
from lazyckpt.format.header import TensorEntry, build_header, dcp_sharding_metadata
from lazyckpt.format.manifest import global_index, tensor_summary, tensor_table_doc
from lazyckpt.ranks.replicas import window_tensors
from lazyckpt.ranks.sharding import Box, local_tensor
from lazyckpt.storage import Storage
from lazyckpt.tree.encode import flatten
from lazyckpt.write.job import CheckpointJob
from lazyckpt.write.plan import Piece, layout, plan_pieces
from lazyckpt.write.staging import CopyBackend
from lazyckpt.write.stats import CheckpointStats
from lazyckpt.write.structure import StructureCache


def immutable_storages(optimizers: Iterable[torch.optim.Optimizer],
                       immutable: Iterable[torch.Tensor | torch.nn.Module]) -> set[tuple[torch.device, int]]:
    """Identities of the storages that stay unchanged until the next optimizer update."""
    return {_storage_id(local_tensor(t)) for t in window_tensors(optimizers, immutable)}


def _storage_id(tensor: torch.Tensor) -> tuple[torch.device, int]:
    return tensor.device, tensor.untyped_storage().data_ptr()


@torch.no_grad()  # DTensor.to_local() then returns the local shard itself instead of going through autograd
def capture_job(state: Any, *, step: int, dirpath: str, config: CheckpointConfig, storage: Storage,
                optimizers: Iterable[torch.optim.Optimizer], immutable: Iterable[torch.Tensor | torch.nn.Module],
                backend_for: Callable[[list[torch.Tensor]], CopyBackend],
                agree: Callable[[str], None] | None) -> CheckpointJob:
    """Build the job for one ``save()``; eager tensors are copied before this returns.

    Only the tensors this rank owns are planned (see :mod:`lazyckpt.ranks.sharding`). ``agree`` publishes the plan's
    signature to the other ranks (None: no store); it raises when it met them and their states do not agree.
    """
    flat = flatten(state)
    tree, deferred = flat.tree, flat.deferred
    structure, tensors = _STRUCTURES.get(flat.tensors, flat.per_rank, rank=config.rank, world_size=config.world_size,
                                         coordinated=agree is not None or config.world_size == 1)
    if agree is not None:
        agree(structure.signature)
    lazy_ids = immutable_storages(optimizers, immutable)
    lazy = tuple(_storage_id(t) in lazy_ids and t.numel() > 0 for t in tensors.values())
    boxes = structure.boxes  # shared with every job of this structure: read only (the commit's tensor table)
    placed, data_bytes, header, pieces, tables_bytes = structure.layout(
        lazy, lambda entries: _plan(entries, boxes, config.world_size))
    needed = len(header) + data_bytes + manifest_bytes(tree, tables_bytes + _json_bytes(flat.aliases),
                                                       config.world_size)
    _check_free_space(storage, dirpath, needed + config.min_free_bytes, step)
    backend = backend_for(list(tensors.values()))
    sources, versions = [], {}
    for index, entry in enumerate(placed):
        tensor = tensors[entry.key]
        if entry.lazy:
            sources.append(tensor.detach())
            versions[index] = tensor._version
        else:
            sources.append(backend.copy_eager(tensor))
    name = step_dirname(step)
    return CheckpointJob(
        step=step, dirpath=dirpath, partial_dir=os.path.join(dirpath, name + PARTIAL_SUFFIX),
        final_dir=os.path.join(dirpath, name), rank=config.rank, world_size=config.world_size, tree=tree,
        entries=list(placed), pieces=list(pieces), sources=sources, versions=versions, deferred=deferred,
        header=header, checksums={e.key: [""] * num_chunks(e.nbytes) for e in placed},
        stats=CheckpointStats(step=step, nbytes=len(header) + data_bytes,
                              lazy_bytes=sum(e.nbytes for e in placed if e.lazy)),
        boxes=boxes, aliases=flat.aliases,
    )


_STRUCTURES = StructureCache()
"""The structures saved recently in this process (keyed by rank and world size too, so checkpointers share it)."""


def _plan(entries: tuple[TensorEntry, ...], boxes: dict[str, Box | None], world_size: int,
          ) -> tuple[tuple[TensorEntry, ...], int, bytes, tuple[Piece, ...], int]:
    """Layout, header, pieces and the size of the manifests' tensor tables for a set of tensors."""
    placed, data_bytes = layout(list(entries))
    offsets = {key: None if box is None else box.offsets for key, box in boxes.items()}
    header = build_header(placed, dcp_sharding_metadata(placed, offsets))
    return tuple(placed), data_bytes, header, tuple(plan_pieces(placed)), _tensor_tables_bytes(placed, boxes, world_size)


_MANIFEST_OVERHEAD_BYTES = 4096
"""Room for the manifests' fixed fields (format, step, checksum algorithm...) of the rank and top manifests."""


def manifest_bytes(tree: Any, tensor_tables_bytes: int, world_size: int) -> int:
    """An upper estimate of the bytes this rank writes besides its tensor file: its manifest (tree plus tensor
    table) and, for rank 0, ``manifest.json``. ``Deferred`` values are not known yet and are not counted."""
    tree_bytes = len(json.dumps(tree, separators=(",", ":"), allow_nan=False))
    return tree_bytes + tensor_tables_bytes + _MANIFEST_OVERHEAD_BYTES + 32 * world_size


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")))


def _tensor_tables_bytes(entries: list[TensorEntry], boxes: dict[str, Box | None], world_size: int) -> int:
    """This rank's tensor table, plus an upper estimate of the global index in ``manifest.json`` (every sharded
    tensor with one box per rank)."""
    placeholder = format_checksum(0)
    table = tensor_table_doc(entries, {e.key: [placeholder] * num_chunks(e.nbytes) for e in entries}, boxes)
    index = global_index({0: tensor_summary(table)})
    return _json_bytes(table) + world_size * _json_bytes(index)


def _check_free_space(storage: Storage, dirpath: str, needed: int, step: int) -> None:
    free = storage.free_bytes(dirpath)
    if free < needed:
        raise OSError(errno.ENOSPC, f"lazyckpt: checkpoint of step {step} needs {needed / 1e6:.1f} MB but only "
                      f"{free / 1e6:.1f} MB are free in {dirpath}; free space, lower keep_last_k or move dirpath")
