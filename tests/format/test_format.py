"""The strict reader: corruption, truncation and every malformed header or manifest give a clear error that
names the file, and ``verify`` refuses exactly what ``load`` refuses."""

from __future__ import annotations

import os
import struct

import pytest
import torch

import lazyckpt
from lazyckpt.format.manifest import MAX_MANIFEST_BYTES

from helpers.forge import FILE, RANK0, downgrade, edit_header, edit_manifest, read_json, reseal
from conftest import assert_tree_equal


@pytest.fixture
def saved(tmp_path):
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64), "n": 1}
    with lazyckpt.LazyCheckpointer(tmp_path / "c") as ckpt:
        path = ckpt.save(state, step=1).wait()
    return path


def load_and_verify_refuse(path, error=lazyckpt.CheckpointFormatError, match=None):
    """Both readers refuse, with the same message."""
    with pytest.raises(error, match=match) as loaded:
        lazyckpt.load(path)
    with pytest.raises(error, match=match) as verified:
        lazyckpt.verify(path)
    assert str(loaded.value) == str(verified.value)
    return str(loaded.value)


def patch_file(path, offset_from_end, data):
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(data)


def shift_later_tensor(header, delta):
    later = max(("a", "b"), key=lambda k: header[k]["data_offsets"][0])
    start, end = header[later]["data_offsets"]
    header[later]["data_offsets"] = [start + delta, end + delta]


def test_a_flipped_tensor_byte_is_detected_and_names_file_and_tensor(saved):
    patch_file(os.path.join(saved, FILE), 10, b"\xff")
    load_and_verify_refuse(saved, lazyckpt.CheckpointCorruptError, rf"{FILE}: tensor '(a|b)'.*chunk 0")
    assert lazyckpt.load(saved, verify=False)["n"] == 1, "verify=False skips the chunk checksums"


def test_truncation_is_detected(saved):
    path = os.path.join(saved, FILE)
    os.truncate(path, os.path.getsize(path) - 7)
    load_and_verify_refuse(saved, match=f"{FILE}: file truncated")


@pytest.mark.parametrize("mutate, message", [
    (lambda h: h["a"].update(dtype="FB2"), f"{FILE}: tensor 'a'.*unknown dtype 'FB2'"),
    (lambda h: h["a"].update(data_offsets=[0, 8]), f"{FILE}: tensor 'a'.*do not match"),
    (lambda h: shift_later_tensor(h, -8), f"{FILE}: tensor '(a|b)' overlaps"),
    (lambda h: h["a"].update(shape=[-1]), f"{FILE}: tensor 'a' has a bad shape"),
    (lambda h: h.pop("b"), f"{FILE}.*(hole|trailing|disagree)"),
    (lambda h: h.update(__metadata__={"format": 1}), f"{FILE}: __metadata__ must map strings to strings"),
])
def test_malformed_headers_give_errors_naming_file_and_tensor(saved, mutate, message):
    edit_header(saved, mutate)
    load_and_verify_refuse(saved, match=message)


def test_a_changed_header_byte_is_detected_by_its_checksum(saved):
    path = os.path.join(saved, FILE)
    with open(path, "r+b") as f:
        f.seek(4000)  # header padding: still valid JSON, so only the checksum can tell
        f.write(b"\t")
    load_and_verify_refuse(saved, match=f"{FILE}: header is corrupt.*header_sha256")


def test_oversized_or_overlong_header_lengths_are_refused(saved):
    path = os.path.join(saved, FILE)
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    load_and_verify_refuse(saved, match=f"{FILE}: header length .* exceeds")
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", os.path.getsize(path)))
    load_and_verify_refuse(saved, match="past the end")


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "..", "a/b.safetensors"])
def test_file_references_outside_the_checkpoint_are_refused(saved, name):
    edit_manifest(os.path.join(saved, RANK0), lambda d: d.update(file=name))
    load_and_verify_refuse(saved, match=f"{RANK0}.*plain file name")


def test_missing_tensor_file_and_manifest_disagreement_are_reported(saved):
    edit_manifest(os.path.join(saved, RANK0), lambda d: d["tensors"]["a"].update(shape=[999]))
    load_and_verify_refuse(saved, match="disagree about tensor 'a'")
    os.remove(os.path.join(saved, FILE))
    load_and_verify_refuse(saved, match=f"{FILE} is missing")


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format_version=99), "format version 99.*cannot read"),
    (lambda d: d.update(format="other"), "field 'format' is 'other'"),
    (lambda d: d.update(world_size=2), "field 'ranks' must list one rank manifest per rank"),
    (lambda d: d.update(extra=1), r"unknown \['extra'\]"),
    (lambda d: d.pop("library_version"), r"missing \['library_version'\]"),
])
def test_malformed_top_manifests_give_errors_naming_the_field(saved, mutate, message):
    edit_manifest(os.path.join(saved, "manifest.json"), mutate)
    load_and_verify_refuse(saved, match=f"manifest.json.*{message}")


AB = [["a", {"$tensor": "a"}], ["b", {"$tensor": "b"}]]
"""The fixture's tensors, each referred to at its own key path (every stored tensor belongs to the tree)."""


@pytest.mark.parametrize("tree, message", [
    ({"$dict": [*AB, ["x", {"__reduce__": ["os.system", ["id"]]}]]}, r"tree at state\['x'\]: unknown node"),
    ({"$dict": [*AB, ["w", {"$tensor": "../../etc/passwd"}]]}, r"tree at state\['w'\]: refers to tensor '../../etc/passwd'"),
    ({"$dict": [*AB, ["p", {"$pickle": "gASV"}]]}, r"tree at state\['p'\]: unknown node"),
    ({"$dict": [["a", {"$complex": [{"$tensor": "a"}, 0]}], AB[1]]}, r"tree at state\['a'\]: expected a number"),
    ({"$dict": [["a", {"$tensor": "b"}], ["b", {"$tensor": "a"}], ["n", 1]]},
     r"tree at state\['a'\]: refers to tensor 'b', but the tensor saved at this key path is named 'a'"),
    ({"$dict": [["a", {"$tensor": "a"}], ["c", {"$tensor": "b"}], ["n", 1]]},
     r"tree at state\['c'\]: refers to tensor 'b', but the tensor saved at this key path is named 'c'"),
    ({"$dict": [AB[1], ["n", 1]]}, r"the tree refers to none of the stored tensors \['a'\]"),
    ({"$dict": [AB[1], ["a", 7], ["n", 1]]}, r"the tree refers to none of the stored tensors \['a'\]"),
    ({"$dict": [*AB, ["a", 7], ["n", 1]]}, r"tree at state: dict key 'a' is repeated"),
    ({"$dict": [*AB, ["n", 1], ["n", 1]]}, r"tree at state: dict key 'n' is repeated"),
])
def test_verify_refuses_every_tree_that_load_refuses(saved, tree, message):
    edit_manifest(os.path.join(saved, RANK0), lambda d: d.update(tree=tree))
    load_and_verify_refuse(saved, match=f"{RANK0}: {message}")


def test_a_flipped_byte_in_a_manifest_key_is_detected(saved):
    path = os.path.join(saved, RANK0)
    raw = open(path, "rb").read()
    at = raw.index(b'"n"') + 1  # the dict key "n" of the tree
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"m")
    load_and_verify_refuse(saved, match=f"{RANK0} is corrupt.*manifest_sha256")


def test_a_manifest_larger_than_the_limit_is_refused_before_reading(saved):
    os.truncate(os.path.join(saved, RANK0), MAX_MANIFEST_BYTES + 1)  # sparse: reading it would take seconds
    load_and_verify_refuse(saved, match=f"{RANK0} holds {MAX_MANIFEST_BYTES + 1} bytes, more than")


@pytest.mark.parametrize("name", [RANK0, FILE, "manifest.json"])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(saved, name):
    os.remove(os.path.join(saved, name))
    os.mkfifo(os.path.join(saved, name))
    load_and_verify_refuse(saved, match=f"{name} is not a regular file")


@pytest.mark.parametrize("name", [RANK0, "manifest.json"])
def test_manifests_linked_from_outside_the_checkpoint_are_refused(saved, tmp_path, name):
    outside = tmp_path / f"elsewhere-{name}"
    os.replace(os.path.join(saved, name), outside)
    os.symlink(outside, os.path.join(saved, name))
    load_and_verify_refuse(saved, match=f"{name} is a symbolic link")


def test_a_link_to_a_checkpoint_directory_is_followed(saved, tmp_path):
    os.symlink(saved, tmp_path / "last")
    assert lazyckpt.load(tmp_path / "last")["n"] == 1


def test_partial_or_missing_directories_are_not_checkpoints(tmp_path, saved):
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match="not a committed"):
        lazyckpt.load(tmp_path / "nowhere")
    partial = tmp_path / "c" / "step-0000009.partial"
    partial.mkdir()
    with pytest.raises(lazyckpt.CheckpointNotFoundError):
        lazyckpt.verify(partial)
    assert lazyckpt.latest(tmp_path / "c") == saved


def test_latest_ignores_steps_whose_manifest_is_not_a_regular_file(tmp_path, saved):
    fake = tmp_path / "c" / "step-0000099"
    fake.mkdir()
    os.symlink(os.path.join(saved, "manifest.json"), fake / "manifest.json")
    assert lazyckpt.latest(tmp_path / "c") == saved


@pytest.mark.parametrize("version", [1, 2, 3])
def test_checkpoints_of_earlier_format_versions_stay_readable(saved, version):
    expected = lazyckpt.load(saved)
    downgrade(saved, version)
    assert read_json(os.path.join(saved, RANK0))["format_version"] == version
    assert_tree_equal(lazyckpt.load(saved), expected)
    lazyckpt.verify(saved)


def test_a_version_2_manifest_relabelled_as_version_1_is_refused(saved):
    downgrade(saved, 2)
    edit_manifest(os.path.join(saved, RANK0), lambda d: d.update(format_version=1), seal=False)
    load_and_verify_refuse(saved, match=r"unknown \['header_sha256', 'manifest_sha256'\]")


def test_resealing_an_unchanged_checkpoint_keeps_it_valid(saved):
    """The forging helper the other tests rely on changes nothing by itself."""
    expected = lazyckpt.load(saved)
    reseal(saved)
    assert_tree_equal(lazyckpt.load(saved), expected)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_checkpoint_written_by_an_earlier_format_version_loads_and_verifies(tmp_path, version):
    """tests/format/data/format-vN was written by the release of format version N (1: no seals; 2: seals, no
    sharding; 3: sharding, no aliases)."""
    import math
    import shutil

    path = shutil.copytree(os.path.join(os.path.dirname(__file__), "data", f"format-v{version}", "step-0000007"),
                           tmp_path / "step-0000007")
    state = lazyckpt.load(path)
    assert torch.equal(state["model"]["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(state["model"]["b"], torch.ones(2, dtype=torch.bfloat16))
    assert state["step"] == 7 and state["pair"] == (1, "x") and math.isnan(state["lr"])
    lazyckpt.verify(path)


def test_a_version_3_manifest_relabelled_as_version_2_is_refused(saved):
    """A version-2 reader would take a shard for a whole tensor: version 3's boxes must never pass as version 2."""
    downgrade(saved, 3)
    edit_manifest(os.path.join(saved, RANK0), lambda d: d.update(format_version=2))
    load_and_verify_refuse(saved, match=r"unknown \['box'\]")
