"""One checkpoint in flight: what was captured, where it goes, and how far it got."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lazyckpt.plan import Piece, TensorEntry
from lazyckpt.state import Deferred, Path


@dataclass
class CheckpointStats:
    """Where one checkpoint's time went (seconds) and how big it was."""

    step: int
    save_s: float = 0.0
    """Training-thread time inside ``save()``."""
    wait_s: float = 0.0
    """Training-thread time inside the barrier (``wait_staged()``)."""
    copy_s: float = 0.0
    """From the request until every lazy byte was staged in host memory."""
    flush_s: float = 0.0
    """From the request until the checkpoint was committed."""
    nbytes: int = 0
    lazy_bytes: int = 0

    @property
    def stall_s(self) -> float:
        return self.save_s + self.wait_s


@dataclass(eq=False)
class CheckpointJob:
    """The state of one requested checkpoint, shared by the training thread, the copier and the writer."""

    step: int
    dirpath: str
    partial_dir: str
    final_dir: str
    rank: int
    world_size: int
    tree: Any
    entries: list[TensorEntry]
    pieces: list[Piece]
    sources: list[torch.Tensor | None]
    """Per entry: the live tensor (lazy) or its private CPU copy (eager); dropped once written."""
    versions: dict[int, int]
    deferred: list[tuple[Path, Deferred]]
    header: bytes
    stats: CheckpointStats
    requested_at: float = field(default_factory=time.monotonic)
    checksums: dict[str, list[str]] = field(default_factory=dict)
    error: BaseException | None = None
    handle: Any = None
    staged: threading.Event = field(default_factory=threading.Event)
    written: threading.Event = field(default_factory=threading.Event)
    """Set once the tensor file is closed (durable unless the job failed)."""
    done: threading.Event = field(default_factory=threading.Event)
    barrier_lock: threading.Lock = field(default_factory=threading.Lock)
    barrier_passed: bool = False
    deferred_resolved: bool = False
    """True once the Deferred leaves are in the tree (at once when there are none)."""
    end_claimed: bool = False
    error_delivered: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def file_path(self) -> str:
        from lazyckpt.format import rank_file

        return os.path.join(self.partial_dir, rank_file(self.rank, self.world_size))

    def __post_init__(self) -> None:
        self.deferred_resolved = not self.deferred

    def fail(self, error: BaseException) -> None:
        """Record the first failure and wake the barrier; the job ends through :meth:`claim_end`."""
        with self._lock:
            if self.error is None:
                error.add_note(f"lazyckpt: while saving step {self.step} to {self.final_dir} (rank {self.rank})")
                self.error = error
        self.staged.set()

    def pass_barrier(self) -> None:
        with self._lock:
            self.barrier_passed = True
            self.deferred_resolved = True

    def claim_end(self) -> str | None:
        """Decide, exactly once, how the job ends: ``"discard"`` once it failed and its file is closed,
        ``"commit"`` once its bytes are durable and its tree complete (no Deferred left); else ``None``.

        The writer (after closing the file) and the barrier (after evaluating the Deferred leaves) both ask;
        whichever comes second gets the answer, so a job always ends and never twice.
        """
        with self._lock:
            if self.end_claimed or not self.written.is_set():
                return None
            if self.error is None and not self.deferred_resolved:
                return None
            self.end_claimed = True
            return "discard" if self.error is not None else "commit"
