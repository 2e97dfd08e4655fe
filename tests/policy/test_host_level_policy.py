"""The policy layer with the host level (``keep_in_memory="host"``): names and retention act on ``dirpath`` (the
disk directory the host folder is copied to), and a step a crash kept in the host folder is what a resume finds."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from helpers.host_faults import fail_copy_to_disk_once, gate_copy_to_disk

from lazyckpt.format.catalog import committed_steps
from lazyckpt.policy import CheckpointNames, CheckpointSession, SessionOptions, resume_target, run_directory
from lazyckpt.storage.urls import host_dir


def host_options(shm) -> SessionOptions:
    return SessionOptions(owner="Adapter", source="the framework",
                          engine={"keep_in_memory": "host", "host_memory_dir": str(shm), "fsync": False})


@pytest.fixture
def gated(monkeypatch):
    """The copy of step 2 to dirpath waits for ``release``: ``(reached, release)``."""
    release = threading.Event()
    reached = gate_copy_to_disk(2, release, patch=monkeypatch.setattr)
    yield reached, release
    release.set()  # whatever the test did: the uploader thread must not wait for ever


def _save(session, step):
    return session.save(step, replicated={"w": torch.full((4,), float(step))}, per_rank={})


def test_a_name_follows_the_copy_to_dirpath_not_the_commit_in_the_host_folder(tmp_path, gated):
    reached, release = gated
    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    session = CheckpointSession(ckpt, host_options(shm), rank=0, world_size=1, engine_retention=False)
    names = CheckpointNames(session, lambda step: _save(session, step))
    for step in (1, 2):
        names.plan(step, str(ckpt / "last.ckpt"))
        names.submit()
        session.barrier()
    assert reached.wait(30), "step 2 is committed in the host folder"
    names.poll(block=False)
    assert os.readlink(ckpt / "last.ckpt") == "step-0000001", "step 2 is not in dirpath yet: not named"
    release.set()
    names.poll(block=True)
    assert os.readlink(ckpt / "last.ckpt") == "step-0000002"
    assert 2 in committed_steps(str(ckpt))
    names.close(raise_errors=True)


def test_a_resume_finds_the_host_folders_newer_step_and_goes_on_in_its_dirpath(tmp_path, gated):
    reached, release = gated
    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    options = host_options(shm)
    session = CheckpointSession(ckpt, options, rank=0, world_size=1)
    _save(session, 1).wait_remote()
    _save(session, 2).wait()
    assert reached.wait(30)  # as after a crash right now: step 2 in the host folder only
    held = os.path.join(host_dir(str(ckpt), str(shm)), "step-0000002")
    assert resume_target(str(ckpt), options) == held
    assert resume_target(str(ckpt), SessionOptions(owner="Adapter", source="s")) == str(ckpt / "step-0000001")
    os.makedirs(ckpt / "run-001")  # the directory of another run below it
    assert run_directory(str(ckpt), held) == str(ckpt), "the run goes on where the host folder's step belongs"
    release.set()
    session.close()


def test_the_newest_step_a_session_gives_is_its_copy_in_dirpath_never_the_host_folders(tmp_path):
    ckpt = tmp_path / "ckpt"
    session = CheckpointSession(ckpt, host_options(tmp_path / "shm"), rank=0, world_size=1)
    _save(session, 1).wait_remote()
    assert session.newest() == str(ckpt / "step-0000001"), "what Accelerate's load_state and Fabric resume from"
    session.close()


def _first_copy_fails(tmp_path, monkeypatch):
    """A host-level session whose copy of step 1 to dirpath fails once, step 1 named ``last.ckpt`` and requested:
    ``(ckpt, session, names)``."""
    failed = fail_copy_to_disk_once(1, patch=monkeypatch.setattr)
    ckpt = tmp_path / "ckpt"
    session = CheckpointSession(ckpt, host_options(tmp_path / "shm"), rank=0, world_size=1, engine_retention=False)
    names = CheckpointNames(session, lambda step: _save(session, step))
    names.plan(1, str(ckpt / "last.ckpt"))
    names.submit()
    session.barrier()
    assert failed.wait(30)
    return ckpt, session, names


def test_a_step_whose_first_copy_failed_gets_its_names_once_its_retry_lands(tmp_path, monkeypatch):
    ckpt, session, names = _first_copy_fails(tmp_path, monkeypatch)
    names.copy(str(ckpt / "last.ckpt"), str(ckpt / "first.ckpt"))
    session.last_request.remote_done(wait=True)
    names.poll()
    assert not (ckpt / "first.ckpt").exists(), "step 1 is not in dirpath: no name yet"
    names.plan(2, str(ckpt / "last.ckpt"))
    with pytest.raises(OSError, match="injected"):  # the failed copy is reported at the next save
        names.submit()  # its commit queues the retry of step 1's copy, before step 2's
    names.poll(block=True)
    assert os.readlink(ckpt / "first.ckpt") == "step-0000001", "the name followed the retried copy"
    assert os.readlink(ckpt / "last.ckpt") == "step-0000002"
    assert sorted(committed_steps(str(ckpt))) == [1, 2]
    names.close(raise_errors=True)


def test_a_failed_copy_is_retried_when_the_run_ends_before_another_commit(tmp_path, monkeypatch):
    ckpt, _, names = _first_copy_fails(tmp_path, monkeypatch)
    names.poll(block=True)  # the end of a fit: no commit comes to queue the retry, so the wait queues it
    assert os.readlink(ckpt / "last.ckpt") == "step-0000001"
    with pytest.raises(OSError, match="injected"):  # the first failure is still reported
        names.close(raise_errors=True)
    assert 1 in committed_steps(str(ckpt))
