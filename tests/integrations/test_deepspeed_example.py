"""``examples/deepspeed_train.py --demo``: 2 processes under ZeRO-3 with gradient accumulation and an LR scheduler
train, crash on purpose, resume from ``latest`` and end bit for bit where the uninterrupted run ends. Also the
refusals and the loss scaler's round trip through the safe encoding."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from lazyckpt.integrations._deepspeed_files import decode_objects, encode_objects  # noqa: E402
from lazyckpt.integrations.deepspeed import use_lazy_checkpoints  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_crashes_resumes_and_matches_the_uninterrupted_run(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "deepspeed_train.py"), "--demo", "--stage", "3"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "resumed from" in result.stdout and "bit for bit: True" in result.stdout, result.stdout


def test_the_loss_scaler_round_trips_through_plain_data():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    dynamic = DynamicLossScaler.__new__(DynamicLossScaler)
    dynamic.__dict__.update(cur_scale=2.0 ** 12, cur_iter=7, dtype=torch.float16, last_overflow_iter=3)
    state = {"optimizer_state_dict": {"loss_scaler": dynamic, "other": [LossScaler(scale=4)]}}
    import lazyckpt

    lazyckpt.check_storable(encode_objects(state))  # plain data only: lazyckpt's encoding takes it
    back = decode_objects(encode_objects(state))
    scaler = back["optimizer_state_dict"]["loss_scaler"]
    assert type(scaler) is DynamicLossScaler and vars(scaler) == vars(dynamic)
    assert type(back["optimizer_state_dict"]["other"][0]) is LossScaler
    assert back["optimizer_state_dict"]["other"][0].cur_scale == 4


def test_use_lazy_checkpoints_names_what_it_was_given():
    with pytest.raises(TypeError, match="needs the DeepSpeedEngine deepspeed.initialize returns; got Linear"):
        use_lazy_checkpoints(torch.nn.Linear(2, 2))
