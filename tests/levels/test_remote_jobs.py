"""Two jobs and one remote: a job refused by the directory lock touches nothing there, a new job removes only the
partial uploads nobody can still be writing, and no commit object names an object that is not on the remote."""

from __future__ import annotations

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
