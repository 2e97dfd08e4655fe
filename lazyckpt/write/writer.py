"""The one background writer of a process: a FIFO of tasks drained by a single thread.

Pieces are written in the order they were staged (adjacent pieces of one file are gathered into a single
``pwritev``), and a checkpoint's commit task is queued after its last piece, so FIFO order is the ordering rule.
A task's failure is handed to its job and never stops the writer; the job's later tasks are skipped, but their
buffers are still released so the staging pool never leaks.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from lazyckpt.storage import Buffer, Storage
from lazyckpt.threads import WRITER_NICE, start_background_thread

logger = logging.getLogger(__name__)


class JobLike(Protocol):
    failed: bool

    def fail(self, error: BaseException) -> None: ...


@dataclass(slots=True)
class WriteTask:
    """Write ``buffers`` at ``offset`` of an open file, then call ``release``."""

    job: JobLike
    storage: Storage
    handle: Any
    offset: int
    buffers: Sequence[Buffer]
    release: Callable[[], None] = lambda: None
    prepare: Callable[[], None] | None = None
    """Runs on the writer thread before the write (checksums of staged bytes, off the barrier's path)."""

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.buffers)


@dataclass(slots=True)
class CallTask:
    """Run ``fn()`` on the writer thread (fsync, manifest, commit)."""

    job: JobLike
    fn: Callable[[], None]
    always: bool = field(default=False)
    """Run even when the job already failed (clean-up tasks)."""


Task = WriteTask | CallTask


def run_writer(tasks: queue.SimpleQueue, max_gather_bytes: int) -> None:
    """The writer thread's body: run tasks until a ``None`` sentinel arrives."""
    carry: Task | None = None
    while True:
        task = carry if carry is not None else tasks.get()
        carry = None
        if task is None:
            return
        if isinstance(task, WriteTask):
            batch, carry = _gather(task, tasks, max_gather_bytes)
            _run_writes(batch)
        else:
            _run_call(task)


def _gather(first: WriteTask, tasks: queue.SimpleQueue, limit: int) -> tuple[list[WriteTask], Task | None]:
    """Take queued writes that continue ``first`` in the same file, up to ``limit`` bytes."""
    batch, end, total = [first], first.offset + first.nbytes, first.nbytes
    while total < limit:
        try:
            nxt = tasks.get_nowait()
        except queue.Empty:
            return batch, None
        if not (isinstance(nxt, WriteTask) and nxt.handle == first.handle and nxt.job is first.job
                and nxt.offset == end):
            return batch, nxt
        batch.append(nxt)
        end, total = end + nxt.nbytes, total + nxt.nbytes
    return batch, None


def _run_writes(batch: list[WriteTask]) -> None:
    first = batch[0]
    try:
        if not first.job.failed:
            for t in batch:
                if t.prepare is not None:
                    t.prepare()
            first.storage.write(first.handle, first.offset, [b for t in batch for b in t.buffers])
    except BaseException as e:  # noqa: BLE001 - every failure belongs to the job, the writer lives on
        first.job.fail(e)
    finally:
        for t in batch:
            t.release()


def _run_call(task: CallTask) -> None:
    if task.job.failed and not task.always:
        return
    try:
        task.fn()
    except BaseException as e:  # noqa: BLE001
        task.job.fail(e)


class SharedWriter:
    """The process-wide writer; created on first use and re-created after ``fork``."""

    _lock = threading.Lock()
    _instance: SharedWriter | None = None

    def __init__(self, max_gather_bytes: int = 8 << 20) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._pid = os.getpid()
        self._thread = start_background_thread(run_writer, self._tasks, max_gather_bytes, name="lazyckpt-writer",
                                               nice=WRITER_NICE)

    @classmethod
    def get(cls) -> SharedWriter:
        with cls._lock:
            if cls._instance is None or cls._instance._pid != os.getpid() or not cls._instance._thread.is_alive():
                cls._instance = cls()
            return cls._instance

    def submit(self, task: Task) -> None:
        self._tasks.put(task)
