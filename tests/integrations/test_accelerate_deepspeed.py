"""``LazyCheckpointHook`` under Accelerate's DeepSpeed plugin (ZeRO-2 on 2 processes, ZeRO-3 on 1): a hard crash,
then ``hook.resume()`` from an epoch's end, ends bit for bit where the uninterrupted run ends (weights, fp32
partitions, optimizer state, RNG). From a mid-epoch checkpoint it does not yet (a known defect, marked xfail)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from helpers.accelerate_deepspeed_run import scenario  # noqa: E402
from helpers.deepspeed_run import CRASH_EXIT_CODE  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402


MID_EPOCH = pytest.mark.xfail(strict=True, reason="known defect: a resume from a mid-epoch checkpoint under "
                               "DeepSpeed does not continue bit for bit (the weights differ after the rest of the "
                               "run); epoch-boundary resumes do")


@pytest.mark.parametrize("crash", ["crash-at-epoch-end", pytest.param("crash-mid-epoch", marks=MID_EPOCH)])
@pytest.mark.parametrize(("stage", "world_size"), [(2, 2), (3, 1)])
def test_a_crash_then_resume_ends_where_the_uninterrupted_run_ends(tmp_path, stage, world_size, crash):
    run_ranks(scenario, world_size, stage, str(tmp_path / "reference"), str(tmp_path), "full")
    codes = run_ranks(scenario, world_size, stage, str(tmp_path / "run"), str(tmp_path), crash, meet_at_end=False)
    assert set(codes.values()) == {CRASH_EXIT_CODE}
    run_ranks(scenario, world_size, stage, str(tmp_path / "run"), str(tmp_path), "resume")
    for rank in range(world_size):
        expected = torch.load(tmp_path / f"final-full-{rank}.pt")
        actual = torch.load(tmp_path / f"final-resume-{rank}.pt")
        assert expected.keys() == actual.keys()
        for key, tensor in expected.items():
            assert torch.equal(actual[key], tensor), f"rank {rank}: {key}"
