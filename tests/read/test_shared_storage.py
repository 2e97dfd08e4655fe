"""Tensors that share storage (tied weights) are stored once and come back as one tensor (docs/FORMAT.md rule 22)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import lazyckpt
from helpers.forge import RANK0, edit_manifest, read_json

FILE = "rank-00000-of-00001.safetensors"


class Tied(nn.Module):
    """A GPT-2-like tie: the embedding's weight is also the output layer's."""

    def __init__(self, vocab: int = 300, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight


def save(dirpath, state, **kwargs):
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        return ckpt.save(state, step=1, **kwargs).wait()


def tensor_file_bytes(path):
    return os.path.getsize(os.path.join(path, FILE))


def test_a_tied_weight_is_stored_once_and_loads_as_one_tensor_under_both_names(tmp_path):
    model = Tied()
    tied = save(tmp_path / "tied", {"model": model.state_dict()}, optimizers=[torch.optim.SGD(model.parameters())])
    untied = {k: v.clone() for k, v in model.state_dict().items()}
    separate = save(tmp_path / "untied", {"model": untied})
    weight = model.embed.weight
    assert tensor_file_bytes(separate) - tensor_file_bytes(tied) == weight.numel() * weight.element_size()
    doc = read_json(os.path.join(tied, RANK0))
    assert doc["aliases"] == {"model/head.weight": "model/embed.weight"} and "model/head.weight" not in doc["tensors"]
    assert doc["tensors"]["model/embed.weight"]["capture"] == "lazy", "the tie's owner is still copied lazily"
    lazyckpt.verify(tied)
    loaded = lazyckpt.load(tied)["model"]
    assert list(loaded) == list(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value) and loaded[key].dtype == value.dtype
    assert loaded["head.weight"] is loaded["embed.weight"]
    loaded["head.weight"][0, 0] = 123.0  # one tensor: an in-place edit under one name is seen under the other
    assert loaded["embed.weight"][0, 0] == 123.0


def test_a_tensor_merely_equal_to_another_is_stored_separately(tmp_path):
    a = torch.randn(64, 64)
    path = save(tmp_path / "c", {"a": a, "b": a.clone(), "view": a[:32], "same": a})
    doc = read_json(os.path.join(path, RANK0))
    assert doc["aliases"] == {"same": "a"}, "an equal copy and a view of part of the buffer are tensors of their own"
    assert sorted(doc["tensors"]) == ["a", "b", "view"]
    loaded = lazyckpt.load(path)
    assert torch.equal(loaded["b"], a) and torch.equal(loaded["view"], a[:32]) and loaded["same"] is loaded["a"]
    assert loaded["b"].untyped_storage().data_ptr() != loaded["a"].untyped_storage().data_ptr()


def test_load_into_a_tied_model_keeps_the_tie_and_an_untied_one_gets_the_values_twice(tmp_path):
    model = Tied()
    path = save(tmp_path / "c", {"model": model.state_dict(), "step": 3})
    fresh = Tied()
    out = lazyckpt.load_into(path, {"model": fresh.state_dict()})
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, model.embed.weight)
    assert torch.equal(fresh.mid.weight, model.mid.weight) and out["step"] == 3
    assert out["model"]["head.weight"].data_ptr() == fresh.embed.weight.data_ptr(), "the live tensor, not a copy"
    untied = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    lazyckpt.load_into(path, {"model": untied})
    assert torch.equal(untied["head.weight"], model.embed.weight) and torch.equal(untied["embed.weight"],
                                                                                 model.embed.weight)
    assert untied["head.weight"] is not untied["embed.weight"]


def test_a_checkpoint_without_the_tie_loads_into_a_tied_model(tmp_path):
    model = Tied()
    path = save(tmp_path / "c", {"model": {k: v.clone() for k, v in model.state_dict().items()}})
    fresh = Tied()
    lazyckpt.load_into(path, {"model": fresh.state_dict()})
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, model.embed.weight)


def test_transformers_gpt2_round_trips_with_its_tied_head_stored_once(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=97, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    path = save(tmp_path / "c", model.state_dict())
    assert read_json(os.path.join(path, RANK0))["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    torch.manual_seed(1)
    fresh = transformers.GPT2LMHeadModel(config).eval()
    lazyckpt.load_into(path, fresh.state_dict())
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(fresh(ids).logits, model(ids).logits)
    loaded = lazyckpt.load(path)
    assert set(loaded) == set(model.state_dict()) and loaded["lm_head.weight"] is loaded["transformer.wte.weight"]


def test_a_per_rank_leaf_and_a_replicated_one_of_one_tensor_are_stored_each(tmp_path):
    t = torch.randn(8)
    path = save(tmp_path / "c", {"a": t, "mine": lazyckpt.PerRank(t)})
    assert read_json(os.path.join(path, RANK0))["aliases"] == {}
    loaded = lazyckpt.load(path)
    assert torch.equal(loaded["a"], t) and torch.equal(loaded["mine"], t)


def test_the_memory_snapshot_of_a_tied_state_restores_into_a_tied_model(tmp_path):
    model = Tied()
    with lazyckpt.LazyCheckpointer(tmp_path / "c", keep_in_memory=True) as ckpt:
        ckpt.save({"model": model.state_dict()}, step=1).wait()
        fresh = Tied()
        step, state = ckpt.memory_snapshot(into={"model": fresh.state_dict()})
    assert step == 1 and state["model"]["head.weight"] is state["model"]["embed.weight"]
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, model.embed.weight)


@pytest.mark.parametrize("lie, match", [
    ({"model/head.weight": "model/nothing"}, "neither this rank's file nor the global view holds"),
    ({"model/mid.bias": "model/embed.weight"}, "names stored tensors as aliases"),
    ({"model/head.weight": "model/embed.weight", "model/spare": "model/embed.weight"}, "refers to none"),
    ({}, "lacks"),
    ({"model/head.weight": 3}, "must map tensor keys to tensor keys"),
])
def test_an_alias_that_does_not_resolve_is_refused_by_load_and_verify(tmp_path, lie, match):
    path = save(tmp_path / "c", {"model": Tied().state_dict()})
    edit_manifest(os.path.join(path, RANK0), lambda d: d.update(aliases=lie))
    for read in (lazyckpt.load, lazyckpt.verify):
        with pytest.raises(lazyckpt.CheckpointFormatError, match=match):
            read(path)


def test_a_negative_or_conjugate_view_of_a_tensor_is_not_an_alias_of_it(tmp_path):
    a = torch.randn(8, 8)
    z = torch.randn(4, 4, dtype=torch.complex64)
    state = {"a": a, "neg": a._neg_view(), "imag": z.imag, "conj_imag": z.conj().imag}
    path = save(tmp_path / "c", state)
    assert read_json(os.path.join(path, RANK0))["aliases"] == {}, "same memory, other values: not one tensor"
    loaded = lazyckpt.load(path)
    assert torch.equal(loaded["neg"], -a) and torch.equal(loaded["conj_imag"], -z.imag)
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["imag"], z.imag)
    tied_to_plain = save(tmp_path / "d", {"neg": a._neg_view(), "a": a, "again": a})
    assert read_json(os.path.join(tied_to_plain, RANK0))["aliases"] == {"again": "a"}
    assert torch.equal(lazyckpt.load(tied_to_plain)["neg"], -a)


def test_load_into_for_a_rank_beyond_the_saved_ones_skips_the_aliases_of_the_dropped_per_rank_values(tmp_path):
    t = torch.randn(8)
    w = torch.randn(4)
    path = save(tmp_path / "c", {"w": w, "rng": lazyckpt.PerRank({"a": t, "b": t})})
    assert read_json(os.path.join(path, RANK0))["aliases"] == {"rng/b": "rng/a"}
    target = torch.zeros(4)
    out = lazyckpt.load_into(path, {"w": target, "rng": None}, rank=1)
    assert out == {"w": target, "rng": None} and torch.equal(target, w)
    mine = lazyckpt.load_into(path, {"w": torch.zeros(4), "rng": None}, rank=0)["rng"]
    assert torch.equal(mine["a"], t) and mine["b"] is mine["a"]


def test_the_memory_snapshot_leaves_alone_an_alias_target_it_cannot_copy_into(tmp_path):
    model = Tied()
    with lazyckpt.LazyCheckpointer(tmp_path / "c", keep_in_memory=True) as ckpt:
        ckpt.save({"model": model.state_dict()}, step=1).wait()
        untied = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        untied["head.weight"] = torch.zeros_like(model.head.weight, dtype=torch.bfloat16)
        untied["embed.weight"] = torch.zeros(model.embed.weight.shape[::-1]).t()  # not contiguous
        _, state = ckpt.memory_snapshot(into={"model": untied})
    assert not untied["head.weight"].any() and not untied["embed.weight"].any(), "neither target fits: untouched"
    got = state["model"]
    assert torch.equal(got["embed.weight"], model.embed.weight) and got["head.weight"] is got["embed.weight"]
    assert got["mid.weight"] is untied["mid.weight"] and torch.equal(untied["mid.weight"], model.mid.weight)


def test_an_alias_whose_tensor_was_not_loaded_is_a_format_error_not_a_key_error():
    from lazyckpt.tree.decode import with_aliases
    with pytest.raises(lazyckpt.CheckpointFormatError, match="'b' is an alias of 'a'"):
        with_aliases({"c": torch.zeros(1)}, {"b": "a"}, "rank 1's manifest")
