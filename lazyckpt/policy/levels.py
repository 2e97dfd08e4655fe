"""A URL ``dirpath`` for a framework that needs a local directory: Lightning's ``ModelCheckpoint`` keeps its file
names (``last.ckpt``, ``epoch=1-step=40.ckpt``) as links next to the checkpoints, and object stores have none.

The split is the engine's own (:func:`lazyckpt.levels.remote.spool.split_levels`), made before the framework sees the
directory: the framework gets the private node-local spool directory, where the names and the local level live,
and the URL becomes the remote level that every checkpoint is uploaded to. ``keep_last_k`` applies on the remote;
the spool keeps the newest checkpoint, the ones a name points at, and any still uploading.

Example:
    >>> dirpath, options = url_dirpath_levels("s3://bucket/run", options)            # doctest: +SKIP
    >>> dirpath                                                                      # doctest: +SKIP
    '/tmp/lazyckpt-spool/3f2a...'
"""

from __future__ import annotations

import dataclasses
import os

from lazyckpt.config import normalize_dirpath
from lazyckpt.levels.remote.spool import split_levels
from lazyckpt.policy.options import SessionOptions
from lazyckpt.storage.urls import is_url


def url_dirpath_levels(dirpath: str | os.PathLike[str] | None,
                       options: SessionOptions) -> tuple[str | os.PathLike[str] | None, SessionOptions]:
    """``(local directory, options)`` for ``dirpath``: for a URL, the spool directory and ``options`` whose remote
    level is that URL; anything else is returned unchanged.

    Raises:
        ValueError: ``remote=`` names another URL, or ``remote_every_n`` is not 1 (every checkpoint goes remote).
    """
    if not is_url(dirpath):
        return dirpath, options
    spool, config = split_levels(normalize_dirpath(dirpath), options._config)
    return spool, dataclasses.replace(options, remote=config.remote, remote_keep_last_k=config.remote_keep_last_k,
                                      keep_last_k=config.keep_last_k)
