"""Background threads leave the training thread's torch threading as they found it."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lazyckpt import LazyCheckpointer
from lazyckpt.threads import start_background_thread

TRAINING_THREADS = 4
"""More OpenMP threads than this machine may have cores: the case where a stray OpenMP team slows training."""


@pytest.fixture
def training_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(TRAINING_THREADS)
    warm = torch.empty(1 << 22)
    warm.copy_(torch.ones(1 << 22))  # the training thread's own OpenMP team exists before anything is counted
    yield TRAINING_THREADS
    torch.set_num_threads(before)


def os_thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def python_thread_ids() -> set[int]:
    return {t.native_id for t in threading.enumerate() if t.native_id is not None}


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts OS threads through /proc")


@needs_proc
def test_a_checkpoint_leaves_no_openmp_team_behind(tmp_path, training_threads):
    state = {"w": torch.randn(1 << 22), "b": torch.randn(1 << 20)}  # large enough for parallel copies
    before = os_thread_ids()
    with LazyCheckpointer(str(tmp_path), keep_last_k=2) as ckpt:
        for step in (1, 2):
            ckpt.save(state, step=step).wait()
        new = os_thread_ids() - before
        # Every OS thread that appeared is a Python thread (copier, writer); an OpenMP worker would not be one.
        assert new <= python_thread_ids(), f"{len(new - python_thread_ids())} OS threads left behind"
    assert torch.get_num_threads() == training_threads


def test_a_background_thread_runs_torch_on_one_thread_and_changes_no_other_count(training_threads):
    seen: dict[str, int] = {}

    def record(label: str) -> None:
        torch.ones(1 << 20).add_(1)
        seen[label] = torch.get_num_threads()

    start_background_thread(record, "background", name="lazyckpt-test").join()
    plain = threading.Thread(target=record, args=("later thread",))
    plain.start()
    plain.join()
    assert seen == {"background": 1, "later thread": training_threads}
    assert torch.get_num_threads() == training_threads
