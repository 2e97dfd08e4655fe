"""The memory level: the newest committed snapshot stays in host memory, checked, bounded, and discardable."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import lazyckpt
from conftest import FailingStorage, GatedBackend, assert_tree_equal, clone_tree, snapshot, step
from lazyckpt.write.plan import staging_slots


def big_state(model, opt, extra: int = 0):
    # More than one 8 MiB staging slot of lazy bytes, plus eager tensors and plain values.
    state = snapshot(model, opt)
    state["buffer"] = torch.full((3,), float(extra))
    state["meta"] = {"epoch": extra, "tag": "x", "nan": float("nan")}
    return state


@pytest.fixture
def large():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 1536), torch.nn.BatchNorm1d(1536), torch.nn.Linear(1536, 1536),
                                torch.nn.Linear(1536, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, opt)
    return model, opt


def save_step(ckpt, model, opt, n: int):
    ckpt.save(big_state(model, opt, n), step=n, optimizers=[opt]).wait()


def test_memory_snapshot_is_the_newest_committed_state_bit_for_bit(tmp_path, large):
    model, opt = large
    with lazyckpt.LazyCheckpointer(tmp_path, keep_in_memory=True) as ckpt:
        assert ckpt.memory_snapshot() is None
        for n in (1, 2, 3):
            step(model, opt, seed=n)
            save_step(ckpt, model, opt, n)
        expected = clone_tree(big_state(model, opt, 3))
        got_step, state = ckpt.memory_snapshot()
        assert got_step == 3
        assert_tree_equal(state, expected)
        assert_tree_equal(state, lazyckpt.load(lazyckpt.latest(tmp_path)))
        # The snapshot is a copy: training on does not change it.
        step(model, opt, seed=9)
        assert_tree_equal(ckpt.memory_snapshot()[1], expected)


def test_pool_holds_exactly_two_checkpoints_however_many_are_taken(tmp_path, large):
    model, opt = large
    with lazyckpt.LazyCheckpointer(tmp_path, keep_in_memory=True, keep_last_k=1) as ckpt:
        for n in range(1, 6):
            step(model, opt, seed=n)
            save_step(ckpt, model, opt, n)
        per_checkpoint = staging_slots(ckpt._job.pieces)
        pool = ckpt._copier.pool
        assert per_checkpoint > 1
        assert pool.num_slots == 2 * per_checkpoint
        held = len(ckpt._memory._newest.slots)
        free = sum(1 for _ in iter(lambda: pool.acquire(block=False), None))
        assert (held, free) == (per_checkpoint, per_checkpoint)


def test_without_keep_in_memory_there_is_no_snapshot(tmp_path, trained):
    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        ckpt.save(snapshot(model, opt), step=1, optimizers=[opt]).wait()
        assert ckpt.memory_snapshot() is None


def test_a_budget_below_two_checkpoints_is_refused_with_the_size_needed(tmp_path, large):
    model, opt = large
    with pytest.raises(ValueError, match="keep_in_memory=True needs host_buffer_bytes of at least 16 MiB"):
        lazyckpt.LazyCheckpointer(tmp_path / "a", keep_in_memory=True, host_buffer_bytes=8 << 20)
    with lazyckpt.LazyCheckpointer(tmp_path / "b", keep_in_memory=True, host_buffer_bytes=16 << 20) as ckpt:
        with pytest.raises(ValueError, match=r"needs host_buffer_bytes >= \d+ \(\d+ MiB: two checkpoints"):
            ckpt.save(big_state(model, opt), step=1, optimizers=[opt])
        assert not os.listdir(ckpt.dirpath) or lazyckpt.latest(ckpt.dirpath) is None


def test_corrupted_host_bytes_are_detected_when_read_back(tmp_path, large):
    model, opt = large
    with lazyckpt.LazyCheckpointer(tmp_path, keep_in_memory=True) as ckpt:
        save_step(ckpt, model, opt, 1)
        _, slot, _ = ckpt._memory._newest.slots[0]
        slot[100] ^= 0xFF
        with pytest.raises(lazyckpt.CheckpointCorruptError, match="memory snapshot of step 1"):
            ckpt.memory_snapshot()


def test_a_snapshot_missing_a_staged_piece_is_refused_not_returned(tmp_path, large):
    model, opt = large
    with lazyckpt.LazyCheckpointer(tmp_path, keep_in_memory=True) as ckpt:
        save_step(ckpt, model, opt, 1)
        ckpt._memory._newest.slots.pop()
        with pytest.raises(lazyckpt.CheckpointCorruptError, match="memory snapshot of step 1 is incomplete"):
            ckpt.memory_snapshot()


@pytest.fixture
def gated():
    """A copy backend whose gate is open until a test holds a copy at it (:func:`save_held_at_the_gate`)."""
    backend = GatedBackend()
    backend.gate.set()
    return backend


def save_held_at_the_gate(ckpt, backend, model, opt, n: int):
    """Request step ``n`` and return its handle once its lazy copy has started and waits at the backend's gate."""
    backend.gate.clear()
    backend.entered.clear()
    pending = ckpt.save(big_state(model, opt, n), step=n, optimizers=[opt])
    backend.entered.wait()
    return pending


def test_discarding_the_in_flight_checkpoint_leaves_neither_files_nor_snapshot(tmp_path, large, gated):
    model, opt = large
    backend = gated
    with lazyckpt.LazyCheckpointer(tmp_path, keep_in_memory=True, backend=backend) as ckpt:
        save_step(ckpt, model, opt, 1)
        pending = save_held_at_the_gate(ckpt, backend, model, opt, 2)
        backend.gate.set()
        assert ckpt.discard(2)
        assert pending.done() and isinstance(pending.error, lazyckpt.CheckpointDiscardedError)
        assert not [d for d in os.listdir(tmp_path) if "step-0000002" in d]  # neither committed nor partial
        assert ckpt.memory_snapshot()[0] == 1
        ckpt.wait_staged()  # the discard is not reported as a failure
        save_step(ckpt, model, opt, 3)
        assert ckpt.memory_snapshot()[0] == 3


def test_discarding_a_committed_checkpoint_removes_it_from_disk_and_memory(tmp_path, trained):
    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path, keep_in_memory=True) as ckpt:
        ckpt.save(snapshot(model, opt), step=1, optimizers=[opt]).wait()
        assert ckpt.discard(1)
        assert lazyckpt.latest(tmp_path) is None
        assert ckpt.memory_snapshot() is None
        assert not ckpt.discard(1)


def test_a_failed_checkpoint_keeps_the_previous_snapshot(tmp_path, large):
    model, opt = large
    storage = FailingStorage()
    with lazyckpt.LazyCheckpointer(tmp_path, keep_in_memory=True, storage=storage) as ckpt:
        save_step(ckpt, model, opt, 1)
        expected = clone_tree(big_state(model, opt, 1))
        storage.fail = True
        with pytest.raises(OSError):
            save_step(ckpt, model, opt, 2)
        storage.fail = False
        got_step, state = ckpt.memory_snapshot()
        assert got_step == 1
        assert_tree_equal(state, expected)
        save_step(ckpt, model, opt, 3)
        assert ckpt.memory_snapshot()[0] == 3


@pytest.mark.parametrize("threads", [1, 2])
def test_a_snapshot_read_into_live_tensors_fills_them_in_place(tmp_path, large, threads):
    model, opt = large
    with lazyckpt.LazyCheckpointer(tmp_path, keep_in_memory=True) as ckpt:
        save_step(ckpt, model, opt, 1)
        expected = clone_tree(big_state(model, opt, 1))
        step(model, opt, seed=5)  # the live tensors move on
        live = big_state(model, opt, 1)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got_step, state = ckpt.memory_snapshot(into=live)
        finally:
            torch.set_num_threads(before)
    assert got_step == 1
    assert_tree_equal(state, expected)
    assert_tree_equal(snapshot(model, opt), {k: expected[k] for k in ("model", "opt")})
    weight = live["model"]["2.weight"]
    assert state["model"]["2.weight"] is weight and weight.data_ptr() == model[2].weight.data_ptr()
    assert state["opt"]["state"][0]["exp_avg"] is opt.state[model[0].weight]["exp_avg"]


def test_targets_that_do_not_fit_are_left_alone_and_come_back_fresh(tmp_path, large):
    model, opt = large
    with lazyckpt.LazyCheckpointer(tmp_path, keep_in_memory=True) as ckpt:
        save_step(ckpt, model, opt, 1)
        expected = clone_tree(big_state(model, opt, 1))
        live = big_state(model, opt, 1)
        misfits = {"2.weight": torch.zeros(1536, 1536, dtype=torch.float64),   # another dtype
                   "0.weight": torch.zeros(16, 1536).t(),                      # not contiguous
                   "0.bias": torch.zeros(7)}                                  # another shape
        live["model"].update(misfits)
        untouched = clone_tree(misfits)
        _, state = ckpt.memory_snapshot(into=live)
    assert_tree_equal(state, expected)
    assert_tree_equal(misfits, untouched)
    assert all(state["model"][k] is not misfits[k] for k in misfits)
    assert state["model"]["2.bias"] is live["model"]["2.bias"]


def test_a_corrupt_chunk_read_into_live_tensors_raises(tmp_path, large):
    model, opt = large
    with lazyckpt.LazyCheckpointer(tmp_path, keep_in_memory=True) as ckpt:
        save_step(ckpt, model, opt, 1)
        _, slot, _ = ckpt._memory._newest.slots[-1]
        slot[100] ^= 0xFF
        with pytest.raises(lazyckpt.CheckpointCorruptError, match="memory snapshot of step 1: tensor .* chunk"):
            ckpt.memory_snapshot(into=big_state(model, opt, 1))


def test_a_snapshot_not_before_the_given_step_is_not_read(tmp_path, large):
    model, opt = large
    with lazyckpt.LazyCheckpointer(tmp_path, keep_in_memory=True) as ckpt:
        save_step(ckpt, model, opt, 4)
        step(model, opt, seed=5)
        live = big_state(model, opt, 1)
        untouched = clone_tree(live)
        assert ckpt.memory_snapshot(into=live, before=4) is None
        assert_tree_equal(live, untouched)
        assert ckpt.memory_snapshot(before=5)[0] == 4


def test_a_snapshot_read_into_live_tensors_waits_for_the_copy_still_reading_them(tmp_path, large, gated):
    model, opt, backend = *large, gated
    with lazyckpt.LazyCheckpointer(tmp_path, keep_in_memory=True, backend=backend) as ckpt:
        save_step(ckpt, model, opt, 1)
        step(model, opt, seed=5)
        requested = clone_tree(big_state(model, opt, 2))
        pending = save_held_at_the_gate(ckpt, backend, model, opt, 2)
        done = threading.Event()
        reader = threading.Thread(target=lambda: (ckpt.memory_snapshot(into=big_state(model, opt, 1)), done.set()))
        reader.start()
        done.wait(timeout=0.5)  # without the wait inside memory_snapshot, it has overwritten the live tensors now
        backend.gate.set()
        reader.join()
        pending.wait()
    assert_tree_equal(lazyckpt.load(lazyckpt.latest(tmp_path)), requested)
