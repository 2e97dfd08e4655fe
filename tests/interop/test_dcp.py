"""``torch.distributed.checkpoint.load`` through lazyckpt's StorageReader: what the strict reader refuses reaches
the caller as lazyckpt's own error (inside DCP's ``CheckpointException``, as DCP wraps every reader's error)."""

from __future__ import annotations

import argparse
import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import lazyckpt
from helpers.forge import edit_manifest, reseal
from lazyckpt.interop.dcp import StorageReader


def test_a_refusal_while_describing_the_checkpoint_reaches_the_caller_as_lazyckpts_error(tmp_path):
    """DCP turns an exception of ``read_metadata`` into an AssertionError holding only its text; the reader
    raises it from ``set_up_storage_reader`` instead (before: AssertionError "metadata is None; ...")."""
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        path = ckpt.save({"step": 1, "w": torch.ones(2)}, step=1).wait()
    edit_manifest(os.path.join(path, "rank-00000.json"), lambda d: d["tensors"]["w"].update(dtype="F16"))
    reseal(path)
    with pytest.raises(CheckpointException) as failure, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized"
        dcp.load({"step": 0}, storage_reader=StorageReader(path), no_dist=True)
    (error, _), = failure.value.failures.values()
    assert isinstance(error, lazyckpt.CheckpointFormatError), repr(error)
    assert "rank-00000.json" in str(error) and "'w'" in str(error)


def test_read_metadata_of_a_refused_checkpoint_raises_lazyckpts_error_when_read_never_looks_empty(tmp_path):
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        path = ckpt.save({"step": 1, "w": torch.ones(2)}, step=1).wait()
    edit_manifest(os.path.join(path, "rank-00000.json"), lambda d: d["tensors"]["w"].update(dtype="F16"))
    reseal(path)
    metadata = StorageReader(path).read_metadata()  # a direct caller, not dcp.load
    for field in ("state_dict_metadata", "storage_data"):
        with pytest.raises(lazyckpt.CheckpointFormatError, match=r"rank-00000\.json.*'w'"):
            getattr(metadata, field)


def _dcp_load(path, state):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized"
        dcp.load(state, storage_reader=StorageReader(path), no_dist=True)


@pytest.mark.parametrize("saved, target, what", [
    ({"pair": (torch.ones(2), 3)}, {"pair": (torch.full((2,), -7.0), 0)}, "holds a Tensor inside a tuple"),
    ({"a": np.ones(3)}, {"a": np.full(3, -7.0)}, "is a ndarray"),
    ({"ns": argparse.Namespace(w=torch.ones(2))}, {"ns": argparse.Namespace(w=torch.full((2,), -7.0))},
     "holds a Tensor inside a Namespace"),
])
def test_a_tensor_dcp_would_load_as_an_opaque_value_is_refused_not_served_as_zeros(tmp_path, saved, target, what):
    """DCP loads a tuple (a numpy array, a Namespace) whole, as bytes of rank 0's outline, whose tensors are
    placeholders: before, ``(ones(2), 3)`` came back as ``(tensor([0., 0.]), 3)``. Refused when a target asks for
    it; a target that does not still loads."""
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        path = ckpt.save({**saved, "w": torch.full((2,), 5.0)}, step=1).wait()
    state = {**target, "w": torch.full((2,), -7.0)}
    with pytest.raises(CheckpointException) as failure:
        _dcp_load(path, state)
    (error, _), = failure.value.failures.values()
    assert isinstance(error, lazyckpt.CheckpointMismatchError) and what in str(error), repr(error)
    assert torch.equal(state["w"], torch.full((2,), -7.0)), "nothing was loaded"
    others = {"w": torch.full((2,), -7.0)}  # a target that does not ask for the value: served as before
    _dcp_load(path, others)
    assert torch.equal(others["w"], torch.full((2,), 5.0))
    lists = {"l": [torch.full((2,), -7.0), 0], "w": torch.full((2,), -7.0)}  # a list's tensors are DCP's leaves
    with lazyckpt.LazyCheckpointer(tmp_path / "list") as ckpt:
        _dcp_load(ckpt.save({"l": [torch.ones(2), 3], "w": torch.full((2,), 5.0)}, step=1).wait(), lists)
    assert torch.equal(lists["l"][0], torch.ones(2)) and lists["l"][1] == 3 and torch.equal(lists["w"], 5 * torch.ones(2))


def test_tensors_under_int_and_tuple_dict_keys_load_through_dcp(tmp_path):
    """DCP names a dict key by its str(): "7" stands for the saved int key 7 (before: "Missing key in checkpoint
    state_dict: d.7", the tensor was not described)."""
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        path = ckpt.save({"d": {7: torch.full((2,), 3.0), (1, "x"): torch.full((2,), 4.0), "7s": 1}}, step=1).wait()
    state = {"d": {7: torch.full((2,), -7.0), (1, "x"): torch.full((2,), -7.0)}}
    _dcp_load(path, state)
    assert torch.equal(state["d"][7], torch.full((2,), 3.0)) and torch.equal(state["d"][(1, "x")], torch.full((2,), 4.0))


def test_each_rank_tree_is_checked_once_per_load(tmp_path, monkeypatch):
    """read_metadata and read_data open rank 0's manifest each; the walk over its tree (every stored tensor
    referenced, FORMAT.md rule 21) runs once: the reader keeps the verdict for that manifest's seal."""
    import lazyckpt.read.reader as reader_module

    walks = []
    check = reader_module.check_references
    monkeypatch.setattr(reader_module, "check_references", lambda *a: (walks.append(a[2]), check(*a)))
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        path = ckpt.save({"w": torch.full((2,), 5.0), "n": 1}, step=1).wait()
    state = {"w": torch.full((2,), -7.0), "n": 0}
    _dcp_load(path, state)
    assert torch.equal(state["w"], torch.full((2,), 5.0)) and state["n"] == 1
    assert len(walks) == 1, walks


def test_a_tied_weight_stored_once_loads_through_dcp_into_tied_and_untied_targets(tmp_path):
    embed = torch.nn.Embedding(20, 8)
    head = torch.nn.Linear(8, 20, bias=False)
    head.weight = embed.weight
    state = {"model": {"embed.weight": embed.weight.detach(), "head.weight": head.weight.detach()}}
    with lazyckpt.LazyCheckpointer(tmp_path / "c") as ckpt:
        path = ckpt.save(state, step=1).wait()
    fresh = torch.nn.Embedding(20, 8)
    tied = {"model": {"embed.weight": fresh.weight.detach(), "head.weight": fresh.weight.detach()}}
    _dcp_load(path, tied)
    assert torch.equal(fresh.weight, embed.weight)
    untied = {"model": {k: torch.zeros(20, 8) for k in ("embed.weight", "head.weight")}}
    _dcp_load(path, untied)
    assert all(torch.equal(t, embed.weight) for t in untied["model"].values())
