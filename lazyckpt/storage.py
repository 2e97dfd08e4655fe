"""The narrow storage seam: everything lazyckpt does to files goes through a :class:`Storage`.

Tests inject faults by subclassing :class:`LocalStorage` (e.g. a ``write`` that raises ``ENOSPC``).
"""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

Buffer = memoryview


@runtime_checkable
class Storage(Protocol):
    """What the writer and the commit step need from a file system."""

    def open_write(self, path: str) -> Any:
        """Create ``path`` (truncating) and return an opaque handle for :meth:`write`."""

    def write(self, handle: Any, offset: int, buffers: Sequence[Buffer]) -> None:
        """Write ``buffers`` back to back at ``offset``, completely."""

    def close(self, handle: Any, *, sync: bool) -> None:
        """Make the file durable (when ``sync``) and close it."""

    def write_atomic(self, path: str, data: bytes, *, sync: bool) -> None:
        """Write ``data`` to ``path`` so that readers see all of it or nothing (temp name, fsync, rename)."""

    def make_dir(self, path: str) -> None: ...

    def rename_dir(self, src: str, dst: str, *, sync: bool) -> None:
        """Atomically rename a directory and make the rename durable."""

    def remove_tree(self, path: str) -> None: ...

    def free_bytes(self, path: str) -> int: ...


class LocalStorage:
    """Local (or POSIX-mounted) files: direct I/O through an aligned bounce buffer, ``fsync``, cache drop.

    Args:
        direct_io: write with ``O_DIRECT`` where the file system allows it. Measured here, a 296 MiB write + fsync
            took 0.4 s instead of 1.5 s and slowed a concurrent compute loop less, because the bytes skip the page
            cache and its write-back burst. File systems without ``O_DIRECT`` (tmpfs) fall back to buffered writes.
    """

    def __init__(self, *, direct_io: bool = True) -> None:
        self.direct_io = direct_io

    def open_write(self, path: str) -> _OpenFile:
        return _OpenFile(path, direct_io=self.direct_io)

    def write(self, handle: _OpenFile, offset: int, buffers: Sequence[Buffer]) -> None:
        handle.write(offset, [memoryview(b).cast("B") for b in buffers if len(b)])

    def close(self, handle: _OpenFile, *, sync: bool) -> None:
        handle.close(sync=sync)

    def write_atomic(self, path: str, data: bytes, *, sync: bool) -> None:
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _CLOEXEC, 0o644)
        try:
            _pwrite_all(fd, [memoryview(data)], 0)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
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


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_ALIGN = 4096
_BOUNCE_BYTES = 8 << 20


class _OpenFile:
    """A file written front to back. In-order bytes gather in a page-aligned bounce buffer that goes out with
    ``O_DIRECT`` in 8 MiB blocks; the unaligned tail (and any out-of-order write) goes through the page cache."""

    def __init__(self, path: str, *, direct_io: bool) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _CLOEXEC, 0o644)
        self.direct_fd: int | None = None
        self.bounce: mmap.mmap | None = None
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT | _CLOEXEC)
                self.bounce = mmap.mmap(-1, _BOUNCE_BYTES)
            except OSError:  # tmpfs and some network file systems refuse O_DIRECT
                self._close_direct()
        # numpy copies release the GIL; an mmap slice assignment would hold it for every megabyte.
        self.bounce_np = np.frombuffer(self.bounce, dtype=np.uint8) if self.bounce is not None else None
        self.start = 0  # file offset of bounce[0]
        self.fill = 0

    def write(self, offset: int, buffers: list[memoryview]) -> None:
        if self.bounce is None or offset != self.start + self.fill:
            self._leave_direct_mode()
            _pwrite_all(self.fd, buffers, offset)
            return
        for buf in buffers:
            while len(buf):
                take = min(len(buf), _BOUNCE_BYTES - self.fill)
                self.bounce_np[self.fill : self.fill + take] = np.frombuffer(buf[:take], dtype=np.uint8)
                self.fill += take
                buf = buf[take:]
                if self.fill == _BOUNCE_BYTES:
                    self._flush_bounce()

    def _flush_bounce(self) -> None:
        aligned = self.fill - self.fill % _ALIGN
        view = memoryview(self.bounce)
        if aligned:
            _pwrite_all(self.direct_fd, [view[:aligned]], self.start)
        if aligned < self.fill:  # only ever the file's last bytes
            _pwrite_all(self.fd, [view[aligned : self.fill]], self.start + aligned)
        view.release()
        self.start += self.fill
        self.fill = 0

    def _leave_direct_mode(self) -> None:
        if self.bounce is not None:
            self._flush_bounce()
            self.bounce_np = None
            self.bounce.close()
            self.bounce = None

    def close(self, *, sync: bool) -> None:
        try:
            self._leave_direct_mode()
            if sync:
                os.fsync(self.fd)
                # The bytes are on disk: drop them from the page cache so checkpoints do not evict training data.
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            try:
                os.close(self.fd)
            finally:
                self._close_direct()

    def _close_direct(self) -> None:
        if self.direct_fd is not None:
            os.close(self.direct_fd)
            self.direct_fd = None


def _pwrite_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    pending = [b for b in buffers if len(b)]
    while pending:
        written = os.pwritev(fd, pending, offset)
        offset += written
        pending = _advance(pending, written)


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
