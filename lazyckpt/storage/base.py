"""The storage seam: the one Protocol through which lazyckpt touches files (or objects).

Every read, write, listing, stat, rename, removal, lock and link goes through a :class:`Storage`, so a backend
(local files, memory for tests, a remote store) and fault injection (a subclass whose method raises) cover all of
lazyckpt at once. Paths are plain strings: a remote backend may receive URLs, which ``pathlib`` would mangle.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

Buffer = memoryview
PAGE_BYTES = 4096
"""The direct-I/O block: staging slots and every tensor file's data section start on it, and a piece whose file
offset is a multiple of it goes to the disk straight from its slot."""


class FileKind(str, enum.Enum):
    """What a path names, without following a final symbolic link."""

    FILE = "file"
    DIR = "dir"
    LINK = "link"
    OTHER = "other"
    """A FIFO, socket or device: never opened by the reader (opening a FIFO blocks)."""


@dataclass(frozen=True, slots=True)
class FileInfo:
    kind: FileKind
    size: int
    mtime: float


@runtime_checkable
class ReadHandle(Protocol):
    """An open file for positional reads. A handle whose reads may run on several threads at once (each at its
    own offset, e.g. ``preadv``) says so with a true ``parallel_reads`` attribute; without it the reader reads
    from one thread."""

    size: int

    def read_into(self, offset: int, buffer: Buffer) -> int:
        """Fill ``buffer`` from ``offset``; returns the bytes read (fewer only at the end of the file)."""

    def close(self) -> None: ...


@runtime_checkable
class StorageLock(Protocol):
    def release(self) -> None: ...


@runtime_checkable
class Storage(Protocol):
    """Everything lazyckpt needs from a file system. Each method says which guarantees it must give."""

    # --- tensor files, written by the shared writer thread ---------------------------------------------------

    def open_write(self, path: str) -> Any:
        """Create ``path`` (truncating) and return an opaque handle for :meth:`write`."""

    def write(self, handle: Any, offset: int, buffers: Sequence[Buffer]) -> None:
        """Write ``buffers`` back to back at ``offset``, completely."""

    def close(self, handle: Any, *, sync: bool) -> None:
        """Make the file durable (when ``sync``) and close it."""

    # --- small files and the namespace ---------------------------------------------------------------------

    def write_atomic(self, path: str, data: bytes, *, sync: bool) -> None:
        """Write ``data`` to ``path`` so that readers see all of it or nothing (temp name, fsync, rename)."""

    def make_dir(self, path: str) -> None:
        """Create ``path`` and its parents; no error when it exists."""

    def rename(self, src: str, dst: str, *, sync: bool) -> None:
        """Atomically rename a file or directory (``dst`` must not be a non-empty directory); durable when
        ``sync`` (the parent directory is synced)."""

    def remove_file(self, path: str) -> None:
        """Remove one file or link; ``FileNotFoundError`` when there is none."""

    def remove_tree(self, path: str) -> None:
        """Remove a directory and everything below it; no error when it is already gone."""

    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` (creations, renames, removals) durable."""

    def link(self, target: str, path: str) -> None:
        """Make ``path`` a symbolic link to ``target`` (relative to ``path``'s directory), replacing what was
        there atomically."""

    def read_link(self, path: str) -> str:
        """The target of the symbolic link ``path``, as stored."""

    def lock(self, path: str) -> StorageLock:
        """Take an exclusive lock named ``path`` for this process; it is released by ``release()`` or when the
        process dies. Raises ``BlockingIOError`` when another holder has it."""

    def free_bytes(self, path: str) -> int:
        """Free space available under ``path``."""

    # --- reading ------------------------------------------------------------------------------------------

    def stat(self, path: str) -> FileInfo | None:
        """What ``path`` names, without following a final link; ``None`` when nothing is there."""

    def list_dir(self, path: str) -> list[str]:
        """The names in directory ``path`` (unsorted); ``FileNotFoundError`` when it is not a directory."""

    def resolve(self, path: str) -> str:
        """``path`` with every link followed (a backend without links returns it unchanged)."""

    def open_read(self, path: str) -> ReadHandle:
        """Open the regular file ``path`` for :meth:`ReadHandle.read_into`."""

    def read_bytes(self, path: str, *, max_bytes: int) -> bytes:
        """The whole regular file ``path``. Raises ``ValueError`` (before reading) when it holds more than
        ``max_bytes`` and ``IsADirectoryError``/``OSError`` when it is not a regular file."""


def wait_for_lock(storage: Storage, path: str, *, timeout_s: float | None = None) -> StorageLock:
    """:meth:`Storage.lock`, waiting while another holder has it (processes taking turns, e.g. at a fetch).

    Raises:
        TimeoutError: still held by another after ``timeout_s`` seconds (None: wait as long as it takes).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            return storage.lock(path)
        except BlockingIOError:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"lazyckpt: {path} stayed locked by another process for {timeout_s:g}s") from None
            time.sleep(delay)
            delay = min(2 * delay, 0.1)


def kind_of(storage: Storage, path: str) -> FileKind | None:
    """What ``path`` names once links are followed (as ``os.path.isdir``/``isfile`` see it); None when nothing is
    there, a link leads nowhere or in a loop, or the path cannot be looked at (``os.path.exists`` says False then)."""
    try:
        info = storage.stat(path)
        if info is not None and info.kind is FileKind.LINK:
            info = storage.stat(storage.resolve(path))
    except OSError:
        return None
    return None if info is None or info.kind is FileKind.LINK else info.kind
