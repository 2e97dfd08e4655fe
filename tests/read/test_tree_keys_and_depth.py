"""Readers of trees a save writes: the deepest state save() accepts loads and verifies however deep in a program's
stack the reader is called, and a tensor's key is its key path written one way (docs/FORMAT.md rules 9 and 21),
whatever the process computed before; keys an older writer wrote for int-subclass dict keys still read."""

from __future__ import annotations

import dataclasses
import enum
import json
import os

import pytest
import torch

import lazyckpt
from helpers.forge import edit_manifest
from lazyckpt.cli import main
from lazyckpt.errors import CheckpointFormatError
from lazyckpt.tree import paths


@dataclasses.dataclass
class Node:
    child: object


class Level(int, enum.Enum):
    LOW = 1
    HIGH = 2


def _chain(depth):
    value = torch.arange(3.0) + 1
    for _ in range(depth):
        value = Node(value)
    return value


def _called_deep(frames, fn):
    return fn() if frames == 0 else _called_deep(frames - 1, fn)


def _save(dirpath, state):
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        return ckpt.save(state, step=1).wait()


def _rank_tensors(path):
    with open(os.path.join(path, "rank-00000.json")) as f:
        return sorted(json.load(f)["tensors"])


def test_the_deepest_state_save_accepts_loads_and_verifies_150_frames_down(tmp_path, capsys):
    with pytest.raises(lazyckpt.UnsupportedValueError, match="deeper than 100 levels"):
        _save(tmp_path / "too-deep", {"deep": _chain(100)})
    path = _save(tmp_path / "run", {"deep": _chain(99)})  # the deepest chain save() accepts
    loaded = _called_deep(150, lambda: lazyckpt.load(path))["deep"]
    for _ in range(99):
        loaded = loaded["child"]
    assert torch.equal(loaded, torch.arange(3.0) + 1)
    _called_deep(150, lambda: lazyckpt.verify(path))
    for rank in (0, 3):  # rank 3: the checkpoint has no part for it, so its PerRank values are dropped
        into = _called_deep(150, lambda: lazyckpt.load_into(path, {"deep": _chain(99)}, rank=rank))["deep"]
        for _ in range(99):
            into = into["child"]
        assert torch.equal(into, torch.arange(3.0) + 1)
    capsys.readouterr()
    assert _called_deep(150, lambda: main(["verify", path])) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "Recursion" not in out.out + out.err


def test_an_int_subclass_key_is_written_as_its_digits_and_loads_in_a_fresh_process_state(tmp_path):
    path = _save(tmp_path / "run", {"per_level": {Level.LOW: torch.ones(2), Level.HIGH: torch.full((2,), 2.0)}})
    assert _rank_tensors(path) == ["per_level/[1]", "per_level/[2]"]  # rule 9: [i], never "[Level.LOW]"
    paths._cached.cache_clear()  # as a fresh process: nothing the writer computed
    loaded = lazyckpt.load(path)["per_level"]
    assert list(loaded) == [1, 2] and torch.equal(loaded[1], torch.ones(2)) and torch.equal(loaded[2], 2 * torch.ones(2))


def _old_key_part(part):  # what writers wrote before rule 9 was enforced for int subclasses
    if isinstance(part, int):
        return f"[{part}]"
    if isinstance(part, tuple):
        return f"({paths.quote(repr(part), safe='')})"
    return paths.quote(part, safe="")


@pytest.fixture
def legacy(tmp_path, monkeypatch):
    """A checkpoint an older writer saved: an int-subclass key's text in its tensor keys."""
    paths._cached.cache_clear()
    with monkeypatch.context() as patch:
        patch.setattr(paths, "_key_part", _old_key_part)
        path = _save(tmp_path / "old", {"per_level": {Level.LOW: torch.ones(2), Level.HIGH: torch.full((2,), 2.0),
                                                      3: torch.full((2,), 3.0)}, "w": torch.full((2,), 4.0)})
    paths._cached.cache_clear()
    assert _rank_tensors(path) == ["per_level/[3]", "per_level/[Level.HIGH]", "per_level/[Level.LOW]", "w"]
    return path


def test_keys_an_older_writer_wrote_for_int_subclass_keys_still_load_and_verify(legacy):
    loaded = lazyckpt.load(legacy)["per_level"]
    assert {k: v[0].item() for k, v in loaded.items()} == {1: 1.0, 2: 2.0, 3: 3.0}
    lazyckpt.verify(legacy)


def _refer(path, at, key):
    def mutate(doc):
        pairs = doc["tree"]["$dict"][0][1]["$dict"] if at != "w" else doc["tree"]["$dict"]
        for pair in pairs:
            if pair[0] == at:
                pair[1] = {"$tensor": key}
    edit_manifest(os.path.join(path, "rank-00000.json"), mutate)


@pytest.mark.parametrize("at, key", [
    (1, "per_level/[3]"),            # to a plain int sibling's tensor
    (3, "per_level/[Level.LOW]"),    # one text for two ints: a copy of another entry's tensor
    (1, "w"),                        # to another path altogether
    ("w", "per_level/[Level.LOW]"),  # a str part is never an int's text
])
def test_a_redirected_reference_is_refused_under_the_older_keys_too(legacy, at, key):
    _refer(legacy, at, key)
    with pytest.raises(CheckpointFormatError, match="the tree was changed after it was written"):
        lazyckpt.load(legacy)
    with pytest.raises(CheckpointFormatError):
        lazyckpt.verify(legacy)


def test_keys_of_equal_tuple_keys_of_other_types_do_not_depend_on_what_the_process_computed_first(tmp_path):
    a = _save(tmp_path / "a", {"d": {(1, "x"): torch.ones(2)}})
    b = _save(tmp_path / "b", {"d": {(1.0, "x"): torch.full((2,), 2.0)}})  # (1.0, "x") == (1, "x"), another key
    assert _rank_tensors(a) == ["d/(%281%2C%20%27x%27%29)"] and _rank_tensors(b) == ["d/(%281.0%2C%20%27x%27%29)"]
    for _ in range(2):  # in this process, then as in a fresh one
        assert torch.equal(lazyckpt.load(a)["d"][(1, "x")], torch.ones(2))
        assert torch.equal(lazyckpt.load(b)["d"][(1.0, "x")], torch.full((2,), 2.0))
        paths._cached.cache_clear()


def test_a_device_of_a_backend_the_reader_renamed_still_loads(tmp_path):
    """torch_npu and the like rename the privateuse1 backend when imported: "privateuseone:0" then reads as
    "npu:0". Its index reads back as written, so the checkpoint is valid (only the index is compared)."""
    import subprocess
    import sys

    with lazyckpt.LazyCheckpointer(tmp_path / "ckpt") as ckpt:
        path = ckpt.save({"device": torch.device("privateuseone", 0)}, step=1).wait()
    code = ("import sys, torch, lazyckpt; torch.utils.rename_privateuse1_backend('npu'); "
            "print(lazyckpt.load(sys.argv[1])['device'])")
    result = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "npu:0"
