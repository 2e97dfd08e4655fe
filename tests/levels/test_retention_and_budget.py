"""keep_last_k retention, and a staging budget smaller than one checkpoint."""

from __future__ import annotations

import os

import pytest
import torch

import lazyckpt
from conftest import assert_tree_equal, clone_tree
from lazyckpt.levels.retention import steps_to_purge


def test_keep_last_k_keeps_the_newest_and_never_the_only_commit(tmp_path):
    with lazyckpt.LazyCheckpointer(tmp_path, keep_last_k=2) as ckpt:
        for step in range(1, 5):
            ckpt.save({"x": torch.tensor(step)}, step=step).wait()
            kept = sorted(n for n in os.listdir(tmp_path) if n.startswith("step-"))
            assert kept == [f"step-{s:07d}" for s in range(max(1, step - 1), step + 1)]
    assert steps_to_purge([7], 1, just_committed=7) == []
    assert steps_to_purge([1, 2, 3], 1, just_committed=3) == [2, 1]


def test_a_failed_save_never_triggers_a_purge(tmp_path):
    from conftest import FailingStorage

    storage = FailingStorage()
    with lazyckpt.LazyCheckpointer(tmp_path, keep_last_k=1, storage=storage) as ckpt:
        first = ckpt.save({"x": torch.ones(10)}, step=1).wait()
        storage.fail = True
        try:
            ckpt.save({"x": torch.ones(10)}, step=2).wait()
        except OSError:
            pass
    assert lazyckpt.latest(tmp_path) == first


def test_a_budget_smaller_than_one_checkpoint_still_works(tmp_path):
    model = torch.nn.Linear(1024, 1500)  # ~6 MB of parameters + ~12 MB of AdamW state
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    expected = clone_tree(state)
    with lazyckpt.LazyCheckpointer(tmp_path, host_buffer_bytes=8 << 20) as ckpt:
        pending = ckpt.save(state, step=1, optimizers=[opt])
        ckpt.wait_staged()
        assert ckpt._copier.pool.nbytes == 8 << 20, "the pool must stay at the budget"
        assert_tree_equal(lazyckpt.load(pending.wait()), expected)


def test_remove_deletes_a_committed_step_and_refuses_the_one_in_flight(tmp_path):
    from conftest import GatedBackend

    backend = GatedBackend()
    with lazyckpt.LazyCheckpointer(tmp_path, backend=backend) as ckpt:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(4))], lr=0.1)
        backend.gate.set()
        ckpt.save({"x": torch.ones(3)}, step=1).wait()
        backend.gate.clear()
        ckpt.save({"p": opt.param_groups[0]["params"][0]}, step=2, optimizers=[opt])
        with pytest.raises(ValueError, match="still being written"):
            ckpt.remove(2)
        assert ckpt.remove(1) and not ckpt.remove(1)
        backend.gate.set()
    assert lazyckpt.checkpoint_step(lazyckpt.latest(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == [".lock-rank00000", "step-0000002"]


def test_a_checkpoint_without_deferred_leaves_commits_before_the_next_barrier(tmp_path):
    param = torch.nn.Parameter(torch.ones(10))
    opt = torch.optim.SGD([param], lr=0.1)
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        pending = ckpt.save({"p": param}, step=1, optimizers=[opt])
        pending._job.wait_done()  # nobody called wait_staged(): a crash now must still find step 1
        assert lazyckpt.latest(tmp_path) == pending.path
