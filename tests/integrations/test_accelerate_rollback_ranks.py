"""hook.rollback() with two Accelerate processes (gloo): a nan on one process rolls both back to the same step."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.distributed import run_ranks
from conftest import assert_tree_equal

EVERY = 3


def _train(rank: int, world_size: int, dirpath: str, out: str, bad: int, skipped: tuple[int, ...]) -> None:
    """Each process trains on its own batches; the one of ``bad`` on rank 1 only is nan."""
    from accelerate import Accelerator

    from lazyckpt import LazyCheckpointHook

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))  # the group exists already: Accelerate joins it
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world_size
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    hook = LazyCheckpointHook(dirpath, every_n_steps=EVERY, keep_in_memory=True).register(accelerator)
    gen = torch.Generator().manual_seed(10 + rank)
    batches = [torch.randn(8, 6, generator=gen) for _ in range(12)]
    restored = []
    for i, x in enumerate((x for i, x in enumerate(batches, start=1) if i not in skipped), start=1):
        loss = model(x).pow(2).mean() * (float("nan") if (i == bad and rank == 1) else 1.0)
        if accelerator.reduce(torch.isfinite(loss).logical_not().float(), "sum") > 0:
            restored.append(hook.rollback())
            continue
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    hook.close()
    state = {"model": accelerator.unwrap_model(model).state_dict(), "opt": opt.state_dict(),
             "sched": sched.state_dict()}
    torch.save({"state": state, "restored": restored}, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow
def test_a_nan_on_one_process_rolls_every_process_back_to_the_same_step(tmp_path):
    for name, bad, skipped in (("run", 5, ()), ("ref", 0, (4, 5))):
        os.makedirs(tmp_path / name)
        run_ranks(_train, 2, str(tmp_path / name / "ckpt"), str(tmp_path / name), bad, skipped)
    runs = {(name, rank): torch.load(tmp_path / name / f"rank{rank}.pt", weights_only=False)
            for name in ("run", "ref") for rank in (0, 1)}
    assert [runs["run", rank]["restored"] for rank in (0, 1)] == [[3], [3]]
    for rank in (0, 1):
        assert_tree_equal(runs["run", rank]["state"], runs["ref", rank]["state"])
    assert_tree_equal(runs["run", 0]["state"]["model"], runs["run", 1]["state"]["model"])
