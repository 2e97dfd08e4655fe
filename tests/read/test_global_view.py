"""The global view of ``manifest.json`` and the rank manifests must agree, whoever reads: ``load`` of any rank,
``load_into``, ``verify`` and DCP's reader refuse a resealed manifest that lies about a block (its box, its rank,
its offsets) with a format error, and never return another block's values.

The checkpoint: two gloo ranks, a tensor sharded by rows (``Shard(0)``), a replicated one split by bytes, and a
per-rank value. Manifests are edited and resealed as docs/FORMAT.md says a writer seals them.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

import lazyckpt
from helpers.distributed import run_ranks
from helpers.forge import edit_manifest

W = torch.arange(32.0).reshape(8, 4)
B = torch.arange(6.0) + 100


def _save(rank, world_size, dirpath):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        ckpt.save({"w": distribute_tensor(W, mesh, [Shard(0)]), "b": B, "rank": lazyckpt.PerRank(rank)},
                  step=1).wait()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    dirpath = str(tmp_path_factory.mktemp("global-view") / "ckpt")
    run_ranks(_save, 2, dirpath)
    return lazyckpt.latest(dirpath)


@pytest.fixture
def copy(saved, tmp_path):
    path = str(tmp_path / "step-0000001")
    shutil.copytree(saved, path)
    return path


def _readers(path):
    """Every way to read the checkpoint back; each returns what it read as plain tensors."""
    def load(rank):
        state = lazyckpt.load(path, rank=rank)
        return {"w": state["w"], "b": state["b"]}

    def load_into():
        state = lazyckpt.load_into(path, {"w": torch.zeros(8, 4), "b": torch.zeros(6)}, rank=0)
        return {"w": state["w"], "b": state["b"]}

    def dcp():
        import torch.distributed.checkpoint as dcp

        from lazyckpt.interop.dcp import StorageReader

        state = {"w": torch.zeros(8, 4), "b": torch.zeros(6)}
        dcp.load(state, storage_reader=StorageReader(path), no_dist=True)
        return state

    def verify():
        lazyckpt.verify(path)
        return {"w": W, "b": B}

    return {"load rank 0": lambda: load(0), "load rank 1": lambda: load(1), "load_into": load_into, "dcp": dcp,
            "verify": verify}


def test_every_reader_reads_the_untouched_checkpoint(saved):
    for name, read in _readers(saved).items():
        got = read()
        assert torch.equal(got["w"], W) and torch.equal(got["b"], B), name


def _reseal(path):
    from helpers.forge import reseal

    reseal(path)


def _box_of(doc, key):
    return doc["tensors"][key]["box"]


LIES = {
    "rank 1's shard says box null": ("rank-00001.json", lambda d: d["tensors"]["w"].update(box=None)),
    "rank 1's shard says it is the whole": ("rank-00001.json", lambda d: d["tensors"]["w"].update(
        box={"global_shape": d["tensors"]["w"]["shape"], "offsets": [0, 0]})),
    "rank 1's shard claims rank 0's rows": ("rank-00001.json", lambda d: d["tensors"]["w"]["box"].update(
        offsets=[0, 0])),
    "the global view swaps the ranks of w's blocks": ("manifest.json", lambda d: [
        b.update(rank=1 - b["rank"]) for b in d["tensors"]["w"]["boxes"]]),
    "the global view swaps the offsets of w's blocks": ("manifest.json", lambda d: [
        b.update(offsets=[4 - b["offsets"][0], 0]) for b in d["tensors"]["w"]["boxes"]]),
    "the global view says rank 1 holds all of b": ("manifest.json", lambda d: d["tensors"]["b"]["boxes"][0].update(
        rank=1 - d["tensors"]["b"]["boxes"][0]["rank"])),
}


REFUSALS = ("disagree", "overlapping", "cover")


def _refused(reader: str, error: BaseException) -> bool:
    """A format error of lazyckpt's; through ``torch.distributed.checkpoint.load`` it arrives wrapped in DCP's own
    exception (DCP wraps whatever a storage reader raises), which must hold lazyckpt's errors only."""
    from torch.distributed.checkpoint.api import CheckpointException

    if reader == "dcp" and isinstance(error, CheckpointException):
        inner = [exc for exc, _ in error.failures.values()]
        return bool(inner) and all(_refused("", exc) for exc in inner)
    return isinstance(error, (lazyckpt.CheckpointFormatError, lazyckpt.CheckpointMismatchError))


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_resealed_manifest_that_lies_about_a_block_is_refused_by_every_reader(copy, lie):
    name, mutate = LIES[lie]
    edit_manifest(os.path.join(copy, name), mutate)
    _reseal(copy)
    for reader, read in _readers(copy).items():
        with pytest.raises(BaseException) as failure:
            read()
        assert _refused(reader, failure.value), f"{reader}: {failure.value!r}"
        assert any(word in str(failure.value) for word in REFUSALS), f"{reader}: {failure.value}"


def _random_lie(rng: random.Random, top: dict, ranks: list[dict]):
    """One random edit of a box field, of the global view or of a rank manifest."""
    if rng.random() < 0.5:
        key = rng.choice(sorted(top["tensors"]))
        box = rng.choice(top["tensors"][key]["boxes"])
        field = rng.choice(["rank", "offsets", "lengths"])
        if field == "rank":
            box["rank"] = rng.randrange(2)
        else:
            box[field] = [max(0, v + rng.choice([-2, -1, 1, 2])) for v in box[field]]
        return
    doc = rng.choice(ranks)
    key = rng.choice(sorted(k for k, e in doc["tensors"].items() if e.get("box")))
    box = doc["tensors"][key]["box"]
    choice = rng.randrange(3)
    if choice == 0:
        doc["tensors"][key]["box"] = None
    elif choice == 1:
        box["offsets"] = [max(0, v + rng.choice([-2, -1, 1, 2])) for v in box["offsets"]]
    else:
        box["global_shape"] = [v + rng.choice([-4, 4]) for v in box["global_shape"]]


def test_random_lies_about_blocks_give_the_true_values_or_a_format_error_never_other_values(saved, tmp_path):
    """60 random resealed edits of box fields (the long suite: ``python tests/helpers/reliability.py``)."""
    from helpers.forge import read_json, write_manifest

    rng = random.Random(7)
    outcomes = {"refused": 0, "same": 0}
    for case in range(60):
        path = str(tmp_path / f"case{case}" / "step-0000001")
        shutil.copytree(saved, path)
        names = ["manifest.json", "rank-00000.json", "rank-00001.json"]
        top, *ranks = [read_json(os.path.join(path, n)) for n in names]
        _random_lie(rng, top, ranks)
        for name, doc in zip(names, [top, *ranks]):
            write_manifest(os.path.join(path, name), doc)
        _reseal(path)
        for reader, read in _readers(path).items():
            try:
                got = read()
            except BaseException as e:  # noqa: BLE001 - only lazyckpt's own refusals (DCP wraps them in a BaseException)
                assert _refused(reader, e), f"case {case}: {reader} raised {e!r}"
                outcomes["refused"] += 1
                continue
            assert torch.equal(got["w"], W) and torch.equal(got["b"], B), f"case {case}: {reader} read other values"
            outcomes["same"] += 1
    assert outcomes["refused"] > 0, json.dumps(outcomes)
