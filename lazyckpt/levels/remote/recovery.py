"""After a crash: the committed local steps that never reached the remote level are uploaded first.

The host level (:mod:`lazyckpt.levels.host`) commits each snapshot in shared memory before its copy to ``dirpath``
(its remote level, ``file://``); a crash between the two must lose nothing. So a new checkpointer uploads every
committed local step newer than what the remote holds before it returns, on every rank together.

The ranks first agree on which steps those are (through the process group's store): a step goes up when every rank
holds it on one level or the other and some rank's remote lacks it. With a ``dirpath`` per node one node may have
copied a step to disk before the crash while another had not, so each rank uploads only what its own remote lacks
and still takes part in the meeting of every agreed step: no rank waits for a step another never uploads. A local
step newer than any step every rank holds is moved aside: resuming from it would put this node's ranks at another
step than the others.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from lazyckpt.errors import CheckpointFormatError, CommitAbandoned, RanksDisagreeError
from lazyckpt.format.catalog import committed_steps
from lazyckpt.format.files import step_dirname
from lazyckpt.levels.directory import move_aside
from lazyckpt.levels.remote.contents import remote_steps, remove_remote_step
from lazyckpt.levels.remote.meeting import upload_attempt
from lazyckpt.storage.urls import join

if TYPE_CHECKING:
    from lazyckpt.levels.remote.upload import RemoteLevel

logger = logging.getLogger(__name__)


def recover_local_steps(level: RemoteLevel, local_root: str) -> list[int]:
    """Upload now the committed steps of ``local_root`` that the remote lacks (see the module docstring); returns
    the steps agreed on, oldest first. A rank whose own copy of a step fails its checks removes that copy and
    gives the step up (on every rank: no remote commits it); it is then never loaded either."""
    local = committed_steps(local_root, level.local)
    here = set(remote_steps(*level.listed_at)[0])
    due, beyond = _agree(level, set(local), here)
    if beyond is not None:
        if level.rendezvous is None or level.rendezvous.leader == level.rank:  # the local folder's leader
            _set_aside(level, local_root, [s for s in local if s > beyond])
        if level.leads:  # the host level's remote is a file:// directory: renamed in place by its leader
            _set_aside(level, level.url.removeprefix("file://"), [s for s in here if s > beyond])
    if level.rendezvous is not None:  # no rank looks for its newest step before its leader moved those aside
        level.rendezvous.exchange("set-aside", b"")
    for step in due:
        _recover_step(level, step, local.get(step, ""), uploaded=step in here)
    if due and level.leads:
        level.prune(due[-1])
    return due


def _agree(level: RemoteLevel, local: set[int], here: set[int]) -> tuple[list[int], int | None]:
    """``(due, newest)``: the steps due (every rank holds them on one level or the other, and some rank's remote
    lacks them and is older; one rank alone: its local steps newer than its remote's newest), and the newest step
    every rank holds on one level or the other (None: no such step, or one rank alone)."""
    local = {s for s in local if s % level.every_n == 0}
    newest_here = max(here, default=-1)
    if level.rendezvous is None:
        return sorted(s for s in local if s > newest_here), None
    mine = json.dumps({"local": sorted(local), "here": sorted(here), "newest": newest_here}).encode()
    views = [json.loads(v) for v in level.rendezvous.exchange("recover", mine)]
    held = [set(v["local"]) | set(v["here"]) for v in views]
    everywhere = set.intersection(*held)
    if not everywhere and any(held):
        raise RanksDisagreeError(
            "lazyckpt: the ranks hold no checkpoint step in common (a node's copies were all lost), so they cannot "
            f"resume together; steps by rank: {_by_rank(held)}. Restore the lost ranks' steps (e.g. from a remote "
            "copy), or move every rank's dirpath and host folder aside to start over")
    due = sorted(s for s in everywhere if any(s > v["newest"] and s not in v["here"] for v in views))
    return due, max(everywhere, default=None)


def _by_rank(held: list[set[int]]) -> str:
    shown = [f"{rank}: {sorted(steps)[-3:]}" for rank, steps in enumerate(held)][:16]
    return "{" + ", ".join(shown) + (", ..." if len(held) > 16 else "") + "}"


def _set_aside(level: RemoteLevel, root: str, steps: list[int]) -> None:
    """Move ``steps`` of ``root`` aside (kept, never ``latest()``): newer than any step every rank holds, so
    resuming from them would resume this node's ranks at another step than the others (their copies died with a
    node)."""
    for step in sorted(steps):
        moved = move_aside(root, step, level.local)
        logger.warning("lazyckpt: step %d is not held by every rank (its other copies were lost); this node's copy "
                       "is kept at %s and not resumed from", step, moved)


def _recover_step(level: RemoteLevel, step: int, local_dir: str, *, uploaded: bool) -> None:
    url, attempt = join(level.url, step_dirname(step)), upload_attempt(f"recover-{step}", False)
    try:
        if uploaded:  # this rank's remote committed it before the crash: only meet the ranks that upload it
            level.meeting.commit(attempt, url, local_dir, lambda: 0)
        else:
            level.upload_step(url, local_dir, attempt, check=True)
    except CheckpointFormatError as e:  # this rank's copy is damaged: it must never load, nor go up
        remove_remote_step(level.local, local_dir)
        logger.error("lazyckpt: step %d in %s fails its checks (%s); it is not committed in %s and is removed",
                     step, local_dir, e, level.url)
        return
    except CommitAbandoned as e:  # another rank's copy was damaged: no remote commits this step
        logger.error("lazyckpt: step %d is not committed in %s: %s", step, level.url, e)
        return
    if not uploaded:
        logger.warning("lazyckpt: step %d was committed in %s but not yet in %s when the last run ended; it is "
                       "committed there now", step, local_dir, level.url)
