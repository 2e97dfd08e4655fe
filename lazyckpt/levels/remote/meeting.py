"""How rank 0 learns that every rank's upload of a step is durable before it writes the remote commit object.

Through the process group's store (:class:`StoreMeeting`, whenever the checkpointer has one): each rank announces
that its upload is durable under a key of its own attempt (the save's attempt number and whether this is the
retry), so an announcement left by an earlier, failed attempt never completes a new one; rank 0 writes the commit
object once every rank has announced, and the others wait for rank 0's word. A rank whose upload fails says so
under the same attempt, and every rank waiting on it gives up at once instead of at the timeout. Only store
operations are used: they are safe from the uploader thread, unlike collectives.

Without a store (one process, or ranks given explicitly with no process group), :class:`RemoteMeeting` meets on the
remote level itself, which every rank sees by definition: a rank's ``rank-NNNNN.json`` is uploaded after its
tensor file, so its presence means that rank's upload is complete.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from lazyckpt.format.checksum import sha256_hex
from lazyckpt.format.files import MANIFEST, rank_manifest
from lazyckpt.format.manifest import MAX_MANIFEST_BYTES
from lazyckpt.ranks.rendezvous import Rendezvous, poll_until
from lazyckpt.storage import Storage
from lazyckpt.storage.urls import join

TIMEOUT_OPTION = "remote_timeout_s"
WriteCommit = Callable[[], int]
"""Rank 0's commit: write the commit object once every rank's files are up; returns its bytes."""


def upload_attempt(save_attempt: int | str, retry: bool) -> str:
    """The store key of one upload: its save's attempt (counted alike on every rank) and which try this is."""
    return f"remote/{save_attempt}/{int(retry)}"


class StoreMeeting:
    """The ranks' uploads of one step meet through the process group's store (see the module docstring)."""

    def __init__(self, rendezvous: Rendezvous, *, rank: int, timeout_s: float) -> None:
        self.rendezvous, self.rank, self.timeout = rendezvous, rank, (timeout_s, TIMEOUT_OPTION)
        self.leader = 0
        """The rank that writes the commit object in this rank's remote directory: rank 0, or with one directory
        per node behind the host level, that directory's lowest rank (:meth:`RemoteLevel.share_url`)."""

    def commit(self, attempt: str, step_url: str, local_dir: str, write_commit: WriteCommit) -> int:
        """After this rank's files are up: on the leader, ``write_commit()`` once every rank announced ``attempt``
        (returns its bytes); elsewhere, wait until the leader did (returns 0). A rank announces only after its own
        files went up, so what the remote holds then is this save's, whatever an earlier run left there."""
        self.rendezvous.announce(attempt)
        if self.rank != self.leader:
            self.rendezvous.wait_committed(attempt, by=self.leader, timeout=self.timeout)
            return 0
        self.rendezvous.wait_everyone(attempt, timeout=self.timeout)
        nbytes = write_commit()
        self.rendezvous.committed(attempt)
        return nbytes

    def give_up(self, attempt: str, error: BaseException) -> None:
        """This rank's upload failed: no rank waits for it any longer, and rank 0 does not commit it."""
        self.rendezvous.abandon(attempt, f"upload failed: {error!r}")


class RemoteMeeting:
    """Without a store: rank 0 polls the remote for the other ranks' manifests, the others for its commit."""

    def __init__(self, storage: Storage, local: Storage, *, rank: int, world_size: int, timeout_s: float) -> None:
        self.storage, self.local = storage, local
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s

    def commit(self, attempt: str, step_url: str, local_dir: str, write_commit: WriteCommit) -> int:
        """Rank 0 waits until each other rank's manifest on the remote is the very one in ``local_dir`` (without a
        store the ranks share the directory), so a killed run's leftover manifest of the same step does not count,
        then writes the commit; the others wait for it."""
        if self.rank != 0:
            poll_until(lambda: self.storage.stat(join(step_url, MANIFEST)) is not None, self.timeout_s,
                       f"rank 0 to commit {step_url} ({TIMEOUT_OPTION})")
            return 0
        others = range(1, self.world_size)  # its own is up already
        known = {r: self._local_hash(local_dir, r) for r in others}
        poll_until(lambda: all(self._uploaded(step_url, r, known.get(r)) for r in others), self.timeout_s,
                   f"the other {self.world_size - 1} rank(s) to upload their files to {step_url} ({TIMEOUT_OPTION})")
        return write_commit()

    def _local_hash(self, local_dir: str, rank: int) -> str | None:
        path = os.path.join(local_dir, rank_manifest(rank))
        if self.local.stat(path) is None:
            return None
        return sha256_hex(self.local.read_bytes(path, max_bytes=MAX_MANIFEST_BYTES))

    def _uploaded(self, step_url: str, rank: int, sha: str | None) -> bool:
        name = join(step_url, rank_manifest(rank))
        if self.storage.stat(name) is None:
            return False
        return sha is None or sha256_hex(self.storage.read_bytes(name, max_bytes=MAX_MANIFEST_BYTES)) == sha

    def give_up(self, attempt: str, error: BaseException) -> None:
        """Nothing to tell: a rank that gave up uploads no manifest, and rank 0's wait runs out."""
