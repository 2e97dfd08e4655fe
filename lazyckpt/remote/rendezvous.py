"""How rank 0 learns that every rank's upload of a step is durable before it writes the remote commit object.

This is the one place to replace with a process-group store rendezvous. Until then ranks meet on the remote
level itself, which every rank can see by definition: a rank's ``rank-NNNNN.json`` is uploaded after its tensor
file, so its presence means that rank's upload is complete.
"""

from __future__ import annotations

from lazyckpt.commit import _wait_for
from lazyckpt.format import MANIFEST, rank_manifest
from lazyckpt.remote.urls import join
from lazyckpt.storage import Storage


def wait_for_rank_uploads(storage: Storage, step_url: str, world_size: int, timeout_s: float) -> None:
    """Block until every rank's manifest is under ``step_url``; ``TimeoutError`` after ``timeout_s``."""
    names = [join(step_url, rank_manifest(r)) for r in range(world_size)]
    _wait_for(lambda: all(storage.stat(n) is not None for n in names), timeout_s,
              f"all {world_size} ranks to upload their files to {step_url}")


def wait_for_remote_commit(storage: Storage, step_url: str, timeout_s: float) -> None:
    """Block until rank 0 has written the commit object of ``step_url``."""
    _wait_for(lambda: storage.stat(join(step_url, MANIFEST)) is not None, timeout_s,
              f"rank 0 to commit {step_url}")
