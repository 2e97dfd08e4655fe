"""Direct-I/O tensor file writer: in-order bytes go out with ``O_DIRECT`` through an aligned bounce buffer."""

from __future__ import annotations

import mmap
import os

import numpy as np

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_ALIGN = 4096
_BOUNCE_BYTES = 8 << 20


class DirectFile:
    """A file written front to back. In-order bytes gather in a page-aligned bounce buffer that goes out with
    ``O_DIRECT`` in 8 MiB blocks; the unaligned tail (and any out-of-order write) goes through the page cache."""

    def __init__(self, path: str, *, direct_io: bool) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | CLOEXEC, 0o644)
        self.direct_fd: int | None = None
        self.bounce: mmap.mmap | None = None
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT | CLOEXEC)
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
            pwrite_all(self.fd, buffers, offset)
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
            pwrite_all(self.direct_fd, [view[:aligned]], self.start)
        if aligned < self.fill:  # only ever the file's last bytes
            pwrite_all(self.fd, [view[aligned : self.fill]], self.start + aligned)
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


def pwrite_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    pending = [b for b in buffers if len(b)]
    while pending:
        written = os.pwritev(fd, pending, offset)
        offset += written
        pending = advance(pending, written)


def advance(buffers: list[memoryview], count: int) -> list[memoryview]:
    while buffers and count >= len(buffers[0]):
        count -= len(buffers[0])
        buffers = buffers[1:]
    if buffers and count:
        buffers = [buffers[0][count:], *buffers[1:]]
    return buffers


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
