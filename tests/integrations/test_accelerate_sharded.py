"""LazyCheckpointHook under Accelerate's FSDP plugin version 2: each process writes its shards, resume is bit-exact
and reshards to another number of processes.

Accelerate selects FSDP only for accelerator devices (``AcceleratorState`` picks ``DistributedType.FSDP`` in its
GPU/NPU/XPU/... branch; a CPU run stays ``MULTI_CPU`` and ignores the plugin), so the CPU tests set the two fields
Accelerate sets on a GPU (``distributed_type``, in both state singletons, and ``fsdp_plugin``) before ``prepare``;
from there the run is Accelerate's own FSDP2 path (``fully_shard`` over gloo). The GPU test at the end runs it
unmodified.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers.distributed import run_ranks
from helpers.remote import moto_endpoint, s3_remote  # noqa: F401 - fixtures
from conftest import clone_tree

pytestmark = pytest.mark.slow
EVERY, STEPS = 2, 6


def _fsdp2_run(rank: int, world_size: int, *, on_cpu: bool = True):
    """A prepared FSDP2 model (rows divide by 2 but not by 3: uneven shards), AdamW and a scheduler, and the hook."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))  # the group exists already: Accelerate joins it
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=on_cpu, fsdp_plugin=plugin)
    if on_cpu:  # what Accelerate's state sets on an accelerator device (see the module docstring)
        PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    return (accelerator, *accelerator.prepare(model, opt, sched))


def _iterate(accelerator, model, opt, sched, steps: range, rank: int) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 * step + rank)
        batch = torch.randn(4, 6, generator=gen).to(accelerator.device)
        accelerator.backward(model(batch).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()


def _full_state(model, opt, sched) -> dict:
    """The whole model and optimizer state (collective), keyed by name, and the scheduler's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = StateDictOptions(full_state_dict=True)
    msd, osd = get_state_dict(model, [opt.optimizer], options=full)
    # one process: the "full" tensors are the live ones, which training goes on to change
    return clone_tree({"model": msd, "optim": osd, "sched": sched.state_dict()})


def _train(rank: int, world_size: int, dirpath: str, out: str, on_cpu: bool = True) -> None:
    """Train STEPS iterations with a checkpoint every EVERY; keep the full state after iteration 4 and at the end."""
    from lazyckpt import LazyCheckpointHook

    accelerator, model, opt, sched = _fsdp2_run(rank, world_size, on_cpu=on_cpu)
    hook = LazyCheckpointHook(dirpath, every_n_steps=EVERY).register(accelerator)
    _iterate(accelerator, model, opt, sched, range(1, 5), rank)
    at_four = _full_state(model, opt, sched)
    _iterate(accelerator, model, opt, sched, range(5, STEPS + 1), rank)
    hook.close()
    if rank == 0:
        torch.save({"at_four": at_four, "end": _full_state(model, opt, sched)}, out)
    else:
        _full_state(model, opt, sched)


def _resume(rank: int, world_size: int, path: str, out: str, on_cpu: bool = True) -> None:
    """Resume from ``path`` (checkpoints go next to ``out``); keep the full state right after the resume and after
    training to STEPS."""
    from lazyckpt import LazyCheckpointHook

    accelerator, model, opt, sched = _fsdp2_run(rank, world_size, on_cpu=on_cpu)
    hook = LazyCheckpointHook(os.path.join(os.path.dirname(out), "ckpt"), every_n_steps=EVERY).register(accelerator)
    step = hook.resume(path)
    resumed = _full_state(model, opt, sched)
    _iterate(accelerator, model, opt, sched, range(step + 1, STEPS + 1), rank)
    end = _full_state(model, opt, sched)
    hook.close()
    if rank == 0:
        torch.save({"step": step, "resumed": resumed, "end": end}, out)


def _assert_same(actual: dict, expected: dict) -> None:
    assert actual["sched"] == expected["sched"]
    for key, tensor in expected["model"].items():
        assert torch.equal(actual["model"][key], tensor), key
    assert actual["optim"]["param_groups"] == expected["optim"]["param_groups"]
    for name, per_param in expected["optim"]["state"].items():
        for field, value in per_param.items():
            assert torch.equal(actual["optim"]["state"][name][field], value), (name, field)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One uninterrupted two-process run with its checkpoints (steps 2, 4, 6)."""
    root = tmp_path_factory.mktemp("fsdp2")
    run_ranks(_train, 2, str(root / "ckpt"), str(root / "full.pt"))
    return root, torch.load(root / "full.pt", weights_only=False)


def test_each_process_writes_its_shards_and_resume_on_as_many_is_bit_exact(trained, tmp_path):
    root, full = trained
    step_dir = root / "ckpt" / "step-0000004"
    sizes = [os.path.getsize(step_dir / f"rank-0000{r}-of-00002.safetensors") for r in (0, 1)]
    assert min(sizes) > 0.3 * sum(sizes)  # each process wrote its own shards
    import lazyckpt

    whole = lazyckpt.load(step_dir)  # consolidated, no process group
    assert torch.equal(whole["models"][0]["2.weight"], full["at_four"]["model"]["2.weight"])
    run_ranks(_resume, 2, str(step_dir), str(tmp_path / "resumed.pt"))
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert resumed["step"] == 4
    _assert_same(resumed["resumed"], full["at_four"])
    _assert_same(resumed["end"], full["end"])  # training on from the checkpoint ends where the full run ended


@pytest.mark.parametrize("processes", [3, 1])
def test_resume_on_another_number_of_processes_reshards_bit_exact(trained, tmp_path, processes):
    root, full = trained
    run_ranks(_resume, processes, str(root / "ckpt" / "step-0000004"), str(tmp_path / "resumed.pt"))
    _assert_same(torch.load(tmp_path / "resumed.pt", weights_only=False)["resumed"], full["at_four"])


def _train_with_remote(rank: int, world_size: int, dirpath: str, url: str, options: dict) -> None:
    from lazyckpt import LazyCheckpointHook

    accelerator, model, opt, sched = _fsdp2_run(rank, world_size)
    hook = LazyCheckpointHook(dirpath, every_n_steps=EVERY, remote=url, storage_options=options).register(accelerator)
    _iterate(accelerator, model, opt, sched, range(1, 5), rank)
    hook.close()


def _resume_from_remote(rank: int, world_size: int, dirpath: str, url: str, options: dict, out: str) -> None:
    from lazyckpt import LazyCheckpointHook

    accelerator, model, opt, sched = _fsdp2_run(rank, world_size)
    hook = LazyCheckpointHook(dirpath, every_n_steps=EVERY, remote=url, storage_options=options).register(accelerator)
    step = hook.resume()  # the local directory is empty: the newest checkpoint is on the remote
    resumed = _full_state(model, opt, sched)
    hook.close()
    if rank == 0:
        torch.save({"step": step, "resumed": resumed}, out)


def test_resume_on_an_empty_node_reads_the_shards_from_the_remote_bit_exact(trained, tmp_path, s3_remote):
    url, options = s3_remote
    run_ranks(_train_with_remote, 2, str(tmp_path / "node-a"), url, options)
    run_ranks(_resume_from_remote, 2, str(tmp_path / "node-b"), url, options, str(tmp_path / "resumed.pt"))
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert resumed["step"] == 4
    _assert_same(resumed["resumed"], trained[1]["at_four"])
    node_b = tmp_path / "node-b"  # ranged reads, nothing fetched (and a job that saved nothing leaves no folder)
    assert not node_b.exists() or not any(n.startswith("step-") for n in os.listdir(node_b))


def _train_on_host_level_then_crash(rank: int, world_size: int, dirpath: str, host_memory_dir: str) -> None:
    """Checkpoints every EVERY steps through the host level; the copy of step 4 to ``dirpath`` never begins, and
    both processes die once it would have (step 4 is then committed in the host folder only)."""
    from helpers.host_faults import crash_once_stalled, stall_copy_to_disk

    from lazyckpt import LazyCheckpointHook

    accelerator, model, opt, sched = _fsdp2_run(rank, world_size)
    stalled = stall_copy_to_disk(4)
    LazyCheckpointHook(dirpath, every_n_steps=EVERY, keep_in_memory="host",  # not refused: it is a directory
                       host_memory_dir=host_memory_dir).register(accelerator)
    _iterate(accelerator, model, opt, sched, range(1, 6), rank)  # the request of step 4 goes out in step 5
    crash_once_stalled(stalled, 13, meet=torch.distributed.barrier)


def _resume_on_host_level(rank: int, world_size: int, dirpath: str, host_memory_dir: str, out: str) -> None:
    from lazyckpt import LazyCheckpointHook

    accelerator, model, opt, sched = _fsdp2_run(rank, world_size)
    hook = LazyCheckpointHook(dirpath, every_n_steps=EVERY, keep_in_memory="host",
                              host_memory_dir=host_memory_dir).register(accelerator)
    step = hook.resume()
    resumed = _full_state(model, opt, sched)
    hook.close()
    if rank == 0:
        torch.save({"step": step, "resumed": resumed}, out)


def test_the_host_level_under_fsdp2_keeps_the_shards_a_crash_kept_from_dirpath_and_resumes_bit_exact(
        trained, tmp_path):
    from lazyckpt.format.catalog import committed_steps
    from lazyckpt.storage.urls import host_dir

    ckpt, shm = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    codes = run_ranks(_train_on_host_level_then_crash, 2, ckpt, shm, meet_at_end=False)
    assert codes == {0: 13, 1: 13}
    assert sorted(committed_steps(ckpt)) == [2] and 4 in committed_steps(host_dir(ckpt, shm))
    run_ranks(_resume_on_host_level, 2, ckpt, shm, str(tmp_path / "resumed.pt"))
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert resumed["step"] == 4, "the host folder's step, committed in dirpath before the resume"
    _assert_same(resumed["resumed"], trained[1]["at_four"])
    assert sorted(os.listdir(tmp_path / "ckpt" / "step-0000004")) == [
        "manifest.json", "rank-00000-of-00002.safetensors", "rank-00000.json", "rank-00001-of-00002.safetensors",
        "rank-00001.json"]
    assert not os.path.exists(host_dir(ckpt, shm)), "a clean close frees the host folder"


def _refusals(rank: int, world_size: int, dirpath: str) -> None:
    from lazyckpt import LazyCheckpointHook

    accelerator, model, opt, sched = _fsdp2_run(rank, world_size)
    with pytest.raises(ValueError, match=r"keep_in_memory=True\) is not supported under FSDP version 2"):
        LazyCheckpointHook(dirpath, keep_in_memory=True).register(accelerator)
    hook = LazyCheckpointHook(dirpath).register(accelerator)
    with pytest.raises(NotImplementedError, match=r"rollback\(\) is not supported under FSDP version 2"):
        hook.rollback()
    hook.close()


def test_the_memory_level_and_rollback_are_refused_under_fsdp2(tmp_path):
    run_ranks(_refusals, 2, str(tmp_path))


def test_fsdp_version_1_is_refused_naming_version_2():
    from accelerate.utils import DistributedType

    from lazyckpt.integrations import _compat

    fsdp1 = type("Accelerator", (), {"distributed_type": DistributedType.FSDP, "is_fsdp2": False})()
    with pytest.raises(ValueError, match=r"FSDP version 1.*fsdp_version=2"):
        _compat.refuse_unsupported_accelerator(fsdp1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="Accelerate's FSDP plugin runs on accelerator devices "
                    "only; this unmodified run needs two CUDA GPUs")
def test_on_two_gpus_the_unmodified_fsdp2_plugin_saves_shards_and_resumes_bit_exact(tmp_path):
    run_ranks(_train, 2, str(tmp_path / "ckpt"), str(tmp_path / "full.pt"), False, backend="nccl")
    full = torch.load(tmp_path / "full.pt", map_location="cpu", weights_only=False)
    (tmp_path / "again").mkdir()
    run_ranks(_resume, 2, str(tmp_path / "ckpt" / "step-0000004"), str(tmp_path / "again" / "resumed.pt"), False,
              backend="nccl")
    resumed = torch.load(tmp_path / "again" / "resumed.pt", map_location="cpu", weights_only=False)
    _assert_same(resumed["resumed"], full["at_four"])
    _assert_same(resumed["end"], full["end"])
