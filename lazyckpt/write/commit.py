"""How a checkpoint ends: committed by the commit protocol, or discarded, each exactly once (one object,
:class:`JobEnds`, per checkpointer).

**The ends.** A job's file is finalized (closed, fsynced) on the writer thread after its last write; its tree is
complete once the barrier evaluated its ``Deferred`` leaves on the training thread. Whichever of the two comes
second claims the commit (:class:`~lazyckpt.write.job.JobState` DURABLE -> COMMITTING under the job's lock), so
exactly one thread commits. Commits run in request order (``latest()`` never moves backwards), and never block the
shared writer when they wait for other ranks or earlier jobs. A failure anywhere becomes the job's error (delivered
to the training thread later) and the job is discarded: the other ranks are told, and what it left is removed.

**The protocol.** Order, for every rank: tensor file fsynced -> ``rank-NNNNN.json`` written atomically. Then the
ranks meet:

* through the process group's store (a :class:`~lazyckpt.ranks.rendezvous.Rendezvous`): each rank publishes that its
  files are durable, with its tensor boxes; once every rank of the job has, each directory's leader writes
  ``manifest.json`` (the global view of every tensor) and commits. No file is read to meet, so ranks need no
  shared directory, and every key belongs to one attempt, so a manifest left by a failed attempt never counts;
* without a store, through the shared directory: rank 0 waits for every rank's manifest there, then commits.

Committing is: write ``manifest.json`` atomically, rename ``step-N.partial`` to ``step-N`` and fsync the parent
directory. The rename is the commit point: a crash before it leaves only a partial directory that readers ignore.
No collectives are used (this runs off the training thread).

With one directory per node, every directory has a leader, and the leaders commit together
(:func:`publish_everywhere`): a step is committed in every directory or in none.

Failure rule (docs/design.md): a commit that raises leaves nothing visible. A failure of the rename itself or of
the directory fsync after it rolls the rename back, so a checkpoint whose ``wait()`` fails is never ``latest()``.
If even the roll-back fails, the directory stays visible and the commit is reported as having succeeded, with a
warning: ``wait()`` and ``latest()`` never disagree.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable

from lazyckpt._version import __version__
from lazyckpt.config import CheckpointConfig
from lazyckpt.errors import CheckpointDiscardedError, CommitAbandoned, DirectoryLockedError
from lazyckpt.format.files import MANIFEST, rank_file, rank_manifest
from lazyckpt.format.manifest import (MAX_MANIFEST_BYTES, encode_manifest, global_index, rank_manifest_doc,
                                      tensor_summary, top_manifest_doc)
from lazyckpt.format.schema import check_global_tensors
from lazyckpt.ranks.rendezvous import Rendezvous, leader_of, poll_until
from lazyckpt.storage import Storage
from lazyckpt.threads import start_background_thread
from lazyckpt.tree.encode import encode_resolved, fill_deferred
from lazyckpt.write.inflight import InFlight, deliver_error
from lazyckpt.write.job import CheckpointJob, JobState, remaining
from lazyckpt.write.writer import CallTask, SharedWriter

logger = logging.getLogger(__name__)


def commit(job: CheckpointJob, storage: Storage, *, sync: bool, timeout_s: float,
           rendezvous: Rendezvous | None = None) -> None:
    """Publish this rank's manifest and, on a directory's leader, commit once every rank is durable."""
    doc = rank_manifest_doc(step=job.step, rank=job.rank, world_size=job.world_size,
                            file=rank_file(job.rank, job.world_size), tree=job.tree, entries=job.entries,
                            checksums=job.checksums, header=job.header, boxes=job.boxes,
                            aliases=job.aliases)
    mine = encode_manifest(doc)
    write_rank_manifest(job, storage, mine, sync=sync, committed_on_sight=rendezvous is None and job.rank != 0)
    summary = tensor_summary(doc["tensors"])
    if rendezvous is not None:
        everyone = rendezvous.gather(job.attempt, summary)
        rendezvous.check_plans(job.attempt)  # save() met only the ranks whose state changed: check them all here
        if rendezvous.leader != job.rank:
            rendezvous.wait_committed(job.attempt)
            return
    elif job.rank != 0:
        wait_for_rank0_commit(job, storage, timeout_s, mine)
        return
    else:
        wait_for_other_ranks(job, storage, timeout_s)
        everyone = {0: summary}  # without a store every rank's tensors are its own: rank 0 alone may hold boxes
    index = global_index(everyone)
    check_global_tensors(index, job.world_size, f"the global view of step {job.step}")
    top = top_manifest_doc(step=job.step, world_size=job.world_size, library_version=__version__, tensors=index)
    storage.write_atomic(os.path.join(job.partial_dir, MANIFEST), encode_manifest(top), sync=sync)
    if rendezvous is not None and rendezvous.commits_together:
        publish_everywhere(job, storage, rendezvous, sync=sync)
    else:
        publish(job, storage, sync=sync)
    if rendezvous is not None:
        rendezvous.committed(job.attempt)


def write_rank_manifest(job: CheckpointJob, storage: Storage, mine: bytes, *, sync: bool,
                        committed_on_sight: bool) -> None:
    """Write ``rank-NNNNN.json`` atomically. ``committed_on_sight``: rank 0 commits (renames the partial directory)
    the moment the last rank's manifest appears, so this rank's fsync of that directory may find it renamed. Rank 0
    fsynced the directory before renaming it (writing ``manifest.json`` there), which made this entry durable too;
    :func:`wait_for_rank0_commit` then checks that the committed manifest is this one."""
    try:
        storage.write_atomic(os.path.join(job.partial_dir, rank_manifest(job.rank)), mine, sync=sync)
    except FileNotFoundError:
        if not committed_on_sight or storage.stat(os.path.join(job.final_dir, rank_manifest(job.rank))) is None:
            raise  # not renamed with this rank's manifest in it: a real failure


def publish_everywhere(job: CheckpointJob, storage: Storage, rendezvous: Rendezvous, *, sync: bool) -> None:
    """Several directories (one per node): the step is committed in all of them or in none. The leaders rename
    only once every one wrote its manifest; once all renamed, one atomic decision says whether the step stands, and
    a leader that gave up (``abort`` set first) undoes its own rename; the ranks waiting for their leader hear of
    it through the attempt's failure mark."""
    rendezvous.meet_leaders(job.attempt, "prepared")
    publish(job, storage, sync=sync)
    try:
        rendezvous.meet_leaders(job.attempt, "renamed")
        stands = rendezvous.decide(job.attempt, "commit") == "commit"
    except BaseException as error:
        if _decided_commit(rendezvous, job):
            return  # every leader had renamed and the step was declared committed: it stands here too
        _undo_rename(job, storage, error)
        raise
    if not stands:
        error = CommitAbandoned(f"lazyckpt: another directory's leader gave step {job.step} up; no rank commits it")
        _undo_rename(job, storage, error)
        raise error


def _decided_commit(rendezvous: Rendezvous, job: CheckpointJob) -> bool:
    """Propose ``abort``; True when ``commit`` had been decided first (False too when the store is gone)."""
    try:
        return rendezvous.decide(job.attempt, "abort") == "commit"
    except Exception:  # noqa: BLE001 - no decision can be read: give the step up here
        return False


def _undo_rename(job: CheckpointJob, storage: Storage, error: BaseException) -> None:
    if not _roll_back(job, storage, error):
        logger.error("lazyckpt: step %d was given up but stays committed in %s (undoing the rename failed): the "
                     "directories' latest() disagree; remove it", job.step, job.final_dir)


def publish(job: CheckpointJob, storage: Storage, *, sync: bool) -> None:
    """The commit point: rename the partial directory to its final name and make the rename durable."""
    try:
        storage.rename(job.partial_dir, job.final_dir, sync=False)
        if sync:
            storage.sync_dir(job.dirpath)
    except BaseException as error:
        if storage.stat(job.final_dir) is not None and not _roll_back(job, storage, error):
            return  # visible and complete: reported committed, so that wait() agrees with latest()
        raise


def _roll_back(job: CheckpointJob, storage: Storage, error: BaseException) -> bool:
    """Undo a rename whose durability is unknown; False when the checkpoint had to stay visible."""
    try:
        storage.rename(job.final_dir, job.partial_dir, sync=False)
    except Exception as again:  # noqa: BLE001 - the first error is the one to report
        logger.warning("lazyckpt: committing %s failed after the rename (%r) and undoing the rename failed too "
                       "(%r); the checkpoint stays visible", job.final_dir, error, again)
        return False
    try:
        storage.sync_dir(job.dirpath)
    except Exception as again:  # noqa: BLE001 - renamed back: a power loss could at worst bring the name back
        logger.warning("lazyckpt: undoing the rename of %s is not durable: %r", job.final_dir, again)
    return True


def wait_for_other_ranks(job: CheckpointJob, storage: Storage, timeout_s: float) -> None:
    """Rank 0: block until every other rank's manifest is in the partial directory (its file is durable)."""
    others = [os.path.join(job.partial_dir, rank_manifest(r)) for r in range(1, job.world_size)]
    poll_until(lambda: all(storage.stat(p) is not None for p in others), timeout_s,
              f"the other {job.world_size - 1} rank(s) to make their files in {job.partial_dir} durable")


def wait_for_rank0_commit(job: CheckpointJob, storage: Storage, timeout_s: float, mine: bytes) -> None:
    """Ranks other than 0: block until rank 0 renamed the directory to its final name, then check that the step
    committed there is this job's: a process calling itself rank 1 of a directory that another job's rank 0 writes
    must not report that job's checkpoints as its own."""
    poll_until(lambda: storage.stat(job.final_dir) is not None, timeout_s, f"rank 0 to commit {job.final_dir}")
    top = os.path.join(job.final_dir, MANIFEST)
    try:
        world_size = json.loads(storage.read_bytes(top, max_bytes=MAX_MANIFEST_BYTES)).get("world_size")
    except (OSError, ValueError, AttributeError):
        world_size = None  # unreadable or not a manifest: not this job's commit either
    mine_path = os.path.join(job.final_dir, rank_manifest(job.rank))
    info = storage.stat(mine_path)
    if world_size != job.world_size or info is None or info.size != len(mine) or \
            storage.read_bytes(mine_path, max_bytes=len(mine)) != mine:
        if isinstance(world_size, int) and world_size != job.world_size:  # that job names none of this rank's files
            for path in (mine_path, os.path.join(job.final_dir, rank_file(job.rank, job.world_size))):
                if storage.stat(path) is not None:
                    storage.remove_file(path)
        raise DirectoryLockedError(
            f"step {job.step} in {job.dirpath} was committed by another job (its {MANIFEST} names "
            f"world_size={world_size!r}, this rank has world_size={job.world_size}), not with this rank's files: "
            "another job's rank 0 writes this directory. Give each job its own dirpath, or start every rank of one "
            "job with the same world_size")


JobHook = Callable[[CheckpointJob], None]


class JobEnds:
    """How the jobs of one checkpointer end (see the module docstring). Every method may run on any thread unless
    it says otherwise; none raises a job's failure except :meth:`drain` (training thread).

    Args:
        committed: runs on the commit thread once a job is visible, before it is marked COMMITTED (the levels'
            bookkeeping: memory level, stats, remote upload, retention); its failure is logged, never the job's.
        discarded: runs once a job that ended discarded is done with (its memory-level slots go back).
    """

    def __init__(self, *, storage: Storage, config: CheckpointConfig, rendezvous: Rendezvous | None,
                 writer: SharedWriter, inflight: InFlight, committed: JobHook, discarded: JobHook) -> None:
        self.storage, self.config, self.rendezvous = storage, config, rendezvous
        self._writer, self._inflight = writer, inflight
        self._committed, self._discarded = committed, discarded

    # --- the training thread --------------------------------------------------------------------------------

    def barrier(self, job: CheckpointJob, timeout: float | None = None, *, stall: bool = True) -> bool:
        """Wait until ``job`` is staged, evaluate its Deferred leaves, and pass. Returns False when ``timeout``
        ran out first (the barrier is then still ahead). ``stall=False``: the wait is not training time (the drain
        at ``close()``), so it is not added to the job's ``wait_s``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not job.barrier_lock.acquire(timeout=-1 if deadline is None else remaining(deadline)):
            return False
        try:
            if job.barrier_passed:
                return True
            started = time.monotonic()
            if not job.wait_staged(remaining(deadline)):
                return False
            owns_commit = self._complete_tree(job)
            job.barrier_passed = True
            if stall:
                job.stats.wait_s += time.monotonic() - started
        finally:
            job.barrier_lock.release()
        if owns_commit:  # the writer already closed the file: it will not commit this job, so queue it here
            self._writer.submit(CallTask(job, lambda: self._commit_off_writer(job), always=True))
        return True

    def drain(self, job: CheckpointJob, *, deliver: bool = True, stall: bool = True) -> None:
        """Pass ``job``'s barrier and wait until it ended; raise its failure when ``deliver`` (``stall``: as for
        :meth:`barrier`)."""
        self.barrier(job, stall=stall)
        job.wait_done()
        if deliver:
            deliver_error(job)

    def abort(self, job: CheckpointJob) -> bool:
        """Fail ``job`` on request and wait until it ended; True when it was discarded (not committed)."""
        discarded = CheckpointDiscardedError(f"the checkpoint of step {job.step} was discarded by discard({job.step})")
        if job.cancel(discarded):  # the file is closed already, so no finalize will discard the job: do it here
            self._discard_off_writer(job)
        if job.error is discarded:
            job.error_delivered = True  # asked for: not a failure to report (an earlier real one still is)
        self.drain(job, deliver=False)
        return job.state is JobState.DISCARDED

    def _complete_tree(self, job: CheckpointJob) -> bool:
        """Put the Deferred leaves' values into the tree; True when that makes the caller own the commit."""
        if job.failed:
            return False
        try:
            if job.deferred:  # filling walks the whole tree: a few ms on the training thread for large states
                resolved = [encode_resolved(d.fn(), path) for path, d in job.deferred]
                job.tree = fill_deferred(job.tree, resolved)
        except BaseException as e:  # noqa: BLE001 - delivered like any other failure of this checkpoint
            if job.fail(e):  # the file is closed already, so no finalize will discard the job: do it here
                self._discard_off_writer(job)
            return False
        return job.complete_tree()

    # --- the writer thread ----------------------------------------------------------------------------------

    def finalize(self, job: CheckpointJob) -> None:
        """After the job's last write: close (and fsync) the file, then commit when the tree is complete too; a
        failed job is discarded here."""
        try:
            if job.handle is not None:
                self.storage.close(job.handle, sync=self.config.fsync and not job.failed)
        except BaseException as e:  # noqa: BLE001 - the job carries it to the training thread
            job.fail(e)
        job.handle = None
        job.sources = []
        claimed = None if job.failed else job.durable()
        if claimed is None:  # failed: before the close, or racing it from the barrier or a discard()
            self._discard(job)
        elif claimed:
            self._commit_off_writer(job)

    def _commit_off_writer(self, job: CheckpointJob) -> None:
        """With several ranks the commit waits for the others, and any commit waits for the earlier checkpoints to
        end: never block the shared writer."""
        if job.world_size == 1 and not self._inflight.earlier(job):
            self._commit(job)
        else:
            start_background_thread(self._commit, job, name="lazyckpt-commit")

    def _discard_off_writer(self, job: CheckpointJob) -> None:
        self._writer.submit(CallTask(job, lambda: self._discard(job), always=True))

    # --- the ends themselves --------------------------------------------------------------------------------

    def _commit(self, job: CheckpointJob) -> None:
        """The thread that claimed the commit: run the protocol after every earlier job ended, then the
        ``committed`` hook, then mark the job COMMITTED; on failure the job is discarded instead."""
        self._inflight.wait_for_earlier(job)  # commits in request order: latest() never moves backwards
        try:
            commit(job, self.storage, sync=self.config.fsync, timeout_s=self.config.commit_timeout_s,
                   rendezvous=self.rendezvous)
        except BaseException as e:  # noqa: BLE001
            job.fail(e)
            self._discard(job)
            return
        try:
            self._committed(job)
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed; only the bookkeeping after it failed
            logger.warning("lazyckpt: bookkeeping after committing step %d failed: %r", job.step, e)
        job.advance(JobState.COMMITTED)

    def _discard(self, job: CheckpointJob) -> None:
        """Tell the other ranks this attempt failed (so none commits it or waits for it), then remove what it left
        (the partial directory on the directory's leader, this rank's manifest and file elsewhere); committed ones
        are never touched. A clean-up failure is logged: the job's own error is what the caller sees."""
        try:
            if self.rendezvous is not None:
                self.rendezvous.abandon(job.attempt, repr(job.error))
            if job.rank == leader_of(self.rendezvous):
                self.storage.remove_tree(job.partial_dir)
                return
            # The manifest first: without a store, rank 0 counts a rank manifest in the directory as that rank's
            # durable file, so a manifest left by this failed attempt must not outlive it.
            for path in (os.path.join(job.partial_dir, rank_manifest(job.rank)), job.file_path):
                if self.storage.stat(path) is not None:
                    self.storage.remove_file(path)
        except Exception as e:  # noqa: BLE001
            logger.warning("lazyckpt: could not remove the partial checkpoint %s: %r", job.partial_dir, e)
        finally:
            job.advance(JobState.DISCARDED)
            self._discarded(job)

