"""The commit protocol: per-rank manifests once each rank's file is durable, then each directory's leader commits.

Order, for every rank: tensor file fsynced -> ``rank-NNNNN.json`` written atomically. Then the ranks meet:

* through the process group's store (a :class:`~lazyckpt.ranks.rendezvous.Rendezvous`): each rank publishes that its
  files are durable, with its tensor boxes; once every rank of the job has, each directory's leader writes
  ``manifest.json`` (the global view of every tensor) and commits. No file is read to meet, so ranks need no
  shared directory, and every key belongs to one attempt, so a manifest left by a failed attempt never counts;
* without a store, through the shared directory: rank 0 waits for every rank's manifest there, then commits.

Committing is: write ``manifest.json`` atomically, rename ``step-N.partial`` to ``step-N`` and fsync the parent
directory. The rename is the commit point: a crash before it leaves only a partial directory that readers ignore.
No collectives are used (this runs off the training thread).

Failure rule (docs/design.md): a commit that raises leaves nothing visible. A failure of the rename itself or of
the directory fsync after it rolls the rename back, so a checkpoint whose ``wait()`` fails is never ``latest()``.
If even the roll-back fails, the directory stays visible and the commit is reported as having succeeded, with a
warning: ``wait()`` and ``latest()`` never disagree.
"""

from __future__ import annotations

import logging
import os

from lazyckpt._version import __version__
from lazyckpt.format.manifest import encode_manifest, global_index, rank_manifest_doc, tensor_summary, top_manifest_doc
from lazyckpt.format.names import MANIFEST, rank_file, rank_manifest
from lazyckpt.format.schema import check_global_tensors
from lazyckpt.job import CheckpointJob
from lazyckpt.ranks.rendezvous import Rendezvous, poll_until
from lazyckpt.storage import Storage

logger = logging.getLogger(__name__)


def commit(job: CheckpointJob, storage: Storage, *, sync: bool, timeout_s: float,
           rendezvous: Rendezvous | None = None) -> None:
    """Publish this rank's manifest and, on a directory's leader, commit once every rank is durable."""
    doc = rank_manifest_doc(step=job.step, rank=job.rank, world_size=job.world_size,
                            file=rank_file(job.rank, job.world_size), tree=job.tree, entries=job.entries,
                            checksums=job.checksums, header=job.header, boxes=job.boxes)
    storage.write_atomic(os.path.join(job.partial_dir, rank_manifest(job.rank)), encode_manifest(doc), sync=sync)
    summary = tensor_summary(doc["tensors"])
    if rendezvous is not None:
        everyone = rendezvous.gather(job.attempt, summary)
        rendezvous.check_plans(job.attempt)  # save() met only the ranks whose state changed: check them all here
        if rendezvous.leader != job.rank:
            rendezvous.wait_committed(job.attempt)
            return
    elif job.rank != 0:
        wait_for_rank0_commit(job, storage, timeout_s)
        return
    else:
        wait_for_other_ranks(job, storage, timeout_s)
        everyone = {0: summary}  # without a store every rank's tensors are its own: rank 0 alone may hold boxes
    index = global_index(everyone)
    check_global_tensors(index, job.world_size, f"the global view of step {job.step}")
    top = top_manifest_doc(step=job.step, world_size=job.world_size, library_version=__version__, tensors=index)
    storage.write_atomic(os.path.join(job.partial_dir, MANIFEST), encode_manifest(top), sync=sync)
    publish(job, storage, sync=sync)
    if rendezvous is not None:
        rendezvous.committed(job.attempt)


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
        storage.sync_dir(job.dirpath)
        return True
    except Exception as again:  # noqa: BLE001 - the first error is the one to report
        logger.warning("lazyckpt: committing %s failed after the rename (%r) and undoing the rename failed too "
                       "(%r); the checkpoint stays committed but may not survive a power loss",
                       job.final_dir, error, again)
        return False


def wait_for_other_ranks(job: CheckpointJob, storage: Storage, timeout_s: float) -> None:
    """Rank 0: block until every other rank's manifest is in the partial directory (its file is durable)."""
    others = [os.path.join(job.partial_dir, rank_manifest(r)) for r in range(1, job.world_size)]
    poll_until(lambda: all(storage.stat(p) is not None for p in others), timeout_s,
              f"the other {job.world_size - 1} rank(s) to make their files in {job.partial_dir} durable")


def wait_for_rank0_commit(job: CheckpointJob, storage: Storage, timeout_s: float) -> None:
    """Ranks other than 0: block until rank 0 renamed the directory to its final name."""
    poll_until(lambda: storage.stat(job.final_dir) is not None, timeout_s, f"rank 0 to commit {job.final_dir}")
