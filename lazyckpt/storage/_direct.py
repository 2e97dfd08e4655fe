"""Direct-I/O tensor file writer: in-order bytes go out with ``O_DIRECT``, straight from the caller's buffer when
it is aligned, else through two aligned bounce buffers.

An aligned buffer at an aligned file position (a staging slot: the pool and the data section start on 4 KiB
boundaries) is written in place, with no copy: the writer's only work is the ``pwrite``. Other bytes (the header,
eager tensors, tails) fill a bounce buffer; while one 8 MiB bounce buffer is on its way to the disk (a ``pwrite``
on a small I/O thread), the writer fills the other one, so the disk never waits for that copy and the copy never
waits for the disk.
"""

from __future__ import annotations

import mmap
import os
import queue

import numpy as np

from lazyckpt.storage.base import PAGE_BYTES
from lazyckpt.threads import WRITER_NICE, start_background_thread

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_ALIGN = PAGE_BYTES  # O_DIRECT's block: the pool's slots and the layout's data section share it
_BOUNCE_BYTES = 8 << 20
_IN_FLIGHT = 2


class DirectFile:
    """A file written front to back. In-order bytes stream out with ``O_DIRECT``; the unaligned tail (and any
    out-of-order write, which ends direct mode) goes through the page cache."""

    def __init__(self, path: str, *, direct_io: bool) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | CLOEXEC, 0o644)
        self.stream: _AlignedStream | None = None
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                self.stream = _AlignedStream(os.open(path, os.O_WRONLY | os.O_DIRECT | CLOEXEC))
            except OSError:  # tmpfs and some network file systems refuse O_DIRECT
                self.stream = None

    def write(self, offset: int, buffers: list[memoryview]) -> None:
        if self.stream is not None and offset == self.stream.end:
            self.stream.append(buffers)
            return
        self._leave_direct_mode()
        pwrite_all(self.fd, buffers, offset)

    def _leave_direct_mode(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            tail, tail_offset = stream.finish()
            pwrite_all(self.fd, [tail], tail_offset)

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
                if self.stream is not None:
                    self.stream.shutdown()


class _AlignedStream:
    """Bytes appended in file order, written in whole aligned bounce buffers by one I/O thread."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.bounces = [mmap.mmap(-1, _BOUNCE_BYTES) for _ in range(_IN_FLIGHT)]
        # numpy copies release the GIL; an mmap slice assignment would hold it for every megabyte.
        self.arrays = [np.frombuffer(b, dtype=np.uint8) for b in self.bounces]
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(1, _IN_FLIGHT):
            self.free.put(index)
        self.writes: queue.SimpleQueue[tuple[int, int, int] | None] = queue.SimpleQueue()
        self.io_thread = None
        self.error: BaseException | None = None
        self.current, self.start, self.fill = 0, 0, 0  # bounce in use, its file offset, bytes in it

    @property
    def end(self) -> int:
        return self.start + self.fill

    def append(self, buffers: list[memoryview]) -> None:
        for buf in buffers:
            buf = self._write_in_place(buf)
            while len(buf):
                take = min(len(buf), _BOUNCE_BYTES - self.fill)
                self.arrays[self.current][self.fill : self.fill + take] = np.frombuffer(buf[:take], dtype=np.uint8)
                self.fill += take
                buf = buf[take:]
                if self.fill == _BOUNCE_BYTES:
                    self._send_bounce()

    def _send_bounce(self) -> None:
        """Hand the filled bounce buffer (a whole number of aligned blocks) to the I/O thread and go on in the
        next free one; waits while every other buffer is still being written."""
        self._hand_over(self.fill)
        self.start, self.fill = self.start + self.fill, 0
        self.current = self.free.get()
        self._raise_if_failed()

    def _write_in_place(self, buf: memoryview) -> memoryview:
        """Write the aligned front of ``buf`` straight from it when it and the file position allow; returns the
        rest. Synchronous: the caller may reuse ``buf`` once ``append`` returns."""
        self._raise_if_failed()  # an earlier bounce write failed: stop writing this file now
        whole = len(buf) - len(buf) % _ALIGN
        if not whole or self.fill % _ALIGN or np.frombuffer(buf, np.uint8).ctypes.data % _ALIGN:
            return buf
        if self.fill:  # the bounce's aligned bytes go first, in file order
            self._send_bounce()
        pwrite_all(self.fd, [buf[:whole]], self.start)
        self.start += whole
        return buf[whole:]

    def finish(self) -> tuple[memoryview, int]:
        """Write out all aligned bytes and wait for them; the unaligned tail ``(bytes, file offset)`` is left to
        the caller. Raises the I/O thread's error, if any."""
        aligned = self.fill - self.fill % _ALIGN
        if aligned:
            self._hand_over(aligned)
        tail = memoryview(bytes(self.arrays[self.current][aligned : self.fill]))  # the I/O thread reads only before it
        self.shutdown()
        self._raise_if_failed()
        return tail, self.start + aligned

    def shutdown(self) -> None:
        """Stop the I/O thread once its queued writes are done and close the direct descriptor (idempotent)."""
        if self.io_thread is not None:
            self.writes.put(None)
            self.io_thread.join()
            self.io_thread = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            # Dropped, not closed: a stored error's traceback may still reference a view of one of them.
            self.arrays, self.bounces = [], []

    def _hand_over(self, nbytes: int) -> None:
        if self.io_thread is None:
            self.io_thread = start_background_thread(self._write_queued, name="lazyckpt-direct-io", nice=WRITER_NICE)
        self.writes.put((self.current, nbytes, self.start))

    def _write_queued(self) -> None:
        while (item := self.writes.get()) is not None:
            index, nbytes, offset = item
            try:
                if self.error is None:
                    with memoryview(self.bounces[index]) as view:
                        pwrite_all(self.fd, [view[:nbytes]], offset)
            except BaseException as e:  # noqa: BLE001 - handed to the writer at its next append or finish
                self.error = e
            finally:
                self.free.put(index)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error


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
    fsync_path(path or ".")


def fsync_path(path: str) -> None:
    """Make a file's bytes (or a directory's entries) durable, opened read-only: for files written by others
    (a download), whose descriptor is gone."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
