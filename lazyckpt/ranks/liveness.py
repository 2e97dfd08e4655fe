"""Which peer ranks are alive, through the store alone: each rank's checkpointer beats (a counter under its own key,
set every ``peer_timeout_s / 4``), and a rank that waits for a peer gives up once that peer's beat stood still for
``peer_timeout_s`` (noticed at the next look, within about a second more), or at once when the peer closed its
checkpointer; a peer found lost fails the next waits for it at their first look, until it beats again. Without this, a rank that died mid-checkpoint
kept every survivor waiting ``commit_timeout_s`` (600 s by default) at each checkpoint and again at ``close()``.

Only a peer a wait still needs counts: one whose key for that wait is missing. A rank that died after doing its part
(a non-leader whose files are durable) does not fail a commit that no longer needs it. Beats are compared with the
waiter's own clock (the values are counters, not times), so nodes need no synchronised clocks. Beats are read only
once every rank of the job has started beating (a counter they each add to): until then a read could block on a
missing key, so a rank that dies before it starts building its checkpointer is noticed after ``commit_timeout_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from lazyckpt.threads import start_background_thread

logger = logging.getLogger(__name__)

CLOSED = b"closed"
"""A beat key's value once its rank closed its checkpointer: it will publish nothing more."""
CHECK_AFTER_S = 1.0
"""A wait looks at its peers' beats only once it lasted this long, then this often: most waits end sooner, and
looking costs one store round trip for all peers."""


class Heartbeat:
    """This rank's beat under ``key``, from a daemon thread, until :meth:`stop`. It beats through a client of its
    own (``store.clone()``): a TCPStore client serves one request at a time, so a long blocking ``get`` or ``wait``
    on the shared client (NCCL's set-up, the user's own) would otherwise hold the beat back and make a live rank
    look dead."""

    def __init__(self, store: Any, key: str, *, period_s: float) -> None:
        self.store, self.key, self.period_s = _own_client(store), key, period_s
        self._stopped = threading.Event()
        self.store.set(key, b"0")  # before any peer can look: the construction meets come after this
        self._thread = start_background_thread(self._beat, name="lazyckpt-heartbeat", nice=0)

    def _beat(self) -> None:
        count = 0
        while not self._stopped.wait(self.period_s):
            count += 1
            try:
                self.store.set(self.key, str(count).encode())
            except Exception as e:  # noqa: BLE001 - a network blip must not silence a live rank: beat again
                logger.debug("lazyckpt: heartbeat %s failed: %r", self.key, e)

    def stop(self) -> None:
        """Stop beating and tell the peers this rank closed (their waits for it end at once)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.period_s + 5)  # a store stuck in a partition must not hang close()
        try:
            self.store.set(self.key, CLOSED)
        except Exception as e:  # noqa: BLE001 - the store is gone: no peer is waiting through it either
            logger.debug("lazyckpt: could not mark %s closed: %r", self.key, e)


def _own_client(store: Any) -> Any:
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):  # a store that cannot clone: share its client
        return store


class PeerWatch:
    """One wait's view of the beats of the peers it needs (``beat_keys``: rank -> beat key).

    ``known_lost`` (rank -> its beat when it was found lost, shared by the waits of one rendezvous): a later wait
    needing such a rank gives up at its first look, without waiting ``peer_timeout_s`` again, unless the rank beat
    since."""

    def __init__(self, store: Any, beat_keys: dict[int, str], timeout_s: float, *,
                 everyone_beats: Callable[[], bool], known_lost: dict[int, bytes]) -> None:
        self.store, self.beat_keys, self.timeout_s = store, beat_keys, timeout_s
        self._everyone_beats, self._known_lost = everyone_beats, known_lost
        now = time.monotonic()
        self._next_look = now if any(r in known_lost for r in beat_keys) else now + CHECK_AFTER_S
        self._seen: dict[int, tuple[bytes, float]] = {}
        """rank -> (its last beat seen, when it was first seen with that value)."""

    def lost(self, still_needed: Callable[[int], bool]) -> str | None:
        """Why a peer this wait still needs is gone (None while every one is alive or it is too early to tell)."""
        now = time.monotonic()
        if now < self._next_look or not self.beat_keys:
            return None
        self._next_look = now + CHECK_AFTER_S
        if not self._everyone_beats():
            return None
        ranks = list(self.beat_keys)
        for rank, beat in zip(ranks, self.store.multi_get([self.beat_keys[r] for r in ranks])):
            reason = self._judge(rank, beat, now)
            if reason is not None and still_needed(rank):
                self._known_lost[rank] = beat
                return reason
        return None

    def _judge(self, rank: int, beat: bytes, now: float) -> str | None:
        if beat == CLOSED:
            return f"rank {rank} closed its checkpointer without taking part in this checkpoint"
        if rank in self._known_lost:
            if self._known_lost[rank] == beat:
                return f"rank {rank} stopped responding earlier and has not beaten since; it died or hangs"
            self._known_lost.pop(rank, None)  # it beats again: judge it afresh
        last = self._seen.get(rank)
        if last is None or last[0] != beat:
            self._seen[rank] = (beat, now)
        elif now - last[1] > self.timeout_s:
            return (f"rank {rank} stopped responding: no heartbeat for {now - last[1]:.1f}s (peer_timeout_s="
                    f"{self.timeout_s:g}); it died or hangs")
        return None
