"""Two jobs and one remote: a job refused by the directory lock touches nothing there, a new job removes only the
partial uploads nobody can still be writing, and no commit object names an object that is not on the remote."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import lazyckpt
from lazyckpt.levels.remote.contents import remote_steps
from lazyckpt.storage.fsspec import FsspecStorage


def _plant_partial(url: str, step: int) -> str:
    """What an upload in flight (or cut short) leaves: a rank manifest, no commit object."""
    storage = FsspecStorage(url)
    entry = f"{url}/step-{step:07d}"
    storage.write_atomic(f"{entry}/rank-00000.json", b"{}", sync=True)
    return entry


def test_a_second_job_refused_by_the_directory_lock_deletes_nothing_on_the_remote(tmp_path):
    url = f"file://{tmp_path}/remote"
    with lazyckpt.LazyCheckpointer(tmp_path / "local", remote=url) as first:
        in_flight = _plant_partial(url, 5)  # the first job's upload of step 5, not committed yet
        with pytest.raises(lazyckpt.DirectoryLockedError):
            lazyckpt.LazyCheckpointer(tmp_path / "local", remote=url)
        assert remote_steps(FsspecStorage(url), url)[1] == [in_flight]
        first.save({"w": torch.ones(4)}, step=5).wait_remote()
    assert lazyckpt.load(lazyckpt.latest(url))["w"].sum() == 4


def test_a_new_job_removes_only_the_partial_uploads_older_than_a_committed_step(tmp_path):
    url = f"file://{tmp_path}/remote"
    with lazyckpt.LazyCheckpointer(tmp_path / "node-a", remote=url) as ckpt:
        ckpt.save({"w": torch.ones(4)}, step=3).wait_remote()
    stale, newest = _plant_partial(url, 2), _plant_partial(url, 5)  # 5 may be a live job's upload in flight
    with lazyckpt.LazyCheckpointer(tmp_path / "node-b", remote=url) as ckpt:
        assert remote_steps(FsspecStorage(url), url)[1] == [newest], f"{stale} is nobody's: step 3 is committed"
        ckpt.save({"w": torch.ones(4)}, step=6).wait_remote()
        assert remote_steps(FsspecStorage(url), url) == ({3: f"{url}/step-0000003", 6: f"{url}/step-0000006"}, []), \
            "once a newer step is committed, the older partial upload is nobody's"


class _LosesTensorFiles(FsspecStorage):
    """The remote, except that tensor files never arrive (another job's clean-up, or an outage, took them)."""

    def upload_file(self, local_path, path):
        if not path.endswith(".safetensors"):
            super().upload_file(local_path, path)


def test_the_commit_object_is_never_written_over_a_missing_object(tmp_path):
    url = f"file://{tmp_path}/remote"
    with lazyckpt.LazyCheckpointer(tmp_path / "local", remote=url) as ckpt:
        ckpt.remote.storage = _LosesTensorFiles(url)
        with pytest.raises(FileNotFoundError, match=r"lacks \['rank-00000-of-00001.safetensors'\].*not written"):
            ckpt.save({"w": torch.ones(4)}, step=1).wait_remote()
    assert lazyckpt.latest(url) is None
    assert lazyckpt.checkpoint_step(lazyckpt.latest(tmp_path / "local")) == 1, "the local level keeps it"


class _Unreachable(FsspecStorage):
    """The remote as one rank sees it after losing its connection: nothing it uploads arrives."""

    def upload_file(self, local_path, path):
        raise ConnectionError(f"connection lost (injected) while writing {path}")


def test_without_a_store_a_killed_run_s_leftover_manifest_never_completes_a_new_upload(tmp_path):
    """Two ranks sharing a directory, no store: rank 0 meets rank 1 on the remote itself. A killed run left rank 1's
    files of step 1 there; rank 1's own upload of step 1 never arrives. Rank 0 must not take the leftover for it."""
    url, shared = f"file://{tmp_path}/remote", str(tmp_path / "shared")
    remote = FsspecStorage(url)
    remote.write_atomic(f"{url}/step-0000001/rank-00001.json", b'{"left": "by a killed run"}', sync=True)
    remote.write_atomic(f"{url}/step-0000001/rank-00001-of-00002.safetensors", b"stale", sync=True)
    ckpts = [lazyckpt.LazyCheckpointer(shared, rank=r, world_size=2, store=None, remote=url, remote_timeout_s=2.0)
             for r in (0, 1)]
    ckpts[1].remote.storage = _Unreachable(url)
    outcomes = {}

    def rank(r):
        pending = ckpts[r].save({"r": torch.full((4,), float(r))}, step=1)
        pending.wait()
        try:
            outcomes[r] = pending.wait_remote()
        except (TimeoutError, ConnectionError) as e:
            outcomes[r] = type(e).__name__

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcomes == {0: "TimeoutError", 1: "ConnectionError"}, outcomes
    assert lazyckpt.latest(url) is None, "no commit object over another run's rank 1 files"
    for ckpt in ckpts:
        ckpt.close()  # each failure was delivered by wait_remote(), once


def test_a_partial_upload_the_job_still_retries_outlives_a_newer_commit(tmp_path):
    from lazyckpt.levels.remote.contents import remove_partial_uploads

    url = f"file://{tmp_path}/remote"
    with lazyckpt.LazyCheckpointer(tmp_path / "local", remote=url) as ckpt:
        ckpt.save({"w": torch.ones(4)}, step=3).wait_remote()
    retried = _plant_partial(url, 2)  # a failed upload of step 2, queued again behind step 3
    assert remove_partial_uploads(FsspecStorage(url), url, below=3, keep={2}) == []
    assert remove_partial_uploads(FsspecStorage(url), url, below=3) == [retried]


def test_a_committed_upload_keeps_nothing_of_its_job(tmp_path):
    """The host level copies every step to dirpath through the remote level: what it keeps of a committed copy
    must not hold the job (its tree, entries and checksums), or memory grows with every checkpoint of the run."""
    with lazyckpt.LazyCheckpointer(tmp_path / "run", keep_in_memory="host", host_memory_dir=tmp_path / "shm",
                                   fsync=False) as ckpt:
        jobs = []
        for step in range(1, 5):
            pending = ckpt.save({"w": torch.full((4,), float(step))}, step=step)
            pending.wait_remote()
            jobs.append(weakref.ref(pending._job))
        del pending
        gc.collect()
        assert [(u.step, u.nbytes > 0) for u in ckpt.remote.completed] == [(s, True) for s in range(1, 5)]
        assert [job() for job in jobs[:-1]] == [None, None, None]  # the newest may still be the engine's
    assert lazyckpt.load(lazyckpt.latest(tmp_path / "run"))["w"].sum() == 16
