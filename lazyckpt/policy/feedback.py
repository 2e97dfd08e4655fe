"""What a run learns about its checkpoints: a summary at the end (count, stalls, time to durable, bytes), a
warning when the background write cannot keep up with the checkpoint interval, and "saved" messages that wait for
their checkpoint's commit. :class:`RunFeedback` is what an integration holds, :class:`Reporter` where it reports
(the framework's console and loggers, on the rank that reports); the functions are their pieces.

Example:
    >>> feedback = RunFeedback()                                  # doctest: +SKIP
    >>> feedback.committed(stats)     # after each commit: warns once when the write falls behind  # doctest: +SKIP
    >>> metrics = feedback.finish(Reporter(print))    # one line; metrics for the loggers   # doctest: +SKIP
    lazyckpt: 12 checkpoints committed, stall median 4.1 ms / max 9.8 ms, durable after 1.20 s (median), 1.3 GB written
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from lazyckpt.write.stats import CheckpointStats, StatsLog

GROWING_RUN = 3
"""Consecutive checkpoints whose stall grows before :func:`falling_behind` says so."""
GROWTH = 2.0
"""How many times the first of those stalls the last must be: noise does not double three times in a row."""
MIN_STALL_S = 0.05
"""The newest stall must be this long too: a few milliseconds growing to a few more (a tiny model, a cold cache)
is noise, not a write that cannot keep up, and costs the run nothing worth changing its settings for."""


Metrics = Callable[[dict[str, float], int], None]
"""Where an integration's metrics go: ``metrics(values, step)`` (the trainer's loggers, ``accelerator.log``)."""


@dataclass(frozen=True)
class Reporter:
    """Where an integration reports its run: the framework's console and loggers. One rank reports for the run
    (:meth:`on_rank`); ``Reporter()`` reports nothing."""

    info: Callable[[str], None] | None = None
    """One line each: the "saved" messages once their checkpoint is committed, the run's summary."""
    metrics: Metrics | None = None
    """Each reported checkpoint's costs and the run's summary (:func:`checkpoint_metrics`, :func:`run_summary`)."""
    each: Callable[[int], None] | None = None
    """Runs with the step of each reported commit, last (e.g. tell the loggers a checkpoint was saved)."""

    def on_rank(self, rank: int) -> Reporter:
        """This reporter on rank 0, which reports for every rank; on the others one that reports nothing."""
        return self if rank == 0 else Reporter()


class _Commit(Protocol):
    step: int
    stats: CheckpointStats | None


def checkpoint_metrics(stats: CheckpointStats) -> dict[str, float]:
    """One committed checkpoint's costs as logger metrics (milliseconds of stall, seconds of background work)."""
    return {"lazyckpt/stall_ms": 1e3 * stats.stall_s, "lazyckpt/save_ms": 1e3 * stats.save_s,
            "lazyckpt/wait_ms": 1e3 * stats.wait_s, "lazyckpt/copy_s": stats.copy_s,
            "lazyckpt/flush_s": stats.flush_s, "lazyckpt/size_mb": stats.nbytes / 1e6}


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
    """A warning when the newest stalls keep growing (each request waits longer for the write before it) and the
    newest is long enough to matter (:data:`MIN_STALL_S`), else None. The fix: checkpoint less often, give the copy
    more host memory, or write to faster storage."""
    recent = [s.stall_s for s in stats[-GROWING_RUN:]]
    if len(recent) < GROWING_RUN or any(b <= a for a, b in zip(recent, recent[1:])) or recent[-1] < GROWTH * recent[0]:
        return None
    if recent[-1] < MIN_STALL_S:
        return None
    durable = statistics.median(s.flush_s for s in stats[-GROWING_RUN:])
    return (f"lazyckpt: the background write is falling behind: the training-thread stall grew from "
            f"{1e3 * recent[0]:.1f} ms to {1e3 * recent[-1]:.1f} ms over the last {GROWING_RUN} checkpoints (each "
            f"takes {durable:.2f} s to become durable). Checkpoint less often (a longer interval), raise "
            "host_buffer_bytes so copies do not wait for the writer, or write to faster storage")


class RunFeedback:
    """The feedback of one integration during one run.

    Args:
        stats: the list that collects the committed checkpoints' stats (an integration may expose it).
    """

    def __init__(self, stats: list[CheckpointStats] | None = None) -> None:
        self.stats: list[CheckpointStats] = [] if stats is None else stats
        self._warned = False
        self._seen = 0
        self._announced: dict[int, list[str]] = {}

    def committed(self, step: int, stats: CheckpointStats | None) -> list[str]:
        """Record the commit of ``step`` (its ``stats`` when this rank has them); warns, once per run, when the
        write is falling behind. Returns the messages that waited for this commit (:meth:`announce`)."""
        if stats is not None:
            self.stats.append(stats)
            warning = None if self._warned else falling_behind(self.stats)
            if warning is not None:
                self._warned = True
                warnings.warn(warning, RuntimeWarning, stacklevel=3)
        return self._announced.pop(step, [])

    def report(self, committed: Iterable[_Commit], reporter: Reporter = Reporter()) -> None:
        """Record each of ``committed`` (:meth:`committed`); the messages that waited for a commit go to the
        ``reporter``'s ``info``, its stats to its ``metrics``, then its ``each(step)`` runs."""
        for done in committed:
            announced = self.committed(done.step, done.stats)
            if reporter.info is None:
                continue
            for message in announced:
                reporter.info(message)
            if reporter.metrics is not None and done.stats is not None:
                reporter.metrics(checkpoint_metrics(done.stats), done.step)
            if reporter.each is not None:
                reporter.each(done.step)

    def follow(self, log: StatsLog) -> None:
        """Record the entries an engine's stats ``log`` (a window of the newest) gained since the last call."""
        new, self._seen = log.total.count - self._seen, log.total.count
        if new <= 0:
            return  # called on every forward: nothing committed since the last call, nothing to copy
        for stats in list(log)[len(log) - min(new, len(log)):]:
            self.committed(stats.step, stats)

    def announce(self, step: int, message: str) -> None:
        """Keep ``message`` until :meth:`committed` of ``step`` (a "saved" line is true once the checkpoint is)."""
        self._announced.setdefault(step, []).append(message)

    def finish(self, reporter: Reporter, *, step: int = 0) -> dict[str, float]:
        """The run's summary: given to the ``reporter``'s ``info`` as one line, and to its ``metrics`` at ``step``
        (unless no checkpoint was committed: nothing to log); returns its metrics ({} when ``reporter`` reports
        nothing: another rank)."""
        if reporter.info is None:
            return {}
        summary = run_summary(self.stats)
        reporter.info(summary_line(summary))
        if summary and reporter.metrics is not None:
            reporter.metrics(summary, step)
        return summary
