"""Several gloo ranks meeting through the process group's store: replicated state written once and split by bytes,
tensor-parallel shards, per-node directories, a rank killed mid-flush, and states the ranks do not agree on."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lazyckpt
from helpers.distributed import run_ranks, two_ranks_meeting
from lazyckpt.errors import CommitAbandoned
from lazyckpt.tree.encode import flatten


def _manifest(path, rank):
    with open(os.path.join(path, f"rank-{rank:05d}.json")) as f:
        return json.load(f)


def _shared_bytes(path, rank):
    """Bytes of this rank's file that belong to the global state (not its PerRank values)."""
    tensors = _manifest(path, rank)["tensors"].values()
    return sum(t["offsets"][1] - t["offsets"][0] for t in tensors if t["box"] is not None)


def _ddp_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])


def _ddp_save_and_restore(rank, world_size, dirpath):
    model = torch.nn.parallel.DistributedDataParallel(_ddp_model())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        for step in (1, 2):
            model(torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
            ckpt.wait_staged()
            opt.step()
            opt.zero_grad()
        rng = torch.Generator().manual_seed(100 + rank).get_state()
        ckpt.save({"model": model.module.state_dict(), "optim": opt.state_dict(), "rng": lazyckpt.PerRank(rng)},
                  step=2, optimizers=[opt]).wait()
    fresh = _ddp_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.fill_(3.0)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    loaded = lazyckpt.load_into(lazyckpt.latest(dirpath), {"model": fresh.state_dict()})
    fresh_opt.load_state_dict(loaded["optim"])
    assert torch.equal(loaded["rng"], torch.Generator().manual_seed(100 + rank).get_state()), "PerRank"
    for key, value in model.module.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(fresh_opt.state_dict()["state"][index][key], value), (index, key)


def test_ddp_state_is_written_once_split_across_ranks_by_bytes_and_restores_exactly(tmp_path):
    run_ranks(_ddp_save_and_restore, 2, str(tmp_path / "ckpt"))
    path = lazyckpt.latest(tmp_path / "ckpt")
    shares = [_shared_bytes(path, r) for r in range(2)]
    assert all(abs(s - sum(shares) / 2) <= 0.1 * sum(shares) / 2 for s in shares), shares
    leaves = flatten({k: v for k, v in lazyckpt.load(path).items() if k != "rng"}).tensors
    assert sum(t.numel() * t.element_size() for _, t in leaves) == sum(shares), "every replicated byte once"


def _tp_model(mesh):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _tensor_parallel_round_trip(rank, world_size, dirpath):
    mesh = init_device_mesh("cpu", (world_size,))
    model = _tp_model(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
    opt.step()
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        ckpt.save({"model": model.state_dict()}, step=1, optimizers=[opt]).wait()
    fresh = _tp_model(mesh)
    targets = fresh.state_dict()
    lazyckpt.load_into(lazyckpt.latest(dirpath), {"model": targets})
    for key, value in model.state_dict().items():
        assert torch.equal(targets[key].full_tensor(), value.full_tensor()), key


def test_tensor_parallel_shards_on_a_1d_mesh_round_trip(tmp_path):
    run_ranks(_tensor_parallel_round_trip, 2, str(tmp_path / "ckpt"))
    path = lazyckpt.latest(tmp_path / "ckpt")
    assert _manifest(path, 1)["tensors"]["model/0.weight"]["box"] == {"global_shape": [16, 8], "offsets": [8, 0]}
    assert lazyckpt.load(path)["model"]["0.weight"].shape == (16, 8)


def _full_tensors():
    return {"tp": torch.arange(48.0).reshape(8, 6), "grid": torch.arange(64, dtype=torch.int32).reshape(8, 8)}


def _mesh_2d_round_trip(rank, world_size, dirpath):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = _full_tensors()
    state = {"tp": distribute_tensor(full["tp"], mesh, [Replicate(), Shard(0)]),  # replicated over dp
             "grid": distribute_tensor(full["grid"], mesh, [Shard(0), Shard(1)]),
             "sub": distribute_tensor(full["tp"], mesh["tp"], [Shard(0)])}  # a sub-mesh: each dp group holds it
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        ckpt.save(state, step=1).wait()
    targets = {"tp": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1), Replicate()]),
               "grid": distribute_tensor(torch.zeros(8, 8, dtype=torch.int32), mesh, [Replicate(), Shard(0)]),
               "sub": distribute_tensor(torch.zeros(8, 6), mesh["dp"], [Shard(1)])}
    lazyckpt.load_into(lazyckpt.latest(dirpath), targets)
    for key, value in {**full, "sub": full["tp"]}.items():
        assert torch.equal(targets[key].full_tensor(), value), key


def test_a_2d_mesh_writes_each_box_once_and_reshards_to_other_placements(tmp_path):
    run_ranks(_mesh_2d_round_trip, 4, str(tmp_path / "ckpt"))
    path = lazyckpt.latest(tmp_path / "ckpt")
    with open(os.path.join(path, "manifest.json")) as f:
        index = json.load(f)["tensors"]
    assert len(index["tp"]["boxes"]) == len(index["sub"]["boxes"]) == 2 and len(index["grid"]["boxes"]) == 4
    loaded = lazyckpt.load(path)
    for key, value in {**_full_tensors(), "sub": _full_tensors()["tp"]}.items():
        assert torch.equal(loaded[key], value), key


def _per_node_directories(rank, world_size, base):
    dirpath = os.path.join(base, f"node{rank}")
    weights = torch.arange(1000.0)
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        for step in (1, 2):
            ckpt.save({"w": weights * step, "v": weights + step, "rank": lazyckpt.PerRank(rank)}, step=step).wait()
            assert lazyckpt.checkpoint_step(lazyckpt.latest(dirpath)) == step


def test_per_node_directories_commit_every_step_on_every_node(tmp_path):
    run_ranks(_per_node_directories, 2, str(tmp_path))
    merged = tmp_path / "merged" / "step-0000002"
    for rank in range(2):
        node = lazyckpt.latest(tmp_path / f"node{rank}")
        assert os.path.basename(node) == "step-0000002"
        assert not any(name.startswith(f"rank-{1 - rank:05d}") for name in os.listdir(node)), "only its own files"
        shutil.copytree(node, merged, dirs_exist_ok=True)
    for rank in range(2):
        state = lazyckpt.load(merged, rank=rank)
        assert state["rank"] == rank
        assert torch.equal(state["w"], torch.arange(1000.0) * 2) and torch.equal(state["v"], torch.arange(1000.0) + 2)
    lazyckpt.verify(merged)


def _killed_mid_flush(rank, world_size, dirpath):
    ckpt = lazyckpt.LazyCheckpointer(dirpath, commit_timeout_s=5.0)
    big = torch.ones(1 << 20)
    ckpt.save({"w": big, "step": 1}, step=1).wait()
    pending = ckpt.save({"w": big * 2, "step": 2}, step=2)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises((TimeoutError, CommitAbandoned), match="no rank commits"):
        pending.wait()
    assert lazyckpt.checkpoint_step(lazyckpt.latest(dirpath)) == 1
    ckpt.close()


def test_a_rank_killed_during_a_flush_leaves_every_rank_on_the_previous_step(tmp_path):
    codes = run_ranks(_killed_mid_flush, 2, str(tmp_path / "ckpt"), meet_at_end=False)
    assert codes == {0: 0, 1: -signal.SIGKILL}
    assert lazyckpt.checkpoint_step(lazyckpt.latest(tmp_path / "ckpt")) == 1


def _bad_inputs(rank, world_size, dirpath):
    mesh = init_device_mesh("cpu", (world_size,))
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        pending_sum = DTensor.from_local(torch.ones(4), mesh, [Partial()])
        with pytest.raises(lazyckpt.UnsupportedValueError, match="Partial placement"):
            ckpt.save({"w": pending_sum}, step=1)
        with pytest.raises(ValueError, match=r"differs from rank\(s\) \[%d\].*lazyckpt.PerRank" % (1 - rank)):
            ckpt.save({"w": torch.zeros(rank + 1)}, step=1)
        ckpt.save({"w": lazyckpt.PerRank(torch.zeros(rank + 1))}, step=1).wait()


def test_a_partial_dtensor_or_a_plain_tensor_that_differs_per_rank_is_refused_at_save(tmp_path):
    run_ranks(_bad_inputs, 2, str(tmp_path / "ckpt"))
    assert torch.equal(lazyckpt.load(lazyckpt.latest(tmp_path / "ckpt"), rank=1)["w"], torch.zeros(2))


def test_a_durable_mark_of_an_earlier_attempt_never_completes_a_new_one(tmp_path):
    rank0, rank1 = two_ranks_meeting(str(tmp_path))
    assert rank0.leader == rank1.leader == 0, "both share the directory: its lowest rank leads"
    rank1.store.set(f"{rank1.prefix}/1/durable/1", b"{}")  # rank 1 finished attempt 1, then that attempt failed
    with pytest.raises(TimeoutError, match="commit_timeout_s"):
        rank0.gather(2, {})
    rank1.abandon(3, "disk full")
    with pytest.raises(CommitAbandoned, match="rank 1: disk full"):
        rank0.gather(3, {})
