"""A rank that dies (SIGKILL) or closes its checkpointer while the others wait for it: they give the checkpoint up
after ``peer_timeout_s`` (or at once for a closed peer), with an error naming the rank, not after
``commit_timeout_s``; ``close()`` returns instead of draining for ``commit_timeout_s``.
"""

from __future__ import annotations

import datetime
import json
import os
import signal

import pytest
import torch

import lazyckpt
from helpers.distributed import run_ranks
from lazyckpt.format.catalog import committed_steps

COMMIT_TIMEOUT_S = 120.0  # what the survivor would wait without liveness: far beyond what the test allows


def _train(rank, world_size, dirpath, out, how):
    ckpt = lazyckpt.LazyCheckpointer(dirpath, commit_timeout_s=COMMIT_TIMEOUT_S, peer_timeout_s=1.0)
    ckpt.save({"w": torch.ones(4), "rank": lazyckpt.PerRank(rank)}, step=1).wait()
    if rank == 1:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.close()  # leaves the job without taking part in step 2
        return
    heard = []
    ckpt.save({"w": torch.ones(4), "rank": lazyckpt.PerRank(rank)}, step=2)
    try:
        ckpt.close()  # drains step 2, which waits for rank 1
    except lazyckpt.CommitAbandoned as e:
        heard.append(str(e))
    with open(out, "w") as f:
        json.dump(heard, f)


@pytest.mark.parametrize("how", ["killed", "closed"])
def test_a_lost_peer_ends_the_wait_long_before_commit_timeout(tmp_path, how):
    dirpath, out = str(tmp_path / "ckpt"), str(tmp_path / "heard.json")
    codes = run_ranks(_train, 2, dirpath, out, how, meet_at_end=False, timeout=COMMIT_TIMEOUT_S / 2)
    assert codes[1] == (-signal.SIGKILL if how == "killed" else 0)
    heard = json.load(open(out))
    assert len(heard) == 1, "rank 0's close() reports that step 2 was given up"
    expected = "rank 1 stopped responding" if how == "killed" else "rank 1 closed its checkpointer"
    assert expected in heard[0]
    assert sorted(committed_steps(dirpath)) == [1]


def _slow_peer(rank, world_size, dirpath, out):
    from lazyckpt.ranks.group import default_store

    ckpt = lazyckpt.LazyCheckpointer(dirpath, commit_timeout_s=COMMIT_TIMEOUT_S, peer_timeout_s=1.0)
    heard = []
    for step in (1, 2):
        if rank == 1 and step == 2:  # a live rank, slow to save, its store client blocked meanwhile (NCCL set-up,
            try:                     # a user's own wait): several peer_timeout_s long
                default_store().wait(["never-set"], datetime.timedelta(seconds=4))
            except RuntimeError:
                pass
        try:
            ckpt.save({"w": torch.ones(4), "rank": lazyckpt.PerRank(rank)}, step=step).wait()
        except lazyckpt.CommitAbandoned as e:
            heard.append(str(e))
    ckpt.close()
    with open(out.format(rank=rank), "w") as f:
        json.dump(heard, f)


def test_a_live_peer_slow_to_save_with_its_store_client_blocked_is_not_taken_as_dead(tmp_path):
    dirpath, out = str(tmp_path / "ckpt"), str(tmp_path / "heard-{rank}.json")
    run_ranks(_slow_peer, 2, dirpath, out)
    assert [json.load(open(out.format(rank=r))) for r in range(2)] == [[], []]
    assert sorted(committed_steps(dirpath)) == [1, 2]
