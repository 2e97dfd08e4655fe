"""One step's upload as the engine and the training thread see it: its ticket, waiting for it, what is kept of it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lazyckpt.write.job import CheckpointJob


@dataclass(eq=False)
class RemoteUpload:
    """One step due for upload: finished once it is committed remotely, failed, or cancelled."""

    step: int
    url: str
    job: CheckpointJob
    """The local checkpoint: nothing is uploaded when it fails."""
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    error_delivered: bool = False
    seconds: float = 0.0
    nbytes: int = 0
    retry: bool = False
    """This is the one retry of a failed upload (made at the next commit); it is not retried again."""
    settled: threading.Event = field(default_factory=threading.Event)
    """Set once no try of this step is to come: committed, its retry ended, or its retry was dropped (closed, or
    the local step gone). A retry shares its first try's event: whoever holds the first try sees the retry end."""
    retried_by: RemoteUpload | None = None
    """The retry made of this failed upload (:meth:`make_retry`)."""

    def make_retry(self) -> RemoteUpload:
        """The one retry of this failed upload, sharing its :attr:`settled`."""
        self.retried_by = RemoteUpload(step=self.step, url=self.url, job=self.job, retry=True, settled=self.settled)
        return self.retried_by

    def last_try(self) -> RemoteUpload:
        """This upload, or its retry once made: the try whose outcome stands."""
        return self.retried_by if self.retried_by is not None else self


@dataclass(frozen=True)
class CompletedUpload:
    """What :attr:`RemoteLevel.completed` keeps of a committed upload: not its job, whose tree, entries and
    checksums would otherwise stay in memory for every step of the run (the host level uploads every step)."""

    step: int
    url: str
    nbytes: int
    seconds: float


def wait_for_upload(upload: RemoteUpload, timeout: float | None) -> str:
    """The remote URL of ``upload`` once committed there; raises its failure (once reported, still raised)."""
    if not upload.done.wait(timeout):
        raise TimeoutError(f"checkpoint of step {upload.step} not committed on {upload.url} within {timeout}s")
    if upload.error is not None:
        upload.error_delivered = True
        raise upload.error
    return upload.url
