"""The host level (``keep_in_memory="host"``): steps commit first in a shared-memory folder that outlives the
process, reach ``dirpath`` in the background, and a restart commits what a crash kept from ``dirpath``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import lazyckpt
from lazyckpt.errors import DirectoryLockedError
from lazyckpt.format.catalog import committed_steps
from lazyckpt.format.files import MANIFEST, rank_file
from lazyckpt.levels.remote.upload import RemoteLevel
from lazyckpt.storage import LocalStorage
from lazyckpt.storage.urls import host_dir

from conftest import assert_tree_equal, clone_tree, snapshot, step as train_step

HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")


def open_host(tmp_path, **options) -> lazyckpt.LazyCheckpointer:
    return lazyckpt.LazyCheckpointer(tmp_path / "run", keep_in_memory="host", host_memory_dir=str(tmp_path / "shm"),
                                     **options)


def folder_of(tmp_path) -> str:
    return host_dir(str(tmp_path / "run"), str(tmp_path / "shm"))


def test_steps_reach_dirpath_with_its_retention_and_close_frees_the_host_folder(tmp_path, trained):
    model, opt = trained
    saved = {}
    with open_host(tmp_path, keep_last_k=2) as ckpt:
        assert ckpt.dirpath == folder_of(tmp_path)
        for s in range(1, 5):
            train_step(model, opt, seed=s)
            saved[s] = clone_tree(snapshot(model, opt))
            ckpt.save(snapshot(model, opt), step=s, optimizers=[opt]).wait()
            ckpt.wait_staged()
        ckpt.remote.drain()
        assert set(committed_steps(ckpt.dirpath)) == {4}  # the host folder keeps the newest step
    assert set(committed_steps(str(tmp_path / "run"))) == {3, 4}
    assert not os.path.exists(folder_of(tmp_path))
    assert_tree_equal(lazyckpt.load(tmp_path / "run" / "step-0000004"), saved[4])


def test_keep_on_close_leaves_the_newest_step_in_shared_memory(tmp_path, trained):
    model, opt = trained
    with open_host(tmp_path, keep_on_close=True) as ckpt:
        ckpt.save(snapshot(model, opt), step=1, optimizers=[opt]).wait()
    assert set(committed_steps(folder_of(tmp_path))) == {1}
    assert set(committed_steps(str(tmp_path / "run"))) == {1}


def _blocked_uploads(monkeypatch) -> threading.Event:
    """Fault injection: copies to ``dirpath`` wait until the returned event is set (a crash comes first)."""
    release, original = threading.Event(), RemoteLevel.upload_step

    def upload_later(self, *args, **kwargs):
        release.wait()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RemoteLevel, "upload_step", upload_later)
    return release


CRASH_AFTER_HOST_COMMIT = r"""
import os, sys, threading, torch, lazyckpt
from lazyckpt.levels.remote.upload import RemoteLevel
run, shm = sys.argv[1], sys.argv[2]
RemoteLevel.upload_step = lambda *a, **k: threading.Event().wait()  # dirpath never gets it: the crash comes first
ckpt = lazyckpt.LazyCheckpointer(run, keep_in_memory="host", host_memory_dir=shm)
torch.manual_seed(0)
state = {"w": torch.randn(1000, 100), "b": torch.arange(7), "meta": {"lr": 0.5}}
ckpt.save(state, step=7).wait()  # committed in shared memory
torch.save(state, os.path.join(shm, "..", "expected.pt"))
os._exit(0)  # no close(): the process dies with the copy to dirpath not begun
"""


def _crash_after_host_commit(tmp_path) -> dict:
    subprocess.run([sys.executable, "-c", CRASH_AFTER_HOST_COMMIT, str(tmp_path / "run"), str(tmp_path / "shm")],
                   check=True, timeout=120)
    return torch.load(tmp_path / "expected.pt")


def test_a_restart_commits_the_step_a_crash_kept_from_dirpath_then_resumes_from_it(tmp_path):
    expected = _crash_after_host_commit(tmp_path)
    run = str(tmp_path / "run")
    assert committed_steps(run) == {}  # the crash kept it from dirpath ...
    newest = lazyckpt.latest(run, host_memory_dir=str(tmp_path / "shm"))
    assert newest == os.path.join(folder_of(tmp_path), "step-0000007")  # ... but latest() sees it
    with open_host(tmp_path) as ckpt:
        assert set(committed_steps(run)) == {7}  # committed in dirpath first
        assert_tree_equal(lazyckpt.load(os.path.join(ckpt.dirpath, "step-0000007")), expected)
    assert_tree_equal(lazyckpt.load(lazyckpt.latest(run)), expected)
    assert not os.path.exists(folder_of(tmp_path))


def test_a_damaged_host_copy_is_never_committed_nor_loaded(tmp_path):
    _crash_after_host_commit(tmp_path)
    step_dir = os.path.join(folder_of(tmp_path), "step-0000007")
    tensor_file = os.path.join(step_dir, rank_file(0, 1))
    data = bytearray(open(tensor_file, "rb").read())
    data[-5] ^= 0x40  # a bit flipped in the last tensor's bytes
    open(tensor_file, "wb").write(bytes(data))
    os.makedirs(os.path.join(folder_of(tmp_path), "step-0000009.partial"))  # and a snapshot torn mid-write
    with open_host(tmp_path) as ckpt:
        assert committed_steps(str(tmp_path / "run")) == {}
        assert committed_steps(ckpt.dirpath) == {}
        assert not os.path.exists(os.path.join(ckpt.dirpath, "step-0000009.partial"))
    assert lazyckpt.latest(tmp_path / "run", host_memory_dir=str(tmp_path / "shm")) is None


def test_a_save_waits_while_the_copy_to_dirpath_lags_two_snapshots(tmp_path, monkeypatch):
    release = _blocked_uploads(monkeypatch)
    waiting, original = threading.Event(), RemoteLevel.wait_backlog

    def noted_wait(self, keep):
        waiting.set()
        return original(self, keep)

    ckpt = open_host(tmp_path)
    try:
        for s in (1, 2):
            ckpt.save({"w": torch.full((100,), float(s))}, step=s).wait()
        monkeypatch.setattr(RemoteLevel, "wait_backlog", noted_wait)
        third = threading.Thread(target=lambda: ckpt.save({"w": torch.zeros(100)}, step=3).wait())
        third.start()
        assert waiting.wait(60)
        assert set(committed_steps(ckpt.dirpath)) == {1, 2}  # step 3 is not written while two wait for the disk
        release.set()
        third.join(60)
        assert not third.is_alive()
    finally:
        release.set()
        ckpt.close()
    assert set(committed_steps(str(tmp_path / "run"))) == {1, 2, 3}


def test_a_second_job_on_the_same_dirpath_is_refused_with_or_without_the_host_level(tmp_path):
    with open_host(tmp_path):
        with pytest.raises(DirectoryLockedError):
            open_host(tmp_path)
        with pytest.raises(DirectoryLockedError):
            lazyckpt.LazyCheckpointer(tmp_path / "run")


def test_two_snapshots_must_fit_in_the_host_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(LocalStorage, "free_bytes", lambda self, path: 6_000_000)
    with open_host(tmp_path) as ckpt:
        with pytest.raises(ValueError, match=r"keep_in_memory='host' holds two snapshots of 3\.8 MiB"):
            ckpt.save({"w": torch.zeros(1_000_000)}, step=1)


@pytest.mark.parametrize(("options", "message"), [
    ({"keep_in_memory": "disk"}, r"keep_in_memory='disk' must be False, True .* or 'host'"),
    ({"host_memory_dir": "/x"}, r"host_memory_dir='/x' applies to keep_in_memory='host' only"),
    ({"keep_on_close": True, "keep_in_memory": True}, r"keep_on_close=True applies to keep_in_memory='host' only"),
    ({"keep_in_memory": "host", "remote": "memory://elsewhere"}, r"host level in front of a remote level"),
    ({"keep_in_memory": "host", "host_memory_dir": "s3://bucket/x"}, r"host_memory_dir='s3://bucket/x' must be a local"),
])
def test_bad_options_are_refused_at_construction(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        lazyckpt.LazyCheckpointer(tmp_path / "run", **options)


def test_a_custom_storage_cannot_hold_the_host_level(tmp_path):
    with pytest.raises(ValueError, match="drop storage="):
        lazyckpt.LazyCheckpointer(tmp_path / "run", storage=LocalStorage(), keep_in_memory="host",
                                  host_memory_dir=str(tmp_path / "shm"))


def test_sigkill_at_30_random_moments_resumes_from_the_newest_complete_snapshot_bit_exact(tmp_path):
    """Kills land in the recovery, the lazy copy, the host write, the copy to disk and between commits; every
    restart resumes from the newest complete step (host or disk), bit-exact, with no host folder leaked."""
    done = subprocess.run([sys.executable, os.path.join(HELPERS, "host_kills.py"), str(tmp_path / "run"),
                           str(tmp_path / "shm"), "--trials", "30", "--max-delay", "0.6"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["trials"] == 31 and counts["from_host"] >= 1, counts  # some restarts needed the host copy
    assert MANIFEST in os.listdir(lazyckpt.latest(tmp_path / "run"))
