"""The names of the on-disk format (docs/FORMAT.md): its version, and the files and directories of a checkpoint."""

from __future__ import annotations

import re
from collections.abc import Iterable

FORMAT_NAME = "lazyckpt"
FORMAT_VERSION = 4
"""Version 2 added the SHA-256 of every manifest and of every tensor file's header. Version 3 adds sharding: each
stored tensor's box in its global tensor (rank manifests) and the global view of which rank holds which box
(``manifest.json``); a version-2 reader would take a shard for the whole tensor, so it must refuse version 3.
Version 4 adds aliases: a tensor leaf that is another leaf's tensor (a tied weight) is stored once, and the rank
manifest's ``aliases`` names it; a version-3 reader would miss those leaves, so it must refuse version 4.
Versions 1 to 3 stay readable."""
READABLE_VERSIONS = (1, 2, 3, 4)
MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
STEP_DIR = re.compile(r"step-([0-9]{7,})")
"""Use with ``fullmatch``: ``match`` would accept a trailing newline."""
RANK_FILE = re.compile(r"rank-([0-9]{5,})-of-([0-9]{5,})\.safetensors")
"""A rank's tensor file (:func:`rank_file`); group 2 is the world size. Use with ``fullmatch``."""
SUPERSEDED_SUFFIX = ".superseded"
"""A committed checkpoint moved aside (``on_older_step="move_aside"``): kept, never read by ``latest()``."""


def step_of_dir(path: str) -> int:
    """The step of a ``.../step-NNNNNNN`` checkpoint directory (or URL)."""
    match = STEP_DIR.fullmatch(path.rstrip("/").rsplit("/", 1)[-1])
    if match is None:
        raise ValueError(f"{path!r} is not a step-NNNNNNN checkpoint directory")
    return int(match.group(1))


def step_dirname(step: int) -> str:
    return f"step-{step:07d}"


def rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def rank_manifest(rank: int) -> str:
    return f"rank-{rank:05d}.json"



def rank_members(world_size: int, ranks: Iterable[int] | None = None) -> list[str]:
    """What a step of ``world_size`` ranks holds besides ``manifest.json``: each rank's manifest and tensor file
    (of ``ranks`` only, when given: a node's directory holds its own ranks' files)."""
    return [name for rank in (range(world_size) if ranks is None else ranks)
            for name in (rank_manifest(rank), rank_file(rank, world_size))]
