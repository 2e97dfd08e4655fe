"""Checkpoint names for ``LazyCheckpoint``: ModelCheckpoint's file names as symlinks to step directories.

The engine writes ``dirpath/step-NNNNNNN/``. ``ModelCheckpoint`` thinks in file names built from its
``filename`` template (``epoch=1-step=40.ckpt``, ``last.ckpt``). Each such name becomes a relative symlink
``epoch=1-step=40.ckpt -> step-0000040``, created only after that step is committed; several names may point
at one step (a top-k name and ``last.ckpt`` saved at the same step share one directory). A step directory is
deleted when ModelCheckpoint has dropped every name that pointed at it and ``keep_last_k`` does not keep it.
"""

from __future__ import annotations

import logging
import os
import shutil

from lazyckpt.format import STEP_DIR

logger = logging.getLogger(__name__)
_TMP_SUFFIX = ".lazyckpt-link"


def link_alias(alias: str, step_dir: str) -> None:
    """Point ``alias`` at ``step_dir`` with a relative symlink, replacing what was there atomically."""
    parent = os.path.dirname(alias)
    os.makedirs(parent, exist_ok=True)
    if os.path.isdir(alias) and not os.path.islink(alias):
        shutil.rmtree(alias)  # a real directory in the way (e.g. another tool's checkpoint of that name)
    tmp = os.path.join(parent, f".{os.path.basename(alias)}{_TMP_SUFFIX}")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.relpath(step_dir, parent), tmp)
    os.replace(tmp, alias)


def unlink_alias(alias: str) -> int | None:
    """Remove the name ``alias``; returns the step it pointed at (None if it was not a lazyckpt alias)."""
    step = alias_step(alias)
    if os.path.islink(alias):
        os.unlink(alias)
    elif os.path.isfile(alias):
        os.remove(alias)  # an ordinary checkpoint file of ModelCheckpoint's: it would have removed it too
    return step


def alias_step(alias: str) -> int | None:
    """The step a symlink alias points at, or None."""
    if not os.path.islink(alias):
        return None
    match = STEP_DIR.fullmatch(os.path.basename(os.path.normpath(os.readlink(alias))))
    return int(match.group(1)) if match else None


def aliased_steps(dirpath: str) -> set[int]:
    """Steps that some symlink directly inside ``dirpath`` points at (names from this run or earlier ones)."""
    steps = set()
    try:
        entries = list(os.scandir(dirpath))
    except FileNotFoundError:
        return steps
    for entry in entries:
        step = alias_step(entry.path) if entry.is_symlink() else None
        if step is not None:
            steps.add(step)
    return steps


def steps_to_delete(committed: list[int], candidates: set[int], protected: set[int],
                    keep_last_k: int | None) -> list[int]:
    """Pure retention decision. ``candidates`` lost their last name; with ``keep_last_k`` every committed step
    beyond the newest k is a candidate too. Protected steps and the newest ``keep_last_k`` always stay: a
    checkpoint survives as long as either save_top_k/save_last (its names) or keep_last_k keeps it."""
    newest_first = sorted(committed, reverse=True)
    kept_by_recency = set(newest_first[:keep_last_k]) if keep_last_k is not None else set()
    if keep_last_k is not None:
        candidates = candidates | set(newest_first[keep_last_k:])
    return sorted(s for s in candidates if s in set(committed) and s not in protected | kept_by_recency)


def resolve_step(path: str | None, dirpath: str) -> int | None:
    """The step of ``path`` when it is (or links to) a step directory of ``dirpath``, else None."""
    if not path:
        return None
    real = os.path.realpath(path)
    if os.path.dirname(real) != os.path.realpath(dirpath):
        return None
    match = STEP_DIR.fullmatch(os.path.basename(real))
    return int(match.group(1)) if match else None
