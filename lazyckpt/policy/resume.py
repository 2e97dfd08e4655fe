"""What "resume from the last checkpoint" means in a directory that holds lazyckpt checkpoints and another tool's
checkpoint files (``ModelCheckpoint``'s ``last.ckpt``): the newest of both kinds by the time it was written, so
switching tools, in either direction, resumes instead of silently starting over.

Example:
    >>> newest_checkpoint("runs/ckpt", others=["runs/ckpt/last.ckpt"])       # doctest: +SKIP
    'runs/ckpt/last.ckpt'
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from lazyckpt.format.files import MANIFEST
from lazyckpt.read.load import latest
from lazyckpt.storage import FileKind, LocalStorage, Storage, kind_of

if TYPE_CHECKING:
    from lazyckpt.policy.options import SessionOptions


def newest_checkpoint(dirpath: str, *, others: Iterable[str] = (), storage: Storage | None = None) -> str | None:
    """The newest of ``dirpath``'s newest committed lazyckpt checkpoint and the plain checkpoint files in
    ``others`` (names that are links, e.g. lazyckpt's own ``last.ckpt``, are skipped: they point at step
    directories already counted). A lazyckpt checkpoint's time is its commit (its manifest), a file's its
    modification time. ``None`` when there is neither."""
    storage = storage if storage is not None else LocalStorage()
    times: dict[str, float] = {}
    newest = latest(dirpath, storage=storage)
    if newest is not None:
        info = storage.stat(os.path.join(newest, MANIFEST))
        times[newest] = info.mtime if info is not None else float("-inf")
    for path in others:
        info = storage.stat(path)
        if info is not None and info.kind is FileKind.FILE:
            times[path] = info.mtime
    return max(times, key=times.__getitem__) if times else None


def resume_target(dirpath: str, options: SessionOptions, others: Iterable[str] = ()) -> str | None:
    """What ``ckpt_path="last"`` resumes in ``dirpath``: a newer checkpoint on the remote level is fetched first,
    then :func:`newest_checkpoint` picks among the local ones and ``others`` (another tool's files). None when
    there is nothing to resume."""
    options.newest_on_this_node(dirpath)
    if kind_of(LocalStorage(), dirpath) is not FileKind.DIR:
        return None
    return newest_checkpoint(dirpath, others=others)
