"""Named checkpoints: names that follow a checkpoint's commit, and retention that keeps what a name points at.

A framework may think in names (Lightning's ``ModelCheckpoint`` in file names built from its ``filename``
template: ``epoch=1-step=40.ckpt``, ``last.ckpt``) while the engine writes ``dirpath/step-NNNNNNN/``. Each name
becomes a relative link to its step directory (:mod:`lazyckpt.levels.aliases`), created only once that step is
committed; a dropped name is removed only once the checkpoint planned with the drop is committed. Several names
may point at one step. A step directory is deleted when its last name is gone and ``keep_last_k`` does not keep
it: the names become the steps to protect of :meth:`CheckpointSession.purge`.

One step's names are planned while the framework decides (:meth:`CheckpointNames.plan`, ``copy``, ``drop``),
the snapshot is requested once (:meth:`~CheckpointNames.submit`), and :meth:`~CheckpointNames.poll` publishes
the committed ones, oldest first (:meth:`~CheckpointNames.deciding` does the three around one framework hook).
Each commit found is reported to the run's :class:`~lazyckpt.policy.RunFeedback` (stats, the "saved" messages that
waited for it, the loggers) when one is given, and :meth:`~CheckpointNames.finish` reports the run's summary.
Outside a fit an integration holds :data:`NO_NAMES`, a :class:`CheckpointNames` that plans and requests nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from lazyckpt.format.files import step_dirname
from lazyckpt.levels.aliases import aliased_steps, link_alias, resolve_step, unlink_alias
from lazyckpt.pending import PendingCheckpoint
from lazyckpt.policy.feedback import Reporter, RunFeedback
from lazyckpt.policy.session import CheckpointSession
from lazyckpt.write.job import CheckpointStats

logger = logging.getLogger(__name__)
Action = tuple[str, str, "int | None"]
"""``("link", name, step)`` or ``("remove", name, None)``."""


@dataclass(eq=False)
class _Request:
    """One lazy save of a step and the name changes that must wait for its commit."""

    step: int
    pending: PendingCheckpoint | None = None
    actions: list[Action] = field(default_factory=list)
    submitted: bool = False
    finished: bool = False
    skipped: bool = False


@dataclass(frozen=True)
class Committed:
    """A requested checkpoint that :meth:`CheckpointNames.poll` found committed."""

    step: int
    stats: CheckpointStats | None


class CheckpointNames:
    """The names of one session's checkpoints and the requests whose commit they wait for.

    Args:
        session: the run's session (rank 0 alone changes names and deletes).
        save: requests the snapshot of a step (None or a skipped handle: nothing was saved), e.g. through
            :meth:`CheckpointSession.save` with the framework's state.
        resumed_from: returns the path the run resumed from: never deleted before this run's first commit, then
            kept only while a name or ``keep_last_k`` keeps it.
        names_dir: where the names are (default: the session's directory); the session may write its steps
            into a run directory of its own below it (:func:`lazyckpt.policy.run_directory`).
        feedback: records every commit found (:meth:`RunFeedback.report`) and the run's summary (:meth:`finish`);
            on rank 0 both go to the ``reporter`` (the other ranks report nothing).
        before_names: called on rank 0 with each committed step before its names are put in place (files a
            framework's own loader needs next to the manifest, so that a name always leads to them).
    """

    def __init__(self, session: CheckpointSession, save: Callable[[int], PendingCheckpoint | None],
                 resumed_from: Callable[[], str | None] = lambda: None, *, feedback: RunFeedback | None = None,
                 reporter: Reporter = Reporter(), names_dir: str | None = None,
                 before_names: Callable[[int], None] = lambda step: None) -> None:
        self._session = session
        self._before_names = before_names
        self._names_dir = names_dir if names_dir is not None else session.dirpath
        self._save = save
        self._resumed_from = resumed_from
        self._feedback = feedback
        self._reporter = reporter.on_rank(session.rank)
        self._names: dict[str, int] = {}
        self._requests: list[_Request] = []
        self._current: _Request | None = None
        self._past_resume = False
        session.protect(self._kept)  # also from the purges of other names sharing the session
        session.hold_names(self.__contains__)

    def _kept(self) -> set[int]:
        """What these names keep from every purge of the session (the uploader thread's too): the steps named or
        requested here, those a link in the names' folder points at (an earlier process's names too), and the step
        resumed from until this run's first commit."""
        storage, dirpath = self._session.storage, self._session.dirpath
        kept = set(self._names.values()) | {r.step for r in list(self._requests)}
        kept |= aliased_steps(storage, self._names_dir, into=dirpath)
        resumed = None if self._past_resume else resolve_step(storage, self._resumed_from(), dirpath)
        return kept if resumed is None else kept | {resumed}

    def __contains__(self, name: str) -> bool:
        return os.path.abspath(name) in self._names

    def fresh(self) -> bool:
        """Nothing was planned or requested through these names yet."""
        return not self._names and not self._requests and self._current is None

    def taken(self, name: str) -> bool:
        """Whether this run gave ``name`` to a checkpoint, through these names or another sharer's of the session
        (two callbacks writing one directory), committed or not: only a committed name is on disk."""
        return self._session.name_taken(name)

    # --- planning one step's names --------------------------------------------------------------------------

    def plan(self, step: int, name: str) -> None:
        """``name`` will point at the checkpoint of ``step``, once committed (one request per step)."""
        if self._current is None or self._current.step != step:
            self._current = _Request(step)
        if not self._current.skipped:  # a skipped step gets no names (nothing was written)
            self._names[os.path.abspath(name)] = step
            self._add(self._current, ("link", name, step))

    def copy(self, name: str, new_name: str) -> None:
        """``new_name`` will point where ``name`` points, once that step is committed."""
        step = self._names.get(os.path.abspath(name))
        if step is None or os.path.abspath(name) == os.path.abspath(new_name):
            return
        self._names[os.path.abspath(new_name)] = step
        waiting = [r for r in (*self._requests, self._current) if r is not None and r.step == step]
        self._add(waiting[-1] if waiting else None, ("link", new_name, step))

    def drop(self, name: str) -> None:
        """Remove ``name`` once the checkpoint being planned is committed."""
        self._names.pop(os.path.abspath(name), None)
        self._add(self._current, ("remove", name, None))

    def adopt(self, step: int, names: list[str]) -> None:
        """Name ``step``, committed in the directory already, with ``names``: a resumed host step's own names,
        planned before a crash kept its copy from that directory (they were never put in place)."""
        for name in names:
            self._names[os.path.abspath(name)] = step
        self._publish(_Request(-1, actions=[("link", name, step) for name in names], finished=True))

    # --- requests and their completion ----------------------------------------------------------------------

    @contextmanager
    def deciding(self) -> Iterator[None]:
        """Around one framework hook that may plan names: publish what is committed first (:meth:`poll`), then,
        when the hook returns, request the step it planned once (:meth:`submit`), with the state it left."""
        self.poll()
        yield
        self.submit()

    def submit(self) -> list[Committed]:
        """Request the planned step's snapshot, once (nothing saved: the names it planned are dropped, keeping
        the ones they would replace); returns :meth:`poll`'s."""
        request = self._current
        if request is None or request.submitted:
            return []
        request.submitted = True
        try:
            request.pending = self._save(request.step)
        except BaseException:  # an earlier failure, raised once this step's request was taken: names follow it
            taken = self._session.last_request
            if taken is not None and taken.step == request.step:
                request.pending = taken
                self._requests.append(request)
            raise
        if request.pending is None or request.pending.skipped:
            for kind, name, _ in request.actions:
                if kind == "link":
                    self._names.pop(os.path.abspath(name), None)
            request.actions.clear()
            request.finished = request.skipped = True
            return []
        self._requests.append(request)
        return self.poll()  # a save may have finished the previous request first (on_busy="wait")

    def poll(self, *, block: bool = False, limit: int | None = None) -> list[Committed]:
        """Publish the requests that are committed (all of them when ``block``), oldest first; reports and
        returns them. With the host level a request counts once its copy to the disk directory is committed: the
        names are there (:meth:`CheckpointSession.landed`).

        A failed request is dropped with its name changes; the engine raises its failure at its next call.
        """
        committed: list[Committed] = []
        while self._requests and (limit is None or len(committed) < limit):
            request = self._requests[0]
            if not block and not self._session.landed(request.pending):
                break
            self._requests.pop(0)
            request.finished = True
            if not self._session.wait_landed(request.pending):
                continue
            stats = next((s for s in reversed(self._session.engine.stats) if s.step == request.step), None)
            self._publish(request)
            committed.append(Committed(request.step, stats))
        self._report(committed)
        return committed

    def _report(self, committed: list[Committed]) -> None:
        if self._feedback is not None and committed:
            self._feedback.report(committed, self._reporter)

    def finish(self, *, step: int) -> dict[str, float]:
        """The end of a run: request what is planned, publish (and report) every request, then report the run's
        summary at ``step``; returns its metrics ({} on a rank that does not report)."""
        self.submit()
        self.poll(block=True)
        return {} if self._feedback is None else self._feedback.finish(self._reporter, step=step)

    def close(self, *, raise_errors: bool) -> None:
        """Publish (and report) every request, then close the session. The first failure is raised when
        ``raise_errors``, else logged: a run that is failing already keeps its own exception."""
        error = None
        try:
            while self._requests:  # one at a time, so the ones before a failure are reported
                self.poll(block=True, limit=1)
        except BaseException as e:  # noqa: BLE001 - re-raised below or logged
            error = e
        finally:
            self._requests.clear()
            self._current = None
            try:
                self._session.close()
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is not None and raise_errors:
            raise error
        if error is not None:
            logger.error("lazyckpt: an in-flight checkpoint failed while the run was stopping: %r", error)

    # --- publishing (rank 0) ----------------------------------------------------------------------------------

    def _add(self, request: _Request | None, action: Action) -> None:
        if request is not None and not request.finished:
            request.actions.append(action)
        else:  # nothing to wait for: the step it names is committed already
            self._publish(_Request(-1, actions=[action], finished=True))

    def _publish(self, request: _Request) -> None:
        """Rank 0, after a commit: put names in place, drop replaced ones, delete what nothing keeps."""
        if self._session.rank != 0:
            return
        storage, dirpath = self._session.storage, self._session.dirpath
        if request.step >= 0:
            self._before_names(request.step)
        unnamed: set[int] = set()
        for kind, name, step in request.actions:
            old = resolve_step(storage, name, dirpath)  # a name of another run's step: that step is not ours
            if kind == "remove":
                unlink_alias(storage, name)
            else:
                link_alias(storage, name, os.path.join(dirpath, step_dirname(step)))
            if old is not None and old != step:
                unnamed.add(old)
        resumed = resolve_step(storage, self._resumed_from(), dirpath)
        if resumed is not None and request.step >= 0 and not self._past_resume:
            # This run's first commit: the step it resumed from is no longer the only way back, so from now on
            # retention treats it like any other step (kept while a name or keep_last_k keeps it).
            self._past_resume = True
            unnamed.add(resumed)
        if unnamed or self._session.options.keep_last_k is not None:
            self._session.purge(released=unnamed)  # what names keep, on disk too: _kept


class _NoNames(CheckpointNames):
    """The names of an integration outside a fit (before its setup, after its close): there is no session, so
    nothing is planned, requested, published, reported or closed. It overrides every public method, so the
    framework's hooks may call it as they call the real ones and none reaches the session it lacks."""

    def __init__(self) -> None:  # no session, on purpose: see the class docstring
        pass

    def __contains__(self, name: str) -> bool:
        return False

    def fresh(self) -> bool:
        return False  # no session to reopen elsewhere

    def taken(self, name: str) -> bool:
        return False

    def plan(self, step: int, name: str) -> None:
        # A framework may still try to save here; raising (or a warning turned into an error) could mask an
        # exception being handled, so log that nothing was saved and go on.
        logger.warning("lazyckpt: no checkpoint of step %d for %r: checkpoints are saved only while fitting",
                       step, name)

    def copy(self, name: str, new_name: str) -> None:
        return None  # no name points anywhere

    def drop(self, name: str) -> None:
        return None

    def adopt(self, step: int, names: list[str]) -> None:
        return None  # nothing to name outside a fit

    @contextmanager
    def deciding(self) -> Iterator[None]:
        yield

    def submit(self) -> list[Committed]:
        return []

    def poll(self, *, block: bool = False, limit: int | None = None) -> list[Committed]:
        return []

    def finish(self, *, step: int) -> dict[str, float]:
        return {}

    def close(self, *, raise_errors: bool) -> None:
        return None


NO_NAMES: CheckpointNames = _NoNames()
"""What an integration holds in place of its :class:`CheckpointNames` while it is not fitting."""
