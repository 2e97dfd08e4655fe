"""Which checkpoints a directory holds, by the format's commit rule (docs/FORMAT.md): the one rule every level and
reader applies, on local files and on object stores alike.

A ``step-NNNNNNN`` entry is a committed checkpoint when it holds a regular ``manifest.json``, the file written last,
and, on a file system, is itself a directory (never a link: a link could make one step look like another). An
object store has no directories: there the manifest alone decides, one look-up per step. Any other ``step-*`` entry is
uncommitted (a partial upload on an object store, which has no rename); names not ``step-*`` are not the format's.

Example:
    >>> committed_steps("runs/ckpt")                    # doctest: +SKIP
    {40: 'runs/ckpt/step-0000040', 80: 'runs/ckpt/step-0000080'}
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from lazyckpt.format.files import MANIFEST, STEP_DIR
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
    link)."""
    if not is_url(step_path):
        here = storage.stat(step_path)
        if here is None or here.kind is not FileKind.DIR:
            return False
    manifest = storage.stat(_join(step_path, MANIFEST))
    return manifest is not None and manifest.kind is FileKind.FILE


def catalog(storage: Storage, dirpath: str) -> Catalog:
    """The ``step-*`` entries under ``dirpath``, sorted by name (a missing directory holds none)."""
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


def committed_steps(dirpath: str, storage: Storage | None = None) -> dict[int, str]:
    """Committed checkpoints under ``dirpath`` by step (default storage: local files)."""
    return catalog(storage if storage is not None else LocalStorage(), dirpath).committed


def _join(path: str, name: str) -> str:
    return join(path, name) if is_url(path) else os.path.join(path, name)
