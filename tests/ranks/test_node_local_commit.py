"""One directory per rank (node-local disks): a step is committed in every directory or in none, and every rank hears
why. The leader of one directory fails its part of the commit (the manifest write, or the rename) through the
``storage=`` seam; the other directory's leader must not leave the step committed there.
"""

from __future__ import annotations

import errno
import json
import os
import time

import pytest
import torch

import lazyckpt
from helpers.distributed import run_ranks
from lazyckpt.format.catalog import committed_steps
from lazyckpt.storage import LocalStorage

STEPS, BAD_STEP, BAD_RANK = 3, 2, 1
COMMIT_TIMEOUT_S = 5.0


class _FailsCommit(LocalStorage):
    """EIO on the bad step's ``manifest.json`` write or on its rename into place."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def write_atomic(self, path, data, *, sync=True):
        if self.where == "manifest" and path.endswith(f"step-{BAD_STEP:07d}.partial/manifest.json"):
            raise OSError(errno.EIO, "Input/output error (injected)")
        super().write_atomic(path, data, sync=sync)

    def rename(self, src, dst, *, sync=True):
        if self.where == "rename" and dst.endswith(f"step-{BAD_STEP:07d}"):
            raise OSError(errno.EIO, "Input/output error (injected)")
        super().rename(src, dst, sync=sync)


class _RenamesLate(LocalStorage):
    """Holds the bad step's rename back until the other node's leader has renamed it and then given it up (it ran
    out of ``commit_timeout_s`` waiting for this rename): the step then exists in neither directory."""

    def __init__(self, other_dir: str) -> None:
        super().__init__()
        self.other = os.path.join(other_dir, f"step-{BAD_STEP:07d}")

    def rename(self, src, dst, *, sync=True):
        if dst.endswith(f"step-{BAD_STEP:07d}"):
            _wait_for(lambda: os.path.exists(self.other))
            _wait_for(lambda: not os.path.exists(self.other))
        super().rename(src, dst, sync=sync)


def _wait_for(condition) -> None:
    deadline = time.monotonic() + 60
    while not condition():  # another process's progress, seen through its directory
        assert time.monotonic() < deadline
        time.sleep(0.01)


def node_of(rank: int, world_size: int) -> int:
    """Two ranks: a node each. Three: ranks 0 and 1 share node 0 (rank 1 is no leader), rank 2 has node 1."""
    return rank if world_size == 2 else int(rank == 2)


def _train(rank, world_size, root, out, where):
    bad = rank == world_size - 1  # the leader of the last node
    if where == "late rename":
        storage = _RenamesLate(os.path.join(root, "node0")) if bad else None
    else:
        storage = _FailsCommit(where) if bad else None
    timeout = COMMIT_TIMEOUT_S if where == "late rename" else 60.0
    outcomes = []
    dirpath = os.path.join(root, f"node{node_of(rank, world_size)}")
    with lazyckpt.LazyCheckpointer(dirpath, storage=storage, commit_timeout_s=timeout) as ckpt:
        for step in range(1, STEPS + 1):
            state = {"w": lazyckpt.PerRank(torch.full((4,), float(step + 10 * rank)))}  # node-local: nothing shared
            pending = ckpt.save(state, step=step)
            try:
                pending.wait()
                outcomes.append([step, "committed"])
            except Exception as e:  # noqa: BLE001 - the test checks what each rank heard
                outcomes.append([step, type(e).__name__])
    with open(out.format(rank=rank), "w") as f:
        json.dump(outcomes, f)


@pytest.mark.parametrize("where", ["manifest", "rename"])
def test_a_leader_failing_its_commit_leaves_the_step_committed_nowhere(tmp_path, where):
    root, out = str(tmp_path), str(tmp_path / "outcomes-{rank}.json")
    run_ranks(_train, 2, root, out, where)
    for rank in range(2):
        node = os.path.join(root, f"node{rank}")
        assert sorted(committed_steps(node)) == [1, 3], f"node {rank}: the failed step must be committed nowhere"
        assert not [n for n in os.listdir(node) if n.endswith(".partial")]
        assert lazyckpt.load(lazyckpt.latest(node), rank=rank)["w"].tolist() == [3.0 + 10 * rank] * 4
    heard = {rank: json.load(open(out.format(rank=rank))) for rank in range(2)}
    assert heard[BAD_RANK] == [[1, "committed"], [2, "OSError"], [3, "committed"]]
    assert heard[1 - BAD_RANK] == [[1, "committed"], [2, "CommitAbandoned"], [3, "committed"]]


def test_a_leader_giving_up_after_its_rename_takes_the_step_back_everywhere(tmp_path):
    # Node 0's leader renames step 2, waits for node 1's rename, runs out of commit_timeout_s and gives the step up;
    # node 1's rename comes only then. Both leaders act on one decision: neither keeps step 2.
    root, out = str(tmp_path), str(tmp_path / "outcomes-{rank}.json")
    run_ranks(_train, 2, root, out, "late rename")
    for rank in range(2):
        assert sorted(committed_steps(os.path.join(root, f"node{rank}"))) == [1, 3], f"node {rank}"
    heard = {rank: json.load(open(out.format(rank=rank))) for rank in range(2)}
    assert heard[0] == [[1, "committed"], [2, "TimeoutError"], [3, "committed"]]
    assert heard[1] == [[1, "committed"], [2, "CommitAbandoned"], [3, "committed"]]


def test_a_rank_that_leads_no_directory_hears_the_other_nodes_failure_too(tmp_path):
    root, out = str(tmp_path), str(tmp_path / "outcomes-{rank}.json")
    run_ranks(_train, 3, root, out, "manifest")
    for node in range(2):
        assert sorted(committed_steps(os.path.join(root, f"node{node}"))) == [1, 3], f"node {node}"
    heard = {rank: json.load(open(out.format(rank=rank))) for rank in range(3)}
    assert heard[2] == [[1, "committed"], [2, "OSError"], [3, "committed"]]
    for rank in (0, 1):  # node 0's leader, and rank 1, which only waits for it
        assert heard[rank] == [[1, "committed"], [2, "CommitAbandoned"], [3, "committed"]], rank
