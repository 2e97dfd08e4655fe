"""The memory level: the newest committed snapshot stays in host memory, for a rollback without the disk.

A checkpoint's lazy bytes already pass through host staging slots on their way to the file. With
``keep_in_memory=True`` the writer hands each slot here instead of back to the pool once its bytes are written;
the eager tensors (private CPU copies made by ``save()``) are kept too. When the checkpoint commits, its slots
become the newest snapshot and the previous snapshot's slots go back to the pool. So the pool holds at most two
checkpoints: the newest complete one and the one being written (double buffering), and nothing accumulates.

Reading a snapshot copies its bytes out under a lock (the writer cannot recycle them meanwhile), straight into
the caller's live tensors where they fit (:mod:`lazyckpt.read.snapshot_copy`), checks every chunk against the
checksums recorded for the file with the reader's own check as it is copied, and rebuilds the state with the
reader's decoder.

Example:
    >>> ckpt = LazyCheckpointer("runs/ckpt", keep_in_memory=True)      # doctest: +SKIP
    >>> live = {"model": model.state_dict(), "opt": opt.state_dict()}  # doctest: +SKIP
    >>> step, state = ckpt.memory_snapshot(into=live)                  # doctest: +SKIP
    >>> model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])   # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lazyckpt.format.checksum import tensor_bytes
from lazyckpt.read.reshard import tensor_targets
from lazyckpt.read.snapshot_copy import Destinations, Transfer, copy_and_check
from lazyckpt.tree.decode import unflatten, with_aliases
from lazyckpt.write.job import CheckpointJob, JobState
from lazyckpt.write.plan import PIECE_BYTES, Piece, segment_runs, staging_slots


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

    def pool_bytes(self, job: CheckpointJob) -> int:
        """Staging memory the pool needs: the newest snapshot plus the checkpoint being written."""
        return 2 * staging_slots(job.pieces) * PIECE_BYTES

    def check_budget(self, job: CheckpointJob, budget_bytes: int | None) -> None:
        """Raise before anything is staged when ``host_buffer_bytes`` cannot hold two checkpoints."""
        needed = self.pool_bytes(job)
        if budget_bytes is not None and budget_bytes < needed:
            raise ValueError(
                f"keep_in_memory=True needs host_buffer_bytes >= {needed} ({needed / 2**20:.0f} MiB: two checkpoints "
                f"of {staging_slots(job.pieces)} staging slots of {PIECE_BYTES >> 20} MiB, the newest snapshot "
                f"and the one being written); got host_buffer_bytes={budget_bytes}. Raise it, pass None to size it "
                "automatically, or turn keep_in_memory off")

    # --- the writer side ------------------------------------------------------------------------------------

    def begin(self, job: CheckpointJob) -> None:
        """Start collecting ``job``'s bytes (called by ``save()`` while the eager copies are still referenced)."""
        eager = {i: t for i, (e, t) in enumerate(zip(job.entries, job.sources)) if not e.lazy}
        with self._lock:
            # Free the earlier ones that ended without committing (their writes, and so their slots, all came
            # back before they ended); the engine usually dropped them already, as each was discarded.
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

    def drop(self, job: CheckpointJob) -> None:
        """If ``job`` was discarded, its kept slots go back to the pool now (the next copy may wait for them)."""
        with self._lock:
            snapshot = self._building.pop(job, None) if job.state is JobState.DISCARDED else None
        if snapshot is not None:
            snapshot.release()

    def publish(self, job: CheckpointJob) -> None:
        """``job`` committed: it becomes the newest snapshot; the previous one's slots go back to the pool."""
        with self._lock:
            snapshot = self._building.pop(job, None)
            if snapshot is None:
                return
            previous, self._newest = self._newest, snapshot
        if previous is not None:
            previous.release()

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

    def read(self, into: Any = None, before: int | None = None) -> tuple[int, Any] | None:
        """``(step, state)`` of the newest snapshot, its bytes copied out and checked; None when there is none.

        ``into`` (optional) is a state with live tensors at its leaves (e.g. ``{"model": model.state_dict()}``):
        every snapshot tensor whose key, dtype and shape match a contiguous CPU tensor there is copied straight
        into it and the returned state holds that tensor; the others come back as fresh tensors. Each chunk is
        checked as soon as it is copied, on as many threads as torch uses (``torch.get_num_threads()``).
        ``before``: read only a snapshot of an earlier step (None otherwise).

        Raises:
            CheckpointCorruptError: a chunk no longer matches the checksum recorded when it was written (tensors
                of ``into`` may then hold part of the snapshot).
        """
        targets = {} if into is None else tensor_targets(into)
        with self._lock:
            snapshot = self._newest
            if snapshot is None or (before is not None and snapshot.job.step >= before):
                return None
            job = snapshot.job
            where = f"memory snapshot of step {job.step}"
            dests = Destinations(job.entries, targets, where)
            copy_and_check(_transfers(snapshot, dests.raw), job.entries, job.checksums, where,
                           threads=torch.get_num_threads())
            fitting = dests.alias_targets(job.entries, targets, job.aliases, where)
        return job.step, unflatten(job.tree, with_aliases(dests.tensors, job.aliases, where, fitting), where)


def _transfers(snapshot: _Snapshot, raw: list[np.ndarray]) -> list[Transfer]:
    """The snapshot's bytes, one transfer per eager tensor and per run of chunks in a staging slot."""
    transfers = [Transfer(index, 0, tensor_bytes(tensor), raw[index]) for index, tensor in snapshot.eager.items()]
    for piece, slot, _ in snapshot.slots:
        staged = slot.numpy()
        for run in segment_runs(piece):
            first, last = run[0], run[-1]
            transfers.append(Transfer(first.tensor_index, first.src_offset,
                                      staged[first.dst_offset : last.dst_offset + last.nbytes],
                                      raw[first.tensor_index][first.src_offset : last.src_offset + last.nbytes]))
    return transfers
