"""Pure decisions about which committed checkpoints to keep (listing them is :mod:`lazyckpt.format.catalog`'s)."""

from __future__ import annotations

from collections.abc import Collection



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
