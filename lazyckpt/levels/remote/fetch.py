"""Bringing a remote checkpoint to this node: for frameworks that resume only from a local path (Lightning).

A step is fetched object by object into ``dirpath/step-NNNNNNN.partial`` and renamed to its final name once
every object is there and the copy passed every check of :func:`lazyckpt.verify` (checksums included), so a fetch
cut short, or of a damaged remote step, is a partial directory (removed at once, or by the next checkpointer after
a crash), never a committed local checkpoint.

Every rank resolves the checkpoint to resume, and the ranks of a node usually share ``dirpath``: they take turns
on a lock file in it, and whoever comes after the first finds the step already there, so a shared directory is
fetched once. The whole step is fetched, not only this rank's files: the local copy is a committed checkpoint like
any other, and a rank may read another rank's file on restore (replicated state is split across the ranks' files,
and a different number of ranks reshards). A node with a directory of its own fetches its own copy.

Example:
    >>> path = newest_on_this_node("runs/ckpt", "s3://bucket/run", {"endpoint_url": "..."})  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import posixpath
from typing import Any

from lazyckpt.errors import CheckpointFormatError, CheckpointNotFoundError
from lazyckpt.format.catalog import committed_steps
from lazyckpt.format.files import MANIFEST, PARTIAL_SUFFIX
from lazyckpt.levels.remote.contents import remote_steps
from lazyckpt.read.load import verify
from lazyckpt.storage import LocalStorage, wait_for_lock
from lazyckpt.storage.fsspec import FsspecStorage
from lazyckpt.storage.urls import join

logger = logging.getLogger(__name__)

FETCH_LOCK = ".lock-fetch"
"""The lock file the ranks sharing a directory take turns on while one of them fetches."""


def newest_on_this_node(dirpath: str, remote: str | None, storage_options: dict[str, Any] | None, *,
                        storage: FsspecStorage | None = None) -> str | None:
    """The newest checkpoint of the local and the remote level, as a local directory: fetched into ``dirpath``
    when only the remote holds it (e.g. on a fresh node); None when neither holds one. A remote step that fails
    verification is skipped with a warning naming it (and how to delete it), for the next older one: a damaged
    newest step never blocks every resume. ``storage``: the remote's (default: fsspec with ``storage_options``).

    Raises:
        CheckpointFormatError, CheckpointCorruptError: no remote step newer than the local ones verified and the
            local level holds none; the message names the newest damaged step and the fix.
    """
    local = LocalStorage()
    here = committed_steps(dirpath, local)
    if remote is None:
        return here[max(here)] if here else None
    remote_storage = storage if storage is not None else FsspecStorage(remote, storage_options)
    newer = {s: url for s, url in remote_steps(remote_storage, remote)[0].items() if s > max(here, default=-1)}
    if not newer:
        return here[max(here)] if here else None
    local.make_dir(dirpath)
    lock = wait_for_lock(local, os.path.join(dirpath, FETCH_LOCK))
    try:
        damaged = _fetch_newest(remote_storage, [newer[s] for s in sorted(newer, reverse=True)], dirpath)
    finally:
        lock.release()
    if isinstance(damaged, str):
        return damaged
    if here:
        return here[max(here)]
    first = damaged[0]
    raise type(first)(f"{first} No remote step verified ({len(damaged)} tried, newest first) and {dirpath} holds "
                      f"none: {_DELETE_ADVICE}") from first


_DELETE_ADVICE = ("delete the damaged step (its manifest.json first, e.g. fsspec's fs.rm(url, recursive=True) or "
                  "`aws s3 rm --recursive URL/`) so that latest() and the next resume take the step before it")


def _fetch_newest(remote: FsspecStorage, candidates: list[str], dirpath: str) -> str | list[CheckpointFormatError]:
    """The first of ``candidates`` (newest first) fetched and verified into ``dirpath`` (or already there, fetched by
    a rank sharing it); else the errors of every damaged one, in order."""
    damaged: list[CheckpointFormatError] = []
    for step_url in candidates:
        there = os.path.join(dirpath, posixpath.basename(step_url))
        if LocalStorage().stat(os.path.join(there, MANIFEST)) is not None:
            return there  # another rank sharing this directory fetched it meanwhile
        try:
            return fetch_step(step_url, None, dirpath, storage=remote)
        except CheckpointFormatError as e:  # CheckpointCorruptError too
            damaged.append(e)
            logger.warning("lazyckpt: remote step %s failed verification and is skipped for the one before it: %s; "
                           "%s", step_url, e, _DELETE_ADVICE)
    return damaged


def fetch_step(step_url: str, storage_options: dict[str, Any] | None, dirpath: str, *,
               storage: FsspecStorage | None = None) -> str:
    """Copy the committed remote checkpoint ``step_url`` into ``dirpath``, check the copy as :func:`lazyckpt.verify`
    does, and only then make it a committed local checkpoint; returns the local directory.

    The copy is made in ``step-NNNNNNN.partial/step-NNNNNNN`` (a step directory the reader opens, inside a partial
    one the next checkpointer removes after a crash) and renamed to ``dirpath/step-NNNNNNN`` once it verified.

    Raises:
        CheckpointFormatError, CheckpointCorruptError: the remote step breaks a format rule or a checksum; the
            message names the remote object. Nothing of the fetch is left in ``dirpath``.
        CheckpointNotFoundError: an object of the step vanished during the fetch (pruned by a newer commit); the
            message names it.
    """
    remote = storage if storage is not None else FsspecStorage(step_url, storage_options)
    local = LocalStorage()
    name = posixpath.basename(step_url.rstrip("/"))
    final, partial = os.path.join(dirpath, name), os.path.join(dirpath, name + PARTIAL_SUFFIX)
    copy = os.path.join(partial, name)
    local.remove_tree(partial)
    local.make_dir(copy)
    try:
        for member in _members(remote, step_url):
            _download(remote, join(step_url, member), os.path.join(copy, member))
        _verify_copy(copy, step_url)
        local.sync_dir(copy)  # its entries, before the rename commits it (each file was synced as it arrived)
        local.rename(copy, final, sync=True)
    finally:
        local.remove_tree(partial)
    logger.info("lazyckpt: fetched %s from the remote level to %s", step_url, final)
    return final


def _members(remote: FsspecStorage, step_url: str) -> list[str]:
    try:
        return remote.list_dir(step_url)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise CheckpointNotFoundError(f"{step_url} vanished before it was fetched ({type(e).__name__}): a newer "
                                      "step was committed and this one pruned; resume again to take the newest") from e


def _download(remote: FsspecStorage, url: str, local_path: str) -> None:
    try:
        remote.download_file(url, local_path)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{url} vanished during the fetch (FileNotFoundError: {e}): a newer step was "
                                      "committed and this one pruned (remote_keep_last_k); resume again to take the "
                                      "newest, nothing of this fetch was kept") from e


def _verify_copy(copy: str, step_url: str) -> None:
    """:func:`lazyckpt.verify` of the fetched copy; its error names the remote object, not the local copy."""
    try:
        verify(copy)
    except CheckpointFormatError as e:  # CheckpointCorruptError too: the same class, raised again
        raise type(e)(f"{str(e).replace(copy, step_url)} (fetched from the remote level; no local copy was "
                      "kept)") from e
