"""The peer copy (``memory_peers=1``): each rank's newest host snapshot also lives in the host memory of another node.

The host level survives a crashed process, not a lost node. With a peer copy, once a step is committed in the host
folder each rank's files of it (its tensor file, its manifest, the commit object) go, on a background thread of
their own, to the rank that keeps its copies on the next node (:mod:`lazyckpt.ranks.topology`); each rank receives
the copies of the ranks it keeps in turn. The transfer runs over ``torch.distributed`` on a gloo group of its own
(:mod:`lazyckpt.levels.peer.wire`), never on the training thread, one step at a time: a save waits while two
steps' transfers are unfinished, as for the copy to ``dirpath``.

A kept copy lands in ``<host folder>/peer-rankNNNNN/step-N.partial`` and is renamed to ``step-N`` once all its
bytes are in. The two newest complete copies are kept (the older goes when the next one starts), so the newest
complete copy is always intact, and after a lost node every keeper still holds a step in common with the others. After a node is lost,
:func:`~lazyckpt.levels.peer.restore.restore_lost_ranks` brings its ranks' newest step back from these copies.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import re
import threading
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lazyckpt.format.catalog import committed_steps
from lazyckpt.format.files import MANIFEST, PARTIAL_SUFFIX, RANK_FILE, rank_file, rank_manifest, step_dirname
from lazyckpt.levels.peer.wire import Outgoing, PathOf, open_outgoing, transfer
from lazyckpt.ranks.topology import node_name, nodes_of, pair_ranks
from lazyckpt.storage import Storage
from lazyckpt.threads import UPLOAD_NICE, start_background_thread

if TYPE_CHECKING:
    from lazyckpt.config import CheckpointConfig
    from lazyckpt.ranks.rendezvous import Rendezvous

logger = logging.getLogger(__name__)

KEPT_PREFIX = "peer-rank"
"""In a host folder, ``peer-rankNNNNN/``: the copies this node keeps of rank NNNNN (of another node)."""
SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
"""A file name a peer may send: one plain name, never a path (nor ``..``)."""


def kept_dir(folder: str, source: int) -> str:
    return os.path.join(folder, f"{KEPT_PREFIX}{source:05d}")


class PeerLevel:
    """One rank's side of the peer copy: what it sends to its keeper, and the copies it keeps for others."""

    def __init__(self, folder: str, config: CheckpointConfig, storage: Storage, rendezvous: Rendezvous,
                 group: Any, keeper: dict[int, int], kept: dict[int, list[int]]) -> None:
        self.folder, self.config, self.storage, self.rendezvous = folder, config, storage, rendezvous
        self.rank, self.group = config.rank, group
        self.keeper = keeper
        """Every rank's keeper: the rank of the next node that receives its copies."""
        self.kept = kept.get(self.rank, [])
        """The ranks (of the previous node) whose copies this rank keeps."""
        self.failures = 0
        self._queue: queue.Queue[tuple[Outgoing, threading.Event] | None] = queue.Queue()
        self._rounds: list[threading.Event] = []
        """One per queued transfer, set when it ended: appended by the commit thread, read by the training thread."""
        self._rounds_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @classmethod
    def join(cls, folder: str, config: CheckpointConfig, storage: Storage,
             rendezvous: Rendezvous | None) -> PeerLevel | None:
        """The peer level ``config`` asks for (collective: every rank, at construction); None without
        ``memory_peers`` or with a single node (a warning says so).

        Raises:
            ValueError: ``memory_peers=1`` outside an initialized ``torch.distributed`` process group.
        """
        if not config.memory_peers:
            return None
        if rendezvous is None or not (dist.is_available() and dist.is_initialized()):
            raise ValueError("memory_peers=1 sends copies over torch.distributed: build the checkpointer inside an "
                             "initialized process group (torchrun, or torch.distributed.init_process_group), or "
                             "pass memory_peers=0")
        nodes = nodes_of([v.decode() for v in rendezvous.exchange("nodes", node_name().encode())])
        keeper, kept = pair_ranks(nodes)
        if not keeper:  # every rank sees the same nodes: all of them leave here, and none makes the group
            logger.warning("lazyckpt: memory_peers=1 but all %d ranks run on one node; there is no peer copy",
                           config.world_size)
            return None
        timeout = datetime.timedelta(seconds=config.commit_timeout_s)
        return cls(folder, config, storage, rendezvous, dist.new_group(backend="gloo", timeout=timeout), keeper, kept)

    # --- the engine's side ----------------------------------------------------------------------------------

    def submit(self, step: int, step_dir: str) -> None:
        """After ``step`` is committed in the host folder (commit thread): open this rank's files of it and queue
        their transfer. Every rank submits the same steps in the same order, so the transfers pair up."""
        names = [rank_file(self.rank, self.config.world_size), rank_manifest(self.rank), MANIFEST]
        if self.rank == self.rendezvous.leader:  # files no rank owns (the leader writes them), if any
            try:
                names += sorted(n for n in self.storage.list_dir(step_dir) if n not in names and not _owned(n))
            except OSError:  # gone already: the transfer still runs (empty), or the ranks' transfers would not pair
                pass
        done = threading.Event()
        with self._rounds_lock:
            self._rounds.append(done)
        if self._thread is None:
            self._thread = start_background_thread(self._run, name="lazyckpt-peer", nice=UPLOAD_NICE)
        self._queue.put((open_outgoing(self.storage, step_dir, names, step), done))

    def wait_backlog(self, keep: int) -> None:
        """Wait until at most ``keep`` transfers are unfinished (a save lets at most one run behind it)."""
        with self._rounds_lock:
            self._rounds = [done for done in self._rounds if not done.is_set()]
            waits = self._rounds[:max(len(self._rounds) - keep, 0)]
        for done in waits:
            done.wait()

    def close(self, *, free: bool) -> None:
        """Finish the queued transfers; with ``free``, remove the copies this rank keeps for others."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if free:
            for source in self.kept:
                self.storage.remove_tree(kept_dir(self.folder, source))

    def kept_steps(self) -> dict[int, list[int]]:
        """The complete copies this rank keeps of each of its sources (steps, oldest first), by source."""
        return {source: sorted(committed_steps(kept_dir(self.folder, source), self.storage)) for source in self.kept}

    # --- the transfer thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            outgoing, done = item
            try:
                self._exchange(outgoing)
            except Exception as e:  # noqa: BLE001 - the host and disk copies are intact; only this copy failed
                self.failures += 1
                logger.error("lazyckpt: the peer copy of step %d (rank %d to rank %d) failed; the previous copy is "
                             "kept: %r", outgoing.step, self.rank, self.keeper[self.rank], e)
            finally:
                outgoing.close()
                done.set()

    def _exchange(self, outgoing: Outgoing) -> None:
        # Every rank starts its transfer of a step together: the rings of local positions (0->2, 1->3, ...) would
        # drift apart otherwise, and after a lost node one rank's keeper could hold only steps another's lacks.
        dist.barrier(group=self.group)
        try:
            received = transfer(self.group, self.storage, {self.keeper[self.rank]: outgoing}, self.kept,
                                self._landing)
            for source, header in received.items():
                self._keep(source, header["step"])
        finally:
            for source in self.kept:  # a transfer cut short leaves its partial copy: never read, removed now
                self._remove_partials(source)

    def _landing(self, source: int, header: dict[str, Any]) -> PathOf | None:
        """Where ``source``'s copy of a step goes (None: it sent none, or names that are not its files)."""
        files = header.get("files") or []
        if not files or not all(isinstance(n, str) and SAFE_NAME.fullmatch(n) for n, _ in files):
            return None
        partial = os.path.join(kept_dir(self.folder, source), step_dirname(int(header["step"])) + PARTIAL_SUFFIX)
        self._prune(source, keep=1)  # room for the new copy: the newest complete one stays while it comes in (every
        # rank's transfer of the step before has ended: they start together)
        self.storage.remove_tree(partial)
        self.storage.make_dir(partial)
        return lambda name: os.path.join(partial, name)

    def _keep(self, source: int, step: int) -> None:
        """``source``'s copy of ``step`` is complete: it joins the previous one (the two newest are kept)."""
        final = os.path.join(kept_dir(self.folder, source), step_dirname(step))
        self.storage.remove_tree(final)  # a copy of the same step from before a restart
        self.storage.rename(final + PARTIAL_SUFFIX, final, sync=False)
        self._prune(source, keep=2)

    def _prune(self, source: int, *, keep: int) -> None:
        """Keep the ``keep`` newest complete copies of ``source``. Two once a copy is in, not one: the ranks'
        transfers start together but end at different times, so when a node dies one source's newest copy may be
        a step newer than another's; each keeper still holds the step before, which every rank can resume from."""
        steps = committed_steps(kept_dir(self.folder, source), self.storage)
        for step in sorted(steps)[:-keep]:
            self.storage.remove_tree(steps[step])

    def _remove_partials(self, source: int) -> None:
        where = kept_dir(self.folder, source)
        if self.storage.stat(where) is not None:
            for name in self.storage.list_dir(where):
                if name.endswith(PARTIAL_SUFFIX):
                    self.storage.remove_tree(os.path.join(where, name))


def _owned(name: str) -> bool:
    return name == MANIFEST or RANK_FILE.fullmatch(name) is not None or re.fullmatch(r"rank-[0-9]{5,}\.json", name) \
        is not None

