"""The Lightning checkpoint dict inside a lazyckpt checkpoint written by ``LazyCheckpoint``: read back as the dict
``Trainer.save_checkpoint`` would have written (with one rank's RNG states), and as the bytes of ``torch.save``
that ``torch.load(weights_only=True)`` accepts. Imports no Lightning: the CLI's export and the ``lazyckpt://``
file system use it as well as the Lightning integration. :func:`monitored_scores` reads the scores of its
``ModelCheckpoint`` top-k models (``lazyckpt ls``'s column), those bytes alone.

Example:
    >>> checkpoint = to_lightning_checkpoint("runs/ckpt/last.ckpt", rank=1)          # doctest: +SKIP
    >>> checkpoint["state_dict"].keys()                                              # doctest: +SKIP
"""

from __future__ import annotations

import io
import os
import warnings
from typing import Any

import torch

from lazyckpt.errors import CheckpointFormatError
from lazyckpt.interop.weights_only import check_weights_only, weights_only_safe
from lazyckpt.read.load import check_committed, load
from lazyckpt.read.reader import CheckpointReader
from lazyckpt.read.tensor_io import read_tensor_bytes
from lazyckpt.storage import Storage
from lazyckpt.storage.urls import storage_for
from lazyckpt.tree.decode import unflatten

EXTRA_KEY = "lazyckpt"
"""Top-level key of the Lightning checkpoint dict that holds lazyckpt's own additions (RNG states, rank)."""
LIGHTNING_KEYS = ("pytorch-lightning_version", "state_dict")


def to_lightning_checkpoint(path: str | os.PathLike[str], *, rank: int | None = None, map_location: Any = None,
                            verify: bool = True, storage: Storage | None = None,
                            storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Lightning checkpoint dict stored in a lazyckpt checkpoint written by ``LazyCheckpoint``.

    Args:
        path: a committed ``step-NNNNNNN`` directory or an alias (``last.ckpt``, ``epoch=1-step=40.ckpt``).
        rank: whose RNG states to attach (DDP writes one small file per rank); default rank 0.
        map_location: device for the tensors (default CPU).
        verify: check checksums while reading.
        storage: where the files live (default: local files, or fsspec for a URL).
        storage_options: passed to fsspec when ``path`` is a URL (``s3://bucket/run/step-0000040``).

    Raises:
        CheckpointNotFoundError: ``path`` is missing, partial (uncommitted) or a directory of checkpoints.
        CheckpointFormatError: it is a lazyckpt checkpoint but not a Lightning one, or its files are damaged.
    """
    path, storage = storage_for(path, storage, storage_options)
    path = check_committed(path, storage)
    state = load(path, map_location=map_location, verify=verify, storage=storage)
    if not isinstance(state, dict) or any(k not in state for k in LIGHTNING_KEYS):
        found = sorted(state)[:8] if isinstance(state, dict) else type(state).__name__
        raise CheckpointFormatError(f"{path} is a lazyckpt checkpoint but not a Lightning one (it has {found}, "
                                    f"not {list(LIGHTNING_KEYS)}); load it with lazyckpt.load() instead")
    extra = state.get(EXTRA_KEY)
    if rank and isinstance(extra, dict):
        extra["rng"] = _rank_rng(path, rank, verify, storage)
    return state


def _rank_rng(path: str, rank: int, verify: bool, storage: Storage | None) -> dict[str, Any] | None:
    try:
        return load(path, rank=rank, verify=verify, storage=storage)[EXTRA_KEY]["rng"]
    except ValueError:  # saved by fewer ranks than read it now
        warnings.warn(f"lazyckpt: {path} holds no RNG state for rank {rank} (it was saved by fewer ranks); "
                      "that rank keeps its current RNG state", RuntimeWarning, stacklevel=3)
        return None


def lightning_checkpoint_bytes(path: str | os.PathLike[str], *, verify: bool = True, storage: Storage | None = None,
                               storage_options: dict[str, Any] | None = None) -> bytes:
    """The Lightning checkpoint stored at ``path`` as ``torch.save`` bytes holding only tensors and plain values,
    so ``torch.load(..., weights_only=True)`` and ``LightningModule.load_from_checkpoint`` accept them: a
    ``Namespace`` becomes a dict, numpy values lists and scalars, an OmegaConf config its unresolved container
    (see :mod:`lazyckpt.interop.weights_only`). ``storage`` and ``storage_options`` as for
    :func:`to_lightning_checkpoint`."""
    checkpoint = weights_only_safe(to_lightning_checkpoint(path, verify=verify, storage=storage,
                                                           storage_options=storage_options))
    check_weights_only(checkpoint, os.fspath(path))
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


def monitored_scores(reader: CheckpointReader, names: set[str]) -> list[tuple[str, float]]:
    """``(monitor, score)`` for each ``ModelCheckpoint`` state in rank 0's ``callbacks`` whose top-k models
    (``best_k_models``: file path to score) include one of ``names``."""
    opened = reader.open_rank(0)
    try:
        tensors = reader.all_placeholders(opened)
        keys = {id(tensor): key for key, tensor in tensors.items() if key in opened.doc["tensors"]}
        state = unflatten(opened.doc["tree"], tensors, opened.manifest)
        callbacks = state.get("callbacks") if isinstance(state, dict) else None
        found = []
        for callback in callbacks.values() if isinstance(callbacks, dict) else ():
            if not isinstance(callback, dict) or not isinstance(callback.get("monitor"), str):
                continue
            for file, score in (callback.get("best_k_models") or {}).items():
                if os.path.basename(str(file)) in names and id(score) in keys:
                    key = keys[id(score)]
                    value = {key: torch.empty(score.shape, dtype=score.dtype)}
                    read_tensor_bytes(opened.handle, opened.file, opened.data_start,
                                      {key: opened.doc["tensors"][key]}, value, verify=True)
                    found.append((callback["monitor"], float(value[key])))
        return found
    finally:
        opened.close()
