"""Pure decisions about which committed checkpoints to keep, plus listing what is committed."""

from __future__ import annotations

import os

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


def steps_to_purge(steps: list[int], keep_last_k: int | None, *, just_committed: int) -> list[int]:
    """Steps to remove so that the newest ``keep_last_k`` remain; never the one just committed."""
    if keep_last_k is None:
        return []
    newest_first = sorted(steps, reverse=True)
    return [s for s in newest_first[keep_last_k:] if s != just_committed]
