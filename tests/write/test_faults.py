"""Failures arrive intact and on time, and never touch committed checkpoints."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import lazyckpt
from conftest import FailingStorage, GatedBackend, snapshot, step


def test_write_failure_surfaces_at_the_next_call_with_its_original_type(tmp_path, trained):
    model, opt = trained
    storage = FailingStorage()
    ckpt = lazyckpt.LazyCheckpointer(tmp_path, storage=storage)
    first = ckpt.save(snapshot(model, opt), step=1, optimizers=[opt]).wait()
    before = {name: open(os.path.join(first, name), "rb").read() for name in os.listdir(first)}
    storage.fail = True
    pending = ckpt.save(snapshot(model, opt), step=2, optimizers=[opt])
    with pytest.raises(OSError) as info:
        pending.wait()
    assert info.value is storage.error, "the original exception object must be re-raised"
    assert info.value.errno == errno.ENOSPC
    assert any("step 2" in n and str(tmp_path) in n for n in info.value.__notes__)
    assert lazyckpt.latest(tmp_path) == first
    assert {n: open(os.path.join(first, n), "rb").read() for n in os.listdir(first)} == before
    assert not any(n.endswith(".partial") for n in os.listdir(tmp_path)), "a failed save leaves nothing behind"
    storage.fail = False
    step(model, opt)
    assert ckpt.save(snapshot(model, opt), step=3, optimizers=[opt]).wait().endswith("step-0000003")
    ckpt.close()


def test_background_failure_is_raised_by_the_next_save_when_nobody_waited(tmp_path, trained):
    model, opt = trained
    storage = FailingStorage()
    storage.fail = True
    with lazyckpt.LazyCheckpointer(tmp_path, storage=storage) as ckpt:
        ckpt.save(snapshot(model, opt), step=1, optimizers=[opt])
        ckpt.in_flight._job.wait_done()  # the failure happened in the background; nobody called wait()
        with pytest.raises(OSError, match="injected") as failure:
            ckpt.save(snapshot(model, opt), step=2, optimizers=[opt])
        assert "save(step=2), which still took its own request" in "\n".join(failure.value.__notes__)
        with pytest.raises(OSError, match="injected"):
            ckpt.close()  # step 2 was taken, and fails on the same disk


def test_not_enough_free_space_fails_early_with_a_clear_message(tmp_path, trained):
    from lazyckpt.storage import LocalStorage

    class TinyDisk(LocalStorage):
        def free_bytes(self, path):
            return 1000

    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path, storage=TinyDisk()) as ckpt:
        with pytest.raises(OSError, match="needs .* MB but only .* free") as info:
            ckpt.save(snapshot(model, opt), step=1, optimizers=[opt])
    assert info.value.errno == errno.ENOSPC


def test_a_committed_step_is_never_overwritten(tmp_path, trained):
    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        path = ckpt.save(snapshot(model, opt), step=5, optimizers=[opt]).wait()
        stamp = os.stat(os.path.join(path, "manifest.json")).st_mtime_ns
        with pytest.raises(lazyckpt.StepAlreadyCommittedError, match="step 5"):
            ckpt.save(snapshot(model, opt), step=5, optimizers=[opt])
    assert os.stat(os.path.join(path, "manifest.json")).st_mtime_ns == stamp


def test_skip_policy_drops_a_request_while_busy_and_says_so(tmp_path, trained):
    model, opt = trained
    backend = GatedBackend()
    with lazyckpt.LazyCheckpointer(tmp_path, backend=backend, on_busy="skip") as ckpt:
        first = ckpt.save(snapshot(model, opt), step=1, optimizers=[opt])
        with pytest.warns(RuntimeWarning, match="skipped the checkpoint of step 2"):
            second = ckpt.save(snapshot(model, opt), step=2, optimizers=[opt])
        assert second.skipped and second.done() and second.wait() is None
        backend.gate.set()
        assert first.wait() is not None
    assert sorted(os.listdir(tmp_path)) == [".lock-rank00000", "step-0000001"]


def test_wait_policy_with_one_in_flight_blocks_until_the_previous_checkpoint_is_committed(tmp_path, trained):
    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path, on_busy="wait", max_in_flight=1) as ckpt:
        first = ckpt.save(snapshot(model, opt), step=1, optimizers=[opt])
        ckpt.save(snapshot(model, opt), step=2, optimizers=[opt])
        assert first.done()
    assert lazyckpt.checkpoint_step(lazyckpt.latest(tmp_path)) == 2


def test_wait_policy_blocks_until_fewer_than_max_in_flight_are_uncommitted(tmp_path, trained):
    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path, on_busy="wait", max_in_flight=2) as ckpt:
        first = ckpt.save(snapshot(model, opt), step=1, optimizers=[opt])
        ckpt.save(snapshot(model, opt), step=2, optimizers=[opt])
        ckpt.save(snapshot(model, opt), step=3, optimizers=[opt])
        assert first.done()
    assert lazyckpt.checkpoint_step(lazyckpt.latest(tmp_path)) == 3


def test_close_is_idempotent_and_a_closed_checkpointer_refuses_saves(tmp_path, trained):
    model, opt = trained
    ckpt = lazyckpt.LazyCheckpointer(tmp_path)
    ckpt.save(snapshot(model, opt), step=1, optimizers=[opt])
    ckpt.close()
    ckpt.close()
    assert lazyckpt.latest(tmp_path) is not None, "close() drains the in-flight checkpoint"
    with pytest.raises(RuntimeError, match="closed"):
        ckpt.save({}, step=2)


def test_two_live_checkpointers_cannot_share_a_directory(tmp_path):
    with lazyckpt.LazyCheckpointer(tmp_path):
        with pytest.raises(lazyckpt.DirectoryLockedError, match="another live LazyCheckpointer"):
            lazyckpt.LazyCheckpointer(tmp_path)
    lazyckpt.LazyCheckpointer(tmp_path).close()


@pytest.mark.parametrize("options, message", [
    ({"keep_last_k": 0}, "keep_last_k=0"), ({"copy_backend": "gpu"}, "copy_backend='gpu'.*'cpu'"),
    ({"on_busy": "drop"}, "on_busy='drop'"), ({"rank": 2, "world_size": 2}, "rank=2"),
    ({"host_buffer_bytes": 0}, "host_buffer_bytes=0"),
    ({"on_busy": "skip", "world_size": 2}, "on_busy='skip' needs world_size=1"),
    ({"max_in_flight": 0}, "max_in_flight=0 must be a positive int"),
])
def test_bad_options_are_refused_with_the_argument_and_value(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        lazyckpt.LazyCheckpointer(tmp_path, **options)


def test_bad_step_values_are_refused(tmp_path):
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        for bad in (-1, 1.5, True, "3"):
            with pytest.raises(ValueError, match="step="):
                ckpt.save({}, step=bad)


def test_a_forked_child_never_drains_the_parent_s_checkpointer(tmp_path, trained):
    import multiprocessing

    model, opt = trained
    backend = GatedBackend()
    with lazyckpt.LazyCheckpointer(tmp_path, backend=backend) as ckpt:
        ckpt.save(snapshot(model, opt), step=1, optimizers=[opt])  # in flight and held at the gate
        child = multiprocessing.get_context("fork").Process(target=ckpt.close)
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0, "close() in a forked child must return at once, not wait for the parent"
        backend.gate.set()
