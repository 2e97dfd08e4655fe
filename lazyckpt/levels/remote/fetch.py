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

from lazyckpt.errors import CheckpointFormatError
from lazyckpt.format.files import MANIFEST, PARTIAL_SUFFIX
from lazyckpt.levels.remote.contents import newest_checkpoint
from lazyckpt.read.load import verify
from lazyckpt.storage import LocalStorage, wait_for_lock
from lazyckpt.storage.fsspec import FsspecStorage
from lazyckpt.storage.urls import is_url, join

logger = logging.getLogger(__name__)

FETCH_LOCK = ".lock-fetch"
"""The lock file the ranks sharing a directory take turns on while one of them fetches."""


def newest_on_this_node(dirpath: str, remote: str | None, storage_options: dict[str, Any] | None) -> str | None:
    """The newest checkpoint of the local and the remote level, as a local directory: fetched into ``dirpath``
    when only the remote holds it (e.g. on a fresh node); None when neither holds one."""
    newest = newest_checkpoint(dirpath, remote, storage_options)
    if newest is None or not is_url(newest):
        return newest
    local = LocalStorage()
    local.make_dir(dirpath)
    lock = wait_for_lock(local, os.path.join(dirpath, FETCH_LOCK))
    try:
        here = os.path.join(dirpath, posixpath.basename(newest))
        if local.stat(os.path.join(here, MANIFEST)) is not None:
            return here  # another rank sharing this directory fetched it meanwhile
        return fetch_step(newest, storage_options, dirpath)
    finally:
        lock.release()


def fetch_step(step_url: str, storage_options: dict[str, Any] | None, dirpath: str) -> str:
    """Copy the committed remote checkpoint ``step_url`` into ``dirpath``, check the copy as :func:`lazyckpt.verify`
    does, and only then make it a committed local checkpoint; returns the local directory.

    The copy is made in ``step-NNNNNNN.partial/step-NNNNNNN`` (a step directory the reader opens, inside a partial
    one the next checkpointer removes after a crash) and renamed to ``dirpath/step-NNNNNNN`` once it verified.

    Raises:
        CheckpointFormatError, CheckpointCorruptError: the remote step breaks a format rule or a checksum; the
            message names the remote object. Nothing of the fetch is left in ``dirpath``.
    """
    remote, local = FsspecStorage(step_url, storage_options), LocalStorage()
    name = posixpath.basename(step_url.rstrip("/"))
    final, partial = os.path.join(dirpath, name), os.path.join(dirpath, name + PARTIAL_SUFFIX)
    copy = os.path.join(partial, name)
    local.remove_tree(partial)
    local.make_dir(copy)
    try:
        for member in remote.list_dir(step_url):
            remote.download_file(join(step_url, member), os.path.join(copy, member))
        _verify_copy(copy, step_url)
        local.rename(copy, final, sync=True)
    finally:
        local.remove_tree(partial)
    logger.info("lazyckpt: fetched %s from the remote level to %s", step_url, final)
    return final


def _verify_copy(copy: str, step_url: str) -> None:
    """:func:`lazyckpt.verify` of the fetched copy; its error names the remote object, not the local copy."""
    try:
        verify(copy)
    except CheckpointFormatError as e:  # CheckpointCorruptError too: the same class, raised again
        raise type(e)(f"{str(e).replace(copy, step_url)} (fetched from the remote level; no local copy was "
                      "kept)") from e
