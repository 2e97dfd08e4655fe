"""The snapshot is the state at request time: lazy tensors through the barrier, everything else eagerly."""

from __future__ import annotations

import pytest
import torch

import lazyckpt
from conftest import GatedBackend, assert_tree_equal, clone_tree, load_through, snapshot, step


def test_parameters_updated_after_the_barrier_keep_their_pre_update_value(storage_root, tmp_path, trained):
    storage, root = storage_root
    model, opt = trained
    backend = GatedBackend()
    with lazyckpt.LazyCheckpointer(root, backend=backend, storage=storage) as ckpt:
        expected = clone_tree(snapshot(model, opt))
        pending = ckpt.save(snapshot(model, opt), step=1, optimizers=[opt])
        assert not pending.done(), "save() must return before the lazy copy ran"
        backend.gate.set()
        ckpt.wait_staged()
        step(model, opt, seed=2)  # the next update, right after the barrier
        loaded = load_through(storage, pending.wait(), tmp_path)
    assert_tree_equal(loaded, expected)
    assert not torch.equal(model[0].weight, expected["model"]["0.weight"]), "the test must really update"


def test_a_buffer_mutated_by_forward_keeps_its_request_time_value(tmp_path, trained):
    model, opt = trained
    backend = GatedBackend()
    with lazyckpt.LazyCheckpointer(tmp_path, backend=backend) as ckpt:
        expected = model[1].running_mean.clone()
        pending = ckpt.save(snapshot(model, opt), step=1, optimizers=[opt])
        model(torch.randn(8, 16))  # forward in train mode updates BatchNorm running stats in place
        assert not torch.equal(model[1].running_mean, expected)
        backend.gate.set()
        loaded = lazyckpt.load(pending.wait())
    assert torch.equal(loaded["model"]["1.running_mean"], expected)


def test_only_optimizer_owned_and_declared_tensors_are_lazy(tmp_path, trained):
    model, opt = trained
    frozen = torch.nn.Linear(4, 4)
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        pending = ckpt.save({"m": model.state_dict(), "frozen": frozen.state_dict(), "rng": torch.get_rng_state()},
                            step=1, optimizers=[opt], immutable=[frozen])
        path = pending.wait()
    import json, os
    doc = json.load(open(os.path.join(path, "rank-00000.json")))
    capture = {k: v["capture"] for k, v in doc["tensors"].items()}
    assert capture["m/0.weight"] == "lazy" and capture["frozen/weight"] == "lazy"
    assert capture["m/1.running_mean"] == "eager" and capture["rng"] == "eager"


def test_an_in_place_change_inside_the_window_is_reported(tmp_path, trained):
    model, opt = trained
    backend = GatedBackend()
    ckpt = lazyckpt.LazyCheckpointer(tmp_path, backend=backend)
    pending = ckpt.save(snapshot(model, opt), step=1, optimizers=[opt])
    backend.entered.wait()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # an update before the barrier: the snapshot would be torn
    backend.gate.set()
    with pytest.raises(lazyckpt.SnapshotConsistencyError, match=r"0\.weight.*modified in place") as info:
        ckpt.wait_staged()
    assert any("step 1" in note for note in info.value.__notes__)
    assert lazyckpt.latest(tmp_path) is None, "a torn snapshot must never be committed"
    with pytest.raises(lazyckpt.SnapshotConsistencyError):
        pending.wait()  # the handle of a failed checkpoint always says so
    assert pending.failed and isinstance(pending.error, lazyckpt.SnapshotConsistencyError)
    ckpt.close()  # the error was delivered; closing does not raise it again


def test_no_optimizers_means_everything_is_copied_eagerly(tmp_path, trained):
    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        expected = clone_tree(model.state_dict())
        pending = ckpt.save(model.state_dict(), step=1)
        step(model, opt, seed=3)  # no barrier needed: nothing was lazy
        assert_tree_equal(lazyckpt.load(pending.wait()), expected)
