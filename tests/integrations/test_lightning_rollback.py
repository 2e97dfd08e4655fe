"""LazyCheckpoint(rollback_on_nonfinite=True): a nan step is undone and training ends bit-equal to a run that
never saw the lost batches (AdamW step counts and the step-wise scheduler restored with the weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger

import lazyckpt
from helpers.rollback_run import NanAtModel, final_state, fit, fp16_plugin
from conftest import assert_tree_equal

HERE = os.path.dirname(os.path.abspath(__file__))


class Recorder(Logger):
    """Keeps every logged metric."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []

    name, version = "recorder", 0

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def rollbacks_logged(recorder: Recorder) -> list[tuple[int, float]]:
    return [(step, m["lazyckpt/rollbacks"]) for step, m in recorder.metrics if "lazyckpt/rollbacks" in m]


def committed(dirpath) -> list[int]:
    return sorted(lazyckpt.checkpoint_step(os.path.join(dirpath, d)) for d in os.listdir(dirpath)
                  if d.startswith("step-") and not d.endswith(".partial"))


@pytest.mark.parametrize("bad, restored, lost, keep_in_memory", [
    (5, 3, (4, 5), True),         # between two checkpoints
    (6, 3, (4, 5, 6), True),      # at a checkpoint step: its snapshot is never taken
    (5, 3, (4, 5), False),        # no memory level: the newest disk checkpoint is the target
    (2, 0, (1, 2), True),         # before the first snapshot: the state at the start of training
])
def test_nan_step_is_rolled_back_to_the_state_of_a_run_without_the_lost_batches(tmp_path, bad, restored, lost,
                                                                              keep_in_memory):
    recorder = Recorder()
    with pytest.warns(RuntimeWarning, match=f"non-finite at step {bad}; rolled back to the snapshot of step "
                                            f"{restored}"):
        trainer = fit(tmp_path / "run", bad=[bad], callback_kwargs={"keep_in_memory": keep_in_memory},
                      trainer_kwargs={"logger": recorder})
    reference = fit(tmp_path / "ref", skip=lost, rollback=False)
    assert_tree_equal(final_state(trainer), final_state(reference))
    assert trainer.global_step == 12 and reference.global_step == 12 - len(lost)  # the loop kept counting
    assert rollbacks_logged(recorder) == [(bad, 1.0)]
    assert committed(tmp_path / "run") == ([3, 6, 9, 12] if bad != 6 else [3, 9, 12])


def test_more_rollbacks_in_a_row_than_max_rollbacks_raise(tmp_path):
    with pytest.warns(RuntimeWarning, match="rolled back"), \
            pytest.raises(lazyckpt.RollbackLimitError, match=r"step 5: 2 rollbacks in a row to step 3"):
        fit(tmp_path / "run", bad=[4, 5], callback_kwargs={"max_rollbacks": 1})


def test_gradient_accumulation_rolls_back_the_whole_window_under_bf16(tmp_path):
    # 12 micro-batches, 2 per step: batch 5 is in the window of step 3, the first checkpoint is step 3.
    kwargs = {"accumulate_grad_batches": 2, "precision": "bf16-mixed"}
    with pytest.warns(RuntimeWarning, match="non-finite at step 3; rolled back to the snapshot of step 0"):
        trainer = fit(tmp_path / "run", bad=[5], trainer_kwargs=kwargs)
    reference = fit(tmp_path / "ref", skip=(1, 2, 3, 4, 5, 6), rollback=False, trainer_kwargs=kwargs)
    assert_tree_equal(final_state(trainer), final_state(reference))


def test_the_amp_grad_scaler_is_restored_with_fp16(tmp_path):
    with pytest.warns(RuntimeWarning, match="non-finite at step 5; rolled back to the snapshot of step 3"):
        trainer = fit(tmp_path / "run", bad=[5], trainer_kwargs={"plugins": [fp16_plugin()]})
    reference = fit(tmp_path / "ref", skip=(4, 5), rollback=False, trainer_kwargs={"plugins": [fp16_plugin()]})
    assert trainer.precision_plugin.scaler.state_dict() == reference.precision_plugin.scaler.state_dict()
    assert_tree_equal(final_state(trainer), final_state(reference))


class ManualNanAtModel(NanAtModel):
    """The same run under manual optimization: ``training_step`` returns the loss it passed to manual_backward."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt, sched = self.optimizers(), self.lr_schedulers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        return loss


def test_manual_optimization_rolls_back_on_the_loss_training_step_returns(tmp_path):
    with pytest.warns(RuntimeWarning, match="non-finite at step 5; rolled back to the snapshot of step 3"):
        trainer = fit(tmp_path / "run", bad=[5], module=ManualNanAtModel)
    reference = fit(tmp_path / "ref", skip=(4, 5), rollback=False, module=ManualNanAtModel)
    assert_tree_equal(final_state(trainer), final_state(reference))
    assert trainer.global_step == 12 and reference.global_step == 10


def test_rollback_needs_the_full_training_state():
    from lazyckpt.integrations.lightning import LazyCheckpoint

    with pytest.raises(ValueError, match="rollback_on_nonfinite=True needs save_weights_only=False"):
        LazyCheckpoint(rollback_on_nonfinite=True, save_weights_only=True)
    with pytest.raises(ValueError, match="max_rollbacks=1.5 must be a non-negative int"):
        LazyCheckpoint(rollback_on_nonfinite=True, max_rollbacks=1.5)


def _script(tmp_path, name: str, *args) -> None:
    cmd = [sys.executable, os.path.join(HERE, "..", "helpers", "rollback_run.py"), "--dirpath", str(tmp_path / name),
           "--out", str(tmp_path / name), *map(str, args)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_ddp_rolls_back_every_rank_when_only_rank_1_sees_a_nan(tmp_path):
    _script(tmp_path, "run", "--bad", 5, "--bad-rank", 1)
    _script(tmp_path, "ref", "--skip", 4, 5, "--reference")
    for rank in (0, 1):
        run = torch.load(tmp_path / f"run.rank{rank}", weights_only=True)
        ref = torch.load(tmp_path / f"ref.rank{rank}", weights_only=True)
        assert_tree_equal(run, ref)
    assert json.loads((tmp_path / "run.json").read_text()) == {"global_step": 12}
    assert committed(tmp_path / "run") == [3, 6, 9, 12]
