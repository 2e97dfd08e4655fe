"""The remote level: committed local checkpoints uploaded in the background, committed and pruned remotely.

One uploader thread per checkpointer takes committed step directories from the local level (never tensors from
the training process) and streams them to ``remote/step-NNNNNNN/``: each rank its own tensor file, then its
rank manifest; the ranks then meet (through the process group's store when there is one, see
:mod:`lazyckpt.levels.remote.meeting`) and rank 0 writes ``manifest.json`` once every rank's upload is durable: the
commit object readers look for, written last. Older remote steps are pruned only after a newer one is committed there.
A failed upload is queued once more at the next commit, from the same committed local files.

The thread starts like every lazyckpt background thread (one torch thread, a lower priority), so it never
competes with the training thread for a core it needs.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from lazyckpt.errors import CheckpointFormatError
from lazyckpt.format.catalog import committed_steps, is_committed
from lazyckpt.format.files import MANIFEST, rank_file, rank_manifest, rank_members, step_dirname
from lazyckpt.format.manifest import MAX_MANIFEST_BYTES
from lazyckpt.levels.remote.contents import remote_steps, remove_partial_uploads, remove_remote_step
from lazyckpt.levels.remote.meeting import RemoteMeeting, StoreMeeting, upload_attempt
from lazyckpt.levels.remote.tickets import CompletedUpload, RemoteUpload
from lazyckpt.levels.retention import steps_to_purge
from lazyckpt.read.reader import CheckpointReader
from lazyckpt.storage import LocalStorage, Storage
from lazyckpt.storage.fsspec import FsspecStorage
from lazyckpt.storage.urls import join, unreachable
from lazyckpt.threads import UPLOAD_NICE, start_background_thread
from lazyckpt.write.stats import STATS_WINDOW

if TYPE_CHECKING:
    from lazyckpt.config import CheckpointConfig
    from lazyckpt.write.job import CheckpointJob
    from lazyckpt.ranks.rendezvous import Rendezvous

logger = logging.getLogger(__name__)


_COPY_BYTES = 8 << 20
"""Piece size when a local level that is not plain files (e.g. in memory) is copied to the remote."""


def open_remote_level(config: CheckpointConfig, local: Storage) -> RemoteLevel | None:
    """The remote level ``config`` asks for, checked for reachability now; None without ``remote``."""
    if config.remote is None:
        return None
    return RemoteLevel(config.remote, config.storage_options, local, every_n=config.remote_every_n,
                       keep_last_k=config.remote_keep_last_k, rank=config.rank, world_size=config.world_size,
                       timeout_s=config.remote_timeout_s)


class RemoteLevel:
    """Uploads, commits and prunes checkpoints on one remote URL for one rank.

    Args:
        url: the remote directory (``s3://bucket/run``, ``file:///shared/run``, ...).
        storage_options: passed to fsspec.
        local: the local level's storage, which the uploads read from.
        every_n: upload the checkpoints whose step is a multiple of this.
        keep_last_k: remote retention (None keeps all).
        rank, world_size: this process's place; each rank uploads its own files.
        timeout_s: how long rank 0 waits for the other ranks' uploads, and they for its commit.

    Raises:
        RemoteUnreachableError: the remote cannot be listed or created (checked here, not at the first upload).
    """

    def __init__(self, url: str, storage_options: dict | None, local: Storage, *, every_n: int,
                 keep_last_k: int | None, rank: int, world_size: int, timeout_s: float) -> None:
        self.local = local
        self.url, self.every_n, self.keep_last_k = url, every_n, keep_last_k
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.members = list(range(world_size))
        """The ranks whose files go to this rank's ``url`` (all of them, unless :meth:`share_url` says otherwise);
        the lowest writes its commit object and prunes it."""
        self.storage, self.storage_options = FsspecStorage(url, storage_options), storage_options
        self.rendezvous: Rendezvous | None = None
        self._node_dir: str | None = None
        """:meth:`share_url`'s per-node directory (``url`` as a path), listed by the file system's rule."""
        self._probe()
        self.meeting: StoreMeeting | RemoteMeeting = RemoteMeeting(self.storage, local, rank=rank, world_size=world_size,
                                                                   timeout_s=timeout_s)
        """Where the ranks' uploads of a step meet before rank 0 commits it (see :meth:`meet_through`)."""
        self._uploads: dict[int, RemoteUpload] = {}
        self._failed: list[RemoteUpload] = []
        self._to_retry: list[tuple[RemoteUpload, str]] = []
        """Failed first attempts and their local directories, queued again at the next commit."""
        self.completed: deque[CompletedUpload] = deque(maxlen=STATS_WINDOW)
        """The newest uploads committed remotely, oldest first (their ``nbytes`` and ``seconds`` give the
        throughput); a bounded window, like the checkpointer's ``stats``."""
        self._cleanup_due: int | None = None
        """Rank 0: the commit whose clean-up failed (an outage); tried again after the next commit or at close."""
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[RemoteUpload, str] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.on_released: Callable[[int], None] | None = None
        """Called on the uploader thread once a step is no longer held (:meth:`holds`): local retention may
        purge it now rather than at the next commit."""

    def _probe(self) -> None:
        try:
            self.storage.make_dir(self.url)
            if self.rank == 0:
                remove_partial_uploads(self.storage, self.url)
            else:  # rank 0 cleans up; the others only check that the remote answers: one listing
                self.storage.list_dir(self.url)
        except Exception as e:
            raise unreachable("remote", self.url, self.storage_options, e) from e

    # --- the engine's side ----------------------------------------------------------------------------------

    def meet_through(self, rendezvous: Rendezvous | None) -> None:
        """Meet the other ranks through the checkpointer's store (None: there is none; meet on the remote)."""
        self.rendezvous = rendezvous
        if rendezvous is not None:
            self.meeting = StoreMeeting(rendezvous, rank=self.rank, timeout_s=self.timeout_s)

    @property
    def listed_at(self) -> tuple[Storage, str]:
        """Where steps are listed and pruned: ``url`` (object-store rule), or :meth:`share_url`'s node directory."""
        return (self.storage, self.url) if self._node_dir is None else (self.local, self._node_dir)

    @property
    def leads(self) -> bool:
        """This rank commits and prunes its ``url`` (rank 0, or the lowest rank of its :attr:`members`)."""
        return self.rank == self.members[0]

    def share_url(self, members: list[int]) -> None:
        """Only ``members`` (lowest first, this rank among them) upload to this rank's ``url``: a ``dirpath`` per
        node behind the host level. Its lowest rank then writes the commit object there, naming only their files,
        and prunes it; each such directory commits on its own (collective: every rank calls it)."""
        if members == self.members:
            return
        assert self.url.startswith("file://"), "only the host level's disk directory is written per node"
        self.members = members
        # its steps hold only these ranks' files: the object-store rule (every rank's files) would call each one
        # uncommitted, and the clean-up would take it for a partial upload
        self._node_dir = self.url[len("file://"):]
        if isinstance(self.meeting, StoreMeeting):
            self.meeting.leader = members[0]
        if self.leads:
            remove_partial_uploads(*self.listed_at)

    def ticket(self, job: CheckpointJob) -> RemoteUpload | None:
        """Register ``job``'s step for upload when it is due (called by ``save()``); None when it is not."""
        step = job.step
        if step % self.every_n != 0:
            return None
        upload = RemoteUpload(step=step, url=join(self.url, step_dirname(step)), job=job)
        with self._lock:
            self._uploads[step] = upload
        return upload

    def submit(self, step: int, local_dir: str) -> None:
        """Queue the committed local checkpoint of ``step`` (commit thread; returns at once), after the one retry
        of each upload that failed since the previous commit. Called before local retention runs: the steps
        queued are held from it until their upload is finished."""
        self.retry_failed()
        upload = self._uploads.get(step)
        if upload is not None:
            self._enqueue(upload, local_dir)

    def retry_failed(self) -> None:
        """Queue now the one retry of each upload that failed since the previous commit, as the next commit would:
        for a caller about to wait for a retry with no commit to come (the end of a run). Any thread."""
        for retry, retry_dir in self._take_retries():
            self._enqueue(retry, retry_dir)

    def _take_retries(self) -> list[tuple[RemoteUpload, str]]:
        with self._lock:
            failed, self._to_retry = self._to_retry, []
            retries = []
            for upload, local_dir in failed:
                if self.local.stat(local_dir) is None:  # gone: the local level no longer keeps that step
                    upload.settled.set()
                else:
                    retries.append((upload.make_retry(), local_dir))
            self._uploads.update((r.step, r) for r, _ in retries)
        for upload, _ in retries:
            logger.info("lazyckpt: retrying the failed upload of step %d to %s", upload.step, upload.url)
        return retries

    def _enqueue(self, upload: RemoteUpload, local_dir: str) -> None:
        with self._lock:  # the commit thread's submit and a training thread's retry_failed
            if self._thread is None:
                self._thread = start_background_thread(self._run, name="lazyckpt-upload", nice=UPLOAD_NICE)
        self._queue.put((upload, local_dir))

    def wait_backlog(self, keep: int) -> None:
        """Wait until at most ``keep`` registered uploads are unfinished, the oldest going first (the host level
        holds two snapshots: a new save waits while the copy to ``dirpath`` lags behind)."""
        with self._lock:
            ordered = sorted(self._uploads.values(), key=lambda u: u.step)
        for upload in ordered[:max(len(ordered) - keep, 0)]:
            upload.job.wait_done()
            if upload.job.error is not None:  # never committed locally: nothing to upload
                self.cancel(upload.step)
            upload.done.wait()

    def wait_for(self, step: int) -> None:
        """Wait until the upload of ``step`` ended, when one is under way (its local checkpoint is committed:
        the upload needs nothing more from the training thread)."""
        with self._lock:
            upload = self._uploads.get(step)
        if upload is not None:
            upload.done.wait()

    def cancel(self, step: int) -> None:
        """The local checkpoint of ``step`` failed: there is nothing to upload (its own error is reported)."""
        with self._lock:
            upload = self._uploads.pop(step, None)
        if upload is not None:
            upload.done.set()
            upload.settled.set()

    def holds(self, step: int) -> bool:
        """True while the local checkpoint of ``step`` is still being uploaded or awaits its one retry (local
        retention must wait)."""
        with self._lock:
            upload = self._uploads.get(step)
            return (upload is not None and not upload.done.is_set()) or any(u.step == step for u, _ in self._to_retry)

    def take_error(self) -> BaseException | None:
        """The first upload failure not reported yet, now reported (the later ones are logged)."""
        with self._lock:
            pending = [u for u in self._failed if not u.error_delivered]
            self._failed = []
        if not pending:
            return None
        for later in pending[1:]:
            logger.error("lazyckpt: upload of step %d also failed: %r", later.step, later.error)
        pending[0].error_delivered = True
        return pending[0].error

    def drain(self) -> None:
        """Wait until every queued upload is finished (committed or failed)."""
        self.wait_backlog(0)

    def close(self) -> None:
        self.drain()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._cleanup_due is not None:  # a clean-up cut by an outage: what it left goes now, if the remote is back
            self._finish_cleanup_at_close(self._cleanup_due)
        with self._lock:  # no commit comes to retry them: local retention may take their steps now
            for upload, _ in self._to_retry:
                logger.warning("lazyckpt: the failed upload of step %d is not retried (closed)", upload.step)
                upload.settled.set()
            self._to_retry = []

    def _finish_cleanup_at_close(self, just_committed: int) -> None:
        """Bounded by ``remote_timeout_s``: a remote still down must not hold ``close()`` for the storage's own
        retries (the thread is a daemon; what it leaves is uncommitted, removed by the next run's clean-up)."""
        thread = start_background_thread(self.prune, just_committed, True, name="lazyckpt-cleanup", nice=UPLOAD_NICE)
        thread.join(self.timeout_s)
        if thread.is_alive():
            logger.warning("lazyckpt: the remote clean-up after step %d did not finish within remote_timeout_s=%gs "
                           "at close(); what it left (uncommitted) is left for the next run", just_committed,
                           self.timeout_s)

    # --- the uploader thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            upload, local_dir = item
            started = time.monotonic()
            try:
                upload.nbytes = self._upload(upload, local_dir)
                upload.seconds = time.monotonic() - started
                logger.info("lazyckpt: uploaded step %d (%.1f MB) to %s in %.3fs", upload.step,
                            upload.nbytes / 1e6, upload.url, upload.seconds)
                self.completed.append(CompletedUpload(upload.step, upload.url, upload.nbytes, upload.seconds))
                if self.leads:
                    self.prune(upload.step)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread at its next call
                then = "not retried again" if upload.retry else "retried once at the next commit"
                e.add_note(f"lazyckpt: while uploading step {upload.step} to {upload.url} (rank {self.rank}); "
                           f"the local checkpoint is intact, this upload is {then}, later steps are still uploaded")
                upload.error = e
                with self._lock:
                    self._failed.append(upload)
                    if not upload.retry:
                        self._to_retry.append((upload, local_dir))
            finally:
                with self._lock:
                    if self._uploads.get(upload.step) is upload:  # not its retry, registered meanwhile
                        del self._uploads[upload.step]
                self._release(upload.step)  # before done: whoever waits for the upload sees retention applied
                upload.done.set()
                if upload.error is None or upload.retry:  # else its retry comes (or close() drops it)
                    upload.settled.set()

    def _release(self, step: int) -> None:
        if self.on_released is None or self.holds(step):
            return
        try:
            self.on_released(step)
        except Exception as e:  # noqa: BLE001 - the upload is finished; only the local clean-up failed
            logger.warning("lazyckpt: local keep_last_k clean-up after the upload of step %d failed: %r", step, e)

    def _upload(self, upload: RemoteUpload, local_dir: str) -> int:
        """This rank's files, then the meeting after which rank 0 writes the commit object; returns the bytes."""
        if upload.retry and self._committed_already(upload.url, local_dir):
            return 0  # only this rank gave up on the first try, after rank 0 had committed it
        return self.upload_step(upload.url, local_dir, upload_attempt(upload.job.attempt, upload.retry))

    def upload_step(self, step_url: str, local_dir: str, attempt: str, *, check: bool = False) -> int:
        """``check``: first run every check a load runs on this rank's files (a copy that outlived its process)."""
        try:
            if check:
                CheckpointReader(local_dir, self.local).check_rank(self.rank)
            nbytes = sum(self._copy(os.path.join(local_dir, name), join(step_url, name))
                         for name in self._own_files(local_dir))
            return nbytes + self.meeting.commit(attempt, step_url, local_dir,
                                                lambda: self._write_commit(step_url, local_dir))
        except BaseException as e:
            self.meeting.give_up(attempt, e)
            raise

    def _write_commit(self, step_url: str, local_dir: str) -> int:
        """Rank 0, once every rank's upload is this save's (see the meetings): the commit object, after checking
        that every object it names is there (each rank's manifest and tensor file): a step whose files an outage or
        another job took is never committed. Returns its bytes."""
        there = set(self.storage.list_dir(step_url))
        missing = [name for name in rank_members(self.world_size, self.members) if name not in there]
        if missing:
            raise FileNotFoundError(errno.ENOENT, f"lazyckpt: {step_url} lacks {missing[:4]} ({len(missing)} in all) "
                                    "although every rank announced its upload; the commit object is not written")
        return self._copy(os.path.join(local_dir, MANIFEST), join(step_url, MANIFEST))

    def _committed_already(self, step_url: str, local_dir: str) -> bool:
        """True when the remote holds this very checkpoint committed (its commit object, not one of another run's step,
        and every rank's files: a commit object alone is not a step)."""
        remote, local = join(step_url, MANIFEST), os.path.join(local_dir, MANIFEST)
        return (self.holds_committed(step_url)
                and self.storage.read_bytes(remote, max_bytes=MAX_MANIFEST_BYTES)
                == self.local.read_bytes(local, max_bytes=MAX_MANIFEST_BYTES))

    def holds_committed(self, step_url: str) -> bool:
        """``step_url`` (under ``url``) is committed here, by the rule of :attr:`listed_at`."""
        storage, where = self.listed_at
        return is_committed(storage, where + step_url[len(self.url):])

    def _own_files(self, local_dir: str) -> list[str]:
        """What this rank uploads, its manifest last (it marks the upload durable); rank 0 adds the files no
        rank owns. The commit object is not among them."""
        mine = [rank_file(self.rank, self.world_size), rank_manifest(self.rank)]
        if self.leads:
            owned = {*rank_members(self.world_size), MANIFEST}
            mine[:0] = sorted(n for n in self.local.list_dir(local_dir) if n not in owned)
        return mine

    def _copy(self, src: str, dst: str) -> int:
        """Copy one committed local file to the remote in pieces; returns its size."""
        if isinstance(self.local, LocalStorage):  # s3fs streams the file itself, parts in parallel
            self.storage.upload_file(src, dst)
            return self.local.stat(src).size
        handle, out = self.local.open_read(src), self.storage.open_write(dst)
        try:
            piece, offset = bytearray(_COPY_BYTES), 0
            while got := handle.read_into(offset, memoryview(piece)):
                self.storage.write(out, offset, [memoryview(piece)[:got]])
                offset += got
        except BaseException:
            out.discard()
            raise
        finally:
            handle.close()
        self.storage.close(out, sync=True)
        return offset

    def prune(self, just_committed: int, at_close: bool = False) -> None:
        try:
            storage, where = self.listed_at
            committed, partial = remote_steps(storage, where)
            for step in steps_to_purge(list(committed), self.keep_last_k, just_committed=just_committed):
                remove_remote_step(storage, committed[step])
            with self._lock:  # a failed upload retried after this commit is still this job's (every rank queues it)
                busy = {u.step for u in self._uploads.values()} | {u.step for u, _ in self._to_retry}
            remove_partial_uploads(storage, where, below=just_committed, keep=busy,
                                   listing=(committed, partial))
            self._cleanup_due = None
        except Exception as e:  # noqa: BLE001 - the new checkpoint is committed; only clean-up failed
            self._cleanup_due = just_committed
            then = ("left for the next run" if at_close else
                    "tried again after the next remote commit and at close()")
            logger.warning("lazyckpt: remote_keep_last_k clean-up after step %d failed (%s; what it left is "
                           "uncommitted): %r", just_committed, then, e)
