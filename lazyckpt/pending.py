"""``PendingCheckpoint``: the handle ``LazyCheckpointer.save()`` returns, for waiting on one checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable

from lazyckpt.levels.remote.tickets import RemoteUpload, wait_for_upload
from lazyckpt.write.job import CheckpointJob, remaining

Barrier = Callable[[CheckpointJob, "float | None"], bool]
"""Passes a job's barrier within a timeout (``JobEnds.barrier``); False when the timeout ran out first."""


class PendingCheckpoint:
    """The handle ``save()`` returns. ``wait()`` gives the committed directory (``None`` if the request was skipped)."""

    def __init__(self, barrier: Barrier, job: CheckpointJob | None, step: int,
                 upload: RemoteUpload | None = None) -> None:
        self._barrier = barrier
        self._job = job
        self._upload = upload
        self.step = step
        self.skipped = job is None
        self.path = None if job is None else job.final_dir

    def done(self) -> bool:
        """True once the checkpoint is committed or failed (or was skipped). Any thread; never blocks."""
        return self._job is None or self._job.done

    def wait(self, timeout: float | None = None) -> str | None:
        """Pass the barrier, then block until the checkpoint is durable and committed; returns its directory.
        Training thread (it may run the ``Deferred`` leaves). ``timeout`` bounds the whole call, barrier included.

        Raises:
            TimeoutError: not committed within ``timeout`` seconds.
            BaseException: the background failure of this checkpoint (the original exception object).
        """
        if self._job is None:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        if not (self._barrier(self._job, timeout)
                and self._job.wait_done(remaining(deadline))):
            raise TimeoutError(f"checkpoint of step {self.step} not committed within {timeout}s")
        if self._job.error is not None:
            self._job.error_delivered = True
            raise self._job.error  # always: this handle's checkpoint failed, whoever saw the error first
        return self.path

    def wait_remote(self, timeout: float | None = None) -> str | None:
        """Block until this checkpoint is committed on the remote level; returns its URL, or ``None`` when this
        step is not due for upload (or the request was skipped).

        Raises:
            TimeoutError: not committed remotely within ``timeout`` seconds.
            BaseException: the local or the upload failure of this checkpoint (the original exception object).
        """
        if self._upload is None:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait(timeout)
        return wait_for_upload(self._upload, remaining(deadline))

    def remote_done(self, *, wait: bool = False) -> bool:
        """True once this checkpoint's upload ended (committed on the remote level, or failed: see
        :attr:`remote_failed`), or when none is due; ``wait``: block until then. Any thread; never raises."""
        return self._upload is None or self._upload.done.is_set() or (wait and self._upload.done.wait())

    def remote_settled(self, *, wait: bool = False) -> bool:
        """:meth:`remote_done`, counting the one retry of a failed upload (made at the next commit): True once this
        checkpoint is committed remotely on either try, once its retry failed or will not come (closed), or when
        none is due; ``wait``: block until then (a retry waits for a commit, or for
        :meth:`~lazyckpt.levels.remote.upload.RemoteLevel.retry_failed`). Any thread; never raises."""
        return self._upload is None or self._upload.settled.is_set() or (wait and self._upload.settled.wait())

    @property
    def remote_given_up(self) -> bool:
        """True once this checkpoint's upload failed and no retry of it is to come, or its retry failed too."""
        return (self._upload is not None and self._upload.settled.is_set()
                and self._upload.last_try().error is not None)

    @property
    def remote_failed(self) -> bool:
        """True once this checkpoint's first upload failed (:meth:`wait_remote` raises its error; its retry may
        still commit it: :attr:`remote_given_up`)."""
        return self._upload is not None and self._upload.error is not None

    @property
    def failed(self) -> bool:
        """True once this checkpoint has failed (see :attr:`error`)."""
        return self._job is not None and self._job.error is not None

    @property
    def error(self) -> BaseException | None:
        """The background failure of this checkpoint, if any (the original exception object)."""
        return None if self._job is None else self._job.error

