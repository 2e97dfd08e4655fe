"""The local level: a checkpointer's directory, which rank leads it, and what it does to the ``step-N`` directories
there.

Each rank locks the directory for itself (a second live checkpointer of the same rank is refused). At construction
the ranks that share a directory agree on its leader, which clears the leftovers of a crash; only the leader
renames or deletes in the directory, so ranks sharing it never race. ``latest()`` must be the checkpoint
of the run that is training now, so a save of a step lower than a committed one is refused or the newer ones are
moved aside; ``keep_last_k`` removes the oldest after each commit, never one still uploading (that one goes once its upload ends).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

from lazyckpt.config import CheckpointConfig, OnOlderStep
from lazyckpt.errors import DirectoryLockedError, StepOrderError
from lazyckpt.format.catalog import committed_steps
from lazyckpt.format.files import PARTIAL_SUFFIX, SUPERSEDED_SUFFIX, step_dirname
from lazyckpt.levels.retention import steps_to_purge
from lazyckpt.ranks.rendezvous import Rendezvous, leader_of
from lazyckpt.storage import Storage, StorageLock
from lazyckpt.storage.local import process_identity

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from lazyckpt.levels.remote.upload import RemoteLevel


def meet_ranks(dirpath: str, storage: Storage, config: CheckpointConfig, store: Any) -> Rendezvous | None:
    """Without a store, rank 0 clears crash leftovers; with one, the ranks agree who leads each directory (the
    leader clears them). Returns the rendezvous the ranks commit through, or None."""
    if config.world_size == 1 or store is None:
        if config.rank == 0:
            remove_partials(dirpath, storage)
        return None
    return Rendezvous(store, rank=config.rank, world_size=config.world_size, dirpath=dirpath, storage=storage,
                      timeout_s=config.commit_timeout_s,
                      peer_timeout_s=config.peer_timeout_s, clear_dir=lambda: remove_partials(dirpath, storage))


class CommittedSteps:
    """The committed steps of one checkpointer's directory, and the changes it makes to them.

    The training thread calls :meth:`check_order` and :meth:`remove`; the commit thread calls
    :meth:`note_committed` and :meth:`purge`, which removes through :meth:`remove`. Both threads update the newest-step cache, under one lock.
    """

    def __init__(self, dirpath: str, storage: Storage, config: CheckpointConfig, *,
                 rendezvous: Rendezvous | None, remote: RemoteLevel | None) -> None:
        self.dirpath, self.storage, self.config = dirpath, storage, config
        self._rendezvous = rendezvous
        self._remote = remote
        self._newest: int | None = None
        """Cache of the newest committed step (None: list the directory when next needed)."""
        self._newest_lock = threading.Lock()
        """Held while the cache is read and refreshed: a commit landing during a listing must not be lost."""
        self._purge_lock = threading.Lock()
        """One purge at a time: the commit thread's after a commit, the uploader thread's after an upload."""
        if remote is not None:
            remote.on_released = lambda step: self.purge()

    @property
    def leads(self) -> bool:
        """This rank removes, moves and purges in its directory (rank 0, or its directory's leader)."""
        return self.config.rank == leader_of(self._rendezvous)

    def check_order(self, step: int) -> None:
        """Refuse (or make room for) a step lower than the newest committed one: ``latest()`` must be the
        checkpoint of the run that is training now."""
        with self._newest_lock:
            if self._newest is not None and step > self._newest:
                return
            committed = committed_steps(self.dirpath, self.storage)
            newer = sorted(s for s in committed if s > step)
            self._newest = max(committed, default=-1)
        if not newer:
            return
        if self.config.on_older_step is OnOlderStep.ERROR:
            raise StepOrderError(
                f"step {step} is lower than the committed step(s) {newer} in {self.dirpath}, which latest() would "
                "keep returning; to resume from an older checkpoint pass on_older_step='move_aside' (renames the "
                "newer ones to step-N.superseded) or remove() them first")
        if self.leads:
            for newer_step in newer:
                move_aside(self.dirpath, newer_step, self.storage)
        with self._newest_lock:
            self._newest = None

    def remove(self, step: int) -> bool:
        """Delete the committed checkpoint of ``step``; False if there was none.

        A rename to a ``*.partial`` name comes first, so a crash mid-delete leaves debris the next checkpointer
        removes, never a half-deleted "committed" checkpoint.
        """
        path = os.path.join(self.dirpath, step_dirname(step))
        with self._newest_lock:
            if step == self._newest:  # removing an older step leaves the newest as it is
                self._newest = None
        doomed = os.path.join(self.dirpath, f".purge-{step_dirname(step)}{PARTIAL_SUFFIX}")
        try:
            self.storage.rename(path, doomed, sync=False)
        except FileNotFoundError:
            return False
        self.storage.remove_tree(doomed)
        return True

    def note_committed(self, step: int) -> None:
        """Commit thread, once ``step`` is visible: it is the newest now."""
        with self._newest_lock:
            if self._newest is not None:
                self._newest = max(self._newest, step)

    def purge(self, just_committed: int | None = None) -> None:
        """On the leading rank, apply ``keep_last_k`` (never to a step the remote level still holds, nor to the
        newest or ``just_committed``). Called by the commit thread after a commit (the new step went to the remote
        level first), by the uploader thread once a held step's upload ends, and by ``close()`` once all ended."""
        if not self.leads or self.config.keep_last_k is None:
            return
        with self._purge_lock:
            steps = list(committed_steps(self.dirpath, self.storage))
            if not steps:
                return
            uploading = [s for s in steps if self._remote is not None and self._remote.holds(s)]
            newest = max(steps) if just_committed is None else just_committed
            for step in steps_to_purge(steps, self.config.keep_last_k, just_committed=newest, protected=uploading):
                self.remove(step)

    def purge_after_uploads(self) -> None:
        """At close, every upload has ended: apply ``keep_last_k`` to the steps they held (normally the uploader
        thread did already; a failed upload's step awaited its retry until now)."""
        try:
            self.purge()
        except Exception as e:  # noqa: BLE001 - every checkpoint is committed; only clean-up failed
            logger.warning("lazyckpt: keep_last_k clean-up at close failed: %r", e)


class DirectoryLock:
    """An exclusive lock on ``dirpath/.lock-rankNNNNN``, taken through the storage (dropped if the process dies).

    Rank 0 also leaves a note of its job beside its lock (``.job-rank00000.json``: world size, process id, host),
    so that a process calling itself another rank of a live job of another size on this host is refused at once
    instead of reporting that job's checkpoints as its own (the commit checks it too, for ranks that start first or
    on another host).

    ``made``: the caller created ``dirpath`` for this job. Such a directory, or one holding only other ranks' locks
    (a peer of this job made it), is this job's: :meth:`release` with ``tidy`` removes the lock file and, when that
    leaves it empty, the directory, so a job that saved nothing leaves nothing behind (in a directory it did not
    make, the lock file goes; the directory stays).
    """

    def __init__(self, dirpath: str, rank: int, storage: Storage, world_size: int = 1, *,
                 made: bool = False) -> None:
        self.path = os.path.join(dirpath, f".lock-rank{rank:05d}")
        self._note = os.path.join(dirpath, JOB_NOTE) if rank == 0 else None
        self._dirpath, self._storage = dirpath, storage
        names = storage.list_dir(dirpath)
        self._ours = made or (bool(names) and all(_is_lock(n) for n in names))
        try:
            self._lock: StorageLock | None = storage.lock(self.path)
        except BlockingIOError:
            raise DirectoryLockedError(
                f"another live LazyCheckpointer writes {dirpath} as rank {rank}; close() it first or use "
                "another dirpath"
            ) from None
        try:
            if self._note is None:
                _refuse_another_jobs_rank(dirpath, rank, world_size, storage)
            else:
                note = {"world_size": world_size, "pid": os.getpid(), "host": socket.gethostname(),
                        "process": process_identity(os.getpid())}
                storage.write_atomic(self._note, json.dumps(note).encode(), sync=False)
        except BaseException:
            self.release()
            raise

    def release(self, *, tidy: bool = False) -> None:
        """Unlock; with ``tidy``, leave nothing in a directory of this job that holds nothing but locks."""
        if self._lock is None:
            return
        try:
            if self._note is not None and self._storage.stat(self._note) is not None:
                self._storage.remove_file(self._note)
            unused = tidy and all(_is_lock(n) for n in self._storage.list_dir(self._dirpath))
            if unused and self._storage.stat(self.path) is not None:
                self._storage.remove_file(self.path)  # while still held: no other writer can hold it meanwhile
        except FileNotFoundError:  # another rank of this job tidied the whole directory away (a host folder)
            unused = False
        except OSError as e:  # tidying is a courtesy: the lock is released whatever the directory does
            logger.warning("lazyckpt: could not tidy %s at close: %r", self._dirpath, e)
            unused = False
        self._lock.release()
        self._lock = None
        try:
            if unused and self._ours and not self._storage.list_dir(self._dirpath):
                self._storage.remove_tree(self._dirpath)
        except OSError as e:
            logger.warning("lazyckpt: could not remove the unused directory %s: %r", self._dirpath, e)


def _is_lock(name: str) -> bool:
    return name.startswith(".lock-rank") or name == JOB_NOTE


JOB_NOTE = ".job-rank00000.json"


def _refuse_another_jobs_rank(dirpath: str, rank: int, world_size: int, storage: Storage) -> None:
    """Raise when a live rank 0 on this host writes ``dirpath`` for a job of another size."""
    try:
        note = json.loads(storage.read_bytes(os.path.join(dirpath, JOB_NOTE), max_bytes=4096))
        size, pid, host, who = int(note["world_size"]), int(note["pid"]), str(note["host"]), note["process"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no note (rank 0 not started, or none live): the commit checks the step it finds
    # Live only when the very process that wrote the note still runs here: a crash leaves the note behind, and its
    # number may be reused by another process (or name one in another container sharing the host name).
    if size == world_size or host != socket.gethostname() or who is None or process_identity(pid) != who:
        return
    raise DirectoryLockedError(
        f"{dirpath} is written by a live {size}-rank job (rank 0 is process {pid}); this process says it is rank "
        f"{rank} of {world_size}. Give each job its own dirpath, or start every rank of one job with the same "
        f"world_size (if no such job runs, remove {os.path.join(dirpath, JOB_NOTE)})")


def remove_partials(dirpath: str, storage: Storage) -> list[str]:
    """Delete ``*.partial`` directories and stray temp files a crash left behind; returns what was removed."""
    removed = []
    for name in storage.list_dir(dirpath):
        if name.endswith(PARTIAL_SUFFIX):
            storage.remove_tree(os.path.join(dirpath, name))
            removed.append(name)
    if removed:
        logger.info("lazyckpt: removed %d partial checkpoint(s) left by an earlier run in %s", len(removed), dirpath)
    return removed


def move_aside(dirpath: str, step: int, storage: Storage) -> str:
    """Rename the committed checkpoint of ``step`` to ``step-N.superseded`` (``.superseded-2``, ... when taken):
    kept for the user, but no longer a committed checkpoint. Returns the new path."""
    name = step_dirname(step)
    for attempt in range(1, 1000):
        suffix = SUPERSEDED_SUFFIX if attempt == 1 else f"{SUPERSEDED_SUFFIX}-{attempt}"
        target = os.path.join(dirpath, name + suffix)
        if storage.stat(target) is None:
            storage.rename(os.path.join(dirpath, name), target, sync=True)
            logger.warning("lazyckpt: moved the newer checkpoint %s aside to %s (on_older_step='move_aside')",
                           name, target)
            return target
    raise FileExistsError(f"{dirpath} holds 999 superseded copies of {name}; delete some of them")
