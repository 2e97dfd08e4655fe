"""After a lost node: its ranks' newest step comes back from the copies their peers keep.

A job restarted on a replacement node finds that node's host folder empty (and its local ``dirpath`` too, if the
disk went with the node). At construction, before the host level commits host steps to ``dirpath``, every rank
says which steps it holds in its own host folder and which copies it keeps for others (through the store). The step
restored is the newest one that every rank can have: in its own host folder, or as a copy its keeper holds. The
ranks that lack it receive it from their keepers (over the peer group, on the training thread: nothing else runs
yet) into ``step-N.partial`` of their host folder; once every rank has, each such folder's leader renames it into
place. The host level then checks it (every chunk against its checksum) and commits it to ``dirpath`` as it does
after a crashed process (:mod:`lazyckpt.levels.remote.recovery`); a copy that fails its checks is removed, never
loaded. When no step is held by every rank this way, nothing is restored: ``dirpath`` and the remote level remain.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from lazyckpt.format.catalog import committed_steps
from lazyckpt.format.files import MANIFEST, PARTIAL_SUFFIX, rank_file, step_dirname
from lazyckpt.levels.peer.level import SAFE_NAME, PeerLevel, kept_dir
from lazyckpt.levels.peer.wire import PathOf, open_outgoing, transfer

logger = logging.getLogger(__name__)


def restore_lost_ranks(peer: PeerLevel | None, disk_dir: str) -> int | None:
    """Bring back the newest step every rank can have into the host folders that lack it (collective: every
    rank, at construction); returns that step, or None when no rank needed one or no step can be restored.
    ``disk_dir``: this rank's ``dirpath`` (a step there counts as held)."""
    if peer is None:
        return None
    mine = json.dumps(_holdings(peer, disk_dir)).encode()
    views = [json.loads(v) for v in peer.rendezvous.exchange("peer-restore", mine)]
    step = _newest_everywhere(views, peer.keeper)
    lacking = [] if step is None else [r for r, view in enumerate(views) if step not in view["own"]]
    if not lacking:
        return None
    _receive(peer, step, lacking)
    peer.rendezvous.exchange("peer-restored", b"")
    final = os.path.join(peer.folder, step_dirname(step))
    if peer.rank in lacking and peer.rank == peer.rendezvous.leader:
        peer.storage.rename(final + PARTIAL_SUFFIX, final, sync=False)
    peer.rendezvous.exchange("peer-placed", b"")
    logger.warning("lazyckpt: step %d of rank(s) %s came back from their peers' copies (their host memory was "
                   "lost)", step, lacking)
    return step


def _holdings(peer: PeerLevel, disk_dir: str) -> dict[str, Any]:
    """This rank's steps: on its own levels (host folder, ``dirpath``), and the copies it keeps by source."""
    mine = rank_file(peer.rank, peer.config.world_size)
    own = [s for where in (peer.folder, disk_dir) for s, path in committed_steps(where, peer.storage).items()
           if peer.storage.stat(os.path.join(path, mine)) is not None]
    return {"own": sorted(set(own)), "kept": {str(source): steps for source, steps in peer.kept_steps().items()}}


def _newest_everywhere(views: list[dict[str, Any]], keeper: dict[int, int]) -> int | None:
    """The newest step each rank holds on its own levels or as the copy its keeper holds."""
    available = []
    for rank, view in enumerate(views):
        available.append(set(view["own"]) | set(views[keeper[rank]]["kept"].get(str(rank), [])))
    common = set.intersection(*available)
    return max(common, default=None)


def _receive(peer: PeerLevel, step: int, lacking: list[int]) -> None:
    """Each keeper sends the copies it holds of ``lacking`` ranks; each of those receives its own."""
    sends = {}
    for source in peer.kept:
        if source in lacking:
            copy = os.path.join(kept_dir(peer.folder, source), step_dirname(step))
            sends[source] = open_outgoing(peer.storage, copy, peer.storage.list_dir(copy), step)
    receives = [peer.keeper[peer.rank]] if peer.rank in lacking else []
    partial = os.path.join(peer.folder, step_dirname(step) + PARTIAL_SUFFIX)
    leads = peer.rank == peer.rendezvous.leader  # the ranks of a folder write into one partial step: the commit
    # object (the same in every rank's copy) is the leader's to write

    def landing(source: int, header: dict[str, Any]) -> PathOf:
        if header.get("step") != step or not header.get("files") or not all(
                isinstance(n, str) and SAFE_NAME.fullmatch(n) for n, _ in header["files"]):
            raise RuntimeError(f"lazyckpt: rank {source} holds no copy of step {step} for rank {peer.rank} although "
                               "it said so; restart the job (nothing was restored)")
        peer.storage.make_dir(partial)
        return lambda name: os.path.join(partial, name if name != MANIFEST or leads else _aside(peer.rank))

    try:
        transfer(peer.group, peer.storage, sends, receives, landing)
    finally:
        for outgoing in sends.values():
            outgoing.close()
    if receives and not leads:
        peer.storage.remove_file(os.path.join(partial, _aside(peer.rank)))


def _aside(rank: int) -> str:
    return f".{MANIFEST}.rank{rank:05d}"
