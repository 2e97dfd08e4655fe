"""DeepSpeed ZeRO 1, 2 and 3 with lazy checkpoints (``use_lazy_checkpoints``), in 1 and 2 gloo processes on CPU:
resume bit-exact, the checkpoint holds the state of its step although training went on, a crash before the commit
leaves the previous checkpoint ``latest``, a crash after it resumes from the new one."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("deepspeed")

from helpers.deepspeed_run import CRASH_EXIT_CODE, scenario  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402


def _run(world_size, stage, dirpath, out, plan, crash=False):
    codes = run_ranks(scenario, world_size, stage, str(dirpath), str(out), plan, meet_at_end=not crash)
    assert set(codes.values()) == ({CRASH_EXIT_CODE} if crash else {0}), codes


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_is_bit_exact_and_the_checkpoint_is_the_state_of_its_step(tmp_path, stage, world_size):
    _run(world_size, stage, tmp_path / "ckpt", tmp_path, "first")
    assert os.readlink(tmp_path / "ckpt" / "global_step4") == "step-0000004"
    _run(world_size, stage, tmp_path / "ckpt", tmp_path, "resume")


@pytest.mark.parametrize("stage", [2, 3])
def test_a_crash_before_the_commit_leaves_the_previous_checkpoint_latest(tmp_path, stage):
    _run(2, stage, tmp_path / "ckpt", tmp_path, "crash-before-commit", crash=True)
    assert not (tmp_path / "ckpt" / "step-0000004").exists()
    _run(2, stage, tmp_path / "ckpt", tmp_path, "resume-2")


@pytest.mark.parametrize("stage", [1, 3])
def test_a_crash_after_the_commit_resumes_from_it_though_latest_had_not_moved(tmp_path, stage):
    _run(2, stage, tmp_path / "ckpt", tmp_path, "crash-after-commit", crash=True)
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    _run(2, stage, tmp_path / "ckpt", tmp_path, "resume-4")
