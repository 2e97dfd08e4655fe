"""The checkpoints one checkpointer has requested and not finished with, oldest first.

Up to ``max_in_flight`` of them are uncommitted at once: the next checkpoint is captured, copied into host memory
and queued for the writer while the previous one is still being written and committed. The rules that keep this
as safe as one checkpoint at a time:

* **One barrier ahead.** Only the newest checkpoint may still read the live tensors: ``save()`` passes the
  previous one's barrier (its copy done, its ``Deferred`` leaves captured) before it captures the next. The copier
  and the writer work through checkpoints in request order.
* **Commits in request order.** A checkpoint commits only after every earlier one has ended (committed or
  discarded), so ``latest()`` never moves backwards, the memory level publishes in step order and retention counts
  what is really committed.
* **Each checkpoint stands alone.** Every checkpoint holds the whole state, so a failure of one does not stop a
  later one from committing; the failure is still delivered, oldest first, at the next call.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from lazyckpt.write.job import CheckpointJob

Handle = TypeVar("Handle")
"""What the caller hands out for each job (the engine's ``PendingCheckpoint``)."""


class InFlight(Generic[Handle]):
    """The jobs of one checkpointer that are unfinished or have an error not yet delivered, oldest first.

    The training thread adds jobs; the writer and commit threads read the order (any thread may call any method).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[tuple[CheckpointJob, Handle]] = []

    def add(self, job: CheckpointJob, pending: Handle) -> None:
        """Track ``job`` as the newest; forget the ended ones whose outcome was delivered."""
        with self._lock:
            kept = [(j, p) for j, p in self._jobs if not j.done or (j.error is not None and not j.error_delivered)]
            self._jobs = [*kept, (job, pending)]

    @property
    def newest(self) -> CheckpointJob | None:
        """The most recently requested job, ended or not."""
        with self._lock:
            return self._jobs[-1][0] if self._jobs else None

    def newest_handle(self) -> Handle | None:
        """The handle of the newest job that has not ended."""
        with self._lock:
            return next((p for j, p in reversed(self._jobs) if not j.done), None)

    def unfinished(self) -> list[CheckpointJob]:
        """The jobs that have not ended, oldest first."""
        with self._lock:
            return [j for j, _ in self._jobs if not j.done]

    def blocking(self, step: int, max_in_flight: int) -> list[CheckpointJob]:
        """The unfinished jobs that must end before ``step`` is captured, oldest first: enough that fewer than
        ``max_in_flight`` stay uncommitted, or all of them when ``step`` is not above theirs (so that its order is
        checked against committed steps only)."""
        unfinished = self.unfinished()
        keep = 0 if any(j.step >= step for j in unfinished) else max_in_flight - 1
        return unfinished[: max(0, len(unfinished) - keep)]

    def find(self, step: int) -> CheckpointJob | None:
        """The unfinished job of ``step``, if any."""
        return next((j for j in self.unfinished() if j.step == step), None)

    def take_error(self, *, excluding: CheckpointJob | None = None) -> BaseException | None:
        """The oldest failure not delivered yet, of a job other than ``excluding``, now counted as delivered."""
        with self._lock:
            job = next((j for j, _ in self._jobs if j is not excluding and j.error is not None
                        and not j.error_delivered), None)
            if job is None:
                return None
            job.error_delivered = True
            return job.error

    def earlier(self, job: CheckpointJob) -> list[CheckpointJob]:
        """The unfinished jobs requested before ``job``."""
        with self._lock:
            before = []
            for j, _ in self._jobs:
                if j is job:
                    break
                before.append(j)
        return [j for j in before if not j.done]

    def wait_for_earlier(self, job: CheckpointJob) -> None:
        """Block until every job requested before ``job`` has ended (commit thread, before committing ``job``)."""
        for earlier in self.earlier(job):
            earlier.wait_done()


def deliver_error(job: CheckpointJob | None) -> None:
    """Training thread: raise ``job``'s background failure (the original object), once."""
    if job is not None and job.error is not None and not job.error_delivered:
        job.error_delivered = True
        raise job.error
