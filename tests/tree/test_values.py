"""Values users keep in checkpoints: OmegaConf configs, numpy string arrays, tuple keys, sparse tensors; and the
check that finds the rest before training starts."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
import torch

import lazyckpt
from helpers.forge import RANK0, edit_manifest
from conftest import assert_tree_equal

omegaconf = pytest.importorskip("omegaconf")
OmegaConf = omegaconf.OmegaConf


def save_and_load(tmp_path, state):
    with lazyckpt.LazyCheckpointer(tmp_path / "ckpt") as ckpt:
        path = ckpt.save(state, step=1).wait()
    return path, lazyckpt.load(path)


def test_omegaconf_configs_come_back_as_configs_with_interpolations_unresolved(tmp_path):
    cfg = OmegaConf.create({"model": {"dim": 8, "hidden": "${model.dim}"}, "tags": ["a", "${model.dim}"],
                            "todo": "???", 3: "int key"})
    OmegaConf.set_struct(cfg, True)
    listcfg = OmegaConf.create([1, "${0}"])
    _, out = save_and_load(tmp_path, {"cfg": cfg, "list": listcfg, "type": type(cfg)})
    assert isinstance(out["cfg"], omegaconf.DictConfig) and isinstance(out["list"], omegaconf.ListConfig)
    assert OmegaConf.to_container(out["cfg"], resolve=False) == OmegaConf.to_container(cfg, resolve=False)
    assert out["cfg"].model._get_node("hidden")._value() == "${model.dim}", "kept unresolved"
    assert out["cfg"].model.hidden == 8 and out["list"][1] == 1, "and still resolves like the original"
    assert OmegaConf.is_missing(out["cfg"], "todo") and OmegaConf.is_struct(out["cfg"])
    assert out["type"] is omegaconf.DictConfig


def test_omegaconf_configs_decode_as_plain_data_without_omegaconf(tmp_path, monkeypatch):
    cfg = OmegaConf.create({"dim": 8, "hidden": "${dim}"})
    path, _ = save_and_load(tmp_path, {"cfg": cfg, "type": type(cfg)})
    monkeypatch.setitem(sys.modules, "omegaconf", None)  # import omegaconf now raises ImportError
    out = lazyckpt.load(path)
    assert out == {"cfg": {"dim": 8, "hidden": "${dim}"}, "type": "DictConfig"}


def test_decoding_imports_no_module_the_file_names(tmp_path):
    path, _ = save_and_load(tmp_path, {"type": omegaconf.DictConfig})
    edit_manifest(pathlib.Path(path) / RANK0, lambda doc: doc.update(tree={"$omegaconf_type": "os"}))
    with pytest.raises(lazyckpt.CheckpointFormatError, match="not an OmegaConf container type"):
        lazyckpt.load(path, verify=False)


def test_numpy_string_arrays_round_trip_with_dtype_and_shape(tmp_path):
    state = {"names": np.array([["ab", "ü"], ["", "xyz"]]), "raw": np.array([b"\x00a", b"b"]),
             "empty": np.zeros((0, 3), dtype="<U4")}
    _, out = save_and_load(tmp_path, state)
    for key, expected in state.items():
        assert out[key].dtype == expected.dtype and out[key].shape == expected.shape, key
        np.testing.assert_array_equal(out[key], expected)


def test_tuple_keys_round_trip_and_never_collide_with_str_keys(tmp_path):
    state = {("a", 1): torch.tensor(1.0), "('a', 1)": torch.tensor(2.0), (("x", None), 2.5, True): {"v": 3},
             "plain": {(0, 1): [torch.tensor(4)]}}
    _, out = save_and_load(tmp_path, state)
    assert_tree_equal(out, state)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr", "csc", "bsr"])
def test_sparse_tensors_round_trip_with_their_layout(tmp_path, layout):
    dense = torch.zeros(4, 6)
    dense[0, 1], dense[2, 4], dense[3, 0] = 1.5, -2.0, 3.0
    sparse = {"coo": dense.to_sparse(), "csr": dense.to_sparse_csr(), "csc": dense.to_sparse_csc(),
              "bsr": dense.to_sparse_bsr((2, 2))}[layout]
    _, out = save_and_load(tmp_path, {"w": sparse, "next": dense})
    assert out["w"].layout == sparse.layout
    assert torch.equal(out["w"].to_dense(), dense) and torch.equal(out["next"], dense)


def test_an_uncoalesced_sparse_tensor_stays_uncoalesced(tmp_path):
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 1]]), torch.tensor([1.0, 2.0]), (2, 2),
                                     check_invariants=True)
    _, out = save_and_load(tmp_path, {"w": sparse})
    assert not out["w"].is_coalesced() and torch.equal(out["w"].to_dense(), sparse.to_dense())


def test_sparse_indices_outside_the_shape_are_refused_at_load(tmp_path):
    sparse = torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.tensor([1.0]), (2, 2), check_invariants=True)
    path, _ = save_and_load(tmp_path, {"w": sparse})
    edit_manifest(pathlib.Path(path) / RANK0, lambda doc: doc["tree"]["$dict"][0][1]["$sparse"].update(size=[1, 1]))
    with pytest.raises(lazyckpt.CheckpointFormatError, match="sparse"):
        lazyckpt.load(path)


def test_check_storable_names_the_key_path_and_the_fix():
    hparams = {"lr": 0.1, "cfg": OmegaConf.create({"a": 1}), "loss": {"fn": torch.nn.MSELoss()}}
    with pytest.raises(lazyckpt.UnsupportedValueError,
                       match=r"state\['loss'\]\['fn'\].*MSELoss.*save_hyperparameters\(ignore=\['loss'\]\)"):
        lazyckpt.check_storable(hparams, what="the hyper-parameters",
                                fix="self.save_hyperparameters(ignore=[{key!r}])")
    lazyckpt.check_storable({"lr": 0.1, "cfg": hparams["cfg"]})
