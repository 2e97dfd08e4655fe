"""The strict reader: corruption, truncation and every malformed header or manifest give a clear error."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

import lazyckpt
from lazyckpt.format import read_header

FILE = "rank-00000-of-00001.safetensors"


@pytest.fixture
def saved(tmp_path):
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64), "n": 1}
    with lazyckpt.LazyCheckpointer(tmp_path / "c") as ckpt:
        path = ckpt.save(state, step=1).wait()
    return path


def patch_file(path, offset_from_end, data):
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(data)


def rewrite_header(path, mutate):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        rest = f.read()
    mutate(header)
    body = json.dumps(header).encode()
    body = body.ljust(n, b" ") if len(body) <= n else body
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + rest)


def shift_later_tensor(header, delta):
    later = max(("a", "b"), key=lambda k: header[k]["data_offsets"][0])
    start, end = header[later]["data_offsets"]
    header[later]["data_offsets"] = [start + delta, end + delta]


def rewrite_json(path, mutate):
    doc = json.load(open(path))
    mutate(doc)
    json.dump(doc, open(path, "w"))


def test_a_flipped_byte_is_detected_and_names_file_and_tensor(saved):
    patch_file(os.path.join(saved, FILE), 10, b"\xff")
    with pytest.raises(lazyckpt.CheckpointCorruptError, match=rf"{FILE}.*tensor '(a|b)'.*chunk 0"):
        lazyckpt.load(saved)
    with pytest.raises(lazyckpt.CheckpointCorruptError):
        lazyckpt.verify(saved)
    assert lazyckpt.load(saved, verify=False)["n"] == 1, "verify=False skips the checksums"


def test_truncation_is_detected(saved):
    path = os.path.join(saved, FILE)
    os.truncate(path, os.path.getsize(path) - 7)
    with pytest.raises(lazyckpt.CheckpointFormatError, match="truncated"):
        lazyckpt.load(saved)


@pytest.mark.parametrize("mutate, message", [
    (lambda h: h["a"].update(dtype="F33"), "unknown dtype 'F33'"),
    (lambda h: h["a"].update(data_offsets=[0, 8]), "do not match"),
    (lambda h: shift_later_tensor(h, -8), "overlaps"),
    (lambda h: h["a"].update(shape=[-1]), "bad shape"),
    (lambda h: h.pop("b"), "hole|trailing|disagree"),
])
def test_malformed_headers_give_clear_errors(saved, mutate, message):
    rewrite_header(os.path.join(saved, FILE), mutate)
    with pytest.raises(lazyckpt.CheckpointFormatError, match=message):
        lazyckpt.load(saved)


def test_oversized_or_overlong_header_lengths_are_refused(saved):
    path = os.path.join(saved, FILE)
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    with pytest.raises(lazyckpt.CheckpointFormatError, match="exceeds"):
        read_header(path)
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", os.path.getsize(path)))
    with pytest.raises(lazyckpt.CheckpointFormatError, match="past the end"):
        read_header(path)


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "..", "a/b.safetensors"])
def test_file_references_outside_the_checkpoint_are_refused(saved, name):
    rewrite_json(os.path.join(saved, "rank-00000.json"), lambda d: d.update(file=name))
    with pytest.raises(lazyckpt.CheckpointFormatError, match="plain file name"):
        lazyckpt.load(saved)


def test_missing_tensor_file_and_manifest_disagreement_are_reported(saved):
    rewrite_json(os.path.join(saved, "rank-00000.json"), lambda d: d["tensors"]["a"].update(shape=[999]))
    with pytest.raises(lazyckpt.CheckpointFormatError, match="disagree about tensor 'a'"):
        lazyckpt.load(saved)
    os.remove(os.path.join(saved, FILE))
    with pytest.raises(lazyckpt.CheckpointFormatError, match="missing"):
        lazyckpt.load(saved)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format_version=99), "format_version 99"),
    (lambda d: d.update(format="other"), "'format'"),
    (lambda d: d.update(world_size=2), "one manifest per rank"),
])
def test_malformed_manifests_give_clear_errors(saved, mutate, message):
    rewrite_json(os.path.join(saved, "manifest.json"), mutate)
    with pytest.raises(lazyckpt.CheckpointFormatError, match=message):
        lazyckpt.load(saved)


def test_partial_or_missing_directories_are_not_checkpoints(tmp_path, saved):
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match="not a committed"):
        lazyckpt.load(tmp_path / "nowhere")
    partial = tmp_path / "c" / "step-0000009.partial"
    partial.mkdir()
    with pytest.raises(lazyckpt.CheckpointNotFoundError):
        lazyckpt.load(partial)
    assert lazyckpt.latest(tmp_path / "c") == saved


def test_the_tree_decoder_rejects_unknown_tags(saved):
    rewrite_json(os.path.join(saved, "rank-00000.json"), lambda d: d.update(tree={"$pickle": "gASV"}))
    with pytest.raises(lazyckpt.CheckpointFormatError, match="unknown node"):
        lazyckpt.load(saved)
