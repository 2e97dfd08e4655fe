"""The strict reader refuses malformed manifests, headers and tree nodes with CheckpointFormatError, never with
a stray exception, an import, or a read outside the checkpoint directory (docs/FORMAT.md)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch

import lazyckpt
from lazyckpt.engine import LazyCheckpointer
from lazyckpt.errors import CheckpointFormatError


def _committed(tmp_path, state):
    with LazyCheckpointer(tmp_path / "run", copy_backend="cpu", fsync=False) as ckpt:
        return ckpt.save(state, step=1).wait(timeout=30)


def _edit_json(path, fn):
    with open(path) as f:
        doc = json.load(f)
    fn(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


def _edit_header(file_path, fn):
    with open(file_path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    fn(header)
    body = json.dumps(header).encode()
    with open(file_path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + raw[8 + n :])


def _tensor_key(doc):
    return next(iter(doc["tensors"]))


@pytest.mark.parametrize("field", ["dtype", "shape"])
def test_a_tensor_entry_missing_a_field_is_a_format_error(tmp_path, field):
    path = _committed(tmp_path, {"w": torch.ones(4)})
    _edit_json(os.path.join(path, "rank-00000.json"), lambda d: d["tensors"][_tensor_key(d)].pop(field))
    with pytest.raises(CheckpointFormatError):
        lazyckpt.load(path)


def test_a_rank_manifest_without_a_tree_is_a_format_error(tmp_path):
    path = _committed(tmp_path, {"w": torch.ones(4)})
    _edit_json(os.path.join(path, "rank-00000.json"), lambda d: d.pop("tree"))
    with pytest.raises(CheckpointFormatError):
        lazyckpt.load(path)


def test_a_header_dtype_that_is_not_a_string_is_a_format_error(tmp_path):
    path = _committed(tmp_path, {"w": torch.ones(4)})
    file_path = os.path.join(path, "rank-00000-of-00001.safetensors")
    _edit_header(file_path, lambda h: h[next(k for k in h if k != "__metadata__")].update(dtype=["F32"]))
    with pytest.raises(CheckpointFormatError):
        lazyckpt.verify(path)


def test_an_empty_tensor_with_a_huge_dimension_is_a_format_error(tmp_path):
    path = _committed(tmp_path, {"e": torch.empty(0, 3)})
    shape = [0, 2**63]
    _edit_header(os.path.join(path, "rank-00000-of-00001.safetensors"),
                 lambda h: h[next(k for k in h if k != "__metadata__")].update(shape=shape))
    _edit_json(os.path.join(path, "rank-00000.json"), lambda d: d["tensors"][_tensor_key(d)].update(shape=shape))
    with pytest.raises(CheckpointFormatError):
        lazyckpt.load(path)


@pytest.mark.parametrize("node", [
    {"$np_scalar": {"dtype": "|i1", "value": 100000}},                        # OverflowError
    {"$torch_device": "not-a-device"},                                        # RuntimeError
    {"$inline": {"dtype": "F32", "shape": [-1, -1], "data": "AAAAAA=="}},     # RuntimeError (reshape)
    {"$inline": {"dtype": "F32", "shape": [0, 10**20], "data": ""}},          # OverflowError (np.prod)
    {"$inline": {"dtype": "F32", "shape": [2**32, 2**32], "data": ""}},       # int64 product wraps to 0
], ids=["np_scalar_overflow", "bad_device", "inline_negative_shape", "inline_huge_shape", "inline_wrapping_shape"])
def test_malformed_tree_nodes_are_format_errors(tmp_path, node):
    path = _committed(tmp_path, {"w": torch.ones(4)})
    _edit_json(os.path.join(path, "rank-00000.json"), lambda d: d.update(tree={"$dict": [["x", node]]}))
    with pytest.raises(CheckpointFormatError):
        lazyckpt.load(path)


def test_deeply_nested_manifest_is_a_format_error(tmp_path):
    path = _committed(tmp_path, {"w": torch.ones(4)})
    manifest = os.path.join(path, "rank-00000.json")
    with open(manifest) as f:
        text = f.read()
    with open(manifest, "w") as f:
        f.write(text[:-1] + ',"deep":' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(CheckpointFormatError):
        lazyckpt.load(path)


def test_a_sealed_tree_nested_deeper_than_any_save_writes_is_a_format_error_not_a_recursion_error(tmp_path):
    from helpers.forge import edit_manifest, reseal

    path = _committed(tmp_path, {"w": torch.ones(4)})
    deep = 0
    for _ in range(300):  # 300 nested tuples, 600 JSON levels: inside JSON's limits, past what a save writes
        deep = {"$tuple": [deep]}
    edit_manifest(os.path.join(path, "rank-00000.json"), lambda doc: doc["tree"]["$dict"].append(["deep", deep]))
    reseal(path)
    for read in (lazyckpt.load, lazyckpt.verify):
        with pytest.raises(CheckpointFormatError, match="nests 6.. levels deep, more than the 508"):
            read(path)


def test_decoding_a_torch_dtype_tag_imports_no_module(tmp_path):
    code = (
        "import sys, torch\n"
        "from lazyckpt.tree.decode import unflatten\n"
        "from lazyckpt.errors import CheckpointFormatError\n"
        "assert 'torch.onnx' not in sys.modules\n"
        "try:\n    unflatten({'$torch_dtype': 'onnx'}, {})\nexcept CheckpointFormatError:\n    pass\n"
        "print('torch.onnx' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "decoding a $torch_dtype tag imported torch.onnx"


def test_a_symlinked_tensor_file_is_not_read_outside_the_checkpoint(tmp_path):
    path = _committed(tmp_path, {"w": torch.ones(4)})
    inside = os.path.join(path, "rank-00000-of-00001.safetensors")
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(inside, outside)
    os.symlink(outside, inside)
    with pytest.raises(CheckpointFormatError):
        lazyckpt.load(path)
