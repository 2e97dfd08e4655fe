"""Two checkpoints in flight: the next one is copied while the previous one is written, and they commit in order.

A storage seam holds the first checkpoint's tensor-file writes on an event, so both checkpoints are observably in
flight at once. Waits are bounded (``BOUND``) so that a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

import lazyckpt
from conftest import assert_tree_equal, clone_tree, snapshot, step
from lazyckpt.storage import LocalStorage
from lazyckpt.write.inflight import InFlight
from lazyckpt.write.job import JobState
from test_lifecycle import _job

BOUND = 30.0  # seconds a wait may take before the test calls it a hang
TWO_IN_FLIGHT = {"max_in_flight": 2, "host_buffer_bytes": 16 << 20}
"""Two checkpoints in flight, and a host budget that holds both of the small model (one 8 MiB slot each)."""


class HeldStorage(LocalStorage):
    """Local files; writes into the tensor file of ``held_step`` wait for ``release`` (``holding`` fires first), and
    with ``error`` set they then fail with it. Records the order of commits (renames to a final name)."""

    def __init__(self, held_step: int, error: BaseException | None = None) -> None:
        super().__init__()
        self.marker = f"step-{held_step:07d}.partial"
        self.holding, self.release = threading.Event(), threading.Event()
        self.error = error
        self.committed: list[str] = []
        self.held: list = []

    def open_write(self, path):
        handle = super().open_write(path)
        if self.marker in path:
            self.held.append(handle)
        return handle

    def write(self, handle, offset, buffers):
        if any(handle is held for held in self.held):
            self.holding.set()
            assert self.release.wait(BOUND)
            if self.error is not None:
                raise self.error
        super().write(handle, offset, buffers)

    def rename(self, src, dst, *, sync):
        super().rename(src, dst, sync=sync)
        if not dst.endswith(".partial") and "step-" in os.path.basename(dst):
            self.committed.append(os.path.basename(dst))


def _two_in_flight(ckpt, model, opt):
    """Save step 1 (held in its writes), step, save step 2: returns both handles and the states they hold."""
    first_state = clone_tree(snapshot(model, opt))
    first = ckpt.save(snapshot(model, opt), step=1, optimizers=[opt])
    ckpt.wait_staged()
    step(model, opt, seed=2)
    second_state = clone_tree(snapshot(model, opt))
    second = ckpt.save(snapshot(model, opt), step=2, optimizers=[opt])
    return first, second, first_state, second_state


def test_the_next_checkpoint_is_copied_while_the_previous_one_is_still_written(tmp_path, trained):
    model, opt = trained
    storage = HeldStorage(held_step=1)
    with lazyckpt.LazyCheckpointer(tmp_path, storage=storage, **TWO_IN_FLIGHT) as ckpt:
        first, second, first_state, second_state = _two_in_flight(ckpt, model, opt)
        assert storage.holding.wait(BOUND)
        ckpt.wait_staged()  # step 2's copy finishes although step 1 is not written yet
        step(model, opt, seed=3)  # the update after the barrier must not reach either snapshot
        assert not first.done() and not second.done(), "both checkpoints are in flight at once"
        assert ckpt.in_flight is second
        assert lazyckpt.latest(tmp_path) is None
        storage.release.set()
        assert second.wait(BOUND).endswith("step-0000002") and first.done()
    assert storage.committed == ["step-0000001", "step-0000002"], "commits follow the request order"
    assert_tree_equal(lazyckpt.load(first.path), first_state)
    assert_tree_equal(lazyckpt.load(second.path), second_state)


def test_a_budget_of_one_slot_shares_it_between_both_checkpoints(tmp_path, trained):
    model, opt = trained
    storage = HeldStorage(held_step=1)
    with lazyckpt.LazyCheckpointer(tmp_path, storage=storage, host_buffer_bytes=8 << 20, max_in_flight=2) as ckpt:
        first, second, first_state, second_state = _two_in_flight(ckpt, model, opt)
        assert storage.holding.wait(BOUND)
        assert not second._job.wait_staged(timeout=0), "step 1's unwritten bytes still hold the only slot"
        assert ckpt._copier.pool.num_slots == 1, "memory stays within the budget"
        storage.release.set()
        ckpt.wait_staged()
        assert second.wait(BOUND) and first.done()
        assert ckpt._copier.pool.num_slots == 1
    assert storage.committed == ["step-0000001", "step-0000002"]
    assert_tree_equal(lazyckpt.load(first.path), first_state)
    assert_tree_equal(lazyckpt.load(second.path), second_state)


def test_a_failure_of_the_first_reaches_the_next_call_and_the_second_still_commits(tmp_path, trained):
    model, opt = trained
    error = OSError(errno.EIO, "Input/output error (injected)")
    storage = HeldStorage(held_step=1, error=error)
    with lazyckpt.LazyCheckpointer(tmp_path, storage=storage, **TWO_IN_FLIGHT) as ckpt:
        first, second, _, second_state = _two_in_flight(ckpt, model, opt)
        storage.release.set()
        assert first._job.wait_done(BOUND) and first.failed
        with pytest.raises(OSError) as info:
            ckpt.wait_staged()
        assert info.value is error and any("step 1" in note for note in info.value.__notes__)
        ckpt.wait_staged()  # delivered once
        assert second.wait(BOUND).endswith("step-0000002"), "each checkpoint holds the whole state"
    assert storage.committed == ["step-0000002"]
    assert lazyckpt.latest(tmp_path) == second.path
    assert_tree_equal(lazyckpt.load(second.path), second_state)
    assert sorted(os.listdir(tmp_path)) == [".lock-rank00000", "step-0000002"], "the failed one left nothing"


def test_close_drains_both_checkpoints(tmp_path, trained):
    model, opt = trained
    storage = HeldStorage(held_step=1)
    ckpt = lazyckpt.LazyCheckpointer(tmp_path, storage=storage, **TWO_IN_FLIGHT)
    first, second, _, _ = _two_in_flight(ckpt, model, opt)
    storage.release.set()
    ckpt.close()
    assert first.done() and second.done()
    assert storage.committed == ["step-0000001", "step-0000002"]


def test_skip_accepts_a_request_while_the_previous_one_is_only_being_written(tmp_path, trained):
    model, opt = trained
    storage = HeldStorage(held_step=1)
    with lazyckpt.LazyCheckpointer(tmp_path, storage=storage, on_busy="skip", **TWO_IN_FLIGHT) as ckpt:
        first, second, _, _ = _two_in_flight(ckpt, model, opt)
        assert not second.skipped
        with pytest.warns(RuntimeWarning, match="skipped the checkpoint of step 3"):
            third = ckpt.save(snapshot(model, opt), step=3, optimizers=[opt])
        assert third.skipped, "two are uncommitted: a third would have to wait"
        storage.release.set()
        assert second.wait(BOUND) and first.done()


def test_a_step_not_above_the_one_in_flight_waits_for_it_and_is_checked_against_it(tmp_path, trained):
    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path, max_in_flight=2) as ckpt:
        first = ckpt.save(snapshot(model, opt), step=5, optimizers=[opt])
        with pytest.raises(lazyckpt.StepOrderError, match="step 3 is lower"):
            ckpt.save(snapshot(model, opt), step=3, optimizers=[opt])
        assert first.done()


def test_a_commit_waits_until_every_earlier_checkpoint_has_ended():
    tracker, earlier, later = InFlight(), _job(), _job()
    tracker.add(earlier, object())
    tracker.add(later, object())
    assert tracker.earlier(later) == [earlier] and tracker.earlier(earlier) == []
    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (tracker.wait_for_earlier(later), waited.set()))
    waiter.start()
    assert not waited.wait(0.05), "the later commit must wait for the earlier checkpoint"
    earlier.fail(RuntimeError("injected"))
    earlier.advance(JobState.DISCARDED)
    assert waited.wait(BOUND), "an ended (even discarded) earlier checkpoint lets the later one commit"
    waiter.join(BOUND)
