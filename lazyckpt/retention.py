"""Pure decisions about which committed checkpoints to keep, plus listing what is committed."""

from __future__ import annotations

import os
from collections.abc import Collection

from lazyckpt.format import MANIFEST, STEP_DIR


def committed_steps(dirpath: str) -> dict[int, str]:
    """Committed checkpoints under ``dirpath`` by step (a partial directory or one without manifest is not)."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(dirpath)
    except FileNotFoundError:
        return found
    for name in names:
        match = STEP_DIR.fullmatch(name)
        path = os.path.join(dirpath, name)
        if match and os.path.isfile(os.path.join(path, MANIFEST)):
            found[int(match.group(1))] = path
    return found


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
