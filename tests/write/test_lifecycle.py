"""The life of one checkpoint: the job state machine, and every job ending exactly once whatever fails when.

Waits are bounded (``BOUND``) so that a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

import lazyckpt
from conftest import GatedBackend
from lazyckpt.config import CheckpointConfig
from lazyckpt.engine import LazyCheckpointer
from lazyckpt.errors import IllegalTransitionError
from lazyckpt.pending import PendingCheckpoint
from lazyckpt.storage import LocalStorage
from lazyckpt.tree.encode import Deferred
from lazyckpt.write.commit import JobEnds
from lazyckpt.write.inflight import InFlight
from lazyckpt.write.job import CheckpointJob, JobState
from lazyckpt.write.staging.cpu import CpuCopyBackend
from lazyckpt.write.stats import CheckpointStats
from lazyckpt.write.writer import SharedWriter

BOUND = 30.0  # seconds a wait may take before the test calls it a hang


def _job(deferred=()) -> CheckpointJob:
    return CheckpointJob(step=1, dirpath="/d", partial_dir="/d/p", final_dir="/d/f", rank=0, world_size=1,
                         tree={}, entries=[], pieces=[], sources=[], versions={}, deferred=list(deferred),
                         header=b"", stats=CheckpointStats(step=1))


# --- the state machine ---------------------------------------------------------------------------------------

def test_a_job_walks_captured_staged_durable_committing_committed():
    job = _job()
    assert job.state is JobState.CAPTURED and not job.wait_staged(timeout=0)
    assert job.advance(JobState.STAGED) and job.wait_staged(timeout=0)
    assert job.durable(), "durable with a complete tree claims the commit for the caller"
    assert job.state is JobState.COMMITTING and not job.done
    assert job.advance(JobState.COMMITTED) and job.done and job.wait_done(timeout=0)


@pytest.mark.parametrize("start, to", [
    (JobState.CAPTURED, JobState.DURABLE), (JobState.CAPTURED, JobState.COMMITTED),
    (JobState.STAGED, JobState.COMMITTING), (JobState.CAPTURED, JobState.DISCARDED),
])
def test_an_illegal_transition_raises(start, to):
    job = _job()
    job.state = start
    with pytest.raises(IllegalTransitionError, match=f"{start.value} -> {to.value}"):
        job.advance(to)


def test_a_failure_wins_every_race_and_only_the_first_error_is_kept():
    job = _job()
    first = RuntimeError("first")
    assert job.fail(first) is False, "the file is not closed yet: finalize discards the job"
    assert job.fail(RuntimeError("second")) is False and job.error is first
    assert job.wait_staged(timeout=0), "a failure releases the barrier"
    assert job.advance(JobState.STAGED) is False and job.state is JobState.FAILED
    assert job.advance(JobState.DISCARDED) and job.done


def test_a_failure_after_the_file_is_closed_tells_the_caller_to_discard():
    job = _job(deferred=[(("s",), Deferred(lambda: 1))])
    job.advance(JobState.STAGED)
    assert job.durable() is False, "the commit waits for the Deferred leaves"
    assert job.fail(RuntimeError("deferred failed")) is True


def test_only_one_of_the_barrier_and_the_writer_claims_the_commit():
    job = _job(deferred=[(("s",), Deferred(lambda: 1))])
    job.advance(JobState.STAGED)
    claims = []
    start = threading.Barrier(2)

    def claim(fn):
        start.wait()
        claims.append(fn())

    threads = [threading.Thread(target=claim, args=(fn,)) for fn in (job.durable, job.complete_tree)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claims) == [False, True] and job.state is JobState.COMMITTING


def test_a_failure_that_lands_between_the_close_and_durable_is_discarded_by_the_writer(tmp_path):
    """The window in finalize between its failure check and ``durable()``: a Deferred raising at the barrier (or
    a ``discard()``) fails the job while the file is still open, so ``fail`` leaves the discard to the writer."""
    job = _job()
    job.partial_dir = str(tmp_path / "step-0000001.partial")
    os.makedirs(job.partial_dir)
    job.advance(JobState.STAGED)
    discarded = []
    ends = JobEnds(storage=LocalStorage(), config=CheckpointConfig(), rendezvous=None, writer=SharedWriter.get(),
                   inflight=InFlight(), committed=lambda j: pytest.fail("a failed job must not commit"),
                   discarded=discarded.append)
    durable = job.durable

    def failed_first():
        assert job.fail(RuntimeError("a Deferred leaf raised")) is False, "the file is still open"
        return durable()

    job.durable = failed_first
    ends.finalize(job)
    assert job.state is JobState.DISCARDED and discarded == [job] and not os.path.exists(job.partial_dir)


def test_a_committed_job_ignores_a_late_failure():
    job = _job()
    job.advance(JobState.STAGED)
    job.durable()
    job.advance(JobState.COMMITTED)
    assert job.fail(RuntimeError("late")) is False and job.error is None


# --- the engine drives every job to exactly one end ---------------------------------------------------------

def test_a_deferred_failing_after_the_file_is_durable_still_discards_the_job(tmp_path):
    ckpt = LazyCheckpointer(tmp_path, copy_backend="cpu", fsync=False)

    def broken_scheduler_state():
        raise RuntimeError("scheduler.state_dict() failed")

    pending = ckpt.save({"w": torch.ones(8), "sched": Deferred(broken_scheduler_state)}, step=1)
    job = pending._job
    assert job.wait_until(lambda: job.state is JobState.DURABLE, BOUND), "the commit waits for the barrier only"
    with pytest.raises(RuntimeError, match="scheduler"):
        ckpt.wait_staged()
    assert job.wait_done(BOUND) and job.state is JobState.DISCARDED
    assert not os.path.exists(job.partial_dir)
    ckpt.close()


class _CleanupFails(LocalStorage):
    """Writes fail (EIO) and removing a directory fails too (a read-only or flaky mount)."""

    def write(self, handle, offset, buffers):
        raise OSError(errno.EIO, "I/O error (injected)")

    def remove_tree(self, path):
        raise PermissionError(errno.EACCES, "cannot remove (injected)", path)


def test_a_failing_cleanup_still_ends_the_job_and_reports_the_original_failure(tmp_path):
    ckpt = LazyCheckpointer(tmp_path, copy_backend="cpu", storage=_CleanupFails(), fsync=False)
    pending = ckpt.save({"w": torch.ones(8)}, step=1)
    assert pending._job.wait_done(BOUND)
    with pytest.raises(OSError) as info:
        pending.wait(timeout=0)
    assert info.value.errno == errno.EIO
    ckpt.close()


class _BadChecksumsOnce(CpuCopyBackend):
    """A fused-checksum backend whose first call returns malformed checksums (one list too short)."""

    def __init__(self) -> None:
        self.calls = 0

    def copy_pieces(self, sources, pieces, slots):
        super().copy_pieces(sources, pieces, slots)
        self.calls += 1
        return [[] for _ in pieces] if self.calls == 1 else None


def test_a_failure_between_copy_and_write_returns_every_staging_slot(tmp_path):
    ckpt = LazyCheckpointer(tmp_path, backend=_BadChecksumsOnce(), host_buffer_bytes=8 << 20, fsync=False)
    w = torch.nn.Parameter(torch.ones(1024))
    opt = torch.optim.SGD([w], lr=0.1)
    with pytest.raises(ValueError):
        ckpt.save({"w": w}, step=1, optimizers=[opt]).wait(timeout=BOUND)
    second = ckpt.save({"w": w}, step=2, optimizers=[opt])
    assert second.wait(timeout=BOUND) is not None, "with one slot, a leaked slot would block the next copy"
    ckpt.close()


class _PurgeFails(LocalStorage):
    def remove_tree(self, path):
        if ".purge-" in os.path.basename(path):
            raise PermissionError(errno.EACCES, "cannot remove (injected)", path)
        super().remove_tree(path)


def test_a_retention_failure_leaves_the_new_checkpoint_committed(tmp_path):
    with LazyCheckpointer(tmp_path, copy_backend="cpu", storage=_PurgeFails(), keep_last_k=1, fsync=False) as ckpt:
        ckpt.save({"w": torch.ones(4)}, step=1).wait(timeout=BOUND)
        pending = ckpt.save({"w": torch.ones(4) * 2}, step=2)
        assert pending.wait(timeout=BOUND) == pending.path == lazyckpt.latest(tmp_path)


def test_in_flight_is_the_pending_checkpoint_of_the_unfinished_save(tmp_path):
    backend = GatedBackend()
    ckpt = LazyCheckpointer(tmp_path, backend=backend, fsync=False)
    w = torch.nn.Parameter(torch.ones(16))
    pending = ckpt.save({"w": w}, step=1, optimizers=[torch.optim.SGD([w], lr=0.1)])
    try:
        assert backend.entered.wait(BOUND)
        assert isinstance(ckpt.in_flight, PendingCheckpoint) and ckpt.in_flight is pending
    finally:
        backend.gate.set()
        pending.wait(timeout=BOUND)
        ckpt.close()
    assert ckpt.in_flight is None


# --- timeouts are honoured -------------------------------------------------------------------------------------

class _StalledDisk(LocalStorage):
    """Writes block until the test opens ``gate`` (a disk that stopped answering)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def write(self, handle, offset, buffers):
        self.gate.wait()
        super().write(handle, offset, buffers)


def test_wait_with_a_timeout_returns_while_staging_is_blocked_on_a_stalled_disk(tmp_path):
    storage = _StalledDisk()
    safety_net = threading.Timer(BOUND, storage.gate.set)  # a regression fails below instead of hanging
    safety_net.start()
    w = torch.nn.Parameter(torch.ones(6 << 20))  # 24 MiB of lazy bytes through an 8 MiB pool
    with LazyCheckpointer(tmp_path, copy_backend="cpu", storage=storage, host_buffer_bytes=8 << 20) as ckpt:
        pending = ckpt.save({"w": w}, step=1, optimizers=[torch.optim.SGD([w], lr=0.1)])
        with pytest.raises(TimeoutError, match="step 1 not committed within 0.2s"):
            pending.wait(timeout=0.2)
        assert not storage.gate.is_set(), "wait() returned only because the disk came back"
        storage.gate.set()
        assert pending.wait(timeout=BOUND) == pending.path
    safety_net.cancel()
