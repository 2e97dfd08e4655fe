"""Resuming through a fetch (Lightning's way): a damaged newest remote step, and a step pruned mid-fetch."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import lazyckpt
from helpers.remote import moto_endpoint, s3_remote  # noqa: F401 - fixtures
from lazyckpt.levels.remote.fetch import newest_on_this_node
from lazyckpt.storage.fsspec import FsspecStorage


def _uploaded(tmp_path, url, options, steps):
    with lazyckpt.LazyCheckpointer(tmp_path / "node-a", remote=url, storage_options=options) as ckpt:
        return {s: ckpt.save({"w": torch.full((64,), float(s))}, step=s).wait_remote() for s in steps}


def _damage(url, options, step_url):
    storage = FsspecStorage(url, options)
    tensor_file = storage._path(f"{step_url}/rank-00000-of-00001.safetensors")
    data = bytearray(storage.fs.cat_file(tensor_file))
    data[-1] ^= 0x01  # only the last chunk's checksum can tell
    storage.fs.pipe_file(tensor_file, bytes(data))


def test_a_damaged_newest_remote_step_falls_back_to_the_one_before_it(tmp_path, s3_remote, caplog):
    """Before, every relaunch downloaded the damaged newest step and failed: no resume ever again."""
    url, options = s3_remote
    steps = _uploaded(tmp_path, url, options, (1, 2, 3))
    _damage(url, options, steps[3])
    with caplog.at_level(logging.WARNING, logger="lazyckpt.levels.remote.fetch"):
        resumed = newest_on_this_node(str(tmp_path / "node-b"), url, options)
    assert resumed == str(tmp_path / "node-b" / "step-0000002")
    assert torch.equal(lazyckpt.load(resumed)["w"], torch.full((64,), 2.0)), "the older step, verified"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and steps[3] in warned[0] and "delete the damaged step" in warned[0]
    assert sorted(os.listdir(tmp_path / "node-b")) == [".lock-fetch", "step-0000002"], "no copy of the damaged one"


def test_when_no_remote_step_verifies_the_error_names_the_newest_and_the_fix(tmp_path, s3_remote):
    url, options = s3_remote
    steps = _uploaded(tmp_path, url, options, (1, 2))
    for step_url in steps.values():
        _damage(url, options, step_url)
    with pytest.raises(lazyckpt.CheckpointCorruptError) as refused:
        newest_on_this_node(str(tmp_path / "node-b"), url, options)
    message = str(refused.value)
    assert f"{steps[2]}/rank-00000-of-00001.safetensors: tensor" in message
    assert "No remote step verified (2 tried" in message and "delete the damaged step" in message
    assert lazyckpt.latest(str(tmp_path / "node-b")) is None


class _PrunedMidFetch(FsspecStorage):
    """The real remote, where a newer commit's clean-up removes the step just after its listing was read."""

    def download_file(self, path, local_path):
        self.remove_tree(path.rsplit("/", 1)[0])
        super().download_file(path, local_path)


def test_a_step_pruned_mid_fetch_is_lazyckpt_s_error_naming_the_object(tmp_path, s3_remote):
    """Before, s3fs's raw FileNotFoundError came out of the resume."""
    url, options = s3_remote
    steps = _uploaded(tmp_path, url, options, (1,))
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match=rf"{steps[1]}/\S+ vanished during the fetch.*again"):
        newest_on_this_node(str(tmp_path / "node-b"), url, options, storage=_PrunedMidFetch(url, options))
    assert lazyckpt.latest(str(tmp_path / "node-b")) is None


def test_a_fetched_step_is_durable_before_its_rename_commits_it(tmp_path, s3_remote, monkeypatch):
    """Each fetched file, then the copy's directory, is fsynced before the rename that makes it a committed local
    checkpoint (the files were never synced: a power loss after the rename could leave a committed step torn)."""
    url, options = s3_remote
    steps = _uploaded(tmp_path, url, options, (1,))
    events = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda src, dst: (events.append(("rename", os.fspath(src))),
                                                        real_rename(src, dst))[1])
    resumed = newest_on_this_node(str(tmp_path / "node-b"), url, options)
    assert resumed == str(tmp_path / "node-b" / "step-0000001") and steps[1].endswith("step-0000001")
    commit = events.index(("rename", str(tmp_path / "node-b" / "step-0000001.partial" / "step-0000001")))
    synced = {path for kind, path in events[:commit] if kind == "fsync"}
    copy = str(tmp_path / "node-b" / "step-0000001.partial" / "step-0000001")
    assert {os.path.join(copy, name) for name in os.listdir(resumed)} | {copy} <= synced, (synced, events)
