"""The ranks' meeting point in the process group's store: an attempt's keys are deleted once every rank is past it,
and an upload's meeting is keyed by its own attempt."""

from __future__ import annotations

import threading

import pytest
import torch

from helpers.distributed import two_ranks_meeting
from lazyckpt.errors import CommitAbandoned
from lazyckpt.levels.remote.meeting import StoreMeeting, upload_attempt


def _on_both(rank0_part, rank1_part):
    """Run the two ranks' parts of one attempt at once; returns what each raised (or None)."""
    raised = [None, None]

    def run(rank, part):
        try:
            part()
        except BaseException as e:  # noqa: BLE001 - returned to the test
            raised[rank] = e

    threads = [threading.Thread(target=run, args=(r, p)) for r, p in enumerate((rank0_part, rank1_part))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return raised


def _commit(rank0, rank1, attempt):
    """One attempt of the local commit, both ranks sharing a directory (rank 0 leads it)."""
    def leader():
        rank0.agree(attempt, "same")
        rank0.gather(attempt, {})
        rank0.committed(attempt)

    def follower():
        rank1.agree(attempt, "same")
        rank1.gather(attempt, {})
        rank1.wait_committed(attempt)

    assert _on_both(leader, follower) == [None, None]


def test_a_long_run_leaves_no_keys_of_the_attempts_every_rank_is_past(tmp_path):
    rank0, rank1 = two_ranks_meeting(str(tmp_path))
    store = rank0.store
    before = store.num_keys()
    for attempt in range(1, 12):
        _commit(rank0, rank1, attempt)
    rank1.abandon(12, "disk full")  # a failed attempt is forgotten too, once both gave it up
    with pytest.raises(CommitAbandoned):
        rank0.gather(12, {})
    rank0.abandon(12, "gave up")
    assert store.num_keys() == before, "only the keys made at construction stay"
    leftover = [f"{rank0.prefix}/{a}/{kind}/{r}" for a in range(1, 13) for r in range(2)
                for kind in ("plan", "durable", "committed", "done")]
    assert not any(store.check([key]) for key in leftover + [f"{rank0.prefix}/12/failed"])


def test_keys_stay_until_the_last_rank_is_past_the_attempt(tmp_path):
    rank0, rank1 = two_ranks_meeting(str(tmp_path))
    rank0.announce(1)
    rank1.announce(1)
    rank0.committed(1)  # rank 1 has not yet seen the commit: it still needs the key
    assert rank1.store.check([f"{rank0.prefix}/1/committed/0"])
    rank1.wait_committed(1)
    assert not rank1.store.check([f"{rank0.prefix}/1/committed/0"])


class _StoreWithoutDeletion:
    """A store that cannot delete keys (as some store backends cannot)."""

    def __init__(self):
        self.inner = torch.distributed.HashStore()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def delete_key(self, key):
        raise RuntimeError("deleteKey is not implemented by this store (injected)")


def test_a_store_that_cannot_delete_keys_keeps_them_and_the_commit_goes_on(tmp_path):
    rank0, rank1 = two_ranks_meeting(str(tmp_path), store=_StoreWithoutDeletion())
    _commit(rank0, rank1, 1)
    _commit(rank0, rank1, 2)
    assert rank0.store.check([f"{rank0.prefix}/1/durable/1", f"{rank0.prefix}/2/done/0"])


def test_an_upload_announced_by_an_earlier_try_never_lets_rank_0_commit_a_new_one(tmp_path):
    rank0, rank1 = two_ranks_meeting(str(tmp_path))
    writes = []
    meeting = StoreMeeting(rank0, rank=0, timeout_s=0.5)
    rank1.announce(upload_attempt(2, retry=False))  # rank 1's first try of step 2's upload was durable; it failed
    with pytest.raises(TimeoutError, match="remote_timeout_s"):
        meeting.commit(upload_attempt(2, retry=True), "memory://bucket/run/step-0000002", "", lambda: writes.append(1))
    StoreMeeting(rank1, rank=1, timeout_s=0.5).give_up(upload_attempt(3, retry=False), ConnectionError("lost"))
    with pytest.raises(CommitAbandoned, match=r"rank 1: upload failed: ConnectionError\('lost'\)"):
        meeting.commit(upload_attempt(3, retry=False), "memory://bucket/run/step-0000003", "", lambda: writes.append(1))
    assert writes == [], "rank 0 never wrote a commit object"


def test_rank_0_commits_an_upload_once_every_rank_announced_it(tmp_path):
    rank0, rank1 = two_ranks_meeting(str(tmp_path))
    writes = []
    attempt = upload_attempt(1, retry=False)
    raised = _on_both(
        lambda: writes.append(StoreMeeting(rank0, rank=0, timeout_s=30).commit(attempt, "u", "", lambda: 7)),
        lambda: writes.append(StoreMeeting(rank1, rank=1, timeout_s=30).commit(attempt, "u", "", lambda: 1 / 0)))
    assert raised == [None, None] and sorted(writes) == [0, 7], "rank 0 wrote the commit object, rank 1 waited"
    assert not rank0.store.check([f"{rank0.prefix}/{attempt}/durable/0"]), "forgotten once both are past it"


def test_the_commit_check_refuses_an_attempt_whose_ranks_published_different_plans(tmp_path):
    rank0, rank1 = two_ranks_meeting(str(tmp_path))
    for rendezvous, signature in ((rank0, b"a"), (rank1, b"b")):
        rendezvous.store.set(f"{rendezvous.prefix}/1/plan/{rendezvous.rank}", signature)
    with pytest.raises(ValueError, match=r"on rank 0 differs from rank\(s\) \[1\]"):
        rank0.check_plans(1)
    rank1.store.set(f"{rank1.prefix}/2/plan/0", b"a")
    rank1.store.set(f"{rank1.prefix}/2/plan/1", b"a")
    rank1.check_plans(2)
