"""What a remote level holds: committed steps, partial uploads, and the commit-aware removal of a step.

A remote step ``step-NNNNNNN/`` is committed by the format's one rule (:mod:`lazyckpt.format.catalog`): its
``manifest.json``, the last object written, is there, and so is every rank's manifest and tensor file.
Removal deletes the manifest first, so a removal cut short leaves an uncommitted step that readers ignore and
the next run cleans up, never a "committed" step with missing files.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from lazyckpt.format.catalog import catalog, committed_steps
from lazyckpt.format.files import MANIFEST, STEP_DIR, SUPERSEDED_SUFFIX
from lazyckpt.storage import Storage
from lazyckpt.storage.urls import join

logger = logging.getLogger(__name__)


def remote_steps(storage: Storage, url: str) -> tuple[dict[int, str], list[str]]:
    """``({step: step URL}, [URLs of uncommitted step entries])`` under ``url`` (an absent prefix holds nothing).

    One recursive listing of ``url`` gives every step's objects, checked by the format's commit rule
    (:func:`lazyckpt.format.catalog.catalog`: the commit object and every rank's manifest and tensor file); on S3 one
    request per 1,000 objects. Entries not named ``step-*`` are not ours and are left alone.
    """
    found = catalog(storage, url)
    return found.committed, found.uncommitted


def remove_partial_uploads(storage: Storage, url: str, *, below: int | None = None, keep: Collection[int] = (),
                           listing: tuple[dict[int, str], list[str]] | None = None) -> list[str]:
    """Delete uploads without their commit object at steps below ``below`` (default: the newest committed step),
    except the steps in ``keep`` (still queued or retried by this job); returns their URLs. ``listing``: what
    :func:`remote_steps` just returned, when the caller has it.

    A newer one may be the upload another live job is writing right now; an older one is nobody's once a newer
    step is committed, except a failed upload this job still retries. A ``step-*`` entry that is no step directory
    at all is nobody's upload either and goes too, except a checkpoint moved aside (``step-N.superseded``: kept on
    purpose, in a ``file://`` remote that is the host level's disk directory).
    """
    committed, partial = listing if listing is not None else remote_steps(storage, url)
    limit = below if below is not None else max(committed, default=None)
    doomed = [entry for entry in partial if not entry.rstrip("/").endswith(SUPERSEDED_SUFFIX) and (
              (step := _step_of(entry)) is None or limit is not None and step < limit and step not in keep)]
    for entry in doomed:
        storage.remove_tree(entry)
    if doomed:
        logger.info("lazyckpt: removed %d partial upload(s) left by an earlier run under %s", len(doomed), url)
    return doomed


def _step_of(entry: str) -> int | None:
    match = STEP_DIR.fullmatch(entry.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def remove_remote_step(storage: Storage, step_url: str) -> None:
    """Un-commit (delete ``manifest.json``), then delete the rest of the step."""
    try:
        storage.remove_file(join(step_url, MANIFEST))
    except FileNotFoundError:
        pass
    storage.remove_tree(step_url)


def newest_checkpoint(local_dir: str, remote: str | None, storage_options: dict | None) -> str | None:
    """The newest checkpoint committed on the local level or on ``remote``; the local copy when both hold that
    step. On a fresh node whose local directory is empty this is the remote's newest (its URL)."""
    from lazyckpt.storage.fsspec import FsspecStorage

    found = remote_steps(FsspecStorage(remote, storage_options), remote)[0] if remote is not None else {}
    found.update(committed_steps(local_dir))
    return found[max(found)] if found else None
