"""Crash (a hard ``os._exit`` in a subprocess) and resume: the resumed run equals the uninterrupted one bit for bit.

The crash is placed at the start of the batch right after a checkpoint request. That request cannot be committed
yet (commit follows the barrier before the next optimizer step), and the engine finished the previous checkpoint
before accepting it (``on_busy="wait"``), so the crash always leaves one partial and one committed checkpoint,
without sleeping or polling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import lazyckpt

HELPER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "lightning_run.py")
pytestmark = pytest.mark.slow


def _train(dirpath, *args, out=None, expect_rc=0, timeout=240):
    cmd = [sys.executable, HELPER, "--dirpath", str(dirpath), *map(str, args)]
    if out is not None:
        cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _assert_identical(expected_file, resumed_file, steps_resumed):
    expected = torch.load(expected_file, weights_only=False)
    resumed = torch.load(resumed_file, weights_only=False)
    assert resumed["global_step"] == expected["global_step"]
    assert len(resumed["losses"]) == steps_resumed  # it really resumed, and from where we expect
    assert resumed["losses"] == expected["losses"][-steps_resumed:]
    _assert_same_state(expected, resumed)


def _assert_same_state(expected, resumed):
    """Model and optimizer states equal bit for bit (optimizer state keyed as the run's state dicts key it)."""
    for key, tensor in expected["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), key
    for exp_opt, res_opt in zip(expected["optimizers"], resumed["optimizers"]):
        assert exp_opt["param_groups"] == res_opt["param_groups"]
        for index, per_param in exp_opt["state"].items():
            for name, value in per_param.items():
                assert torch.equal(value, res_opt["state"][index][name]), (index, name)


def _committed(dirpath):
    return sorted(n for n in os.listdir(dirpath) if n.startswith("step-") and not n.endswith(".partial"))


@pytest.mark.parametrize("ns", ["lightning"])  # pytorch_lightning resume: test_lightning_callback.py
def test_crash_and_resume_at_an_epoch_boundary_is_bit_exact(tmp_path, ns):
    _train(tmp_path / "full", "--ns", ns, out=tmp_path / "full.pt")
    crashed = tmp_path / "crashed"
    _train(crashed, "--ns", ns, "--crash-at", 16, expect_rc=17)
    assert _committed(crashed) == ["step-0000008"]  # step 16 was requested, never committed
    _train(crashed, "--ns", ns, "--resume", "last", out=tmp_path / "resumed.pt")
    _assert_identical(tmp_path / "full.pt", tmp_path / "resumed.pt", steps_resumed=16)
    assert _committed(crashed) == ["step-0000008", "step-0000016", "step-0000024"]


def test_mid_epoch_resume_is_bit_exact_with_a_stateful_loader(tmp_path):
    args = ("--every-n-train-steps", 3, "--stateful-loader")
    _train(tmp_path / "full", *args, out=tmp_path / "full.pt")
    crashed = tmp_path / "crashed"
    _train(crashed, *args, "--crash-at", 12, expect_rc=17)
    assert lazyckpt.latest(crashed).endswith("step-0000009")  # mid-epoch: batch 1 of epoch 1
    _train(crashed, *args, "--resume", "last", out=tmp_path / "resumed.pt")
    _assert_identical(tmp_path / "full.pt", tmp_path / "resumed.pt", steps_resumed=15)


def test_ddp_on_cpu_splits_the_replicated_state_across_ranks_and_resumes_bit_exact(tmp_path):
    args = ("--devices", 2, "--max-epochs", 3)  # 64 samples, 2 ranks, batch 8: 4 steps per epoch
    _train(tmp_path / "full", *args, out=tmp_path / "full.pt")
    crashed = tmp_path / "crashed"
    _train(crashed, *args, "--crash-at", 8, expect_rc=17)
    assert _committed(crashed) == ["step-0000004"]
    files = sorted(os.listdir(crashed / "step-0000004"))
    assert files == ["manifest.json", "rank-00000-of-00002.safetensors", "rank-00000.json",
                     "rank-00001-of-00002.safetensors", "rank-00001.json"]
    step_dir = crashed / "step-0000004"
    sizes = [os.path.getsize(step_dir / f"rank-0000{r}-of-00002.safetensors") for r in (0, 1)]
    assert min(sizes) > 0.25 * sum(sizes)  # the replicated model and optimizer are split, not all on rank 0
    rank0, rank1 = (lazyckpt.load(step_dir, rank=r) for r in (0, 1))
    assert rank1["lazyckpt"]["rank"] == 1 and rank0["lazyckpt"]["rank"] == 0  # RNG states come back per rank
    for key, tensor in rank0["state_dict"].items():  # every rank reads the whole replicated state
        assert torch.equal(tensor, rank1["state_dict"][key]), key
    _train(crashed, *args, "--resume", "last", out=tmp_path / "resumed.pt")
    _assert_identical(tmp_path / "full.pt", tmp_path / "resumed.pt", steps_resumed=8)


def test_model_parallel_fsdp2_on_cpu_writes_each_rank_its_shards_and_resumes_bit_exact(tmp_path):
    args = ("--devices", 2, "--max-epochs", 3, "--strategy", "model_parallel")  # FSDP2 over 2 gloo ranks
    _train(tmp_path / "full", *args, out=tmp_path / "full.pt")
    crashed = tmp_path / "crashed"
    _train(crashed, *args, "--crash-at", 8, expect_rc=17)
    assert _committed(crashed) == ["step-0000004"]
    step_dir = crashed / "step-0000004"
    sizes = [os.path.getsize(step_dir / f"rank-0000{r}-of-00002.safetensors") for r in (0, 1)]
    assert min(sizes) > 0.25 * sum(sizes)  # each rank wrote its own shards
    whole = lazyckpt.load(step_dir)["state_dict"]  # consolidated in this process, no process group
    assert whole["head.weight"].shape == (2, 16)
    _train(crashed, *args, "--resume", "last", out=tmp_path / "resumed.pt")
    _assert_identical(tmp_path / "full.pt", tmp_path / "resumed.pt", steps_resumed=8)


def test_tensor_parallel_on_cpu_writes_each_rank_its_shards_and_resumes_bit_exact(tmp_path):
    # ColwiseParallel then RowwiseParallel on a 1-D tensor-parallel mesh of 2 gloo ranks (every rank sees every batch)
    args = ("--devices", 2, "--max-epochs", 3, "--strategy", "tensor_parallel")  # 8 steps an epoch
    _train(tmp_path / "full", *args, out=tmp_path / "full.pt")
    crashed = tmp_path / "crashed"
    _train(crashed, *args, "--crash-at", 16, expect_rc=17)
    assert _committed(crashed) == ["step-0000008"]
    step_dir = crashed / "step-0000008"
    ranks = [lazyckpt.load(step_dir, rank=r)["state_dict"] for r in (0, 1)]  # consolidated, no process group
    assert ranks[0]["frozen.weight"].shape == (8, 8) and ranks[0]["net.0.weight"].shape == (16, 8)
    for key, tensor in ranks[0].items():  # the sharded layers come back whole on every rank
        assert torch.equal(tensor, ranks[1][key]), key
    _train(crashed, *args, "--resume", "last", out=tmp_path / "resumed.pt")
    _assert_identical(tmp_path / "full.pt", tmp_path / "resumed.pt", steps_resumed=16)


def test_model_parallel_refuses_the_memory_level_at_setup_naming_the_option_and_the_fix(tmp_path):
    # The memory level restores one rank's whole copy; under FSDP2 each rank holds only its shards.
    proc = _train(tmp_path, "--devices", 2, "--strategy", "model_parallel", "--keep-in-memory", expect_rc=1)
    assert ("LazyCheckpoint(keep_in_memory=True) is not supported under ModelParallelStrategy" in proc.stderr
            and "Drop keep_in_memory" in proc.stderr)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("step-")]  # refused before the first step


@pytest.mark.parametrize("devices", [3, 1])
def test_model_parallel_resumes_on_another_number_of_devices_resharded_bit_exact(tmp_path, devices):
    saved = ("--max-epochs", 1, "--strategy", "model_parallel")  # 64 samples, 2 ranks, batch 8: step 4
    _train(tmp_path, *saved, "--devices", 2, out=tmp_path / "saved.pt")
    proc = _train(tmp_path, *saved[2:], "--devices", devices, "--max-epochs", 2, "--resume", "last",
                  "--out-at-start", tmp_path / "restored.pt")
    assert ("rank 2 took rank 0's" if devices == 3 else "saved ranks [1]") in proc.stderr  # what was not restored
    expected = torch.load(tmp_path / "saved.pt", weights_only=False)
    restored = torch.load(tmp_path / "restored.pt", weights_only=False)
    assert restored["global_step"] == expected["global_step"] == 4 and restored["losses"] == []
    _assert_same_state(expected, restored)
    if devices == 3:  # BatchNorm statistics are per rank: rank 1 gets its own back, the new rank 2 takes rank 0's
        stats = [torch.load(tmp_path / f"restored.pt.rank{r}", weights_only=False)["model"]["net.1.running_mean"]
                 for r in (1, 2)]
        assert torch.equal(stats[1], expected["model"]["net.1.running_mean"])
        assert not torch.equal(stats[0], expected["model"]["net.1.running_mean"])
    newest = lazyckpt.latest(tmp_path)
    assert newest.endswith("step-0000007" if devices == 3 else "step-0000012")  # it trained on, and saved
    assert len([n for n in os.listdir(newest) if n.endswith(".safetensors")]) == devices


def test_model_parallel_switching_from_model_checkpoint_keeps_its_top_k_state(tmp_path):
    """Under ModelParallelStrategy the strategy loads a ModelCheckpoint's (DCP) checkpoint itself, past the
    CheckpointIO that hands a switching callback the state of the same options: LazyCheckpoint found none (no best
    score, two top-k files kept with save_top_k=1). It gets ModelCheckpoint's state there too."""
    args = ("--devices", 2, "--strategy", "model_parallel")
    first = tmp_path / "first.json"
    _train(tmp_path / "ckpt", *args, "--max-epochs", 2, "--model-checkpoint", "--top-k-report", first)
    then = tmp_path / "then.json"
    _train(tmp_path / "ckpt", *args, "--max-epochs", 4, "--resume", "last", "--top-k-report", then)
    earlier, later = json.loads(first.read_text())["final"], json.loads(then.read_text())
    assert later["restored"] == earlier, "ModelCheckpoint's best score, path and top-k, restored into LazyCheckpoint"
    kept = {n for n in os.listdir(tmp_path / "ckpt") if n.endswith(".ckpt") and not n.startswith("last")}
    assert kept == {os.path.basename(later["final"]["path"])}, "save_top_k=1 keeps one top-k name"
    assert later["final"]["score"] <= earlier["score"]
