"""DeepSpeed ZeRO 1, 2 and 3 with lazy checkpoints (``use_lazy_checkpoints``), in 1 and 2 gloo processes on CPU:
resume bit-exact, the checkpoint holds the state of its step although training went on and consolidates in one
process like DeepSpeed's own ``zero_to_fp32``, a crash before the commit
leaves the previous checkpoint ``latest``, a crash after it resumes from the new one."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("deepspeed")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import lazyckpt  # noqa: E402
from helpers.deepspeed_run import CRASH_EXIT_CODE, edge_cases, gated_barrier, scenario  # noqa: E402
from lazyckpt.integrations.deepspeed import consolidated_state  # noqa: E402
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
    _assert_consolidated_like_deepspeed(tmp_path / "ckpt" / "global_step4", tmp_path / "torch-engine")
    exported = lazyckpt.export(tmp_path / "ckpt" / "global_step4", tmp_path / "model.safetensors",
                               format="safetensors")
    whole = consolidated_state(tmp_path / "ckpt" / "global_step4")["module"]
    assert load_file(exported).keys() == whole.keys()
    assert all(torch.equal(t, whole[name]) for name, t in load_file(exported).items())


def _assert_consolidated_like_deepspeed(lazy_tag, torch_dir):
    """In this one process: the whole weights of the lazy checkpoint are DeepSpeed's own consolidation of the same
    state (``zero_to_fp32`` on the checkpoint its own engine wrote), bit for bit, and every parameter's optimizer
    state is whole too."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    expected = get_fp32_state_dict_from_zero_checkpoint(str(torch_dir), tag="global_step4")
    whole = consolidated_state(lazy_tag)
    assert whole["module"].keys() == expected.keys() and whole["global_steps"] == 4
    for name, tensor in expected.items():
        assert torch.equal(whole["module"][name], tensor), name
        state = whole["optimizer"][name]
        assert state["exp_avg"].shape == state["exp_avg_sq"].shape == tensor.shape, name


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


def test_a_tag_saved_again_names_the_newest_step_and_retention_keeps_it(tmp_path):
    _run(1, 2, tmp_path / "ckpt", tmp_path, "fixed-tag")
    assert os.readlink(tmp_path / "ckpt" / "last") == "step-0000008"
    assert (tmp_path / "ckpt" / "latest").read_text() == "last"
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-0000004", "step-0000006",
                                                                          "step-0000008"]  # keep_last_k=3


@pytest.mark.parametrize("stage", [1, 3])
def test_the_next_update_waits_for_the_copy_at_the_base_optimizers_step(tmp_path, stage):
    run_ranks(gated_barrier, 1, stage, str(tmp_path / "ckpt"))


def test_save_latest_false_a_second_tag_at_one_step_and_save_16bit_model(tmp_path):
    run_ranks(edge_cases, 1, 2, str(tmp_path / "ckpt"), str(tmp_path))


def test_the_host_level_resumes_a_crash_kept_step_with_its_markers_tag_and_latest_in_dirpath(tmp_path):
    from helpers.deepspeed_run import host_scenario

    from lazyckpt.format.catalog import committed_steps
    from lazyckpt.storage.urls import host_dir

    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    codes = run_ranks(host_scenario, 1, 1, str(ckpt), str(tmp_path), str(shm), "host-crash", meet_at_end=False)
    assert codes == {0: CRASH_EXIT_CODE}, codes
    assert sorted(committed_steps(str(ckpt))) == [2] and 4 in committed_steps(host_dir(str(ckpt), str(shm)))
    _run_host = run_ranks(host_scenario, 1, 1, str(ckpt), str(tmp_path), str(shm), "host-resume")
    assert _run_host == {0: 0}
    assert sorted(committed_steps(str(ckpt))) == [2, 4, 6]
    for step in (4, 6):  # DeepSpeed's loader globs its file names next to the manifest: in dirpath
        assert (ckpt / f"step-000000{step}" / "latest").read_text() == "checkpoint"
    assert (ckpt / "latest").read_text() == "global_step6"
    assert not os.path.exists(host_dir(str(ckpt), str(shm))), "a clean close frees the host folder"
