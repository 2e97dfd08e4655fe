"""Exact round trips: every dtype, layout and plain value comes back bit for bit with its type."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import pathlib

import numpy as np
import pytest
import torch

import lazyckpt
from conftest import assert_tree_equal, clone_tree, load_through, snapshot


@pytest.fixture
def save_and_load(storage_root, tmp_path):
    """Save ``state`` as step 1 on each storage backend in turn and load it back."""
    storage, root = storage_root

    def run(state, **kwargs):
        with lazyckpt.LazyCheckpointer(f"{root}/ckpt", storage=storage) as ckpt:
            path = ckpt.save(state, step=1, **kwargs).wait()
        return load_through(storage, path, tmp_path)

    return run


def test_mixed_dtypes_and_layouts_round_trip_bit_exactly(save_and_load):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "f32": torch.randn(5, 7), "f64": torch.randn(3, dtype=torch.float64), "f16": torch.randn(9).half(),
        "bf16": torch.randn(11).to(torch.bfloat16), "i64": torch.arange(-5, 5), "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "u8": torch.randint(0, 255, (13,), dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4), "scalar": torch.tensor(3.5), "transposed": base.t(), "strided": base[:, ::2],
        "view_a": base[1], "view_b": base[1:3], "special": torch.tensor([float("nan"), float("inf"), -0.0]),
        "big": torch.randn(600_000),  # more than one checksum chunk
    }
    assert_tree_equal(save_and_load(state), clone_tree(state))


def test_plain_values_keep_their_types(save_and_load):
    state = {"int": 3, "float": 2.5, "nan": float("nan"), "inf": float("-inf"), "bool": True, "none": None,
             "str": "héllo", "tuple": (1, (2, [3])), "list": [1, 2], 7: "int key", "nested": {0: {"a.b": 1}},
             "big": 2**70}
    assert_tree_equal(save_and_load(state), state)


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Hyper:
    lr: float
    name: str


def test_common_non_json_values_have_safe_typed_encodings(save_and_load):
    state = {"np_f": np.float32(1.5), "np_i": np.int64(-3), "arr": np.arange(6, dtype=np.int32).reshape(2, 3),
             "path": pathlib.Path("/a/b"), "dtype": torch.bfloat16, "device": torch.device("cpu"),
             "ns": argparse.Namespace(lr=0.1, tag="x"), "enum": Color.RED, "dc": Hyper(0.1, "h"),
             "bytes": b"\x00\xff", "set": {1, 2}, "rng": np.random.RandomState(0).get_state()}
    out = save_and_load(state)
    assert out["np_f"] == np.float32(1.5) and out["np_f"].dtype == np.float32
    assert out["np_i"].dtype == np.int64
    np.testing.assert_array_equal(out["arr"], state["arr"])
    assert out["path"] == pathlib.Path("/a/b") and out["dtype"] is torch.bfloat16
    assert out["device"] == torch.device("cpu") and out["ns"] == state["ns"]
    assert out["enum"] == "red", "an Enum comes back as its value (decoding never imports its class)"
    assert out["dc"] == {"lr": 0.1, "name": "h"}
    assert out["bytes"] == b"\x00\xff" and out["set"] == {1, 2}
    np.random.set_state(out["rng"])
    assert np.random.rand() == np.random.RandomState(0).rand()


def test_unsupported_value_is_refused_at_save_with_its_key_path(tmp_path):
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        with pytest.raises(lazyckpt.UnsupportedValueError, match=r"state\['cfg'\]\['fn'\].*function"):
            ckpt.save({"cfg": {"fn": lambda: 1}}, step=1)
        with pytest.raises(lazyckpt.UnsupportedValueError, match="key"):
            ckpt.save({1.5: 3}, step=1)


def test_keys_that_look_alike_or_like_paths_never_collide(save_and_load):
    state = {"a.b": torch.tensor(1), "a": {"b": torch.tensor(2), "/": torch.tensor(3)}, "../x": torch.tensor(4),
             "[0]": torch.tensor(5), "list": [torch.tensor(6)], "%2F": torch.tensor(7), "": torch.tensor(8)}
    assert_tree_equal(save_and_load(state), state)


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
def test_deferred_leaves_are_captured_at_the_barrier(storage_root, tmp_path, trained):
    storage, root = storage_root
    model, opt = trained
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with lazyckpt.LazyCheckpointer(root, storage=storage) as ckpt:
        pending = ckpt.save({"sched": lazyckpt.Deferred(sched.state_dict),
                             "lr": lazyckpt.Deferred(lambda: torch.tensor(opt.param_groups[0]["lr"], dtype=torch.float64))},
                            step=1, optimizers=[opt])
        sched.step()  # the loop steps the scheduler after the request fired
        expected = sched.state_dict()
        ckpt.wait_staged()
        sched.step()  # after the barrier: not part of this checkpoint
        out = load_through(storage, pending.wait(), tmp_path)
    assert out["sched"] == expected
    assert out["lr"].item() == expected["_last_lr"][0]


def test_tensor_part_is_a_valid_safetensors_file_readable_by_dcp(tmp_path, trained):
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys  # noqa: F401

    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path / "c") as ckpt:
        path = ckpt.save({"model": model.state_dict()}, step=3, optimizers=[opt]).wait()
    file = next(pathlib.Path(path).glob("*.safetensors"))
    with safe_open(str(file), framework="pt") as f:
        assert torch.equal(f.get_tensor("model/0.weight"), model[0].weight)
    metadata = HuggingFaceStorageReader(path).read_metadata()
    assert set(metadata.state_dict_metadata) == {f"model/{k}" for k in model.state_dict()}


def test_round_trip_through_the_triton_backend(tmp_path, trained):
    pytest.importorskip("triton")
    model, opt = trained
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "bf16": torch.randn(33).to(torch.bfloat16)}
    expected = clone_tree(state)
    with lazyckpt.LazyCheckpointer(tmp_path, copy_backend="triton") as ckpt:
        pending = ckpt.save(state, step=1, optimizers=[opt])
        ckpt.wait_staged()
        path = pending.wait()
    assert_tree_equal(lazyckpt.load(path), expected)
    lazyckpt.verify(path)


def _nested(depth: int):
    value = 1
    for level in range(depth):
        value = (value,) if level % 3 == 0 else [value] if level % 3 == 1 else {"k": value}
    return value


def _called_deep(frames: int, fn):
    return fn() if frames == 0 else _called_deep(frames - 1, fn)


def test_containers_nested_to_the_limit_save_and_load_even_deep_in_a_program_stack(tmp_path):
    from lazyckpt.tree.encode import MAX_DEPTH

    state = {"deep": _nested(MAX_DEPTH - 1)}  # with the top-level dict: MAX_DEPTH levels
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        path = ckpt.save(state, step=1).wait()
    assert _called_deep(150, lambda: lazyckpt.load(path)) == state  # load() called 150 frames down still decodes


def test_a_state_nested_deeper_than_the_limit_is_refused_at_save_naming_its_path(tmp_path):
    from lazyckpt.tree.encode import MAX_DEPTH

    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        with pytest.raises(lazyckpt.UnsupportedValueError, match=rf"state\['deep'\].*deeper than {MAX_DEPTH} levels"):
            ckpt.save({"deep": _nested(MAX_DEPTH + 5)}, step=1)
        assert ckpt.save({"fine": _nested(3)}, step=1).wait(), "the refused request left nothing behind"


def test_typed_values_wrapping_deep_containers_are_measured_so_what_saves_loads(tmp_path):
    """Dataclasses and namespaces wrap each container in more JSON levels than a dict: a state that is not too deep
    by its key paths can still be too deep to decode; save() measures it and refuses it, or it loads."""
    import argparse

    def wrapped(depth, make):
        value = 0
        for _ in range(depth):
            value = make(value)
        return value

    @dataclasses.dataclass
    class Node:
        child: object

    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        for step, make in enumerate((Node, lambda v: argparse.Namespace(child=v)), start=1):
            state = {"deep": wrapped(95, make)}  # 95 levels by key path: within MAX_DEPTH
            try:
                path = ckpt.save(state, step=step).wait()
            except lazyckpt.UnsupportedValueError as e:
                assert "levels deep, more than the 508" in str(e)
                continue
            lazyckpt.load(path)  # saved, so it decodes
