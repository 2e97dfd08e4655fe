"""The split of a URL ``dirpath`` into a node-local spool directory and the remote level behind it."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from lazyckpt.levels.host import split_host_level
from lazyckpt.storage.urls import default_spool_dir, is_url

if TYPE_CHECKING:
    from lazyckpt.config import CheckpointConfig


def split_levels(dirpath: str, config: CheckpointConfig) -> tuple[str, CheckpointConfig]:
    """For a URL ``dirpath``: the local spool directory and a config whose remote level is that URL.

    Every checkpoint goes remote and the user's ``keep_last_k`` applies there; the spool keeps only the newest
    checkpoint (plus any still uploading). With ``keep_in_memory="host"`` the local level is ``dirpath``'s host
    folder and the remote level ``dirpath`` itself (:mod:`lazyckpt.levels.host`). Any other local ``dirpath`` is
    returned unchanged.
    """
    if config.host_level:
        return split_host_level(dirpath, config)
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
