"""Reading the global tensors of a checkpoint: consolidated into full tensors, or into targets of any layout.

``manifest.json`` says, for every global tensor, which rank's file holds which box. A target (a plain tensor, or
the local shard of a ``DTensor`` on any mesh and world size) needs the parts of the stored boxes it intersects; for
each, only the byte range from the first to the last needed element is read (widened to whole checksum chunks so
that what is read is verified), and the block is copied out of it in place. Files are opened through
:class:`~lazyckpt.reader.CheckpointReader`, so every manifest and header check of ``load`` applies here too.

Example:
    >>> msd, osd = get_state_dict(model, [opt])                                  # doctest: +SKIP
    >>> loaded = lazyckpt.load_into(lazyckpt.latest("runs/ckpt"), {"model": msd, "optim": osd})  # doctest: +SKIP
    >>> set_state_dict(model, [opt], model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from lazyckpt.errors import CheckpointFormatError, CheckpointMismatchError
from lazyckpt.format.checksum import CHUNK_BYTES
from lazyckpt.format.header import torch_dtype
from lazyckpt.ranks.group import rank_and_size
from lazyckpt.ranks.sharding import is_dtensor, local_block
from lazyckpt.reader import CheckpointReader, RankFile
from lazyckpt.storage import Storage
from lazyckpt.storage.urls import storage_for
from lazyckpt.tensor_io import check_chunks, read_exact
from lazyckpt.tree.decode import unflatten
from lazyckpt.tree.encode import flatten


class ShardFiles:
    """The rank files of one checkpoint, opened on first use, with verified reads of byte ranges of a tensor.

    Use as a context manager (closes the files).
    """

    def __init__(self, reader: CheckpointReader, *, verify: bool) -> None:
        self.reader = reader
        self.index: dict[str, Any] = reader.top.get("tensors", {})
        """The global view (empty before format version 3: every tensor belonged to its rank)."""
        self.verify = verify
        self._open: dict[int, RankFile] = {}

    def __enter__(self) -> ShardFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for opened in self._open.values():
            opened.close()
        self._open.clear()

    def rank(self, rank: int) -> RankFile:
        if rank not in self._open:
            self._open[rank] = self.reader.open_rank(rank)
        return self._open[rank]

    def read(self, rank: int, key: str, start: int, end: int) -> np.ndarray:
        """Bytes ``[start, end)`` of tensor ``key`` in ``rank``'s file, the chunks they touch verified."""
        opened = self.rank(rank)
        info = opened.doc["tensors"].get(key)
        if info is None:
            raise CheckpointFormatError(f"{opened.manifest}: the global view places tensor {key!r} in this rank's "
                                        "file, which does not hold it")
        t_start, t_end = info["offsets"]
        lo, hi = start, end
        if self.verify:
            lo, hi = start // CHUNK_BYTES * CHUNK_BYTES, min(-(-end // CHUNK_BYTES) * CHUNK_BYTES, t_end - t_start)
        buffer = np.empty(hi - lo, dtype=np.uint8)
        read_exact(opened.handle, opened.data_start + t_start + lo, buffer, opened.file, f"tensor {key!r}")
        if self.verify:
            check_chunks(buffer, lo, info["checksums"][lo // CHUNK_BYTES :], opened.file, key)
        return buffer[start - lo : end - lo]

    def read_whole(self, rank: int, key: str) -> torch.Tensor:
        """A whole stored tensor of ``rank``'s file, in its own memory."""
        info = self.rank(rank).doc["tensors"][key]
        data = self.read(rank, key, 0, info["offsets"][1] - info["offsets"][0])
        dtype = torch_dtype(info["dtype"], f"{self.rank(rank).manifest}: tensor {key!r}")
        return torch.from_numpy(data.copy()).view(dtype).reshape(info["shape"])

    def fill(self, key: str, target: torch.Tensor, offsets: tuple[int, ...]) -> None:
        """Copy into ``target`` (the block at ``offsets`` of global tensor ``key``) every stored part it meets."""
        info = self.index[key]
        dtype = torch_dtype(info["dtype"], f"{self.reader.path}: tensor {key!r}")
        if target.dtype != dtype:
            raise CheckpointMismatchError(f"tensor {key!r} is {dtype} in {self.reader.path}, the target is "
                                          f"{target.dtype}")
        for box in info["boxes"]:
            self._check_box(key, info, box)
            lo = [max(a, b) for a, b in zip(offsets, box["offsets"])]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, target.shape, box["offsets"], box["lengths"])]
            if any(h <= low for low, h in zip(lo, hi)) or target.numel() == 0:
                continue
            strides = _contiguous_strides(box["lengths"])
            first = sum((low - o) * s for low, o, s in zip(lo, box["offsets"], strides))
            last = sum((h - 1 - o) * s for h, o, s in zip(hi, box["offsets"], strides))
            raw = self.read(box["rank"], key, first * target.element_size(), (last + 1) * target.element_size())
            flat = torch.from_numpy(raw).view(dtype)
            block = flat.as_strided([h - low for low, h in zip(lo, hi)], strides) if target.dim() else flat.reshape(())
            region = target[tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets))]
            with torch.no_grad():
                region.copy_(block)

    def _check_box(self, key: str, info: dict[str, Any], box: dict[str, Any]) -> None:
        """The rank's own manifest must agree with what the global view says it holds."""
        opened = self.rank(box["rank"])
        stored = opened.doc["tensors"].get(key)
        claimed = {"global_shape": info["shape"], "offsets": box["offsets"]}
        if stored is None or stored["dtype"] != info["dtype"] or stored["shape"] != box["lengths"] \
                or stored.get("box") != claimed:
            raise CheckpointFormatError(f"{opened.manifest} and the global view of {self.reader.path} disagree "
                                        f"about tensor {key!r} (box of rank {box['rank']})")

    def consolidate(self, keys: Iterable[str], device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Full tensors of the global view, assembled from every box."""
        out = {}
        for key in keys:
            info = self.index[key]
            full = torch.empty(info["shape"], dtype=torch_dtype(info["dtype"], f"{self.reader.path}: {key!r}"))
            self.fill(key, full, (0,) * full.dim())
            out[key] = full if device is None else full.to(device)
        return out


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def target_block(key: str, target: torch.Tensor, global_shape: list[int]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The local tensor a target owns and its offsets in the global tensor (a plain target is the whole)."""
    if list(target.shape) != list(global_shape):
        kind = "DTensor" if is_dtensor(target) else "tensor"
        raise CheckpointMismatchError(f"tensor {key!r} has global shape {global_shape} in the checkpoint, the "
                                      f"target {kind} {list(target.shape)}")
    if is_dtensor(target):
        return local_block(target)
    return target, (0,) * target.dim()


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
        mine = {k for k, info in doc["tensors"].items() if info.get("box") is None} if own else set()
        unknown = sorted(set(targets) - set(files.index) - mine)
        if unknown:
            raise CheckpointMismatchError(f"{reader.path} holds no tensor for the targets {unknown[:8]} "
                                          f"({len(unknown)} in all)")
        loaded: dict[str, torch.Tensor] = {}
        for key, target in targets.items():
            if key in files.index:
                files.fill(key, *target_block(key, target, files.index[key]["shape"]))
            else:
                _copy_whole(files, rank, key, target)
            loaded[key] = target
        tree = doc["tree"] if own else _drop_per_rank(doc["tree"])
        needed = _tensor_keys(tree) - set(loaded)
        loaded.update(files.consolidate(sorted(needed & set(files.index))))
        loaded.update({k: files.read_whole(rank, k) for k in sorted(needed - set(files.index))})
        return unflatten(tree, loaded, f"{reader.path}: rank {rank if own else 0}'s manifest")


def tensor_targets(state: Any) -> dict[str, torch.Tensor]:
    """The tensor leaves of a nested state, keyed as a checkpoint of that state names its tensors."""
    return dict(flatten(state)[1])


def _copy_whole(files: ShardFiles, rank: int, key: str, target: torch.Tensor) -> None:
    stored = files.read_whole(rank, key)
    if stored.dtype != target.dtype or stored.shape != target.shape:
        raise CheckpointMismatchError(f"tensor {key!r} is {stored.dtype}{list(stored.shape)} in the checkpoint, the "
                                      f"target {target.dtype}{list(target.shape)}")
    with torch.no_grad():
        target.copy_(stored)


def _drop_per_rank(tree: Any) -> Any:
    """The tree with every ``PerRank`` value replaced by None (for a rank the checkpoint has no part for)."""
    if isinstance(tree, list):
        return [_drop_per_rank(v) for v in tree]
    if isinstance(tree, dict):
        if set(tree) == {"$per_rank"}:
            return None
        return {k: _drop_per_rank(v) for k, v in tree.items()}
    return tree


def _tensor_keys(tree: Any) -> set[str]:
    """Every ``$tensor`` key a tree refers to."""
    if isinstance(tree, list):
        return set().union(*(_tensor_keys(v) for v in tree))
    if isinstance(tree, dict):
        if set(tree) == {"$tensor"} and isinstance(tree["$tensor"], str):
            return {tree["$tensor"]}
        return set().union(*(_tensor_keys(v) for v in tree.values()))
    return set()
