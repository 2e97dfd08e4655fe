"""Pure decisions about which committed checkpoints to keep, plus listing what is committed."""

from __future__ import annotations

import os
from collections.abc import Collection

from lazyckpt.format import MANIFEST, STEP_DIR
from lazyckpt.storage import FileKind, LocalStorage, Storage


def committed_steps(dirpath: str, storage: Storage | None = None) -> dict[int, str]:
    """Committed checkpoints under ``dirpath`` by step (a partial directory or one without manifest is not).

    A step directory counts when it is a real directory (not a link) holding a regular ``manifest.json``.
    """
    storage = storage if storage is not None else LocalStorage()
    found: dict[int, str] = {}
    try:
        names = storage.list_dir(dirpath)
    except (FileNotFoundError, NotADirectoryError):
        return found
    for name in names:
        match = STEP_DIR.fullmatch(name)
        path = os.path.join(dirpath, name)
        if match and _is_committed(storage, path):
            found[int(match.group(1))] = path
    return found


def _is_committed(storage: Storage, path: str) -> bool:
    here, manifest = storage.stat(path), storage.stat(os.path.join(path, MANIFEST))
    return here is not None and here.kind is FileKind.DIR and manifest is not None and manifest.kind is FileKind.FILE


def steps_to_purge(steps: list[int], keep_last_k: int | None, *, just_committed: int,
                   protected: Collection[int] = (), released: Collection[int] = ()) -> list[int]:
    """Committed steps to remove, newest first.

    A step is removed when it is beyond the newest ``keep_last_k`` or when its caller ``released`` it (e.g. the
    last name pointing at it was dropped), unless it is ``protected`` (named, resumed from, still in flight), among
    the newest ``keep_last_k``, or the one just committed: keeping always wins over removing.
    """
    newest_first = sorted(steps, reverse=True)
    doomed = set(released)
    kept = {just_committed, *protected}
    if keep_last_k is not None:
        doomed.update(newest_first[keep_last_k:])
        kept.update(newest_first[:keep_last_k])
    return [s for s in newest_first if s in doomed and s not in kept]
