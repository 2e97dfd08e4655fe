"""Directory ownership and crash leftovers: a per-rank lock, and removal of partial checkpoints."""

from __future__ import annotations

import logging
import os

from lazyckpt.errors import DirectoryLockedError
from lazyckpt.format.names import PARTIAL_SUFFIX, SUPERSEDED_SUFFIX, step_dirname
from lazyckpt.storage import Storage, StorageLock

logger = logging.getLogger(__name__)


class DirectoryLock:
    """An exclusive lock on ``dirpath/.lock-rankNNNNN``, taken through the storage (dropped if the process dies)."""

    def __init__(self, dirpath: str, rank: int, storage: Storage) -> None:
        self.path = os.path.join(dirpath, f".lock-rank{rank:05d}")
        try:
            self._lock: StorageLock | None = storage.lock(self.path)
        except BlockingIOError:
            raise DirectoryLockedError(
                f"another live LazyCheckpointer writes {dirpath} as rank {rank}; close() it first or use "
                "another dirpath"
            ) from None

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def remove_partials(dirpath: str, storage: Storage) -> list[str]:
    """Delete ``*.partial`` directories and stray temp files a crash left behind; returns what was removed."""
    removed = []
    for name in storage.list_dir(dirpath):
        if name.endswith(PARTIAL_SUFFIX):
            storage.remove_tree(os.path.join(dirpath, name))
            removed.append(name)
    if removed:
        logger.info("lazyckpt: removed %d partial checkpoint(s) left by an earlier run in %s", len(removed), dirpath)
    return removed


def move_aside(dirpath: str, step: int, storage: Storage) -> str:
    """Rename the committed checkpoint of ``step`` to ``step-N.superseded`` (``.superseded-2``, ... when taken):
    kept for the user, but no longer a committed checkpoint. Returns the new path."""
    name = step_dirname(step)
    for attempt in range(1, 1000):
        suffix = SUPERSEDED_SUFFIX if attempt == 1 else f"{SUPERSEDED_SUFFIX}-{attempt}"
        target = os.path.join(dirpath, name + suffix)
        if storage.stat(target) is None:
            storage.rename(os.path.join(dirpath, name), target, sync=True)
            logger.warning("lazyckpt: moved the newer checkpoint %s aside to %s (on_older_step='move_aside')",
                           name, target)
            return target
    raise FileExistsError(f"{dirpath} holds 999 superseded copies of {name}; delete some of them")
