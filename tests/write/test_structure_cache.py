"""save() plans a state's structure once: every change of structure or of the lazy/eager split must plan anew,
and every save must still store its own bytes bit-exact with the right capture."""

from __future__ import annotations

import json
import os

import pytest
import torch

import lazyckpt
from conftest import assert_tree_equal, clone_tree, snapshot, step


def _captures(path) -> dict[str, str]:
    with open(os.path.join(path, "rank-00000.json")) as f:
        return {key: t["capture"] for key, t in json.load(f)["tensors"].items()}


def _save_and_check(ckpt, state, number, **kwargs) -> dict[str, str]:
    expected = clone_tree(state)
    path = ckpt.save(state, step=number, **kwargs).wait()
    assert_tree_equal(lazyckpt.load(path), expected)
    return _captures(path)


def _param_and_buffer(rows: int = 4, dtype=torch.float32):
    param = torch.nn.Parameter(torch.arange(rows * 3, dtype=dtype).reshape(rows, 3))
    return param, torch.full((5,), 2.0, dtype=dtype), torch.optim.SGD([param], lr=0.1)


@pytest.mark.parametrize("change", ["shape", "dtype", "key added", "key removed", "key renamed"])
def test_a_save_after_a_structure_change_is_bit_exact_and_classified_anew(tmp_path, change):
    param, buffer, opt = _param_and_buffer()
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        assert _save_and_check(ckpt, {"w": param, "b": buffer}, 1, optimizers=[opt]) == {"w": "lazy", "b": "eager"}
        if change in ("shape", "dtype"):
            param, buffer, opt = _param_and_buffer(6) if change == "shape" else _param_and_buffer(dtype=torch.float64)
            state, expected = {"w": param, "b": buffer}, {"w": "lazy", "b": "eager"}
        elif change == "key added":
            state, expected = {"w": param, "b": buffer, "c": torch.ones(2)}, {"w": "lazy", "b": "eager", "c": "eager"}
        elif change == "key removed":
            state, expected = {"w": param}, {"w": "lazy"}
        else:
            state, expected = {"w": param, "b2": buffer}, {"w": "lazy", "b2": "eager"}
        assert _save_and_check(ckpt, state, 2, optimizers=[opt]) == expected
        with torch.no_grad():
            param.add_(1.0)
        assert _save_and_check(ckpt, {"w": param, "b": buffer}, 3, optimizers=[opt]) == {"w": "lazy", "b": "eager"}


def test_the_same_structure_with_another_lazy_split_is_planned_for_that_split(tmp_path):
    param, buffer, opt = _param_and_buffer()
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        state = {"w": param, "b": buffer}
        assert _save_and_check(ckpt, state, 1, optimizers=[opt]) == {"w": "lazy", "b": "eager"}
        assert _save_and_check(ckpt, state, 2, optimizers=[opt], immutable=[buffer]) == {"w": "lazy", "b": "lazy"}
        assert _save_and_check(ckpt, state, 3) == {"w": "eager", "b": "eager"}
        copy = {"w": param.detach().clone(), "b": buffer}  # same keys and shapes, another storage: eager
        assert _save_and_check(ckpt, copy, 4, optimizers=[opt]) == {"w": "eager", "b": "eager"}
        assert _save_and_check(ckpt, state, 5, optimizers=[opt]) == {"w": "lazy", "b": "eager"}


def test_a_tensor_that_replaces_an_optimizer_tensor_in_place_of_storage_is_lazy_again(tmp_path):
    param, buffer, opt = _param_and_buffer()
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        _save_and_check(ckpt, {"w": param, "b": buffer}, 1, optimizers=[opt])
        param.data = torch.full_like(param, 9.0)  # a new storage under the same parameter
        assert _save_and_check(ckpt, {"w": param, "b": buffer}, 2, optimizers=[opt]) == {"w": "lazy", "b": "eager"}


def test_optimizer_state_that_appears_at_the_first_step_is_saved_and_lazy(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        before = _save_and_check(ckpt, snapshot(model, opt), 1, optimizers=[opt])
        assert before == {"model/weight": "lazy", "model/bias": "lazy"}
        step(torch.nn.Sequential(model), opt)
        after = _save_and_check(ckpt, snapshot(model, opt), 2, optimizers=[opt])
    moments = {k: v for k, v in after.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert len(moments) == 4 and set(moments.values()) == {"lazy"}


def test_the_structure_saved_every_time_stays_cached_through_one_off_structures():
    from lazyckpt.write.structure import _KEPT_STRUCTURES, Structure, StructureCache

    def planned(shape) -> Structure:
        return Structure(shape, (), {}, signature=str(shape))

    cache, every_time = StructureCache(), planned(("every time",))
    cache.keep(every_time)
    for one_off in range(2 * _KEPT_STRUCTURES):  # the loop's own save between one-off saves of other structures
        assert cache.find(("every time",)) is every_time
        assert cache.find(("one-off", one_off)) is None
        cache.keep(planned(("one-off", one_off)))
    assert cache.find(("every time",)) is every_time
