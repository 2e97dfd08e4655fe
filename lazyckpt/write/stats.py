"""Where checkpoints' time went: one record per committed checkpoint, a bounded window of them, and totals."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

STATS_WINDOW = 1000
"""How many recent :class:`CheckpointStats` a checkpointer keeps (a run of 100k checkpoints must not grow)."""


@dataclass
class CheckpointStats:
    """Where one checkpoint's time went (seconds) and how big it was."""

    step: int
    save_s: float = 0.0
    """Training-thread time inside ``save()``."""
    wait_s: float = 0.0
    """Training-thread time inside the barrier (``wait_staged()``); not the drain at ``close()``, when training is
    over."""
    copy_s: float = 0.0
    """From the request until every lazy byte was staged in host memory."""
    flush_s: float = 0.0
    """From the request until the checkpoint was committed."""
    nbytes: int = 0
    lazy_bytes: int = 0

    @property
    def stall_s(self) -> float:
        return self.save_s + self.wait_s


@dataclass
class StatsSummary:
    """Running totals over every committed checkpoint of a checkpointer, however many there were."""

    count: int = 0
    stall_s: float = 0.0
    max_stall_s: float = 0.0
    flush_s: float = 0.0
    nbytes: int = 0

    def add(self, stats: CheckpointStats) -> None:
        self.count += 1
        self.stall_s += stats.stall_s
        self.max_stall_s = max(self.max_stall_s, stats.stall_s)
        self.flush_s += stats.flush_s
        self.nbytes += stats.nbytes

    @property
    def mean_stall_s(self) -> float:
        return self.stall_s / self.count if self.count else 0.0


class StatsLog:
    """The newest :data:`STATS_WINDOW` records (iterable and indexable like a list) plus :attr:`total`."""

    def __init__(self, window: int = STATS_WINDOW) -> None:
        self.recent: deque[CheckpointStats] = deque(maxlen=window)
        self.total = StatsSummary()

    def append(self, stats: CheckpointStats) -> None:
        self.recent.append(stats)
        self.total.add(stats)

    def __iter__(self):
        return iter(self.recent)

    def __len__(self) -> int:
        return len(self.recent)

    def __getitem__(self, index: int) -> CheckpointStats:
        return self.recent[index]

    def __bool__(self) -> bool:
        return bool(self.recent)
