"""FSDP2 state on several gloo ranks: owners write their shards, a crash resumes bit-exact, load_into reshards."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import lazyckpt
from helpers.distributed import run_ranks

STEPS, SAVE_AT = 4, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # rows divide by 2 and 4 (equal shards); 3 ranks get shards of different sizes
    return torch.nn.Sequential(torch.nn.Linear(8, 20), torch.nn.ReLU(), torch.nn.Linear(20, 8))


def _fsdp(model: torch.nn.Module) -> torch.nn.Module:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _train(model, opt, steps, rank, ckpt=None, first=1, full_at_save=None):
    for step in range(first, steps + 1):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        if ckpt is not None:
            ckpt.wait_staged()
        opt.step()
        opt.zero_grad()
        if ckpt is not None and step == SAVE_AT:
            msd, osd = get_state_dict(model, [opt])
            ckpt.save({"model": msd, "optim": osd, "step": step, "rank": lazyckpt.PerRank(rank)}, step=step,
                      optimizers=[opt])
            full = _full(model, opt)  # collective: every rank takes part
            if rank == 0 and full_at_save is not None:
                torch.save(full, full_at_save)


def _full(model, opt) -> dict[str, torch.Tensor]:
    msd, osd = get_state_dict(model, [opt])
    out = {f"model.{k}": v.full_tensor() for k, v in msd.items()}
    for name, state in osd["state"].items():
        for k, v in state.items():
            out[f"optim.{name}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def _flat(loaded) -> dict[str, torch.Tensor]:
    """The consolidated checkpoint in the layout of :func:`_full`."""
    out = {f"model.{k}": v for k, v in loaded["model"].items()}
    for name, state in loaded["optim"]["state"].items():
        out.update({f"optim.{name}.{k}": v for k, v in state.items()})
    return out


def _fresh():
    model = _fsdp(_model())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(7.0)  # nothing of the original initialization survives
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _resume(dirpath, rank):
    """A fresh model and optimizer filled from the newest checkpoint through load_into."""
    model, opt = _fresh()
    msd, osd = get_state_dict(model, [opt])
    loaded = lazyckpt.load_into(lazyckpt.latest(dirpath), {"model": msd, "optim": osd, "step": 0, "rank": 0})
    assert loaded["step"] == SAVE_AT
    assert all(loaded["model"][k] is v for k, v in msd.items()), "targets come back as the same objects"
    set_state_dict(model, [opt], model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    return model, opt, loaded


def _crash_and_resume(rank, world_size, dirpath, full_at_save):
    model = _fsdp(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ckpt = lazyckpt.LazyCheckpointer(dirpath)
    assert (ckpt.config.rank, ckpt.config.world_size) == (rank, world_size)
    _train(model, opt, STEPS, rank, ckpt, full_at_save=full_at_save)
    ckpt.close()
    uninterrupted = _full(model, opt)
    del model, opt  # the "crash": everything in memory is gone; only the committed files remain

    model, opt, loaded = _resume(dirpath, rank)
    assert loaded["rank"] == rank
    _train(model, opt, STEPS, rank, first=SAVE_AT + 1)
    resumed = _full(model, opt)
    assert uninterrupted.keys() == resumed.keys()
    for key in uninterrupted:
        assert torch.equal(uninterrupted[key], resumed[key]), key


def _data_bytes(path, rank):
    with open(os.path.join(path, f"rank-{rank:05d}.json")) as f:
        return sum(end - start for start, end in (t["offsets"] for t in json.load(f)["tensors"].values()))


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_crash_and_resume_is_bit_exact_and_each_rank_writes_its_shard(tmp_path, world_size):
    run_ranks(_crash_and_resume, world_size, str(tmp_path / "ckpt"), str(tmp_path / "full.pt"))
    path = lazyckpt.latest(tmp_path / "ckpt")
    lazyckpt.verify(path)
    sizes = [_data_bytes(path, r) for r in range(world_size)]
    assert all(abs(s - sum(sizes) / world_size) <= 0.15 * sum(sizes) / world_size for s in sizes), sizes
    consolidated, expected = _flat(lazyckpt.load(path)), torch.load(tmp_path / "full.pt")
    assert consolidated.keys() == expected.keys()
    for key, value in expected.items():  # resharding N -> 1: load() in a process with no process group
        assert torch.equal(consolidated[key], value), key


def _save_once(rank, world_size, dirpath, full_at_save):
    model = _fsdp(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        _train(model, opt, SAVE_AT, rank, ckpt, full_at_save=full_at_save)


def _reshard(rank, world_size, dirpath, full_at_save):
    model, opt, loaded = _resume(dirpath, rank)
    saved_by = lazyckpt.load(lazyckpt.latest(dirpath))["rank"]
    assert saved_by == 0 and (loaded["rank"] is None) == (rank >= 2), "PerRank values come back to their rank"
    expected, filled = torch.load(full_at_save), _full(model, opt)
    assert expected.keys() == filled.keys()
    for key, value in expected.items():
        assert torch.equal(filled[key], value), key


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(4, 2), (2, 3)])
def test_load_into_reshards_to_another_world_size_bit_exact(tmp_path, saved_on, resumed_on):
    dirpath, full = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    run_ranks(_save_once, saved_on, dirpath, full)
    run_ranks(_reshard, resumed_on, dirpath, full)


def test_load_of_a_rank_the_checkpoint_lacks_says_to_use_load_into(tmp_path):
    run_ranks(_save_once, 2, str(tmp_path / "ckpt"), str(tmp_path / "full.pt"))
    with pytest.raises(ValueError, match=r"saved by 2 rank\(s\).*lazyckpt.load_into"):
        lazyckpt.load(lazyckpt.latest(tmp_path / "ckpt"), rank=2)


def _reshard_with_dcp(rank, world_size, dirpath, full_at_save):
    import torch.distributed.checkpoint as dcp

    import lazyckpt.interop.dcp

    model, opt = _fresh()
    msd, osd = get_state_dict(model, [opt])
    state = {"model": msd, "optim": osd, "step": 0}
    dcp.load(state, storage_reader=lazyckpt.interop.dcp.StorageReader(lazyckpt.latest(dirpath)))
    assert state["step"] == SAVE_AT
    set_state_dict(model, [opt], model_state_dict=state["model"], optim_state_dict=state["optim"])
    expected, filled = torch.load(full_at_save), _full(model, opt)
    for key, value in expected.items():
        assert torch.equal(filled[key], value), key


def test_dcp_load_through_the_storage_reader_reshards_bit_exact(tmp_path):
    dirpath, full = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    run_ranks(_save_once, 4, dirpath, full)
    run_ranks(_reshard_with_dcp, 2, dirpath, full)


def _placements_and_per_rank_change_between_saves(rank, world_size, dirpath):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh, full = init_device_mesh("cpu", (world_size,)), torch.arange(24.0).reshape(8, 3)
    mine = torch.full((3,), float(rank))
    per_rank_p = {"r": torch.ones(5), "p": lazyckpt.PerRank(mine)}
    per_rank_r = {"r": lazyckpt.PerRank(torch.full((5,), rank + 10.0)), "p": torch.ones(3)}
    saves = [  # (placement of "d", the rest of the state, bytes of all ranks' files together): one change a save
        (Shard(0), per_rank_p, 96 + 20 + 2 * 12),
        (Replicate(), per_rank_p, 96 + 20 + 2 * 12),
        (Replicate(), per_rank_r, 96 + 2 * 20 + 12),
        (Shard(0), per_rank_p, 96 + 20 + 2 * 12),
    ]
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        for number, (placement, rest, total_bytes) in enumerate(saves, 1):
            d = full + number
            path = ckpt.save({"d": distribute_tensor(d, mesh, [placement]), **rest}, step=number).wait()
            loaded = lazyckpt.load(path, rank=rank)
            assert torch.equal(loaded["d"], d)
            for key, value in rest.items():
                assert torch.equal(loaded[key], value.value if isinstance(value, lazyckpt.PerRank) else value), key
            assert sum(_data_bytes(path, r) for r in range(world_size)) == total_bytes


def test_placements_and_per_rank_membership_that_change_between_saves_are_planned_anew(tmp_path):
    run_ranks(_placements_and_per_rank_change_between_saves, 2, str(tmp_path / "ckpt"))


def _fill_a_target_on_a_mesh_without_this_rank(rank, world_size, dirpath):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        ckpt.save({"w": full}, step=1).wait()
    sub_mesh = DeviceMesh("cpu", [0])  # rank 1 holds no part of this target
    target = distribute_tensor(torch.zeros(6, 4), sub_mesh, [Shard(0)])
    loaded = lazyckpt.load_into(lazyckpt.latest(dirpath), {"w": target})  # no error on the rank outside the mesh
    assert loaded["w"] is target
    if rank == 0:
        assert torch.equal(target.to_local(), full)
    else:
        assert target.to_local().numel() == 0


def test_load_into_a_dtensor_on_a_mesh_without_this_rank_fills_nothing_there(tmp_path):
    run_ranks(_fill_a_target_on_a_mesh_without_this_rank, 2, str(tmp_path / "ckpt"))
