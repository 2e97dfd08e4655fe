"""A tied weight on 2 gloo ranks: replicated, it is stored once in rank 0's file, and rank 1's manifest names it as
an alias of that global-view tensor (docs/FORMAT.md rule 22); every rank loads it back as one tensor."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

import lazyckpt
from helpers.distributed import run_ranks


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same (replicated) weights on every rank
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight


def _save(rank, world_size, dirpath):
    model = Tied()
    mine = torch.full((3,), float(rank))
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        ckpt.save({"model": model.state_dict(), "mine": lazyckpt.PerRank({"a": mine, "b": mine})}, step=1).wait()


def _manifest(path, rank):
    with open(os.path.join(path, f"rank-{rank:05d}.json")) as f:
        return json.load(f)


def test_a_tied_replicated_weight_is_stored_by_rank_0_and_an_alias_on_rank_1(tmp_path):
    run_ranks(_save, 2, str(tmp_path / "ckpt"))
    path = lazyckpt.latest(tmp_path / "ckpt")
    lazyckpt.verify(path)
    one = _manifest(path, 1)
    assert one["aliases"] == {"model/head.weight": "model/embed.weight", "mine/b": "mine/a"}
    assert "model/embed.weight" not in one["tensors"], "the target is in rank 0's file (global view)"
    expected = Tied().embed.weight.detach()
    for rank in range(2):
        state = lazyckpt.load(path, rank=rank)
        assert torch.equal(state["model"]["embed.weight"], expected)
        assert state["model"]["head.weight"] is state["model"]["embed.weight"]
        mine = state["mine"]
        assert torch.equal(mine["a"], torch.full((3,), float(rank))) and mine["b"] is mine["a"]
    for rank in range(3):  # rank 2: beyond the saved ranks, its PerRank part is None
        fresh = Tied()
        nn.init.zeros_(fresh.embed.weight)
        out = lazyckpt.load_into(path, {"model": fresh.state_dict(), "mine": None}, rank=rank)
        assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, expected)
        assert (out["mine"] is None) == (rank == 2)
        if rank < 2:
            assert out["mine"]["b"] is out["mine"]["a"]
