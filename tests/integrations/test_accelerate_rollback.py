"""LazyCheckpointHook.rollback(): the documented two-line pattern ends bit-equal to a run without the lost batches."""

from __future__ import annotations

import os

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from conftest import assert_tree_equal

import lazyckpt
from lazyckpt import LazyCheckpointHook


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def batches(n: int = 12) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(8, 6, generator=gen) for _ in range(n)]


def train(dirpath, data, *, bad=(), check_after_step=False, **hook_options):
    """Returns the final state and what each rollback() returned."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    hook = LazyCheckpointHook(dirpath, every_n_steps=3, **hook_options).register(accelerator)
    restored = []
    for i, x in enumerate(data, start=1):
        loss = model(x).pow(2).mean() * (float("nan") if i in bad else 1.0)
        if not check_after_step and not torch.isfinite(loss):
            restored.append(hook.rollback())
            continue
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        if check_after_step and not torch.isfinite(loss):
            restored.append(hook.rollback())
    hook.close()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, restored


@pytest.mark.parametrize("check_after_step, bad, lost", [(False, 5, (4, 5)), (True, 6, (4, 5, 6))])
@pytest.mark.parametrize("keep_in_memory", [True, False])
def test_rollback_restores_the_newest_snapshot_before_the_bad_update(tmp_path, check_after_step, bad, lost,
                                                                     keep_in_memory):
    data = batches()
    final, restored = train(tmp_path / "run", data, bad={bad}, check_after_step=check_after_step,
                            keep_in_memory=keep_in_memory)
    assert restored == [3]
    kept = [x for i, x in enumerate(data, start=1) if i not in lost]
    reference, _ = train(tmp_path / "ref", kept)
    assert_tree_equal(final, reference)
    steps = sorted(lazyckpt.checkpoint_step(tmp_path / "run" / d) for d in os.listdir(tmp_path / "run")
                   if d.startswith("step-"))
    assert steps == ([3, 6, 9] if not check_after_step else [3, 9, 12])  # the loop's step counter keeps counting


def test_rollback_before_any_snapshot_uses_the_start_with_keep_in_memory_and_none_without(tmp_path):
    data = batches(6)
    final, restored = train(tmp_path / "mem", data, bad={2}, keep_in_memory=True)
    assert restored == [0]
    reference, _ = train(tmp_path / "ref", data[2:])
    assert_tree_equal(final, reference)
    _, restored = train(tmp_path / "disk", data, bad={2})
    assert restored == [None]


def test_repeated_rollbacks_to_the_same_step_stop_the_run(tmp_path):
    with pytest.raises(lazyckpt.RollbackLimitError, match="max_rollbacks=1"):
        train(tmp_path / "run", batches(), bad={4, 5}, keep_in_memory=True, max_rollbacks=1)
