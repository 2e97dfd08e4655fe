"""Directory ownership and crash leftovers: a per-rank lock, and removal of partial checkpoints."""

from __future__ import annotations

import fcntl
import logging
import os

from lazyckpt.errors import DirectoryLockedError
from lazyckpt.format import PARTIAL_SUFFIX
from lazyckpt.storage import Storage

logger = logging.getLogger(__name__)


class DirectoryLock:
    """An exclusive ``flock`` on ``dirpath/.lock-rankNNNNN``; the kernel drops it if the process dies."""

    def __init__(self, dirpath: str, rank: int) -> None:
        self.path = os.path.join(dirpath, f".lock-rank{rank:05d}")
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise DirectoryLockedError(
                f"another live LazyCheckpointer writes {dirpath} as rank {rank}; close() it first or use "
                "another dirpath"
            ) from None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def remove_partials(dirpath: str, storage: Storage) -> list[str]:
    """Delete ``*.partial`` directories and stray temp files a crash left behind; returns what was removed."""
    removed = []
    for name in os.listdir(dirpath):
        if name.endswith(PARTIAL_SUFFIX):
            storage.remove_tree(os.path.join(dirpath, name))
            removed.append(name)
    if removed:
        logger.info("lazyckpt: removed %d partial checkpoint(s) left by an earlier run in %s", len(removed), dirpath)
    return removed
