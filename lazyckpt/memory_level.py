"""The memory level: the newest committed snapshot stays in host memory, for a rollback without the disk.

A checkpoint's lazy bytes already pass through host staging slots on their way to the file. With
``keep_in_memory=True`` the writer hands each slot here instead of back to the pool once its bytes are written;
the eager tensors (private CPU copies made by ``save()``) are kept too. When the checkpoint commits, its slots
become the newest snapshot and the previous snapshot's slots go back to the pool. So the pool holds at most two
checkpoints: the newest complete one and the one being written (double buffering), and nothing accumulates.

Reading a snapshot copies its bytes out under a lock (the writer cannot recycle them meanwhile), checks every
chunk against the checksums recorded for the file with the reader's own check
(:func:`lazyckpt.tensor_io.check_chunks`), and rebuilds the state with the reader's decoder.

Example:
    >>> ckpt = LazyCheckpointer("runs/ckpt", keep_in_memory=True)      # doctest: +SKIP
    >>> step, state = ckpt.memory_snapshot()                           # doctest: +SKIP
    >>> model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])   # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lazyckpt.checksum import CHUNK_BYTES, num_chunks, tensor_bytes
from lazyckpt.errors import CheckpointCorruptError
from lazyckpt.format import torch_dtype
from lazyckpt.job import CheckpointJob, JobState
from lazyckpt.plan import PIECE_BYTES, Piece, segment_runs
from lazyckpt.tensor_io import WORKERS, check_chunks
from lazyckpt.threads import limit_torch_threads_here
from lazyckpt.unflatten import unflatten


@dataclass(eq=False)
class _Snapshot:
    """One checkpoint's bytes held in host memory: staged slots (lazy pieces) and eager tensor copies."""

    job: CheckpointJob
    eager: dict[int, torch.Tensor]
    slots: list[tuple[Piece, torch.Tensor, Callable[[], None]]] = field(default_factory=list)

    def release(self) -> None:
        for _, _, give_back in self.slots:
            give_back()
        self.slots = []
        self.eager = {}


class MemoryLevel:
    """Keeps the newest committed snapshot of one checkpointer in its host staging pool."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._building: dict[CheckpointJob, _Snapshot] = {}
        self._newest: _Snapshot | None = None

    # --- sizing -----------------------------------------------------------------------------------------------

    @staticmethod
    def slots_per_checkpoint(job: CheckpointJob) -> int:
        return sum(1 for piece in job.pieces if piece.lazy)

    def pool_bytes(self, job: CheckpointJob) -> int:
        """Staging memory the pool needs: the newest snapshot plus the checkpoint being written."""
        return 2 * self.slots_per_checkpoint(job) * PIECE_BYTES

    def check_budget(self, job: CheckpointJob, budget_bytes: int | None) -> None:
        """Raise before anything is staged when ``host_buffer_bytes`` cannot hold two checkpoints."""
        needed = self.pool_bytes(job)
        if budget_bytes is not None and budget_bytes < needed:
            raise ValueError(
                f"keep_in_memory=True needs host_buffer_bytes >= {needed} ({needed / 2**20:.0f} MiB: two checkpoints "
                f"of {self.slots_per_checkpoint(job)} staging slots of {PIECE_BYTES >> 20} MiB, the newest snapshot "
                f"and the one being written); got host_buffer_bytes={budget_bytes}. Raise it, pass None to size it "
                "automatically, or turn keep_in_memory off")

    # --- the writer side ------------------------------------------------------------------------------------

    def begin(self, job: CheckpointJob) -> None:
        """Start collecting ``job``'s bytes (called by ``save()`` while the eager copies are still referenced)."""
        eager = {i: t for i, (e, t) in enumerate(zip(job.entries, job.sources)) if not e.lazy}
        with self._lock:
            # One job is in flight at a time, so every earlier one has ended: free those that never committed
            # (failed or discarded; their writes, and so their slots, all came back before they ended).
            ended = [s for j, s in self._building.items() if j.state is JobState.DISCARDED]
            for snapshot in ended:
                del self._building[snapshot.job]
            self._building[job] = _Snapshot(job, eager)
        for snapshot in ended:
            snapshot.release()

    def keeper(self, job: CheckpointJob, piece: Piece, slot: torch.Tensor,
               give_back: Callable[[], None]) -> Callable[[], None]:
        """The release callback of one written slot: keep the slot for the snapshot instead of freeing it."""
        def keep() -> None:
            with self._lock:
                snapshot = self._building.get(job)
                if snapshot is None:  # already dropped (the job was discarded): nothing will read it
                    give_back()
                else:
                    snapshot.slots.append((piece, slot, give_back))
        return keep

    def publish(self, job: CheckpointJob) -> None:
        """``job`` committed: it becomes the newest snapshot; the previous one's slots go back to the pool."""
        with self._lock:
            snapshot = self._building.pop(job, None)
            if snapshot is None:
                return
            previous, self._newest = self._newest, snapshot
        if previous is not None:
            previous.release()

    def drop(self, job: CheckpointJob) -> None:
        """``job`` failed or was discarded: free what it held; the newest snapshot stays."""
        with self._lock:
            snapshot = self._building.pop(job, None)
        if snapshot is not None:
            snapshot.release()

    def forget(self, step: int) -> bool:
        """Drop the newest snapshot if it is of ``step`` (its checkpoint was removed); True if it was."""
        with self._lock:
            snapshot = self._newest
            if snapshot is None or snapshot.job.step != step:
                return False
            self._newest = None
        snapshot.release()
        return True

    def clear(self) -> None:
        with self._lock:
            snapshots = [*self._building.values(), *([self._newest] if self._newest else [])]
            self._building, self._newest = {}, None
        for snapshot in snapshots:
            snapshot.release()

    # --- the training side ----------------------------------------------------------------------------------

    @property
    def newest_step(self) -> int | None:
        snapshot = self._newest
        return None if snapshot is None else snapshot.job.step

    def read(self) -> tuple[int, Any] | None:
        """``(step, state)`` of the newest snapshot, its bytes copied out and checked; None when there is none.

        The copy runs on the calling thread while worker threads check the chunks already copied (numpy releases
        the GIL for both), so a read costs about the larger of the two, not their sum.

        Raises:
            CheckpointCorruptError: a chunk no longer matches the checksum recorded when it was written.
        """
        pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="lazyckpt-check", initializer=limit_torch_threads_here)
        try:
            with self._lock:
                snapshot = self._newest
                if snapshot is None:
                    return None
                checks = _Checks(snapshot.job, pool)
                tensors = _copy_out(snapshot, checks.submit)
            checks.wait()
        finally:
            pool.shutdown(cancel_futures=True)
        job = snapshot.job
        return job.step, unflatten(job.tree, tensors, checks.where)


class _Checks:
    """The chunk checks of one read, on worker threads, with the reader's own check (``check_chunks``)."""

    def __init__(self, job: CheckpointJob, pool: ThreadPoolExecutor) -> None:
        self.job, self.pool = job, pool
        self.where = f"memory snapshot of step {job.step}"
        self.futures: list[Future] = []
        self.chunks = 0

    def submit(self, index: int, data: np.ndarray, start: int) -> None:
        """Check ``data``, the bytes of entry ``index`` from ``start`` (a chunk boundary)."""
        key = self.job.entries[index].key
        first, count = start // CHUNK_BYTES, num_chunks(data.size)
        self.chunks += count
        self.futures.append(self.pool.submit(check_chunks, data, start, self.job.checksums[key][first : first + count],
                                             self.where, key))

    def wait(self) -> None:
        for future in self.futures:
            future.result()
        recorded = sum(len(sums) for sums in self.job.checksums.values())
        if self.chunks != recorded:  # every recorded chunk must have been copied out and checked
            raise CheckpointCorruptError(f"{self.where} is incomplete: {self.chunks} of its {recorded} chunks are "
                                         "held in memory")


def _copy_out(snapshot: _Snapshot, check: Callable[[int, np.ndarray, int], None]) -> dict[str, torch.Tensor]:
    """Fresh tensors with the snapshot's bytes (so the slots can be recycled once this returns); ``check`` is
    called with each run of bytes as soon as it is copied."""
    entries = snapshot.job.entries
    tensors = [torch.empty(e.nbytes, dtype=torch.uint8) for e in entries]
    raw = [t.numpy() for t in tensors]  # numpy slice assignment is a plain memcpy (torch's uint8 copy_ is slower)
    for index, tensor in snapshot.eager.items():
        raw[index][:] = tensor_bytes(tensor)
        check(index, raw[index], 0)
    for piece, slot, _ in snapshot.slots:
        staged = slot.numpy()
        for run in segment_runs(piece):
            first, last = run[0], run[-1]
            copied = raw[first.tensor_index][first.src_offset : last.src_offset + last.nbytes]
            copied[:] = staged[first.dst_offset : last.dst_offset + last.nbytes]
            check(first.tensor_index, copied, first.src_offset)
    return {e.key: t.view(torch_dtype(e.dtype, f"memory snapshot: tensor {e.key!r}")).reshape(e.shape)
            for e, t in zip(entries, tensors)}
