"""One checkpoint in flight: what was captured, where it goes, and the state machine of its life.

A job moves through :class:`JobState` by :meth:`CheckpointJob.advance` only::

    CAPTURED -> STAGED -> DURABLE -> COMMITTING -> COMMITTED
        \\__________\\_________\\___________\\-----> FAILED -> DISCARDED

``save()`` creates it CAPTURED; the copier makes it STAGED once every lazy byte is in host memory; the writer
makes it DURABLE once the tensor file is closed (and fsynced); whoever sees it DURABLE *and* its tree complete
(no ``Deferred`` leaf left) claims the commit (COMMITTING). A failure anywhere before COMMITTED makes it FAILED,
and the clean-up of the partial directory makes it DISCARDED. COMMITTED and DISCARDED are the two ends.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lazyckpt.errors import IllegalTransitionError
from lazyckpt.format.header import TensorEntry
from lazyckpt.tree.encode import Deferred
from lazyckpt.tree.paths import Path
from lazyckpt.write.plan import Piece
from lazyckpt.write.stats import CheckpointStats


class JobState(enum.Enum):
    CAPTURED = "captured"
    """``save()`` returned: eager tensors are copied, lazy ones still live in the model."""
    STAGED = "staged"
    """Every lazy byte is in host memory: the barrier may pass."""
    DURABLE = "durable"
    """The tensor file is written, fsynced and closed."""
    COMMITTING = "committing"
    """One thread claimed the commit (manifests, rename); nobody else may start it."""
    COMMITTED = "committed"
    """The step directory is visible under its final name."""
    FAILED = "failed"
    """An error was recorded; the partial directory still has to be removed."""
    DISCARDED = "discarded"
    """Failed, and nothing of it is left in storage."""


_NEXT: dict[JobState, frozenset[JobState]] = {
    JobState.CAPTURED: frozenset({JobState.STAGED, JobState.FAILED}),
    JobState.STAGED: frozenset({JobState.DURABLE, JobState.FAILED}),
    JobState.DURABLE: frozenset({JobState.COMMITTING, JobState.FAILED}),
    JobState.COMMITTING: frozenset({JobState.COMMITTED, JobState.FAILED}),
    JobState.FAILED: frozenset({JobState.DISCARDED}),
    JobState.COMMITTED: frozenset(),
    JobState.DISCARDED: frozenset(),
}
ENDS = frozenset({JobState.COMMITTED, JobState.DISCARDED})
_FILE_CLOSED = frozenset({JobState.DURABLE, JobState.COMMITTING})


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
    handle: Any = None
    barrier_lock: threading.Lock = field(default_factory=threading.Lock)
    """Serialises the barrier (two threads may reach it; the Deferred leaves run once)."""
    barrier_passed: bool = False
    error_delivered: bool = False
    """The training thread raised :attr:`error` once already (from ``save()``/``wait_staged()``/``close()``)."""
    state: JobState = JobState.CAPTURED
    error: BaseException | None = None
    tree_complete: bool = False
    """True once the Deferred leaves are in the tree (at once when there are none)."""
    boxes: dict[str, Any] = field(default_factory=dict)
    """Per written key: its :class:`~lazyckpt.ranks.sharding.Box` in the global tensor, None for a tensor of this rank
    alone."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Key of a tensor leaf stored under another key (the same tensor, e.g. a tied weight) -> that key."""
    attempt: int = 0
    """This checkpointer's save counter, the same on every rank: the key of this attempt's rendezvous."""
    _changed: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.tree_complete = not self.deferred

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def done(self) -> bool:
        """True once the job reached one of its ends (committed or discarded)."""
        return self.state in ENDS

    @property
    def file_path(self) -> str:
        from lazyckpt.format.files import rank_file

        return os.path.join(self.partial_dir, rank_file(self.rank, self.world_size))

    # --- the one transition function ------------------------------------------------------------------------

    def advance(self, to: JobState) -> bool:
        """Move to ``to``. Returns False, changing nothing, when the job has already failed and ``to`` is a
        step of the success path (a failure wins every race). Any thread.

        Raises:
            IllegalTransitionError: the current state does not lead to ``to``.
        """
        with self._changed:
            if self.state is JobState.FAILED and to is not JobState.DISCARDED:
                return False
            if to not in _NEXT[self.state]:
                raise IllegalTransitionError(f"step {self.step}: {self.state.value} -> {to.value} is not allowed")
            self.state = to
            self._changed.notify_all()
            return True

    def fail(self, error: BaseException) -> bool:
        """Record the first failure and move to FAILED (waking the barrier). Any thread.

        Returns True when the tensor file was already closed, so the caller must discard the job itself;
        otherwise the writer's finalize does it. A failure after the job ended changes nothing.
        """
        with self._changed:
            if self.state in ENDS or self.state is JobState.FAILED:
                return False
            file_closed = self.state in _FILE_CLOSED
            error.add_note(f"lazyckpt: while saving step {self.step} to {self.final_dir} (rank {self.rank})")
            self.error = error
            self.advance(JobState.FAILED)
            return file_closed

    def cancel(self, error: BaseException) -> bool | None:
        """Fail the job on request, unless its commit is already under way (or it ended). Any thread.

        Returns None when the job was not failed (committing or ended: it goes on to its end); otherwise
        what :meth:`fail` returns (True: the file is closed, so the caller must discard the job itself).
        """
        with self._changed:
            if self.state in ENDS or self.state in (JobState.COMMITTING, JobState.FAILED):
                return None
            return self.fail(error)

    def complete_tree(self) -> bool:
        """Note that the Deferred leaves are in the tree; True when this makes the job ready to commit and
        claims the commit for the caller (training thread, at the barrier)."""
        with self._changed:
            self.tree_complete = True
            return self._claim_commit()

    def durable(self) -> bool | None:
        """Note that the file is closed and durable; True when this claims the commit for the caller (writer).
        None when the job failed first: its failure came while the file was still open, so :meth:`fail` left the
        discard to the writer, which is the caller."""
        with self._changed:
            if not self.advance(JobState.DURABLE):
                return None
            return self._claim_commit()

    def _claim_commit(self) -> bool:
        if self.state is JobState.DURABLE and self.tree_complete:
            return self.advance(JobState.COMMITTING)
        return False

    # --- waiting ----------------------------------------------------------------------------------------------

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until the live tensors are no longer needed (staged, or failed); False on timeout."""
        return self.wait_until(lambda: self.state is not JobState.CAPTURED, timeout)

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until the job reached an end; False on timeout."""
        return self.wait_until(lambda: self.state in ENDS, timeout)

    def wait_until(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until ``predicate()`` (evaluated under the job's lock) holds; False on timeout. Any thread."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)


def remaining(deadline: float | None) -> float | None:
    """Seconds left until the monotonic ``deadline``, never negative; None when there is no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
