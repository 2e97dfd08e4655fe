"""The commit protocol: per-rank manifests once each rank's file is durable, then rank 0 commits the whole.

Order, for every rank: tensor file fsynced -> ``rank-NNNNN.json`` written atomically. Then rank 0 waits for every
rank's manifest, writes ``manifest.json`` atomically and renames ``step-N.partial`` to ``step-N`` (fsyncing the
parent). The rename is the commit point: a crash before it leaves only a partial directory that readers ignore.
No collectives are used (this runs on the writer thread); ranks meet through the shared file system.
"""

from __future__ import annotations

import os
import time

from lazyckpt._version import __version__
from lazyckpt.format import (MANIFEST, encode_manifest, rank_file, rank_manifest, rank_manifest_doc,
                             top_manifest_doc)
from lazyckpt.job import CheckpointJob
from lazyckpt.storage import Storage


def commit(job: CheckpointJob, storage: Storage, *, sync: bool, timeout_s: float) -> None:
    """Publish this rank's manifest and, on rank 0, commit the checkpoint once every rank is durable."""
    doc = rank_manifest_doc(step=job.step, rank=job.rank, world_size=job.world_size,
                            file=rank_file(job.rank, job.world_size), tree=job.tree, entries=job.entries,
                            checksums=job.checksums, header=job.header)
    storage.write_atomic(os.path.join(job.partial_dir, rank_manifest(job.rank)), encode_manifest(doc), sync=sync)
    if job.rank != 0:
        _wait_for(lambda: os.path.isdir(job.final_dir), timeout_s, f"rank 0 to commit {job.final_dir}")
        return
    others = [os.path.join(job.partial_dir, rank_manifest(r)) for r in range(1, job.world_size)]
    _wait_for(lambda: all(os.path.exists(p) for p in others), timeout_s,
              f"the other {job.world_size - 1} rank(s) to make their files in {job.partial_dir} durable")
    top = top_manifest_doc(step=job.step, world_size=job.world_size, library_version=__version__)
    storage.write_atomic(os.path.join(job.partial_dir, MANIFEST), encode_manifest(top), sync=sync)
    storage.rename(job.partial_dir, job.final_dir, sync=sync)


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    # Polling the file system is the only rendezvous available off the training thread.
    deadline, delay = time.monotonic() + timeout_s, 0.005
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"lazyckpt: gave up after {timeout_s:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
