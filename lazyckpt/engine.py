"""``LazyCheckpointer``: the engine every integration drives.

Example:
    >>> ckpt = LazyCheckpointer("runs/ckpt", keep_last_k=3)                       # doctest: +SKIP
    >>> for step in range(1, 101):                                               # doctest: +SKIP
    ...     loss = model(batch).sum(); loss.backward()
    ...     ckpt.wait_staged()            # the barrier: the previous snapshot must be staged before the update
    ...     opt.step(); opt.zero_grad()
    ...     if step % 10 == 0:
    ...         ckpt.save({"model": model.state_dict(), "opt": opt.state_dict()}, step=step, optimizers=[opt])
    >>> ckpt.close()                                                              # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lazyckpt.config import CheckpointConfig, OnBusy, check_option_names, normalize_dirpath
from lazyckpt.errors import StepAlreadyCommittedError
from lazyckpt.format.files import step_dirname
from lazyckpt.levels.directory import CommittedSteps, DirectoryLock, meet_ranks
from lazyckpt.levels.host import HostLevel
from lazyckpt.levels.memory import MemoryLevel
from lazyckpt.levels.remote.spool import split_levels
from lazyckpt.levels.remote.upload import RemoteLevel, open_remote_level
from lazyckpt.pending import PendingCheckpoint
from lazyckpt.ranks.group import default_store, rank_and_size
from lazyckpt.ranks.rendezvous import Attempts
from lazyckpt.storage import LocalStorage, Storage
from lazyckpt.threads import weakly
from lazyckpt.write.capture import capture_job
from lazyckpt.write.commit import JobEnds
from lazyckpt.write.copier import Copier
from lazyckpt.write.inflight import InFlight
from lazyckpt.write.job import CheckpointJob
from lazyckpt.write.staging import CopyBackend, make_backend
from lazyckpt.write.stats import StatsLog
from lazyckpt.write.writer import SharedWriter

logger = logging.getLogger(__name__)
GROUP_STORE: Any = object()
"""``store``'s default: the initialized default process group's store, or none outside a process group."""
_OPEN: weakref.WeakSet[LazyCheckpointer] = weakref.WeakSet()


class LazyCheckpointer:
    """Lazy asynchronous checkpoints of a training state into ``dirpath`` (see docs/ and the module example).

    Args:
        dirpath: directory that holds one ``step-NNNNNNN/`` directory per committed checkpoint.
        storage: file-system seam (default :class:`~lazyckpt.storage.LocalStorage`). Without it a URL
            ``dirpath`` (``s3://bucket/run``) is the remote level behind a local spool directory (docs/remote.md);
            with it, ``dirpath`` is passed to ``storage`` as it is.
        backend: a ready :class:`~lazyckpt.write.staging.CopyBackend` instance, overriding ``copy_backend`` (for
            custom copy paths and tests).
        store: the ``torch.distributed`` key-value store the ranks meet through (default: the initialized
            process group's). With a store the ranks save one global state: DTensor leaves are written as shards
            by their owners, plain tensors are taken as replicated and written once in total (split across ranks
            by bytes), :class:`~lazyckpt.PerRank` values stay per rank; each rank may have its own ``dirpath``.
            Construction is then collective: every rank builds its checkpointer, in the same order. ``None``
            (or no process group): the ranks meet through the shared ``dirpath`` and each rank's state is its own.
        **options: the fields of :class:`~lazyckpt.config.CheckpointConfig` (``keep_last_k``,
            ``host_buffer_bytes``, ``copy_backend``, ``on_busy``, ``rank``, ``world_size``, ...). Inside an
            initialized process group, ``rank`` and ``world_size`` default to the group's.
    """

    def __init__(self, dirpath: str | os.PathLike[str], *, storage: Storage | None = None,
                 backend: CopyBackend | None = None, store: Any = GROUP_STORE, **options: Any) -> None:
        self._closed = True  # until fully built, so close() and __del__ on a half-built object are no-ops
        check_option_names(options, owner="LazyCheckpointer", extra=("storage", "backend", "store"))
        rank, world_size = rank_and_size(options.pop("rank", None), options.pop("world_size", None))
        self.config = CheckpointConfig(rank=rank, world_size=world_size, **options)
        self.dirpath = normalize_dirpath(dirpath)
        if storage is None:  # a URL dirpath (or the host level): a local spool directory before the remote level
            self.dirpath, self.config = split_levels(self.dirpath, self.config)
        elif self.config.host_level:
            raise ValueError("keep_in_memory='host' keeps its copies in local shared memory; drop storage=")
        self.storage: Storage = storage if storage is not None else LocalStorage()
        made = self.storage.stat(self.dirpath) is None
        self.storage.make_dir(self.dirpath)
        # first: a refused job touches nothing
        self._lock = DirectoryLock(self.dirpath, self.config.rank, self.storage, self.config.world_size, made=made)
        try:
            self.remote: RemoteLevel | None = open_remote_level(self.config, self.storage)  # fails here, not at a save
            self._rendezvous = meet_ranks(self.dirpath, self.storage, self.config,
                                          default_store() if store is GROUP_STORE else store)
            if self.remote is not None:
                self.remote.meet_through(self._rendezvous)
            self._host = HostLevel.attach(self.dirpath, self.config, self.storage, self.remote)  # None without it
            # where retention and names act: with the host level the disk directory behind its host folder
            self.retained_dir = self._host.dirpath if self._host is not None else self.dirpath
        except BaseException:
            self._lock.release()  # a half-built checkpointer must not keep the directory from the next one
            if getattr(self, "_rendezvous", None) is not None:
                self._rendezvous.close()
            raise
        self._attempts = Attempts()
        self._backend: CopyBackend | None = backend
        self._copier: Copier | None = None
        self._inflight = InFlight()
        self._memory = MemoryLevel() if self.config.in_process_memory else None
        """The memory level (``keep_in_memory=True``): the newest committed snapshot, kept in the staging pool."""
        self.stats = StatsLog()
        """The newest committed checkpoints' :class:`~lazyckpt.CheckpointStats` (a bounded window, iterable and
        indexable) and ``stats.total``, running totals over all of them."""
        self._writer = SharedWriter.get()
        self._steps = CommittedSteps(self.dirpath, self.storage, self.config, rendezvous=self._rendezvous,
                                     remote=self.remote)
        self._ends = JobEnds(storage=self.storage, config=self.config, rendezvous=self._rendezvous,
                             writer=self._writer, inflight=self._inflight, committed=weakly(self._on_committed),
                             discarded=weakly(self._drop_if_discarded))
        self._pid = os.getpid()
        self._closed = False
        _OPEN.add(self)

    # --- the public surface ---------------------------------------------------------------------------------

    def save(self, state: Any, *, step: int, optimizers: Iterable[torch.optim.Optimizer] = (),
             immutable: Iterable[torch.Tensor | torch.nn.Module] = ()) -> PendingCheckpoint:
        """Request a checkpoint of ``state`` as of now and return at once (see docs/ENGINE_API.md).

        Args:
            state: nested dict/list/tuple of tensors, plain values and :class:`~lazyckpt.Deferred` leaves.
            step: the training step; a committed step is never overwritten.
            optimizers: their parameters and state tensors are copied lazily (they stay unchanged until the
                next ``optimizer.step()``, which must come after :meth:`wait_staged`).
            immutable: more tensors, or modules whose parameters, that stay unchanged until the barrier (e.g.
                frozen base weights in parameter-efficient fine-tuning); copied lazily too.

        Raises:
            StepAlreadyCommittedError: ``step`` is committed already or in flight.
            StepOrderError: ``step`` is lower than the newest committed step and ``on_older_step="error"``.
            UnsupportedValueError: a value in ``state`` has no safe encoding (the message names its path).
            OSError: not enough free space (``ENOSPC``).
            BaseException: a background failure of an earlier checkpoint (the original exception object), raised
                only once this request is taken (its handle is then :attr:`in_flight`): every rank takes the same
                requests, so a rank that hears of a failure first never falls out of step with the others. A
                request that fails itself is given up on every rank at once.
        """
        started = time.monotonic()
        self._check_open("save")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        attempt = self._attempts.next(step)
        try:
            pending, job = self._request(state, step, attempt, optimizers, immutable, started)
        except BaseException as e:  # every rank gives this attempt up at once, not at commit_timeout_s
            if self._rendezvous is not None:  # (after another rank's failure too: this rank is done with it)
                self._rendezvous.abandon(attempt, f"save(step={step}) raised {e!r}")
            raise
        self._raise_earlier_failure(step, job)
        return pending

    def _request(self, state: Any, step: int, attempt: str, optimizers: Iterable[torch.optim.Optimizer],
                 immutable: Iterable[torch.Tensor | torch.nn.Module],
                 started: float) -> tuple[PendingCheckpoint, CheckpointJob | None]:
        """Take the request of ``step`` (``save()`` but for the hand-off of earlier failures); its job (None when
        skipped)."""
        final_dir = os.path.join(self.dirpath, step_dirname(step))
        if self.storage.stat(final_dir) is not None or ((same := self._inflight.find(step)) and not same.failed):
            raise StepAlreadyCommittedError(f"step {step} is already committed or in flight at {final_dir}; "
                                            "lazyckpt never overwrites a checkpoint (use a new step number)")
        if self._host is not None:
            self._host.check_step(step)  # the disk directory's steps count too
        if not self._make_room(step):
            warnings.warn(f"lazyckpt: skipped the checkpoint of step {step}: step {self._job.step} is still being "
                          "copied or written (on_busy='skip')", RuntimeWarning, stacklevel=3)
            return PendingCheckpoint(self._ends.barrier, None, step), None
        self._steps.check_order(step)
        rendezvous = self._rendezvous
        agree = None if rendezvous is None else (lambda signature: rendezvous.agree(attempt, signature))
        job = capture_job(state, step=step, dirpath=self.dirpath, config=self.config, storage=self.storage,
                          optimizers=optimizers, immutable=immutable, backend_for=self._backend_for, agree=agree)
        job.attempt = attempt
        if self._memory is not None:
            self._memory.check_budget(job, self.config.host_buffer_bytes)
            self._memory.begin(job)
        self._backend.on_request([t for e, t in zip(job.entries, job.sources) if e.lazy])
        if self._host is not None:
            self._host.before_save(job)  # at most two snapshots in shared memory
        upload = self.remote.ticket(job) if self.remote is not None else None
        pending = PendingCheckpoint(self._ends.barrier, job, step, upload)
        self._inflight.add(job, pending)
        self._copier.submit(job)
        job.stats.save_s = time.monotonic() - started
        return pending, job

    def _raise_earlier_failure(self, step: int, job: CheckpointJob | None) -> None:
        """Once the request of ``step`` is taken: raise the oldest background failure not delivered yet. Raising it
        before would leave this rank without the checkpoint every other rank took."""
        error = self._earlier_failure(excluding=job)
        if error is not None:
            error.add_note(f"lazyckpt: raised by save(step={step}), which still took its own request "
                           "(LazyCheckpointer.in_flight)")
            raise error

    def wait_staged(self) -> None:
        """The barrier: returns once the in-flight snapshot no longer needs the live tensors.

        Call it right before the next ``optimizer.step()``. It also evaluates the ``Deferred`` leaves and
        re-raises a background failure.
        """
        if self._job is not None:
            self._ends.barrier(self._job)
        if (error := self._earlier_failure()) is not None:
            raise error

    def remove(self, step: int) -> bool:
        """Delete the committed checkpoint of ``step`` (for callers with their own retention, e.g. top-k).

        The directory is first renamed to a ``*.partial`` name, so a crash mid-delete leaves debris that the
        next checkpointer removes, never a half-deleted "committed" checkpoint. Returns False if there was none.
        With the host level, its copy in ``retained_dir`` goes too.

        Raises:
            ValueError: ``step`` is the checkpoint in flight.
        """
        if self._inflight.find(step) is not None:
            raise ValueError(f"step {step} is still being written; wait() for it before removing it")
        on_disk = self._host is not None and self._host.remove(step)  # first: it waits for a copy under way
        return self._steps.remove(step) or on_disk

    def memory_snapshot(self, *, into: Any = None, before: int | None = None) -> tuple[int, Any] | None:
        """``(step, state)`` of the newest committed snapshot kept in host memory, or None.

        Needs ``keep_in_memory=True``. The bytes are copied out of the staging pool and checked against their
        checksums; the checkpoint being written goes on. Load the state with the usual ``load_state_dict`` calls.

        Args:
            into: the live state, e.g. ``{"model": model.state_dict(), "opt": opt.state_dict()}`` (the structure
                that was saved): snapshot tensors are copied straight into its tensors where key, dtype and shape
                match (contiguous CPU tensors), so the ``load_state_dict`` calls that follow copy nothing more.
                Tensors without such a target come back fresh.
            before: only a snapshot of an earlier step is read (None is returned otherwise, ``into`` untouched).

        With ``into``, a checkpoint still being copied from those live tensors is first staged (as
        :meth:`wait_staged` would), so it keeps the values it was requested with.

        Raises:
            CheckpointCorruptError: the host copy no longer matches its checksums (tensors of ``into`` may
                already hold part of the snapshot: load another state into them).
        """
        self._check_open("memory_snapshot")
        if self._memory is None:
            return None
        if into is not None and self._job is not None:
            self._ends.barrier(self._job)  # its lazy copy reads the tensors about to be overwritten
        return self._memory.read(into, before)

    def discard(self, step: int) -> bool:
        """Make sure no checkpoint of ``step`` survives: abort it when in flight, else remove it.

        For a snapshot found bad after it was requested (e.g. the loss of its step is not finite). An in-flight
        one is failed with :class:`~lazyckpt.CheckpointDiscardedError` and discarded like any failed checkpoint
        (its partial directory is removed), unless its commit is already under way: then it commits and is
        removed. Either way it leaves the memory level. Returns True if there was one.
        """
        self._check_open("discard")
        job = self._inflight.find(step)
        aborted = job is not None and self._ends.abort(job)
        removed = self.remove(step)
        forgotten = self._memory is not None and self._memory.forget(step)
        return aborted or removed or forgotten

    @property
    def in_flight(self) -> PendingCheckpoint | None:
        """The handle of the newest checkpoint not yet committed (or failed), if any; earlier ones commit first."""
        return self._inflight.newest_handle()

    def close(self) -> None:
        """Finish the in-flight checkpoint and its upload, stop the copier and release the directory. Idempotent."""
        if getattr(self, "_closed", True):
            return
        if self._pid != os.getpid():
            return  # a forked child (e.g. a DataLoader worker) owns none of the parent's threads or files
        try:
            for job in self._inflight.unfinished():  # the run is over: waiting for them stalls no training
                self._ends.drain(job, deliver=False, stall=False)
            if self.remote is not None:
                self.remote.close()
                self._steps.purge_after_uploads()
            if self._host is not None:
                self._host.close(leader=self._steps.leads)
        finally:
            self._closed = True
            _OPEN.discard(self)
            if self._copier is not None:
                self._copier.stop()
            if self._memory is not None:
                self._memory.clear()
            if self._rendezvous is not None:
                self._rendezvous.close()  # after the drain: a peer still waiting for this rank gives up now
            self._lock.release(tidy=True)  # a directory made for a job that saved nothing goes too
            if self._host is not None:
                self._host.tidy()
        if (error := self._earlier_failure()) is not None:
            raise error

    def __enter__(self) -> LazyCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"LazyCheckpointer({self.dirpath!r}) is closed; cannot {what}()")
        if self._pid != os.getpid():
            raise RuntimeError(f"LazyCheckpointer({self.dirpath!r}) was created in process {self._pid}; its threads "
                               f"do not exist in this forked process {os.getpid()}: create a new one here")

    _job = property(lambda self: self._inflight.newest)
    """The newest requested checkpoint: the only one whose barrier may still be ahead."""

    def _make_room(self, step: int) -> bool:
        """Before capturing ``step``: pass the newest checkpoint's barrier and wait for those that must commit
        first (:meth:`InFlight.blocking`). False when ``on_busy="skip"`` and that would block."""
        newest, older = self._job, self._inflight.blocking(step, self.config.max_in_flight)
        if self.config.on_busy is OnBusy.SKIP and newest is not None and (older or not newest.wait_staged(0)):
            return False
        if newest is not None:
            self._ends.barrier(newest)  # its copy is done and its tree complete, so it commits before the next one
        for job in older:
            self._ends.drain(job, deliver=False)  # its failure is delivered once the new request is taken
        return True

    def _earlier_failure(self, excluding: CheckpointJob | None = None) -> BaseException | None:
        """The oldest background failure the training thread has not heard of yet (a checkpoint's first, then an
        upload's), now counted as heard; ``excluding``: a job just requested, whose own failure is not earlier."""
        error = self._inflight.take_error(excluding=excluding)
        if error is None and self.remote is not None:
            error = self.remote.take_error()
        return error

    def _backend_for(self, tensors: list[torch.Tensor]) -> CopyBackend:
        if self._copier is None:
            if self._backend is None:
                self._backend = make_backend(self.config.copy_backend, tensors)
            self._copier = Copier(backend=self._backend, budget_bytes=self.config.host_buffer_bytes,
                                  storage=self.storage, writer=self._writer, finalize=self._ends.finalize,
                                  memory=self._memory, max_in_flight=self.config.max_in_flight)
        return self._backend

    # --- the levels' part of a job's end (JobEnds calls these) ------------------------------------------------

    def _drop_if_discarded(self, job: CheckpointJob) -> None:
        """A discarded job's slots kept for the memory level go back to the pool now (the next copy may wait)."""
        if self._memory is not None:
            self._memory.drop(job)

    def _on_committed(self, job: CheckpointJob) -> None:
        """The commit thread, once ``job`` is visible: the memory level, stats, log, retention (rank 0)."""
        if self._memory is not None:
            self._memory.publish(job)
        job.stats.flush_s = time.monotonic() - job.requested_at
        self.stats.append(job.stats)
        logger.info("lazyckpt: committed step %d (%.1f MB) in %.3fs", job.step, job.stats.nbytes / 1e6,
                    job.stats.flush_s)
        self._steps.note_committed(job.step)
        if self._host is not None:  # first, its files opened now: the clean-up cannot take them from the transfer
            self._host.committed(job.step, job.final_dir)
        if self.remote is not None:  # before the clean-up: the upload need not wait for old steps' removal
            self.remote.submit(job.step, job.final_dir)
        try:
            self._steps.purge(job.step)
        except Exception as e:  # noqa: BLE001 - the new checkpoint is committed; only clean-up failed
            logger.warning("lazyckpt: keep_last_k clean-up after step %d failed: %r", job.step, e)

    def __del__(self) -> None:
        try:
            self.close()
        except BaseException:  # noqa: BLE001 - never raise from a finalizer
            pass




@atexit.register
def _close_open_checkpointers() -> None:
    # Finish what was requested before the interpreter exits normally; a crash leaves only partial dirs.
    for checkpointer in list(_OPEN):
        try:
            checkpointer.close()
        except BaseException as e:  # noqa: BLE001
            logger.error("lazyckpt: closing %s at exit failed: %r", checkpointer.dirpath, e)


__all__ = ["LazyCheckpointer", "PendingCheckpoint"]
