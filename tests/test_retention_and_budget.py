"""keep_last_k retention, and a staging budget smaller than one checkpoint."""

from __future__ import annotations

import os

import torch

import lazyckpt
from conftest import assert_tree_equal, clone_tree
from lazyckpt.retention import steps_to_purge


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
    with lazyckpt.LazyCheckpointer(tmp_path, host_buffer_bytes=2 << 20) as ckpt:
        pending = ckpt.save(state, step=1, optimizers=[opt])
        ckpt.wait_staged()
        assert ckpt._copier.pool.nbytes == 2 << 20, "the pool must stay at the budget"
        assert_tree_equal(lazyckpt.load(pending.wait()), expected)
