"""Validation of the remote-level options and the split of a URL ``dirpath`` into spool + remote."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from lazyckpt.storage.urls import check_url, default_spool_dir, is_url

if TYPE_CHECKING:
    from lazyckpt.config import CheckpointConfig


def check_remote_options(config: CheckpointConfig) -> None:
    """Raise ``ValueError`` naming the option, the value and the fix."""
    if config.remote is not None:
        config.remote = check_url("remote", config.remote)
    every_n = config.remote_every_n
    if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
        raise ValueError(f"remote_every_n={every_n!r} must be a positive int (1 uploads every checkpoint)")
    keep = config.remote_keep_last_k
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"remote_keep_last_k={keep!r} must be a positive int or None (keep all)")
    timeout = config.remote_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"remote_timeout_s={timeout!r} must be a positive number of seconds")
    if config.storage_options is not None and not isinstance(config.storage_options, dict):
        raise ValueError(f"storage_options={config.storage_options!r} must be a dict of fsspec options or None")
    if config.spool_dir is not None and is_url(config.spool_dir):
        raise ValueError(f"spool_dir={config.spool_dir!r} must be a local directory, not a URL")


def split_levels(dirpath: str, config: CheckpointConfig) -> tuple[str, CheckpointConfig]:
    """For a URL ``dirpath``: the local spool directory and a config whose remote level is that URL.

    Every checkpoint goes remote and the user's ``keep_last_k`` applies there; the spool keeps only the newest
    checkpoint (plus any still uploading). A local ``dirpath`` is returned unchanged.
    """
    if not is_url(dirpath):
        return dirpath, config
    if config.remote is not None and config.remote != dirpath:
        raise ValueError(f"dirpath={dirpath!r} is a URL and remote={config.remote!r} names another one; pass a "
                         "local dirpath with remote=URL, or only the URL as dirpath")
    if config.remote_every_n != 1:
        raise ValueError(f"remote_every_n={config.remote_every_n!r} needs a local dirpath: with a URL dirpath "
                         "every checkpoint goes to the URL")
    remote_keep = config.remote_keep_last_k if config.remote_keep_last_k is not None else config.keep_last_k
    spool = os.path.abspath(config.spool_dir) if config.spool_dir else default_spool_dir(dirpath)
    return spool, dataclasses.replace(config, remote=dirpath, remote_keep_last_k=remote_keep, keep_last_k=1)
