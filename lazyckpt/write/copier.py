"""The copier: one background thread per checkpointer that stages a job's bytes and feeds the writer.

Lazy pieces go first (they gate the barrier), through the host pool and the copy backend; eager pieces are
already private CPU copies and go to the writer straight from there. Every job ends with one finalize task on
the writer, queued last, whether the job succeeded or not.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch

from lazyckpt.errors import SnapshotConsistencyError
from lazyckpt.format.checksum import checksum_run, format_checksum, tensor_bytes
from lazyckpt.storage import Storage
from lazyckpt.threads import COPIER_NICE, start_background_thread
from lazyckpt.write.job import CheckpointJob, JobState
from lazyckpt.write.plan import PIECE_BYTES, Piece, lazy_bytes, segment_runs, staging_slots
from lazyckpt.write.staging import CopyBackend, HostBufferPool
from lazyckpt.write.staging.pool import slots_for
from lazyckpt.write.writer import CallTask, SharedWriter, WriteTask


class SlotKeeper(Protocol):
    """Keeps written staging slots instead of freeing them (the memory level: the newest snapshot stays in the
    pool). The copier sizes the pool by it and hands each written slot to it."""

    def pool_bytes(self, job: CheckpointJob) -> int:
        """The staging memory the pool needs for ``job`` while the keeper holds a snapshot."""

    def keeper(self, job: CheckpointJob, piece: Piece, slot: torch.Tensor,
               give_back: Callable[[], None]) -> Callable[[], None]:
        """What the writer calls once ``slot`` is written: keep it (``give_back`` frees it later)."""


class Copier:
    """Owns the host pool and the copy thread of one checkpointer."""

    def __init__(self, *, backend: CopyBackend, budget_bytes: int | None, storage: Storage, writer: SharedWriter,
                 finalize: Callable[[CheckpointJob], None], memory: SlotKeeper | None = None,
                 max_in_flight: int = 1) -> None:
        self.backend = backend
        self.max_in_flight = max_in_flight
        self.memory = memory
        self.writer = writer
        self.budget_bytes = budget_bytes
        self.storage = storage
        self.finalize = finalize
        self.pool: HostBufferPool | None = None
        self._jobs: queue.SimpleQueue[CheckpointJob | None] = queue.SimpleQueue()
        self._thread = start_background_thread(self._loop, name="lazyckpt-copier", nice=COPIER_NICE)

    def submit(self, job: CheckpointJob) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        self.pool = None

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            writer = self.writer
            try:
                self._stage(job, writer)
            except BaseException as e:  # noqa: BLE001 - the job carries it to the training thread
                job.fail(e)
            finally:
                writer.submit(CallTask(job, lambda job=job: self.finalize(job), always=True))

    def _stage(self, job: CheckpointJob, writer: SharedWriter) -> None:
        self.storage.make_dir(job.partial_dir)
        job.handle = self.storage.open_write(job.file_path)
        writer.submit(WriteTask(job, self.storage, job.handle, 0, [memoryview(job.header)]))
        pool = self._pool_for(self._pool_bytes(job))
        lazy = [p for p in job.pieces if p.lazy]
        flat = [self.backend.prepare_source(t) if e.lazy else None for e, t in zip(job.entries, job.sources)]
        batch = self.backend.max_batch_pieces
        for start in range(0, len(lazy), batch):
            self._copy_batch(job, flat, lazy[start : start + batch], pool, writer)
            if job.failed:
                return
        _check_versions(job)
        job.stats.copy_s = time.monotonic() - job.requested_at
        job.advance(JobState.STAGED)
        for piece in (p for p in job.pieces if not p.lazy):
            _write_eager_piece(job, piece, writer, self.storage)

    def _pool_bytes(self, job: CheckpointJob) -> int:
        """What the pool should hold, before the budget caps it: the memory level keeps the newest snapshot's
        slots (two checkpoints); otherwise one checkpoint, or with a budget as many as may be in flight, so the
        next copy need not wait for the writer."""
        if self.memory is not None:
            return self.memory.pool_bytes(job)
        if self.budget_bytes is None:
            return lazy_bytes(job.entries)
        return self.max_in_flight * PIECE_BYTES * staging_slots(job.pieces)

    def _pool_for(self, nbytes: int) -> HostBufferPool:
        wanted = slots_for(self.budget_bytes, nbytes)
        if self.pool is None or self.pool.num_slots < wanted:
            if self.pool is not None and self.memory is None:
                self.pool.drain()  # the previous checkpoint may still be written from it: stay within the budget
            self.pool = None  # free the smaller pool before allocating the larger one
            self.pool = HostBufferPool(wanted, pin=self.backend.pin_memory())
        return self.pool

    def _copy_batch(self, job: CheckpointJob, flat: list, pieces: list[Piece], pool: HostBufferPool,
                    writer: SharedWriter) -> None:
        done = 0
        while done < len(pieces):
            slots = [pool.acquire(block=True)]  # wait for the writer to free at least one slot
            while len(slots) < len(pieces) - done and (extra := pool.acquire(block=False)) is not None:
                slots.append(extra)
            batch = pieces[done : done + len(slots)]
            handed = 0  # slots owned by the writer from here on; the rest go back to the pool on any failure
            try:
                sums = self.backend.copy_pieces(flat, batch, [pool.slot(s) for s in slots])
                for i, (piece, slot) in enumerate(zip(batch, slots)):
                    staged = pool.slot(slot)[: piece.nbytes].numpy()
                    if sums is not None:
                        _record_checksums(job, piece, sums[i])
                    writer.submit(WriteTask(
                        job, self.storage, job.handle, _file_offset(job, piece), [memoryview(staged)],
                        release=self._release_for(job, piece, pool, slot),
                        prepare=None if sums is not None else partial(_checksum_staged, job, piece, staged)))
                    handed += 1
            finally:
                for slot in slots[handed:]:
                    pool.release(slot)
            done += len(batch)

    def _release_for(self, job: CheckpointJob, piece: Piece, pool: HostBufferPool, slot: int) -> Callable[[], None]:
        """What the writer calls once a slot is written: back to the pool, or to the memory level to keep."""
        give_back = partial(pool.release, slot)
        return give_back if self.memory is None else self.memory.keeper(job, piece, pool.slot(slot), give_back)


def _checksum_staged(job: CheckpointJob, piece: Piece, staged) -> None:
    """Checksums of a staged piece, computed by the writer right before it writes the piece."""
    _record_checksums(job, piece, [value for run in segment_runs(piece)
                                   for value in checksum_run(staged[run[0].dst_offset : _run_end(run)])])


def _write_eager_piece(job: CheckpointJob, piece: Piece, writer: SharedWriter, storage: Storage) -> None:
    datas = [tensor_bytes(job.sources[run[0].tensor_index])[run[0].src_offset : run[-1].src_offset + run[-1].nbytes]
             for run in segment_runs(piece)]

    def checksum() -> None:
        _record_checksums(job, piece, [value for data in datas for value in checksum_run(data)])

    writer.submit(WriteTask(job, storage, job.handle, _file_offset(job, piece), [memoryview(d) for d in datas],
                            prepare=checksum))


def _run_end(run: list) -> int:
    return run[-1].dst_offset + run[-1].nbytes


def _file_offset(job: CheckpointJob, piece: Piece) -> int:
    return len(job.header) + piece.data_offset


def _record_checksums(job: CheckpointJob, piece: Piece, sums: list[int]) -> None:
    for seg, value in zip(piece.segments, sums, strict=True):
        job.checksums[job.entries[seg.tensor_index].key][seg.chunk_index] = format_checksum(value)


def _check_versions(job: CheckpointJob) -> None:
    """The safety net behind the barrier: a lazily captured tensor must not change before it is copied."""
    for index, version in job.versions.items():
        tensor = job.sources[index]
        if tensor._version != version:
            raise SnapshotConsistencyError(
                f"tensor {job.entries[index].key!r} was modified in place after save(step={job.step}) and "
                "before its copy finished. Lazily copied tensors (those of `optimizers` and `immutable`) must stay "
                "unchanged from save() until wait_staged(): call save() right after optimizer.step(), not between "
                "backward() and optimizer.step(), and wait_staged() right before the next optimizer.step(); or "
                "pass the tensor through neither `optimizers` nor `immutable` so it is copied eagerly"
            )

