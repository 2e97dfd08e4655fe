"""How a job ends: finalize its file, commit it, or discard it. Plain functions of (job, storage, config).

Each function moves the job through :class:`~lazyckpt.job.JobState` and never raises: a failure becomes the
job's error (delivered to the training thread by the engine), and every job reaches COMMITTED or DISCARDED
exactly once, because only the thread that wins a transition goes on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from lazyckpt.commit import commit
from lazyckpt.config import CheckpointConfig
from lazyckpt.format.names import rank_manifest
from lazyckpt.job import CheckpointJob, JobState
from lazyckpt.ranks.rendezvous import Rendezvous
from lazyckpt.storage import Storage

logger = logging.getLogger(__name__)


def finalize(job: CheckpointJob, storage: Storage, config: CheckpointConfig,
             rendezvous: Rendezvous | None = None) -> bool:
    """Writer thread, after the job's last write: close (and fsync) the file. Returns True when the caller
    now owns the commit (the job is durable and its tree complete); a failed job is discarded here."""
    try:
        if job.handle is not None:
            storage.close(job.handle, sync=config.fsync and not job.failed)
    except BaseException as e:  # noqa: BLE001 - the job carries it to the training thread
        job.fail(e)
    job.handle = None
    job.sources = []
    if job.failed:
        discard(job, storage, rendezvous)
        return False
    return job.durable()


def commit_job(job: CheckpointJob, storage: Storage, config: CheckpointConfig,
               on_committed: Callable[[CheckpointJob], None], rendezvous: Rendezvous | None = None) -> None:
    """The thread that claimed the commit: run the commit protocol, then ``on_committed`` (stats, retention),
    then mark the job COMMITTED; on failure the job is discarded instead."""
    try:
        commit(job, storage, sync=config.fsync, timeout_s=config.commit_timeout_s, rendezvous=rendezvous)
    except BaseException as e:  # noqa: BLE001
        job.fail(e)
        discard(job, storage, rendezvous)
        return
    try:
        on_committed(job)
    except Exception as e:  # noqa: BLE001 - the checkpoint is committed; only the bookkeeping after it failed
        logger.warning("lazyckpt: bookkeeping after committing step %d failed: %r", job.step, e)
    job.advance(JobState.COMMITTED)


def discard(job: CheckpointJob, storage: Storage, rendezvous: Rendezvous | None = None) -> None:
    """Tell the other ranks this attempt failed (so none commits it or waits for it), then remove what it left
    (the partial directory on the directory's leader, this rank's manifest and file elsewhere); committed ones are
    never touched. A clean-up failure is logged: the job's own error is what the caller sees."""
    try:
        if rendezvous is not None:
            rendezvous.abandon(job.attempt, repr(job.error))
        leader = 0 if rendezvous is None else rendezvous.leader
        if job.rank == leader:
            storage.remove_tree(job.partial_dir)
            return
        # The manifest first: without a store, rank 0 counts a rank manifest in the directory as that rank's
        # durable file, so a manifest left by this failed attempt must not outlive it.
        for path in (os.path.join(job.partial_dir, rank_manifest(job.rank)), job.file_path):
            if storage.stat(path) is not None:
                storage.remove_file(path)
    except Exception as e:  # noqa: BLE001
        logger.warning("lazyckpt: could not remove the partial checkpoint %s: %r", job.partial_dir, e)
    finally:
        job.advance(JobState.DISCARDED)
