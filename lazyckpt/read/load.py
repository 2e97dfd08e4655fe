"""Reading checkpoints back: ``load``, ``verify``, ``latest``. Strict, and never executes stored code.

``load`` and ``verify`` run the same checks (:class:`~lazyckpt.read.reader.CheckpointReader`): every file kind, size
cap, manifest and header seal, schema rule, tree node and chunk checksum.

Example:
    >>> path = latest("runs/ckpt")                      # doctest: +SKIP
    >>> state = load(path, map_location="cpu")          # doctest: +SKIP
    >>> state = load(latest("s3://bucket/run", storage_options={"anon": False}))   # doctest: +SKIP

Every function also takes an fsspec URL (``s3://``, ``gs://``, ``file://``, ``memory://``) for ``path``/``dirpath``,
with ``storage_options`` passed to fsspec: it is read through :class:`~lazyckpt.storage.fsspec.FsspecStorage`, with
fresh listings (another process's commit is seen at once) and the same checks as local files.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lazyckpt.errors import CheckpointNotFoundError
from lazyckpt.format.catalog import newest_committed
from lazyckpt.format.files import MANIFEST, PARTIAL_SUFFIX, step_of_dir
from lazyckpt.read.reader import CheckpointReader, Progress
from lazyckpt.read.shard_files import ShardFiles
from lazyckpt.storage import FileKind, LocalStorage, Storage, kind_of
from lazyckpt.storage.urls import host_dir, reads_url, storage_for
from lazyckpt.tree.decode import unflatten, with_aliases


@reads_url("dirpath")
def latest(dirpath: str | os.PathLike[str], *, storage: Storage | None = None,
           storage_options: dict[str, Any] | None = None, host_memory_dir: str | None = None) -> str | None:
    """The newest committed checkpoint directory (or URL) under ``dirpath``, or ``None`` when there is none.

    For a local ``dirpath``, a newer step in its host folder (``keep_in_memory="host"``: committed in shared memory
    under ``host_memory_dir``, None for the default root, before the crash that kept it from ``dirpath``) is that
    checkpoint; when both hold the newest step, ``dirpath``'s copy is given."""
    path, storage = storage_for(dirpath, storage, storage_options)
    if storage is not None:
        return newest_committed(storage, path)
    local, host = (newest_committed(LocalStorage(), where) for where in (path, host_dir(path, host_memory_dir)))
    return host if host is not None and (local is None or step_of_dir(host) > step_of_dir(local)) else local


@reads_url("path")
def checkpoint_step(path: str | os.PathLike[str], *, storage: Storage | None = None,
                    storage_options: dict[str, Any] | None = None) -> int:
    """The step a committed checkpoint directory (or URL) holds."""
    return CheckpointReader(*storage_for(path, storage, storage_options)).top["step"]


@reads_url("path")
def load(path: str | os.PathLike[str], *, map_location: str | torch.device | None = None, verify: bool = True,
         rank: int | None = None, storage: Storage | None = None, storage_options: dict[str, Any] | None = None) -> Any:
    """Load the state saved in a committed checkpoint directory.

    Tensor bytes are read straight into the returned tensors (on ``map_location``'s device through a small
    reused host buffer), and checksums are checked on worker threads while reading goes on. A tensor saved under
    several names (a tied weight, stored once: docs/FORMAT.md rule 22) comes back as *one* tensor object under
    all of them, as in the saved state: an in-place change under one name shows under the others.

    Args:
        path: a ``step-NNNNNNN`` directory (see :func:`latest`), or its URL on a remote level.
        map_location: device to put every tensor on (default: CPU).
        verify: check every chunk's checksum (on by default). Manifests and headers are always checked.
        rank: whose state to load in a multi-rank checkpoint (default 0): its :class:`~lazyckpt.PerRank` values
            and its own tensors; sharded and replicated tensors come back whole (consolidated from every rank's
            file), in any process, with no process group needed.
        storage: where the files live (default: local files).
        storage_options: passed to fsspec when ``path`` is a URL.

    Raises:
        CheckpointNotFoundError: ``path`` is not a committed checkpoint.
        CheckpointFormatError: the files break a format rule (the message names the file and the tensor, field
            or key path).
        CheckpointCorruptError: a checksum does not match (the message names file, tensor and chunk).
    """
    reader = CheckpointReader(*storage_for(path, storage, storage_options))
    rank = 0 if rank is None else rank
    if type(rank) is not int or not 0 <= rank < reader.world_size:
        raise ValueError(f"rank={rank!r} is out of range: {reader.path} was saved by {reader.world_size} rank(s); to "
                         "resume on another number of ranks, fill this run's state with "
                         "lazyckpt.load_into(path, state), which reshards")
    device = torch.device(map_location) if map_location is not None else None
    opened = reader.open_rank(rank)
    try:
        tensors = reader.read_whole(opened, verify=verify, device=device)
        others = [key for key in reader.top.get("tensors", {}) if key not in tensors]
        if others:  # the global view's tensors, consolidated from every rank's file
            with ShardFiles(reader, verify=verify) as files:
                tensors.update(files.consolidate(others, device))
        tensors = with_aliases(tensors, opened.doc.get("aliases", {}), opened.manifest)  # one tensor under both keys, as saved
        return unflatten(opened.doc["tree"], tensors, opened.manifest, depth_checked=True)
    finally:
        opened.close()


@reads_url("path")
def verify(path: str | os.PathLike[str], *, storage: Storage | None = None, progress: Progress | None = None,
           storage_options: dict[str, Any] | None = None) -> None:
    """Run every check :func:`load` runs, on every rank, without keeping the tensors; raises on the first problem.

    ``progress`` (optional) is called with the number of tensor bytes checked so far, piece by piece.
    """
    reader = CheckpointReader(*storage_for(path, storage, storage_options))
    for rank in range(reader.world_size):
        reader.check_rank(rank, progress=progress)


def check_committed(path: str, storage: Storage | None = None, *, advice: str = "or pass ckpt_path='last'") -> str:
    """``path``, unless it cannot be what a run resumes from: then :class:`~lazyckpt.CheckpointNotFoundError` says
    what it is instead (a directory of checkpoints, with its newest committed one and ``advice``; a checkpoint never
    committed; nothing, with the newest committed checkpoint next to it). Another tool's file passes."""
    storage = storage if storage is not None else LocalStorage()
    kind = kind_of(storage, path)
    if kind is FileKind.DIR and kind_of(storage, os.path.join(path, MANIFEST)) is not FileKind.FILE:
        newest = latest(path, storage=storage)
        if newest is not None:
            raise CheckpointNotFoundError(
                f"{path} is a directory of checkpoints, not one checkpoint; the newest committed one is {newest} "
                f"({advice.replace('<that step>', newest)})")
    if kind is None:
        partial = kind_of(storage, path + PARTIAL_SUFFIX) is FileKind.DIR
        hint = " It is still partial (never committed)." if partial else ""
        newest = latest(os.path.dirname(path) or ".", storage=storage)
        raise CheckpointNotFoundError(f"lazyckpt checkpoint {path} does not exist.{hint}"
                                      + (f" The newest committed checkpoint there is {newest}." if newest else ""))
    return path
