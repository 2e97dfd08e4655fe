"""``CheckpointSession``: the checkpoint policy of one training run, whatever framework drives it.

The Lightning callback and the Accelerate hook translate framework events into calls on this object; everything
they would otherwise both decide lives here or in its sibling modules: which rank writes what
(:meth:`CheckpointSession.save`), the barrier and the training-thread time each checkpoint cost
(:meth:`~CheckpointSession.barrier`, :attr:`~CheckpointSession.stalls`) and retention with steps to protect
(:meth:`~CheckpointSession.purge`). Options are validated by :class:`~lazyckpt.policy.SessionOptions`, RNG and
loader generators are found by :mod:`lazyckpt.policy.randomness`, the fit check is :mod:`lazyckpt.policy.fit`.

Example:
    >>> session = CheckpointSession("runs/ckpt", options, rank=0, world_size=1)          # doctest: +SKIP
    >>> session.save(5, replicated={"model": model.state_dict()}, per_rank={"rng": rng},  # doctest: +SKIP
    ...              optimizers=[opt])
    >>> session.barrier()             # right before the next optimizer step            # doctest: +SKIP
    >>> session.close()                                                                  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Literal

import torch

from lazyckpt.config import normalize_dirpath
from lazyckpt.engine import LazyCheckpointer
from lazyckpt.errors import StepAlreadyCommittedError
from lazyckpt.format.catalog import committed_steps
from lazyckpt.levels.remote.contents import newest_checkpoint
from lazyckpt.levels.retention import steps_to_purge
from lazyckpt.pending import PendingCheckpoint
from lazyckpt.policy.options import SessionOptions
from lazyckpt.policy.resume import committed_copy
from lazyckpt.ranks.group import default_store
from lazyckpt.ranks.replicas import keep_unsynchronized_per_rank, synchronized_storages
from lazyckpt.read.load import load
from lazyckpt.storage import Storage
from lazyckpt.storage.urls import options_for
from lazyckpt.tree.encode import PerRank

logger = logging.getLogger(__name__)
_OPEN: dict[str, CheckpointSession] = {}
"""Sessions of this process by directory (:meth:`CheckpointSession.shared`); the directory lock is about others."""
_OPEN_LOCK = threading.Lock()


def open_directories() -> list[str]:
    """The directories this process has a session open on (:meth:`CheckpointSession.shared`)."""
    with _OPEN_LOCK:
        return list(_OPEN)


class CheckpointSession:
    """The engine of one process of one training run, and the policy around it.

    Args:
        dirpath: the checkpoint directory.
        options: the integration's validated options.
        rank, world_size: this process and how many write each checkpoint (from the framework).
        engine_retention: the engine applies ``keep_last_k`` after each commit; False when the caller decides
            with steps to protect (:meth:`purge`), e.g. because names keep checkpoints too.
    """

    def __init__(self, dirpath: Any, options: SessionOptions, *, rank: int, world_size: int,
                 engine_retention: bool = True) -> None:
        self.dirpath = normalize_dirpath(dirpath)
        self.options = options
        self.rank = rank
        arguments = options.engine_arguments(rank=rank, world_size=world_size, retention=engine_retention)
        # With the process group's store the ranks save one global state: the engine splits the replicated
        # tensors across ranks by bytes. Without one (no group), rank 0 writes the replicated state itself; so it
        # does with keep_in_memory, whose host copy (what a rollback restores from rank 0) is what each rank wrote.
        split = world_size > 1 and options.engine.get("keep_in_memory", False) is not True
        self._store = default_store() if split else None
        self.engine = LazyCheckpointer(self.dirpath, store=self._store, **arguments)
        self._stalls: dict[int, float] = {}
        self._awaiting_barrier: int | None = None
        self._world_size = world_size
        self._engine_retention = engine_retention
        self._users = 1
        self._last: PendingCheckpoint | None = None
        self._protectors: list[Callable[[], Collection[int]]] = []
        self._name_holders: list[Callable[[str], bool]] = []
        self._deferred: set[int] = set()
        """Steps a purge would have deleted but for their upload in flight: deleted once it ends."""
        self._purge_lock = threading.Lock()
        """One purge at a time: the training thread's, and the uploader thread's once a deferred step uploaded."""
        self._names_follow_copy = self.engine.retained_dir != self.engine.dirpath
        """The host level: steps are kept (and named) in the disk directory its host folder is copied to."""
        if self.engine.remote is not None:
            self._purge_when_uploaded(self.engine.remote)

    @classmethod
    def shared(cls, dirpath: Any, options: SessionOptions, *, rank: int, world_size: int,
               engine_retention: bool = True) -> CheckpointSession:
        """The session this process has open on ``dirpath``, or a new one: several integrations writing to one
        directory (a best-by-metric and an every-N-steps callback) share one engine; each calls :meth:`close`.

        Raises:
            ValueError: the open session was made with other options (they must agree: one engine writes).
        """
        key = normalize_dirpath(dirpath)
        with _OPEN_LOCK:
            session = _OPEN.get(key)
            if session is None:
                session = _OPEN[key] = cls(key, options, rank=rank, world_size=world_size,
                                           engine_retention=engine_retention)
                return session
            asked = (options.engine, options.keep_last_k, rank, world_size, engine_retention)
            have = (session.options.engine, session.options.keep_last_k, session.rank, session._world_size,
                    session._engine_retention)
            if asked != have:
                raise ValueError(f"{options.owner}: another {session.options.owner} of this process writes to "
                                 f"{key} with keep_last_k={have[1]!r} and engine options {have[0]!r}; callbacks "
                                 "sharing a directory share its engine, so give them the same keep_last_k and "
                                 "engine options (or different directories)")
            session._users += 1
            return session

    @classmethod
    def commit_host_leftovers(cls, dirpath: Any, options: SessionOptions, *, rank: int, world_size: int) -> None:
        """With ``keep_in_memory="host"``: commit in ``dirpath`` the steps a crash kept in its host folder only (an
        engine opened and closed, :meth:`lazyckpt.levels.host.HostLevel.attach`), for a framework that looks for
        checkpoints in ``dirpath`` before any session is open; every rank calls it. Nothing otherwise."""
        if options.engine.get("keep_in_memory") == "host":
            cls(dirpath, options, rank=rank, world_size=world_size, engine_retention=False).close()

    def protect(self, steps: Callable[[], Collection[int]]) -> None:
        """Never let :meth:`purge` delete the steps ``steps()`` returns (names of one sharer of the session)."""
        self._protectors.append(steps)

    def hold_names(self, holds: Callable[[str], bool]) -> None:
        """``holds(name)`` tells whether one sharer of the session gave ``name`` to a checkpoint (committed or not)."""
        self._name_holders.append(holds)

    def name_taken(self, name: str) -> bool:
        """Whether any sharer of the session named a checkpoint ``name``, before the name is on disk (a framework's
        version counter then picks another name, as it does for a file that exists)."""
        return any(holds(name) for holds in self._name_holders)

    @property
    def storage(self) -> Storage:
        return self.engine.storage

    @property
    def stalls(self) -> dict[int, float]:
        """Training-thread seconds each checkpoint cost, by step: capture, request and the first barrier."""
        return dict(self._stalls)

    def save(self, step: int, *, replicated: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
             per_rank: Mapping[str, Any],
             optimizers: Iterable[torch.optim.Optimizer] = (), immutable: Iterable[Any] = (),
             started: float | None = None,
             if_committed: Literal["raise", "warn"] = "raise") -> PendingCheckpoint | None:
        """Request the checkpoint of ``step`` on this rank.

        ``replicated`` values are the same on every rank (a DDP model, its optimizer): inside a process group
        they are written once in total, each rank writing its share by bytes (every rank passes them, so every
        rank must call this for the same steps); without a group rank 0 alone writes them. Only the tensors of
        ``optimizers`` and ``immutable`` are known to agree across ranks: other tensors (buffers, metrics) are
        kept per rank (:mod:`lazyckpt.ranks.replicas`). Their ``optimizers``
        and ``immutable`` tensors are copied lazily. Every rank's ``per_rank`` values (RNG states, loader
        positions) are :class:`~lazyckpt.PerRank`: they come back to the same rank. ``replicated`` may be a
        function: without a group only rank 0 builds it.

        Args:
            started: when capturing this checkpoint began (``time.monotonic()``), if before this call; that time
                counts towards its stall.
            if_committed: when ``step`` is committed or in flight already: ``raise``
                :class:`~lazyckpt.StepAlreadyCommittedError`, or ``warn`` and save nothing (returns None; a
                framework that saves on its own schedule, e.g. again at the step it resumed from).
        """
        if self._last is not None and self._last.step == step:
            return self._last  # a second integration sharing this session asks for the step already requested
        started = time.monotonic() if started is None else started
        state, optimizers, immutable = self._rank_state(replicated, per_rank, optimizers, immutable)
        try:
            pending = self.engine.save(state, step=step, optimizers=optimizers, immutable=immutable)
        except StepAlreadyCommittedError as e:
            if if_committed == "raise":
                raise
            warnings.warn(f"lazyckpt: not saving step {step}: {e}", RuntimeWarning, stacklevel=2)
            return None
        except BaseException:
            taken = self.engine.in_flight  # an earlier failure, raised once this step's request was taken
            if taken is not None and taken.step == step:
                self._requested(taken, started)
            raise
        return self._requested(pending, started)

    @property
    def last_request(self) -> PendingCheckpoint | None:
        """The newest request this session made (also one whose ``save()`` then raised an earlier failure)."""
        return self._last

    def _requested(self, pending: PendingCheckpoint, started: float) -> PendingCheckpoint:
        self._last = pending
        if not pending.skipped:
            self._awaiting_barrier = pending.step
            self._add_stall(pending.step, time.monotonic() - started)
        return pending

    def _rank_state(self, replicated: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
                    per_rank: Mapping[str, Any], optimizers: Iterable[torch.optim.Optimizer],
                    immutable: Iterable[Any]) -> tuple[dict[str, Any], list[Any], list[Any]]:
        """What this rank passes to the engine: all of it in a group, else the replicated part on rank 0 only."""
        optimizers, immutable = list(optimizers), list(immutable)
        if self._store is not None:
            shared = replicated() if callable(replicated) else replicated
            shared = keep_unsynchronized_per_rank(shared, synchronized_storages(optimizers, immutable))
            return {**shared, **{key: PerRank(value) for key, value in per_rank.items()}}, optimizers, immutable
        if self.rank == 0:
            shared = replicated() if callable(replicated) else replicated
            return {**shared, **per_rank}, optimizers, immutable
        return dict(per_rank), [], []

    def barrier(self) -> None:
        """Return once the in-flight snapshot no longer reads the live tensors (right before an update)."""
        started = time.monotonic()
        self.engine.wait_staged()
        if self._awaiting_barrier is not None:  # the first barrier after a request is part of its stall
            self._add_stall(self._awaiting_barrier, time.monotonic() - started)
            self._awaiting_barrier = None

    def landed(self, pending: PendingCheckpoint) -> bool:
        """``pending`` is committed (or failed) in the directory its names and retention act on: with the host
        level, once its copy from the host folder to that disk directory ended too, its one retry included (a
        failed copy is tried again at the next commit; its names wait for it). Never blocks."""
        return pending.done() and (not self._names_follow_copy or pending.remote_settled())

    def wait_landed(self, pending: PendingCheckpoint) -> bool:
        """Block until ``pending`` :meth:`landed`; True when it is committed there, False when it failed there or
        was skipped (the engine raises the failure at its next call). A failed copy's retry is queued now rather
        than at a next commit that may not come (the end of a run)."""
        if pending.failed or pending.wait() is None:
            return False
        if not self._names_follow_copy:
            return True
        if pending.remote_done() and not pending.remote_settled():
            self.engine.remote.retry_failed()
        return pending.remote_settled(wait=True) and not pending.remote_given_up

    def purge(self, *, released: Collection[int] = (), protected: Collection[int] = ()) -> list[int]:
        """Delete the committed checkpoints retention lets go (rank 0; see :func:`lazyckpt.levels.retention.steps_to_purge`):
        ``released`` ones and those beyond the newest ``keep_last_k``, never a ``protected`` one, the newest, or
        one still uploading to the remote level (a released one is deleted as soon as its upload ends, on the
        uploader thread, ``close()`` included). Returns the steps deleted."""
        with self._purge_lock:
            committed = list(committed_steps(self.engine.retained_dir, self.storage))
            if not committed:
                return []
            remote = self.engine.remote
            uploading = {step for step in committed if remote is not None and remote.holds(step)}
            protected = set(protected).union(*(steps() for steps in self._protectors))
            doomed = steps_to_purge(committed, self.options.keep_last_k, just_committed=max(committed),
                                    protected=protected, released=set(released) | self._deferred)
            self._deferred = {step for step in doomed if step in uploading}
            removed = [step for step in doomed if step not in uploading and self.engine.remove(step)]
        for step in removed:
            logger.info("lazyckpt: removed step %d (nothing keeps it)", step)
        return removed

    def _purge_when_uploaded(self, remote: Any) -> None:
        """Chain onto the remote level's end-of-upload call (the directory applies ``keep_last_k`` there): a step
        released while it uploaded is deleted then, not only at the next commit's purge."""
        directory_purge = remote.on_released

        def released(step: int) -> None:
            if directory_purge is not None:
                directory_purge(step)
            self._purge_deferred(step)

        remote.on_released = released

    def _purge_deferred(self, step: int) -> None:
        """The upload of ``step`` ended: delete it if a purge had deferred it and nothing keeps it now (names may
        have come back to it since; the newest step always stays)."""
        with self._purge_lock:
            if step not in self._deferred:
                return
            self._deferred.discard(step)
            committed = committed_steps(self.engine.retained_dir, self.storage)
            kept = set().union(*(steps() for steps in self._protectors))
            if step not in committed or step == max(committed) or step in kept or not self.engine.remove(step):
                return
        logger.info("lazyckpt: removed step %d (nothing keeps it; its upload ended)", step)

    def resumed(self, step: int, path: str) -> None:
        """Note that the run continues from ``step`` (restored from ``path``); warns when newer checkpoints exist,
        because saving a step that is already committed fails."""
        newer = [s for s in committed_steps(self.engine.retained_dir, self.storage) if s > step]
        if newer:
            warnings.warn(f"lazyckpt: resumed {path}, but step {max(newer)} is newer in {self.dirpath}; saving a step "
                          "that is already committed fails, so move the newer checkpoints away before training on",
                          RuntimeWarning, stacklevel=3)
        logger.info("lazyckpt: resumed step %d from %s", step, path)

    def newest(self) -> str | None:
        """The newest committed checkpoint of this run: on the local level or, with a remote level, there (its
        URL) when it is newer, e.g. on a fresh node whose local directory is empty. With the host level, a step
        committed in ``dirpath`` too is given there (a clean close frees the host folder)."""
        config = self.engine.config
        found = newest_checkpoint(self.engine.dirpath, config.remote, config.storage_options)
        return committed_copy(found) if found is not None and self._names_follow_copy else found

    def load(self, path: str, **kwargs: Any) -> Any:
        """``lazyckpt.load(path, ...)``, reading a remote URL with this run's ``storage_options``."""
        return load(path, storage_options=options_for(path, self.engine.config.storage_options), **kwargs)

    def close(self) -> None:
        """Finish the checkpoints in flight and release the directory (re-raises a background failure); a shared
        session does so when its last user closes it."""
        with _OPEN_LOCK:
            self._users -= 1
            if self._users > 0:
                return
            if _OPEN.get(self.dirpath) is self:
                del _OPEN[self.dirpath]
        self.engine.close()

    def _add_stall(self, step: int, seconds: float) -> None:
        self._stalls[step] = self._stalls.get(step, 0.0) + seconds
