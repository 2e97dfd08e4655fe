"""Several ranks, one commit: a checkpoint becomes visible only when every rank's file is durable."""

from __future__ import annotations

import threading

import torch

import lazyckpt
from conftest import GatedBackend


def test_commit_waits_for_the_slowest_rank_and_each_rank_loads_its_own_state(tmp_path):
    slow = GatedBackend()
    rank0 = lazyckpt.LazyCheckpointer(tmp_path, rank=0, world_size=2)
    rank1 = lazyckpt.LazyCheckpointer(tmp_path, rank=1, world_size=2, backend=slow)
    params = [torch.nn.Parameter(torch.full((100,), float(r))) for r in range(2)]
    opts = [torch.optim.SGD([p], lr=0.1) for p in params]
    p0 = rank0.save({"w": params[0], "rank": 0}, step=1, optimizers=[opts[0]])
    p1 = rank1.save({"w": params[1], "rank": 1}, step=1, optimizers=[opts[1]])
    committed0 = threading.Thread(target=p0.wait)
    committed0.start()
    slow.entered.wait()
    assert lazyckpt.latest(tmp_path) is None, "rank 1 has not written yet: nothing may be visible"
    slow.gate.set()
    assert p1.wait() == p0.path
    committed0.join()
    path = lazyckpt.latest(tmp_path)
    for r in range(2):
        state = lazyckpt.load(path, rank=r)
        assert state["rank"] == r and torch.equal(state["w"], torch.full((100,), float(r)))
    lazyckpt.verify(path)
    rank0.close()
    rank1.close()
