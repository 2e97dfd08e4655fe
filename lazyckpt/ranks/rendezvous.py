"""How the ranks of one checkpointer agree, through the process group's key-value store and nothing else.

Only store operations are used (``set``, ``get``, ``check``, ``delete_key``): they are safe from background
threads, unlike collectives, and they need no directory that every node sees. Every key lives under a prefix agreed
at construction (one per checkpointer of the job), and every save has its own attempt number, which all ranks count
in the same order; so a key left by an earlier or failed attempt can never complete a new one. Once every rank is
past an attempt (committed, or gave it up), the last of them deletes its keys, so the store does not grow with the
length of the run; a store that cannot delete keys keeps them.

Directories: each rank names its own ``dirpath`` (node-local disks are fine). At construction the ranks find out
which of them share a directory (a marker file each, listed after everyone wrote theirs); the lowest rank of a
directory is its *leader*: it clears crash leftovers there, writes the global manifest and renames the step
directory into place once every rank of the job has published that its files are durable. With several
directories (one per node) the leaders commit together: each writes its manifest, they meet (``prepared``), each
renames, they meet again (``renamed``), then one atomic decision (:meth:`Rendezvous.decide`) says whether the step
stands: a leader that gave up (a failure, a lost peer, its timeout) proposes ``abort`` and undoes its rename unless
``commit`` was set first. So a step is committed in every directory or in none, and every rank hears why.

Liveness: every rank beats through the store (:mod:`~lazyckpt.ranks.liveness`), so a wait for a rank that died ends
after ``peer_timeout_s``, not ``commit_timeout_s``.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from lazyckpt.errors import CommitAbandoned
from lazyckpt.ranks.liveness import Heartbeat, PeerWatch
from lazyckpt.storage import Storage

logger = logging.getLogger(__name__)

Attempt = int | str
"""The key of one attempt: ``"<step>.<try>"`` for a save (:class:`Attempts`: the same on every rank), or a string
naming another meeting of it (an upload of that save: ``"remote/7.0/0"``)."""
Timeout = tuple[float, str]
"""``(seconds, the option that sets them)``, for a wait that is not bounded by ``commit_timeout_s``."""

_INSTANCES: dict[tuple[int, int], int] = {}
"""Checkpointers built per (store, rank) in this process: all ranks build them in the same order."""


class Attempts:
    """The key of each ``save()``'s attempt, from what every rank agrees on: its step and how many times this
    checkpointer was asked for that step before (``"40.0"``, then ``"40.1"`` for a retry). A local counter of saves
    would drift when one rank's ``save()`` raises and another's does not, and pair one rank's step with another's.
    The last :data:`KEPT_STEPS` steps are remembered (a loop retries a step right away, if at all)."""

    KEPT_STEPS = 64

    def __init__(self) -> None:
        self._tries: dict[int, int] = {}

    def next(self, step: int) -> str:
        tries = self._tries.pop(step, 0)
        self._tries[step] = tries + 1  # the newest last: the oldest is dropped first
        if len(self._tries) > self.KEPT_STEPS:
            del self._tries[next(iter(self._tries))]
        return f"{step}.{tries}"


class Rendezvous:
    """One checkpointer's meeting point with its peer ranks (see the module docstring)."""

    def __init__(self, store: Any, *, rank: int, world_size: int, dirpath: str, storage: Storage,
                 timeout_s: float, clear_dir: Callable[[], None], peer_timeout_s: float = 10.0) -> None:
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.peer_timeout_s = peer_timeout_s
        self._everyone_beats, self._beats = False, {}
        """Peers' beats are read only once every rank beats (before, a read of a missing key would block)."""
        self._lost: dict[int, bytes] = {}
        """Ranks found lost, with their beat then: later waits for them give up at once (PeerWatch)."""
        self._can_delete = True
        self._given_up: dict[Attempt, None] = {}
        """The attempts this rank abandoned, newest last (a second abandon could re-create deleted keys)."""
        self._agreed: str | None = None
        """The last plan signature every rank agreed on at save() (None before the first save)."""
        count = _INSTANCES.get((id(store), rank), 0)
        _INSTANCES[(id(store), rank)] = count + 1
        run_key = f"lazyckpt/checkpointer-{count}"
        if rank == 0:
            store.set(run_key, uuid.uuid4().hex)
        self.prefix = f"lazyckpt/{self._get(run_key).decode()}"
        self._beats = {r: f"{self.prefix}/beat/{r}" for r in range(world_size)}
        self._heartbeat = Heartbeat(store, self._beats[rank], period_s=peer_timeout_s / 4)
        store.add(f"{self.prefix}/beating", 1)
        try:
            self.leader = self._find_leader(dirpath, storage)
            if self.leader == rank:
                clear_dir()
            ready = [v.decode().split() for v in self._meet("ready", f"{self.leader} {peer_timeout_s!r}".encode())]
        except BaseException:
            self._heartbeat.stop()
            raise
        self.leaders = sorted({int(leader) for leader, _ in ready})
        """The leader of every directory of the job (one per node with node-local directories)."""
        self.peer_timeout_s = max(float(timeout) for _, timeout in ready)  # no rank judged by a shorter one than
        # its own beat period was set for

    def close(self) -> None:
        """Stop this rank's heartbeat; peers still waiting for it give up at once."""
        self._heartbeat.stop()

    # --- construction: who shares my directory -------------------------------------------------------------

    def _find_leader(self, dirpath: str, storage: Storage) -> int:
        self.members = self.sharing(dirpath, storage)
        """The ranks that share this rank's directory (itself included), lowest first."""
        return self.members[0]

    def sharing(self, dirpath: str, storage: Storage, label: str = "") -> list[int]:
        """The ranks whose ``dirpath`` is this rank's very directory, lowest first (construction only, every rank
        together): each writes a marker there, and lists the markers once every rank wrote its own. ``label``
        tells one such meeting of a checkpointer from another."""
        tag = self.prefix.rsplit("/", 1)[1] + label
        marker = os.path.join(dirpath, f".member-{tag}-rank{self.rank:05d}")
        storage.write_atomic(marker, b"", sync=False)
        self._meet(f"marked{label}")
        sharing = [int(name.rsplit("rank", 1)[1]) for name in storage.list_dir(dirpath)
                   if name.startswith(f".member-{tag}-rank")]
        self._meet(f"listed{label}")
        storage.remove_file(marker)
        return sorted(sharing)

    def exchange(self, name: str, value: bytes) -> list[bytes]:
        """Publish ``value`` under ``name`` and return what every rank published there, by rank (training thread,
        every rank together: construction and recovery only)."""
        return self._meet(f"x/{name}", value)

    def _meet(self, name: str, value: bytes | None = None) -> list[bytes]:
        """Every rank arrives at ``name`` before any leaves it (training thread, construction only); with a
        ``value``, returns what each rank published there."""
        keys = [f"{self.prefix}/{name}/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank], b"1" if value is None else value)
        self._wait(keys, f"every rank to reach {name!r}", owners=range(self.world_size))
        return [] if value is None else self.store.multi_get(keys)

    # --- save: the ranks' states must agree ----------------------------------------------------------------

    def agree(self, attempt: Attempt, signature: str) -> None:
        """Publish this rank's plan signature (its tensors' keys, dtypes and global shapes) for ``attempt``.

        The training thread waits for the other ranks' signatures only when this one differs from the last one
        every rank agreed on (the first save, or this rank's state changed): a rank whose state changed is the
        one that meets, and the commit checks the others (:meth:`check_plans`). On a mismatch it raises, and the
        failing ``save()`` abandons the attempt, so the ranks that did not wait stop waiting for it at once."""
        self.store.set(f"{self.prefix}/{attempt}/plan/{self.rank}", signature.encode())
        if signature == self._agreed:
            return
        keys = self._plan_keys(attempt)
        self._wait(keys, "every rank to call save() for the same step", attempt=attempt, owners=range(self.world_size))
        error = self._mismatch(signature, self.store.multi_get(keys))
        if error is not None:
            raise error
        self._agreed = signature

    def check_plans(self, attempt: Attempt) -> None:
        """Raise unless every rank published this rank's plan signature for ``attempt`` (commit, once every rank
        is durable: every rank published its signature by then)."""
        keys = self._plan_keys(attempt)
        values = self.store.multi_get(keys)
        error = self._mismatch(values[self.rank].decode(), values)
        if error is not None:
            raise error

    def _plan_keys(self, attempt: Attempt) -> list[str]:
        return [f"{self.prefix}/{attempt}/plan/{r}" for r in range(self.world_size)]

    def _mismatch(self, signature: str, values: list[bytes]) -> ValueError | None:
        differing = [r for r, value in enumerate(values) if value.decode() != signature]
        if not differing:
            return None
        return ValueError(
            f"the state passed to save() on rank {self.rank} differs from rank(s) {differing[:8]} in its tensor "
            "keys, dtypes or (global) shapes. Plain tensors are taken as replicated (identical on every rank) "
            "and written once: shard them as DTensors, or wrap per-rank values in lazyckpt.PerRank(...)")

    # --- commit (background threads) -----------------------------------------------------------------------

    def gather(self, attempt: Attempt, summary: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Publish that this rank's files are durable, then every rank's summary once all have published."""
        self.announce(attempt, summary)
        keys = self.wait_everyone(attempt)
        return {r: json.loads(v) for r, v in enumerate(self.store.multi_get(keys))}

    def announce(self, attempt: Attempt, summary: dict[str, Any] | None = None) -> None:
        """Publish that this rank's part of ``attempt`` is durable."""
        self.store.set(f"{self.prefix}/{attempt}/durable/{self.rank}", json.dumps(summary or {}).encode())

    def wait_everyone(self, attempt: Attempt, *, timeout: Timeout | None = None) -> list[str]:
        """Block until every rank announced ``attempt`` durable; returns their keys."""
        keys = [f"{self.prefix}/{attempt}/durable/{r}" for r in range(self.world_size)]
        self._wait(keys, "every rank to make its files durable", attempt=attempt, timeout=timeout,
                   owners=range(self.world_size))
        return keys

    def decide(self, attempt: Attempt, outcome: str) -> str:
        """The leaders' one decision on ``attempt`` (``"commit"`` or ``"abort"``): the first leader to propose one
        sets it, atomically, and every leader acts on what is set. So no leader gives a step up that another one has
        already found renamed everywhere, nor commits one another one rolled back."""
        return self.store.compare_set(f"{self.prefix}/{attempt}/outcome", "", outcome).decode()

    @property
    def commits_together(self) -> bool:
        """Several directories: their leaders commit each step in all of them or in none (:meth:`meet_leaders`)."""
        return len(self.leaders) > 1

    def meet_leaders(self, attempt: Attempt, phase: str) -> None:
        """A leader: publish that ``attempt`` reached ``phase`` here and wait until every directory's leader has
        (raises :class:`~lazyckpt.CommitAbandoned` once one failed)."""
        self.store.set(f"{self.prefix}/{attempt}/{phase}/{self.rank}", b"1")
        self._wait([f"{self.prefix}/{attempt}/{phase}/{r}" for r in self.leaders],
                   f"every directory's leader to reach {phase!r}", attempt=attempt, owners=self.leaders)

    def committed(self, attempt: Attempt) -> None:
        self.store.set(f"{self.prefix}/{attempt}/committed/{self.rank}", b"1")
        self._finished(attempt)

    def wait_committed(self, attempt: Attempt, *, by: int | None = None, timeout: Timeout | None = None) -> None:
        """Block until rank ``by`` (default: this directory's leader) committed ``attempt``."""
        by = self.leader if by is None else by
        self._wait([f"{self.prefix}/{attempt}/committed/{by}"], f"rank {by} to commit", attempt=attempt,
                   timeout=timeout, owners=[by])
        self._finished(attempt)

    def abandon(self, attempt: Attempt, reason: str) -> None:
        """Tell every rank that this attempt failed here, so none waits for it or commits it (the first rank's
        reason is kept: a rank that gives up because another failed adds nothing)."""
        if attempt in self._given_up:
            return
        self._given_up[attempt] = None
        if len(self._given_up) > 256:
            del self._given_up[next(iter(self._given_up))]
        failed = f"{self.prefix}/{attempt}/failed"
        if not self.store.check([failed]):
            self.store.set(failed, f"rank {self.rank}: {reason}".encode())
        self._finished(attempt)

    # --- forgetting an attempt once every rank is past it ----------------------------------------------------

    def _finished(self, attempt: Attempt) -> None:
        """This rank reads no key of ``attempt`` any more. The last rank to say so deletes them all, so a long run
        does not grow the store (a rank's mark is a key of its own: saying it twice never counts twice)."""
        done = [f"{self.prefix}/{attempt}/done/{r}" for r in range(self.world_size)]
        self.store.set(done[self.rank], b"1")
        if self._can_delete and self.store.check(done):
            self._delete(self._keys_of(attempt))

    def _keys_of(self, attempt: Attempt) -> list[str]:
        base = f"{self.prefix}/{attempt}"
        per_rank = [f"{base}/{kind}/{r}" for kind in ("plan", "durable", "prepared", "renamed", "committed")
                    for r in range(self.world_size)]
        per_rank.append(f"{base}/outcome")
        # The done marks last: while one is left, a rank that checks them never sees all of them.
        return [*per_rank, f"{base}/failed", *(f"{base}/done/{r}" for r in range(self.world_size))]

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self.store.delete_key(key)
            except (RuntimeError, NotImplementedError) as e:  # a store without deletion: keep the keys
                logger.info("lazyckpt: the process group's store cannot delete keys (%r); they are kept", e)
                self._can_delete = False
                return

    def _wait(self, keys: list[str], what: str, *, attempt: Attempt | None = None,
              timeout: Timeout | None = None, owners: Iterable[int] = ()) -> None:
        """Block until every one of ``keys`` exists; ``owners``: the rank that sets each key, watched for liveness.
        Polled with a cap, not store.wait(): a failure key must end the wait as soon as it appears."""
        failed = None if attempt is None else f"{self.prefix}/{attempt}/failed"
        seconds, option = timeout if timeout is not None else (self.timeout_s, "commit_timeout_s")
        key_of = dict(zip(owners, keys))
        watch = PeerWatch(self.store, {r: self._beats[r] for r in key_of if r != self.rank}, self.peer_timeout_s,
                          everyone_beats=self._all_beating, known_lost=self._lost)

        def arrived() -> bool:
            if self.store.check(keys):
                return True
            if failed is not None and self.store.check([failed]):
                raise CommitAbandoned(f"lazyckpt: {self.store.get(failed).decode()}; no rank commits this attempt")
            lost = watch.lost(lambda r: not self.store.check([key_of[r]]))
            if lost is not None:
                raise CommitAbandoned(f"lazyckpt: {lost} while this rank waited for {what}; no rank commits this "
                                      "attempt")
            return False

        poll_until(arrived, seconds, f"{what} ({option}); a rank failed or died, so no rank commits this checkpoint",
                   first_delay=0.001, max_delay=0.05)

    def _all_beating(self) -> bool:
        """Every rank of the job has started its heartbeat (then stays so: a closed rank's key says it closed)."""
        if not self._everyone_beats:
            self._everyone_beats = self.store.add(f"{self.prefix}/beating", 0) >= self.world_size
        return self._everyone_beats

    def _get(self, key: str) -> bytes:
        self._wait([key], f"rank 0 to create the checkpointer ({key})")
        return self.store.get(key)



def poll_until(predicate: Callable[[], bool], timeout_s: float, what: str, *, first_delay: float = 0.005,
               max_delay: float = 0.1) -> None:
    """Call ``predicate`` until it holds, backing off from ``first_delay`` to ``max_delay`` between calls: how ranks
    wait for each other off the training thread (store keys, or files on a level every rank sees), where a
    collective is not allowed.

    Raises:
        TimeoutError: ``predicate`` did not hold within ``timeout_s`` seconds (the message names ``what``).
    """
    deadline, delay = time.monotonic() + timeout_s, first_delay
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"lazyckpt: gave up after {timeout_s:g}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, max_delay)


def leader_of(rendezvous: Rendezvous | None) -> int:
    """The rank that leads this rank's directory: its rendezvous's leader, or rank 0 without a store."""
    return 0 if rendezvous is None else rendezvous.leader
