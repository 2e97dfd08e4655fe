"""The host level's disk directory: its committed steps are the checkpointer's own even when the host folder holds
none of them (after a clean close it is empty): never overwritten, never passed by a lower step, removed by
``remove()``."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import lazyckpt
from lazyckpt.format.catalog import committed_steps
from lazyckpt.storage.urls import host_dir


def _host(tmp_path, **options) -> lazyckpt.LazyCheckpointer:
    return lazyckpt.LazyCheckpointer(tmp_path / "ckpt", keep_in_memory="host", host_memory_dir=str(tmp_path / "shm"),
                                     fsync=False, **options)


def test_a_step_dirpath_holds_is_never_overwritten_nor_passed_by_a_lower_one_and_remove_deletes_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    with _host(tmp_path) as first:
        first.save({"w": torch.ones(4)}, step=5).wait()
    assert not os.path.exists(host_dir(str(ckpt), str(tmp_path / "shm"))), "freed at close: step 5 is on disk only"
    with _host(tmp_path) as second:
        with pytest.raises(lazyckpt.StepAlreadyCommittedError, match=r"step 5 is already committed in .*ckpt"):
            second.save({"w": torch.zeros(4)}, step=5)
        with pytest.raises(lazyckpt.StepOrderError, match=r"step 3 is lower than the committed step\(s\) \[5\]"):
            second.save({"w": torch.zeros(4)}, step=3)
        assert second.remove(5) and committed_steps(str(ckpt)) == {}


def test_a_lower_step_moves_dirpaths_newer_ones_aside_when_asked(tmp_path):
    with _host(tmp_path) as first:
        first.save({"w": torch.ones(4)}, step=5).wait()
    with _host(tmp_path, on_older_step="move_aside") as second:
        second.save({"w": torch.zeros(4)}, step=3).wait()
    assert sorted(committed_steps(str(tmp_path / "ckpt"))) == [3]
    assert os.path.isdir(tmp_path / "ckpt" / "step-0000005.superseded")


def test_remove_waits_for_the_copy_under_way_so_the_step_does_not_come_back_in_dirpath(tmp_path, monkeypatch):
    from helpers.host_faults import gate_copy_to_disk

    from lazyckpt.levels.remote.upload import RemoteLevel

    release = threading.Event()
    reached = gate_copy_to_disk(2, release, patch=monkeypatch.setattr)
    wait_for = RemoteLevel.wait_for
    monkeypatch.setattr(RemoteLevel, "wait_for", lambda self, step: (release.set(), wait_for(self, step))[-1])
    with _host(tmp_path) as ckpt:
        ckpt.save({"w": torch.ones(4)}, step=1).wait_remote()
        ckpt.save({"w": torch.ones(4)}, step=2).wait()
        assert reached.wait(30), "committed in the host folder, its copy to dirpath held back"
        assert ckpt.remove(2)
        release.set()  # (without the wait in remove(), the copy went on only now)
    assert sorted(committed_steps(str(tmp_path / "ckpt"))) == [1]
