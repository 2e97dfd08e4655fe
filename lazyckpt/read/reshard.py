"""Reading a checkpoint into targets of any layout: ``load_into`` fills the tensors of a live state in place,
resharding to this run's mesh and world size.

A target (a plain tensor, or the local shard of a ``DTensor`` on any mesh and world size) gets the parts of the
stored boxes it meets, read through :class:`~lazyckpt.read.shard_files.ShardFiles` (only the byte ranges it needs,
their checksums verified).

Example:
    >>> msd, osd = get_state_dict(model, [opt])                                  # doctest: +SKIP
    >>> loaded = lazyckpt.load_into(lazyckpt.latest("runs/ckpt"), {"model": msd, "optim": osd})  # doctest: +SKIP
    >>> set_state_dict(model, [opt], model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])  # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lazyckpt.errors import CheckpointMismatchError
from lazyckpt.ranks.group import rank_and_size
from lazyckpt.ranks.sharding import is_dtensor, local_block
from lazyckpt.read.reader import CheckpointReader
from lazyckpt.read.shard_files import ShardFiles
from lazyckpt.storage import Storage
from lazyckpt.storage.urls import reads_url, storage_for
from lazyckpt.tree.decode import aliases_in, drop_per_rank, tensor_keys, unflatten, with_aliases
from lazyckpt.tree.encode import flatten


def target_block(key: str, target: torch.Tensor, global_shape: list[int]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The local tensor a target owns and its offsets in the global tensor (a plain target is the whole)."""
    if list(target.shape) != list(global_shape):
        kind = "DTensor" if is_dtensor(target) else "tensor"
        raise CheckpointMismatchError(f"tensor {key!r} has global shape {global_shape} in the checkpoint, the "
                                      f"target {kind} {list(target.shape)}")
    if is_dtensor(target):
        return local_block(target)
    return target, (0,) * target.dim()


@reads_url("path")
def load_into(path: str | os.PathLike[str], state: Any, *, verify: bool = True, rank: int | None = None,
              storage: Storage | None = None, storage_options: dict[str, Any] | None = None) -> Any:
    """Fill the tensors of ``state`` in place from a checkpoint, resharding to this run's layout.

    ``state`` is a nested dict whose tensor leaves are the targets (DTensors of any mesh, or plain tensors), e.g.
    from ``torch.distributed.checkpoint.state_dict.get_state_dict`` on the freshly built model and optimizer.
    Each rank reads only the byte ranges its targets need, and verifies the checksums of what it reads.

    Args:
        path: a committed ``step-NNNNNNN`` directory holding every rank's files (see :func:`lazyckpt.latest`), or
            its fsspec URL on a remote level (``s3://bucket/run/step-0000040``: only the byte ranges needed are read).
        state: the targets.
        verify: check the checksum of every chunk read (on by default).
        rank: whose :class:`~lazyckpt.PerRank` values to return (default: this process's rank in the group).
        storage: where the files live (default: local files, or fsspec for a URL).
        storage_options: passed to fsspec when ``path`` is a URL.

    Returns:
        The saved tree, with the target objects themselves at the tensor leaves that have a target and the
        checkpoint's values elsewhere (stored tensors without a target come back whole). ``PerRank`` values come
        from this rank's part of the checkpoint (None where the checkpoint was saved by fewer ranks).

    Raises:
        CheckpointMismatchError: a target's key, dtype or global shape is not in the checkpoint.
    """
    rank, _ = rank_and_size(rank)
    targets = tensor_targets(state)
    reader = CheckpointReader(*storage_for(path, storage, storage_options))
    own = rank < reader.world_size
    with ShardFiles(reader, verify=verify) as files:
        doc = files.rank(rank if own else 0).doc
        where = f"{reader.path}: rank {rank if own else 0}'s manifest"
        tree = doc["tree"] if own else drop_per_rank(doc["tree"])
        mine = {k for k, info in doc["tensors"].items() if info.get("box") is None} if own else set()
        available = set(files.index) | mine
        aliases = {a: k for a, k in aliases_in(tree, doc.get("aliases", {})).items() if k in available}
        unknown = sorted(set(targets) - available - set(aliases))
        if unknown:
            raise CheckpointMismatchError(f"{reader.path} holds no tensor for the targets {unknown[:8]} "
                                          f"({len(unknown)} in all)")
        loaded = _fill(files, rank, targets, aliases)
        needed = {aliases.get(k, k) for k in tensor_keys(tree) - set(loaded)} - set(loaded)
        loaded.update(files.consolidate(sorted(needed & set(files.index))))
        loaded.update({k: files.read_whole(rank, k) for k in sorted(needed - set(files.index))})
        return unflatten(tree, with_aliases(loaded, aliases_in(tree, doc.get("aliases", {})), where), where)


def _fill(files: ShardFiles, rank: int, targets: dict[str, torch.Tensor],
          aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """Fill every target from the stored tensor of its key, or of the key it is an alias of (FORMAT.md rule 22):
    a target that is the very tensor of that key (tied in the live state too) is filled once, keeping the tie."""
    for key, target in targets.items():
        source = aliases.get(key, key)
        if source != key and targets.get(source) is target:
            continue
        if source in files.index:
            files.fill(source, *target_block(source, target, files.index[source]["shape"]))
        else:
            _copy_whole(files, rank, source, target)
    return dict(targets)


def tensor_targets(state: Any) -> dict[str, torch.Tensor]:
    """The tensor leaves of a nested state, keyed as a checkpoint of that state names its tensors (a leaf that is
    an earlier leaf's tensor, e.g. a tied weight, under its own key too: the same tensor object)."""
    flat = flatten(state)
    targets = dict(flat.tensors)
    targets.update({alias: targets[key] for alias, key in flat.aliases.items()})
    return targets


def _copy_whole(files: ShardFiles, rank: int, key: str, target: torch.Tensor) -> None:
    stored = files.read_whole(rank, key)
    if stored.dtype != target.dtype or stored.shape != target.shape:
        raise CheckpointMismatchError(f"tensor {key!r} is {stored.dtype}{list(stored.shape)} in the checkpoint, the "
                                      f"target {target.dtype}{list(target.shape)}")
    with torch.no_grad():
        target.copy_(stored)
