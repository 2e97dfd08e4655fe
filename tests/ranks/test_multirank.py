"""Several ranks, one commit: a checkpoint becomes visible only when every rank's file is durable."""

from __future__ import annotations

import os
import threading

import pytest

import torch

import lazyckpt
from conftest import GatedBackend
from lazyckpt.storage import LocalStorage


def test_commit_waits_for_the_slowest_rank_and_each_rank_loads_its_own_state(tmp_path):
    slow = GatedBackend()
    rank0 = lazyckpt.LazyCheckpointer(tmp_path, rank=0, world_size=2)
    rank1 = lazyckpt.LazyCheckpointer(tmp_path, rank=1, world_size=2, backend=slow)
    params = [torch.nn.Parameter(torch.full((100,), float(r))) for r in range(2)]
    opts = [torch.optim.SGD([p], lr=0.1) for p in params]
    p0 = rank0.save({"w": params[0], "rank": 0}, step=1, optimizers=[opts[0]])
    p1 = rank1.save({"w": params[1], "rank": 1}, step=1, optimizers=[opts[1]])
    committed0 = threading.Thread(target=p0.wait)
    committed0.start()
    slow.entered.wait()
    assert lazyckpt.latest(tmp_path) is None, "rank 1 has not written yet: nothing may be visible"
    slow.gate.set()
    assert p1.wait() == p0.path
    committed0.join()
    path = lazyckpt.latest(tmp_path)
    for r in range(2):
        state = lazyckpt.load(path, rank=r)
        assert state["rank"] == r and torch.equal(state["w"], torch.full((100,), float(r)))
    lazyckpt.verify(path)
    rank0.close()
    rank1.close()


def test_a_rank_that_gave_up_leaves_no_manifest_that_would_let_rank_0_commit_without_it(tmp_path):
    slow = GatedBackend()
    rank0 = lazyckpt.LazyCheckpointer(tmp_path, rank=0, world_size=2, backend=slow, commit_timeout_s=0.5)
    rank1 = lazyckpt.LazyCheckpointer(tmp_path, rank=1, world_size=2, commit_timeout_s=0.5)
    params = [torch.nn.Parameter(torch.full((10,), float(r))) for r in range(2)]
    p0 = rank0.save({"w": params[0]}, step=1, optimizers=[torch.optim.SGD([params[0]], lr=0.1)])  # gated: lazy
    p1 = rank1.save({"w": params[1]}, step=1)
    with pytest.raises(TimeoutError, match="rank 0 to commit"):
        p1.wait()  # rank 1 wrote its manifest, waited for rank 0's commit, gave up and removed what it wrote
    slow.gate.set()
    with pytest.raises(TimeoutError, match="other 1 rank"):
        p0.wait()
    assert lazyckpt.latest(tmp_path) is None
    rank0.close()
    rank1.close()


class _SaysWhenItsManifestIsWritten(LocalStorage):
    """Says when rank 1's manifest is in the directory, and when it renamed a directory (rank 0: the commit point)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = threading.Event()
        self.renamed = threading.Event()

    def write_atomic(self, path, data, *, sync=True):
        super().write_atomic(path, data, sync=sync)
        if path.endswith("rank-00001.json"):
            self.written.set()

    def rename(self, src, dst, *, sync=True):
        super().rename(src, dst, sync=sync)
        self.renamed.set()


def test_a_process_calling_itself_rank_1_of_another_jobs_directory_is_refused_at_its_first_commit(tmp_path):
    # A process says it is rank 1 of 2 in a directory; a 1-rank job starts there after it (so it was not refused at
    # construction). That job's rank 0 commits its own step 5; the stranger must not report it as its checkpoint.
    storage = _SaysWhenItsManifestIsWritten()
    with lazyckpt.LazyCheckpointer(tmp_path, rank=1, world_size=2, commit_timeout_s=30.0, storage=storage) as stranger, \
            lazyckpt.LazyCheckpointer(tmp_path) as owner:
        theirs = stranger.save({"w": torch.zeros(3)}, step=5)
        storage.written.wait()  # the stranger waits for "its" rank 0 now
        owner.save({"w": torch.ones(3)}, step=5).wait()
        with pytest.raises(lazyckpt.DirectoryLockedError, match="committed by another job"):
            theirs.wait()
    assert lazyckpt.load(lazyckpt.latest(tmp_path))["w"].tolist() == [1.0, 1.0, 1.0]
    assert not [name for name in os.listdir(lazyckpt.latest(tmp_path)) if name.startswith("rank-00001")], \
        "the stranger's files do not stay in the other job's checkpoint"


def test_a_process_calling_itself_rank_1_of_a_live_1_rank_job_is_refused_at_construction(tmp_path):
    with lazyckpt.LazyCheckpointer(tmp_path):
        with pytest.raises(lazyckpt.DirectoryLockedError, match=r"written by a live 1-rank job .* rank 1 of 2"):
            lazyckpt.LazyCheckpointer(tmp_path, rank=1, world_size=2)
    # Once that job ended, a 2-rank job may use the directory (its rank 1 may start first).
    with lazyckpt.LazyCheckpointer(tmp_path, rank=1, world_size=2), \
            lazyckpt.LazyCheckpointer(tmp_path, rank=0, world_size=2):
        pass


def test_a_note_left_by_a_crashed_job_whose_process_number_was_reused_refuses_nobody(tmp_path):
    # A 1-rank job was killed and left its note; its process number now belongs to another process (here: this
    # one). A 2-rank job's rank 1 starting before its rank 0 must not be refused.
    import json as _json

    note = {"world_size": 1, "pid": os.getpid(), "host": __import__("socket").gethostname(),
            "process": "another-boot:12345"}
    (tmp_path / ".job-rank00000.json").write_text(_json.dumps(note))
    with lazyckpt.LazyCheckpointer(tmp_path, rank=1, world_size=2), \
            lazyckpt.LazyCheckpointer(tmp_path, rank=0, world_size=2):
        pass


class _FsyncsItsDirectoryLate(LocalStorage):
    """Rank 1's storage: its manifest is visible, and the directory fsync after it comes only once rank 0 renamed."""

    def __init__(self, rank0_renamed: threading.Event) -> None:
        super().__init__()
        self.rank0_renamed = rank0_renamed
        self.writing_manifest = False

    def write_atomic(self, path, data, *, sync=True):
        self.writing_manifest = path.endswith("rank-00001.json")
        super().write_atomic(path, data, sync=sync)

    def sync_dir(self, path):
        if self.writing_manifest:
            assert self.rank0_renamed.wait(30), "rank 0 commits once rank 1's manifest is in the directory"
        super().sync_dir(path)


def test_rank_0_committing_before_rank_1_fsynced_its_manifest_directory_fails_no_rank(tmp_path):
    # Without a store, rank 0 commits (renames step-N.partial) as soon as rank 1's manifest appears; rank 1's own
    # fsync of the partial directory then finds it renamed. Rank 0's fsync of that directory (writing manifest.json
    # there) made rank 1's entry durable: the commit stands on both ranks.
    first = _SaysWhenItsManifestIsWritten()
    with lazyckpt.LazyCheckpointer(tmp_path, rank=0, world_size=2, storage=first) as rank0, \
            lazyckpt.LazyCheckpointer(tmp_path, rank=1, world_size=2, storage=_FsyncsItsDirectoryLate(first.renamed),
                                      commit_timeout_s=30.0) as rank1:
        p0 = rank0.save({"w": torch.zeros(4)}, step=1)
        p1 = rank1.save({"w": torch.ones(4)}, step=1)
        assert p1.wait() == p0.wait() == lazyckpt.latest(tmp_path)
    assert lazyckpt.load(lazyckpt.latest(tmp_path), rank=1)["w"].tolist() == [1.0] * 4
