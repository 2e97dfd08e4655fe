"""Names of checkpoints on disk: ``epoch=1-step=40.ckpt -> step-0000040``, relative symbolic links made through
the :class:`~lazyckpt.storage.Storage` seam. The only file-system code of the integrations."""

from __future__ import annotations

import os

from lazyckpt.format.files import STEP_DIR
from lazyckpt.storage import FileKind, Storage


def link_alias(storage: Storage, alias: str, step_dir: str) -> None:
    """Point ``alias`` at ``step_dir`` with a relative link, replacing what was there atomically."""
    parent = os.path.dirname(alias)
    storage.make_dir(parent)
    info = storage.stat(alias)
    if info is not None and info.kind is FileKind.DIR:
        storage.remove_tree(alias)  # a real directory in the way (e.g. another tool's checkpoint of that name)
    storage.link(os.path.relpath(step_dir, parent), alias)


def unlink_alias(storage: Storage, alias: str) -> int | None:
    """Remove the name ``alias`` (a link, or an ordinary checkpoint file ModelCheckpoint would have removed
    too); returns the step it pointed at (None if it was not a lazyckpt alias)."""
    step = alias_step(storage, alias)
    info = storage.stat(alias)
    if info is not None and info.kind in (FileKind.LINK, FileKind.FILE):
        storage.remove_file(alias)
    return step


def alias_step(storage: Storage, alias: str) -> int | None:
    """The step a link alias points at, or None."""
    info = storage.stat(alias)
    if info is None or info.kind is not FileKind.LINK:
        return None
    match = STEP_DIR.fullmatch(os.path.basename(os.path.normpath(storage.read_link(alias))))
    return int(match.group(1)) if match else None


def aliased_steps(storage: Storage, dirpath: str, *, into: str | None = None) -> set[int]:
    """Steps that some link directly inside ``dirpath`` points at (names from this run or earlier ones); with
    ``into``, only links to step directories of ``into`` (names beside another run's checkpoint directory)."""
    try:
        names = storage.list_dir(dirpath)
    except FileNotFoundError:
        return set()
    if into is not None:
        links = [path for path in (os.path.join(dirpath, n) for n in names)
                 if (info := storage.stat(path)) is not None and info.kind is FileKind.LINK]
        return {resolve_step(storage, path, into) for path in links} - {None}
    steps = {alias_step(storage, os.path.join(dirpath, name)) for name in names}
    return steps - {None}


def resolve_step(storage: Storage, path: str | None, dirpath: str) -> int | None:
    """The step of ``path`` when it is (or links to) a step directory of ``dirpath``, else None."""
    if not path:
        return None
    real = storage.resolve(os.path.abspath(path))
    if os.path.dirname(real) != storage.resolve(dirpath):
        return None
    match = STEP_DIR.fullmatch(os.path.basename(real))
    return int(match.group(1)) if match else None
