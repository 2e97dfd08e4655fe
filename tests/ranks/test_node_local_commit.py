"""One directory per rank (node-local disks): a step is committed in every directory or in none, and every rank hears
why. The leader of one directory fails its part of the commit (the manifest write, or the rename) through the
``storage=`` seam; the other directory's leader must not leave the step committed there.
"""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

import lazyckpt
from helpers.distributed import run_ranks
from lazyckpt.format.catalog import committed_steps
from lazyckpt.storage import LocalStorage

STEPS, BAD_STEP, BAD_RANK = 3, 2, 1


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


def _train(rank, world_size, root, out, where):
    storage = _FailsCommit(where) if rank == BAD_RANK else None
    outcomes = []
    with lazyckpt.LazyCheckpointer(os.path.join(root, f"node{rank}"), storage=storage, commit_timeout_s=60.0) as ckpt:
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
