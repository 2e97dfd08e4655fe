"""Which checkpoints a directory holds, by the format's commit rule (docs/FORMAT.md): the one rule every level and
reader applies, on local files and on object stores alike.

A ``step-NNNNNNN`` entry is a committed checkpoint when it holds a regular ``manifest.json``, the file written last,
and, on a file system, is itself a directory (never a link: a link could make one step look like another). An
object store (any URL) has no rename and no directories: there a step counts when its listing also holds every
rank's manifest and tensor file of one world size (``rank-NNNNN.json``, ``rank-NNNNN-of-WWWWW.safetensors``), which
rank 0 checks before it writes the manifest; a step whose other objects an outage, a tool or an older job's removal
took is uncommitted, never ``latest()``. One recursive listing of the directory in all (one request per 1,000
objects on S3). Any other ``step-*`` entry is
uncommitted (a partial upload on an object store); names not ``step-*`` are not the format's.

Example:
    >>> committed_steps("runs/ckpt")                    # doctest: +SKIP
    {40: 'runs/ckpt/step-0000040', 80: 'runs/ckpt/step-0000080'}
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from lazyckpt.format.files import MANIFEST, RANK_FILE, STEP_DIR, rank_file, rank_manifest
from lazyckpt.storage import FileKind, LocalStorage, Storage
from lazyckpt.storage.urls import is_url, join


@dataclass
class Catalog:
    """The ``step-*`` entries of one directory, by the commit rule."""

    committed: dict[int, str] = field(default_factory=dict)
    """Committed checkpoints by step (their paths or URLs)."""
    uncommitted: list[str] = field(default_factory=list)
    """Other ``step-*`` entries: partial uploads, or directories whose manifest is missing."""


def is_committed(storage: Storage, step_path: str) -> bool:
    """True when ``step_path`` holds a regular ``manifest.json`` and, unless it is a URL, is a directory (not a
    link); a URL's listing must also hold every rank's files (:func:`holds_every_rank`)."""
    if not is_url(step_path):
        here = storage.stat(step_path)
        if here is None or here.kind is not FileKind.DIR:
            return False
    elif not holds_every_rank(storage, step_path):
        return False
    manifest = storage.stat(_join(step_path, MANIFEST))
    return manifest is not None and manifest.kind is FileKind.FILE


def holds_every_rank(storage: Storage, step_url: str) -> bool:
    """True when the listing of ``step_url`` holds ``manifest.json`` and, for a world size its tensor files name,
    every rank's manifest and tensor file (a leftover of a run with another number of ranks does not matter)."""
    try:
        names = set(storage.list_dir(step_url))
    except (FileNotFoundError, NotADirectoryError):
        return False
    return names_hold_every_rank(names)


def names_hold_every_rank(names: set[str]) -> bool:
    """:func:`holds_every_rank` of a step's listing. A world size is tried only when the listing is long enough to
    hold its ``2 * size + 1`` objects, name by name (never a list of them): a name claiming 4294967296 ranks costs
    nothing."""
    if MANIFEST not in names:
        return False
    sizes = {int(match.group(2)) for name in names if (match := RANK_FILE.fullmatch(name))}
    return any(all(rank_manifest(rank) in names and rank_file(rank, size) in names for rank in range(size))
               for size in sizes if 1 <= size and 2 * size + 1 <= len(names))


def catalog(storage: Storage, dirpath: str) -> Catalog:
    """The ``step-*`` entries under ``dirpath``, sorted by name (a missing directory holds none). A URL whose storage
    lists a whole tree (:meth:`~lazyckpt.storage.fsspec.FsspecStorage.list_tree`) costs one recursive listing."""
    tree = _listed_tree(storage, dirpath)
    if tree is not None:
        return _catalog_of_tree(dirpath, tree)
    found = Catalog()
    try:
        names = storage.list_dir(dirpath)
    except (FileNotFoundError, NotADirectoryError):
        return found
    for name in sorted(names):
        if not name.startswith("step-"):
            continue
        match, path = STEP_DIR.fullmatch(name), _join(dirpath, name)
        if match and is_committed(storage, path):
            found.committed[int(match.group(1))] = path
        else:
            found.uncommitted.append(path)
    return found


def newest_committed(storage: Storage, dirpath: str) -> str | None:
    """The committed checkpoint with the largest step under ``dirpath`` (``latest()``): from one recursive listing
    where the storage has one, else step by step, newest first, stopping at the first committed one."""
    tree = _listed_tree(storage, dirpath)
    if tree is not None:
        steps = _catalog_of_tree(dirpath, tree).committed
        return steps[max(steps)] if steps else None
    try:
        names = storage.list_dir(dirpath)
    except (FileNotFoundError, NotADirectoryError):
        return None
    steps = sorted(((int(m.group(1)), name) for name in names if (m := STEP_DIR.fullmatch(name))), reverse=True)
    return next((path for _, name in steps if is_committed(storage, path := _join(dirpath, name))), None)


def _listed_tree(storage: Storage, dirpath: str) -> dict[str, FileKind] | None:
    """Every entry two levels below the URL ``dirpath`` when its storage lists trees; None otherwise."""
    list_tree = getattr(storage, "list_tree", None)
    if list_tree is None or not is_url(dirpath):
        return None
    try:
        return list_tree(dirpath, depth=2)
    except (FileNotFoundError, NotADirectoryError):
        return {}


def _catalog_of_tree(dirpath: str, tree: dict[str, FileKind]) -> Catalog:
    """:func:`catalog` of a listing by relative name: the object-store rule applied to each step's objects."""
    members: dict[str, dict[str, FileKind]] = {}
    for name, kind in tree.items():
        top, _, member = name.partition("/")
        if top.startswith("step-"):
            members.setdefault(top, {}).update({member: kind} if member else {})
    found = Catalog()
    for name in sorted(members):
        match, objects, path = STEP_DIR.fullmatch(name), members[name], _join(dirpath, name)
        if (match and tree[name] is FileKind.DIR and objects.get(MANIFEST) is FileKind.FILE
                and names_hold_every_rank(set(objects))):
            found.committed[int(match.group(1))] = path
        else:
            found.uncommitted.append(path)
    return found


def committed_steps(dirpath: str, storage: Storage | None = None) -> dict[int, str]:
    """Committed checkpoints under ``dirpath`` by step (default storage: local files)."""
    return catalog(storage if storage is not None else LocalStorage(), dirpath).committed


def _join(path: str, name: str) -> str:
    return join(path, name) if is_url(path) else os.path.join(path, name)
