"""The narrow storage seam: everything lazyckpt does to files goes through a :class:`Storage`.

Tests inject faults by subclassing :class:`LocalStorage` (e.g. a ``write`` that raises ``ENOSPC``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

Buffer = memoryview


@runtime_checkable
class Storage(Protocol):
    """What the writer and the commit step need from a file system."""

    def open_write(self, path: str) -> int:
        """Create ``path`` (truncating) and return a handle for :meth:`write`."""

    def write(self, handle: int, offset: int, buffers: Sequence[Buffer]) -> None:
        """Write ``buffers`` back to back at ``offset``, completely."""

    def close(self, handle: int, *, sync: bool) -> None:
        """Make the file durable (when ``sync``) and close it."""

    def write_atomic(self, path: str, data: bytes, *, sync: bool) -> None:
        """Write ``data`` to ``path`` so that readers see all of it or nothing (temp name, fsync, rename)."""

    def make_dir(self, path: str) -> None: ...

    def rename_dir(self, src: str, dst: str, *, sync: bool) -> None:
        """Atomically rename a directory and make the rename durable."""

    def remove_tree(self, path: str) -> None: ...

    def free_bytes(self, path: str) -> int: ...


class LocalStorage:
    """Local (or POSIX-mounted) files with ``pwritev``, ``fsync`` and a page-cache drop after each file."""

    def open_write(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)

    def write(self, handle: int, offset: int, buffers: Sequence[Buffer]) -> None:
        pending = [memoryview(b).cast("B") for b in buffers if len(b)]
        while pending:
            written = os.pwritev(handle, pending, offset)
            offset += written
            pending = _advance(pending, written)

    def close(self, handle: int, *, sync: bool) -> None:
        try:
            if sync:
                os.fsync(handle)
                # The bytes are on disk: drop them from the page cache so checkpoints do not evict training data.
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(handle, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(handle)

    def write_atomic(self, path: str, data: bytes, *, sync: bool) -> None:
        tmp = f"{path}.tmp"
        handle = self.open_write(tmp)
        try:
            self.write(handle, 0, [memoryview(data)])
        finally:
            self.close(handle, sync=sync)
        os.replace(tmp, path)
        if sync:
            _fsync_dir(os.path.dirname(path))

    def make_dir(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rename_dir(self, src: str, dst: str, *, sync: bool) -> None:
        os.rename(src, dst)
        if sync:
            _fsync_dir(os.path.dirname(dst))

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def free_bytes(self, path: str) -> int:
        return shutil.disk_usage(path).free


def _advance(buffers: list[memoryview], count: int) -> list[memoryview]:
    while buffers and count >= len(buffers[0]):
        count -= len(buffers[0])
        buffers = buffers[1:]
    if buffers and count:
        buffers = [buffers[0][count:], *buffers[1:]]
    return buffers


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
