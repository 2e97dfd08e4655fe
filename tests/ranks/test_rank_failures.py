"""One rank fails a checkpoint the others take: every rank gives that step up at once, and every later checkpoint
commits with every rank's files (the ranks pair their attempts by step, never by a local count of saves).

Each rank hears of the failure at a different call: the rank whose state is refused at ``save()`` itself, the
others when their commit finds the failure mark; a rank whose tensor write fails hears of it at the next ``save()``,
which still takes its own request, so the ranks stay in step.
"""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest
import torch

import lazyckpt
from helpers.distributed import run_ranks
from lazyckpt.storage import LocalStorage

STEPS, BAD_STEP, BAD_RANK = 6, 4, 1


class _FailsOneStep(LocalStorage):
    """Writes of the bad step's tensor file wait until ``release`` is set, then fail with EIO: the failure comes
    after the barrier passed, so the rank hears of it at its next ``save()``."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.release, self.doomed = step, threading.Event(), None

    def open_write(self, path):
        handle = super().open_write(path)
        if f"step-{self.step:07d}" in path:
            self.doomed = handle
        return handle

    def write(self, handle, offset, buffers):
        if handle is self.doomed:
            self.release.wait(60)
            raise OSError(errno.EIO, "Input/output error (injected)")
        super().write(handle, offset, buffers)


def _train(rank, world_size, dirpath, out, fault):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    storage = _FailsOneStep(BAD_STEP) if fault == "eio" and rank == BAD_RANK else None
    errors = []
    ckpt = lazyckpt.LazyCheckpointer(dirpath, storage=storage, commit_timeout_s=30.0)
    for step in range(1, STEPS + 1):
        model(torch.randn(4, 8)).square().mean().backward()
        _record(errors, "barrier", step, ckpt.wait_staged)
        opt.step()
        opt.zero_grad()
        state = {"model": model.state_dict(), "rank": lazyckpt.PerRank(rank), "step": step}
        if fault == "refused" and rank == BAD_RANK and step == BAD_STEP:
            state["loader"] = lazyckpt.PerRank({"sampler": object()})  # no safe encoding: refused at save()
        if storage is not None and step == BAD_STEP + 1:
            storage.release.set()  # the bad step's write fails now, while save() drains it
        _record(errors, "save", step, lambda: ckpt.save(state, step=step, optimizers=[opt]))
    _record(errors, "close", STEPS, ckpt.close)
    with open(out.format(rank=rank), "w") as f:
        json.dump(errors, f)


def _record(errors, call, step, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test checks which call raised what
        errors.append([call, step, type(e).__name__])


@pytest.mark.parametrize("fault", ["refused", "eio"])
def test_one_rank_failing_a_step_gives_it_up_everywhere_and_later_steps_commit_with_every_rank(tmp_path, fault):
    dirpath, out = str(tmp_path / "ckpt"), str(tmp_path / "errors-{rank}.json")
    run_ranks(_train, 2, dirpath, out, fault)
    committed = lazyckpt.format.catalog.committed_steps(dirpath)
    assert sorted(committed) == [s for s in range(1, STEPS + 1) if s != BAD_STEP]
    for step, path in committed.items():
        lazyckpt.verify(path)  # every rank's files are there and intact
        for rank in range(2):
            state = lazyckpt.load(path, rank=rank)
            assert (state["step"], state["rank"]) == (step, rank)
    errors = {rank: json.load(open(out.format(rank=rank))) for rank in range(2)}
    bad = errors[BAD_RANK]
    if fault == "refused":
        assert bad == [["save", BAD_STEP, "UnsupportedValueError"]]
    else:
        assert bad == [["save", BAD_STEP + 1, "OSError"]], "heard at the next save(), which took its own request"
    other = errors[1 - BAD_RANK]
    assert len(other) == 1 and other[0][2] == "CommitAbandoned", "the other rank gave the step up, no timeout"
    assert not any(name.endswith(".partial") for name in os.listdir(dirpath))
