"""What a run learns about its checkpoints: a summary at the end (count, stalls, time to durable, bytes) and a
warning when the background write cannot keep up with the checkpoint interval.

Example:
    >>> summary = run_summary(callback.stats)                     # doctest: +SKIP
    >>> print(summary_line(summary))                               # doctest: +SKIP
    lazyckpt: 12 checkpoints committed, stall median 4.1 ms / max 9.8 ms, durable after 1.20 s (median), 1.3 GB written
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from lazyckpt.stats import CheckpointStats

GROWING_RUN = 3
"""Consecutive checkpoints whose stall grows before :func:`falling_behind` says so."""
GROWTH = 2.0
"""How many times the first of those stalls the last must be: noise does not double three times in a row."""


def run_summary(stats: Sequence[CheckpointStats]) -> dict[str, float]:
    """Logger metrics over a run's committed checkpoints (empty when there were none)."""
    if not stats:
        return {}
    stalls = [s.stall_s for s in stats]
    return {"lazyckpt/checkpoints": float(len(stats)),
            "lazyckpt/stall_median_ms": 1e3 * statistics.median(stalls), "lazyckpt/stall_max_ms": 1e3 * max(stalls),
            "lazyckpt/durable_median_s": statistics.median(s.flush_s for s in stats),
            "lazyckpt/written_mb": sum(s.nbytes for s in stats) / 1e6}


def summary_line(summary: dict[str, float]) -> str:
    """The summary as one log line."""
    if not summary:
        return "lazyckpt: no checkpoint was committed"
    return (f"lazyckpt: {int(summary['lazyckpt/checkpoints'])} checkpoints committed, stall median "
            f"{summary['lazyckpt/stall_median_ms']:.1f} ms / max {summary['lazyckpt/stall_max_ms']:.1f} ms, durable "
            f"after {summary['lazyckpt/durable_median_s']:.2f} s (median), "
            f"{summary['lazyckpt/written_mb'] / 1e3:.2f} GB written")


def falling_behind(stats: Sequence[CheckpointStats]) -> str | None:
    """A warning when the newest stalls keep growing (each request waits longer for the write before it), else
    None. The fix: checkpoint less often, give the copy more host memory, or write to faster storage."""
    recent = [s.stall_s for s in stats[-GROWING_RUN:]]
    if len(recent) < GROWING_RUN or any(b <= a for a, b in zip(recent, recent[1:])) or recent[-1] < GROWTH * recent[0]:
        return None
    durable = statistics.median(s.flush_s for s in stats[-GROWING_RUN:])
    return (f"lazyckpt: the background write is falling behind: the training-thread stall grew from "
            f"{1e3 * recent[0]:.1f} ms to {1e3 * recent[-1]:.1f} ms over the last {GROWING_RUN} checkpoints (each "
            f"takes {durable:.2f} s to become durable). Checkpoint less often (a longer interval), raise "
            "host_buffer_bytes so copies do not wait for the writer, or write to faster storage")
