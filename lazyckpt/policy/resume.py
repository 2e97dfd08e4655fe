"""What "resume from the last checkpoint" means in a directory that holds lazyckpt checkpoints and another tool's
checkpoint files (``ModelCheckpoint``'s ``last.ckpt``): the newest of both kinds by the time it was written, so
switching tools, in either direction, resumes instead of silently starting over; and where a run writes its steps
when ``dirpath`` holds an earlier run's (:func:`run_directory`: a run directory of its own, ``dirpath/run-001``),
so the step directories of two runs never collide.

Example:
    >>> newest_checkpoint("runs/ckpt", others=["runs/ckpt/last.ckpt"])       # doctest: +SKIP
    'runs/ckpt/last.ckpt'
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from lazyckpt.format.catalog import is_committed
from lazyckpt.format.files import MANIFEST, PARTIAL_SUFFIX, STEP_DIR
from lazyckpt.levels.host import host_folder_owner
from lazyckpt.read.load import latest
from lazyckpt.storage import FileKind, LocalStorage, Storage, kind_of

if TYPE_CHECKING:
    from lazyckpt.policy.options import SessionOptions


RUN_DIR = re.compile(r"run-([0-9]{3,})")
"""A run directory below a checkpoint directory (docs/FORMAT.md, "Run directories"). Use with ``fullmatch``."""


def run_dirs(dirpath: str, storage: Storage | None = None) -> list[str]:
    """``dirpath`` and its run directories, oldest first: each is a checkpoint directory of one run."""
    storage = storage if storage is not None else LocalStorage()
    if kind_of(storage, dirpath) is not FileKind.DIR:
        return [dirpath]
    runs = sorted((int(m.group(1)), name) for name in storage.list_dir(dirpath) if (m := RUN_DIR.fullmatch(name))
                  and kind_of(storage, os.path.join(dirpath, name)) is FileKind.DIR)
    return [dirpath, *(os.path.join(dirpath, name) for _, name in runs)]


def run_directory(dirpath: str, resumed_from: str | None, *, taken: Iterable[str] = (),
                  storage: Storage | None = None) -> str:
    """Where a run writes its step directories: next to the step it resumed from (``resumed_from``, a step
    directory of ``dirpath`` or of a run directory, or a name linking to one), else ``taken`` (one of ``dirpath``'s
    directories this process writes already: callbacks sharing it), else the first of ``dirpath`` and its run
    directories that holds no step yet, else a new run directory ``dirpath/run-NNN``."""
    storage = storage if storage is not None else LocalStorage()
    candidates = run_dirs(dirpath, storage)
    real = {storage.resolve(os.path.abspath(d)): d for d in candidates}
    if resumed_from:
        step_dir = storage.resolve(os.path.abspath(resumed_from))
        parent = os.path.dirname(step_dir)
        owner = host_folder_owner(storage, parent)  # a step in a host folder belongs to the directory it serves
        parent = storage.resolve(owner) if owner is not None else parent
        if STEP_DIR.fullmatch(os.path.basename(step_dir)) and parent in real:
            return real[parent]
    for path in taken:
        if storage.resolve(os.path.abspath(path)) in real:
            return real[storage.resolve(os.path.abspath(path))]
    for candidate in candidates:
        if kind_of(storage, candidate) is not FileKind.DIR or not any(
                STEP_DIR.fullmatch(name.removesuffix(PARTIAL_SUFFIX)) for name in storage.list_dir(candidate)):
            return candidate
    last = RUN_DIR.fullmatch(os.path.basename(candidates[-1])) if len(candidates) > 1 else None
    return os.path.join(dirpath, f"run-{(int(last.group(1)) if last else 0) + 1:03d}")


def newest_checkpoint(dirpath: str, *, others: Iterable[str] = (), storage: Storage | None = None,
                      host_level: bool = False, host_memory_dir: str | None = None) -> str | None:
    """The newest of ``dirpath``'s newest committed lazyckpt checkpoint (its own or a run directory's: the newest
    commit) and the other tool's checkpoints in ``others`` (files, or directories of a sharded save; names that are
    links, e.g. lazyckpt's own ``last.ckpt``, are skipped: they point at step directories already counted). A
    lazyckpt checkpoint's time is its commit (its manifest), another's when it was written (:func:`_written_at`).
    ``host_level``: a newer step in a directory's host folder under ``host_memory_dir`` counts (a crash kept it
    from the directory). ``None`` when there is neither."""
    storage = storage if storage is not None else LocalStorage()
    times: dict[str, float] = {}
    found = (latest(d, host_memory_dir=host_memory_dir) if host_level else latest(d, storage=storage)
             for d in run_dirs(dirpath, storage))
    for newest in filter(None, found):
        info = storage.stat(os.path.join(newest, MANIFEST))
        times[newest] = info.mtime if info is not None else float("-inf")
    for path in others:
        written = _written_at(storage, path)
        if written is not None:
            times[path] = written
    return max(times, key=times.__getitem__) if times else None


def _written_at(storage: Storage, path: str) -> float | None:
    """When another tool's checkpoint at ``path`` was written: a file's modification time, or for a directory
    (a sharded ``ModelCheckpoint``'s DCP folder, ``last.ckpt/``) its newest file's; None for a link (it names a
    step directory counted already), a lazyckpt step directory, or nothing."""
    info = storage.stat(path)
    if info is None or info.kind is FileKind.LINK:
        return None
    if info.kind is FileKind.FILE:
        return info.mtime
    if info.kind is not FileKind.DIR or storage.stat(os.path.join(path, MANIFEST)) is not None:
        return None
    files = [f for f in (storage.stat(os.path.join(path, name)) for name in storage.list_dir(path))
             if f is not None and f.kind is FileKind.FILE]
    return max((f.mtime for f in files), default=None)


def committed_copy(path: str, storage: Storage | None = None) -> str:
    """The path a resume from ``path`` goes by once its session is open: a step of a host folder, committed by then
    in the ``dirpath`` that folder serves (a host-level engine commits it there before it returns), is that step
    there, since a clean close frees the host folder; any other path, or a step not committed there, is itself."""
    storage = storage if storage is not None else LocalStorage()
    step_dir = os.path.abspath(os.fspath(path))
    owner = host_folder_owner(storage, os.path.dirname(step_dir))
    if owner is None or not STEP_DIR.fullmatch(os.path.basename(step_dir)):
        return path
    copy = os.path.join(owner, os.path.basename(step_dir))
    return copy if is_committed(storage, copy) else path


def resume_target(dirpath: str, options: SessionOptions, others: Iterable[str] = ()) -> str | None:
    """What ``ckpt_path="last"`` resumes in ``dirpath``: a newer checkpoint on the remote level is fetched first,
    then :func:`newest_checkpoint` picks among the local ones and ``others`` (another tool's files). None when
    there is nothing to resume."""
    options.newest_on_this_node(dirpath)
    if kind_of(LocalStorage(), dirpath) is not FileKind.DIR:
        return None
    return newest_checkpoint(dirpath, others=others, host_level=options.engine.get("keep_in_memory") == "host",
                             host_memory_dir=options.engine.get("host_memory_dir"))
