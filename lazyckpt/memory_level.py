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
from dataclasses import dataclass, field
from typing import Any

import torch

from lazyckpt.checksum import tensor_bytes
from lazyckpt.format import torch_dtype
from lazyckpt.job import CheckpointJob, JobState
from lazyckpt.plan import PIECE_BYTES, Piece
from lazyckpt.tensor_io import check_chunks
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

        Raises:
            CheckpointCorruptError: a chunk no longer matches the checksum recorded when it was written.
        """
        with self._lock:
            snapshot = self._newest
            if snapshot is None:
                return None
            tensors = _copy_out(snapshot)
        job = snapshot.job
        where = f"memory snapshot of step {job.step}"
        for entry in job.entries:
            check_chunks(tensor_bytes(tensors[entry.key]), 0, job.checksums[entry.key], where, entry.key)
        return job.step, unflatten(job.tree, tensors, where)


def _copy_out(snapshot: _Snapshot) -> dict[str, torch.Tensor]:
    """Fresh tensors with the snapshot's bytes, so the slots can be recycled once this returns."""
    entries = snapshot.job.entries
    tensors = [torch.empty(e.nbytes, dtype=torch.uint8) for e in entries]
    raw = [t.numpy() for t in tensors]  # numpy slice assignment is a plain memcpy (torch's uint8 copy_ is slower)
    for index, tensor in snapshot.eager.items():
        raw[index][:] = tensor_bytes(tensor)
    for piece, slot, _ in snapshot.slots:
        staged = slot.numpy()
        for seg in piece.segments:
            raw[seg.tensor_index][seg.src_offset : seg.src_offset + seg.nbytes] = \
                staged[seg.dst_offset : seg.dst_offset + seg.nbytes]
    return {e.key: t.view(torch_dtype(e.dtype, f"memory snapshot: tensor {e.key!r}")).reshape(e.shape)
            for e, t in zip(entries, tensors)}
