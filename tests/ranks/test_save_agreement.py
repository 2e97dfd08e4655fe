"""Two gloo ranks checking that they save the same tensors: save() meets the other ranks only when this rank's
plan changed since the last one every rank agreed on; the commit checks every rank's plan either way."""

from __future__ import annotations

import threading

import pytest
import torch

import lazyckpt
from helpers.distributed import run_ranks
from lazyckpt.errors import CommitAbandoned
from lazyckpt.ranks.group import default_store

MISMATCH = r"on rank 1 differs from rank\(s\) \[0\] in its tensor keys.*lazyckpt.PerRank"


def _rank1_adds_a_key_after_an_agreed_save(rank, world_size, dirpath):
    # A hang would outlast run_ranks' timeout: the failure must end the wait, not the commit timeout.
    with lazyckpt.LazyCheckpointer(dirpath, commit_timeout_s=3600) as ckpt:
        ckpt.save({"w": torch.ones(4)}, step=1).wait()
        changed = {"w": torch.full((4,), 2.0), **({"extra": torch.zeros(2)} if rank == 1 else {})}
        if rank == 1:  # its plan changed: it meets rank 0 at save() and sees the difference there
            with pytest.raises(ValueError, match=MISMATCH):
                ckpt.save(changed, step=2)
        else:  # unchanged: save() returns at once, and the failure comes with the next call
            pending = ckpt.save(changed, step=2)
            with pytest.raises(CommitAbandoned, match=MISMATCH):
                pending.wait()
        assert lazyckpt.checkpoint_step(lazyckpt.latest(dirpath)) == 1
        ckpt.save({"w": torch.full((4,), 3.0)}, step=3).wait()  # the ranks still count attempts alike
    assert torch.equal(lazyckpt.load(lazyckpt.latest(dirpath))["w"], torch.full((4,), 3.0))


def test_a_rank_whose_keys_change_fails_at_save_and_the_other_rank_at_its_next_call(tmp_path):
    run_ranks(_rank1_adds_a_key_after_an_agreed_save, 2, str(tmp_path / "ckpt"), timeout=120)
    assert lazyckpt.checkpoint_step(lazyckpt.latest(tmp_path / "ckpt")) == 3


class _PlanReads:
    """A store that counts, per thread, the reads of the ranks' plan signatures (it forwards everything)."""

    def __init__(self, store):
        self._store, self.reads = store, {}

    def __getattr__(self, name):
        return getattr(self._store, name)

    def _count(self, keys):
        if any("/plan/" in key for key in keys):
            thread = threading.get_ident()
            self.reads[thread] = self.reads.get(thread, 0) + 1

    def check(self, keys):
        self._count(keys)
        return self._store.check(keys)

    def multi_get(self, keys):
        self._count(keys)
        return self._store.multi_get(keys)

    def get(self, key):
        self._count([key])
        return self._store.get(key)


def _plan_reads_of(ckpt, store, state, step):
    """Reads of plan signatures made by the training thread during one save()."""
    before = store.reads.get(threading.get_ident(), 0)
    pending = ckpt.save(state, step=step)
    reads = store.reads.get(threading.get_ident(), 0) - before
    pending.wait()
    return reads


def _unchanged_plans(rank, world_size, dirpath):
    store = _PlanReads(default_store())
    with lazyckpt.LazyCheckpointer(dirpath, store=store) as ckpt:
        assert _plan_reads_of(ckpt, store, {"w": torch.ones(4)}, 1) > 0, "the first save meets the other rank"
        assert _plan_reads_of(ckpt, store, {"w": torch.full((4,), 2.0)}, 2) == 0, "an unchanged plan does not"
    assert set(store.reads) - {threading.get_ident()}, "the commit threads check every rank's plan"


def test_a_save_whose_plan_is_unchanged_does_not_wait_for_the_other_ranks(tmp_path):
    run_ranks(_unchanged_plans, 2, str(tmp_path / "ckpt"), timeout=120)
    assert torch.equal(lazyckpt.load(lazyckpt.latest(tmp_path / "ckpt"))["w"], torch.full((4,), 2.0))
