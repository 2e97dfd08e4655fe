"""Remote-level failures: unreachable at start, lost mid-run, an upload cut short by an error or by SIGKILL."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import lazyckpt
from helpers.remote import FlakyRemote, free_port, moto_endpoint, s3_options, s3_remote  # noqa: F401 - fixtures
from conftest import snapshot, step
from lazyckpt.errors import RemoteUnreachableError
from lazyckpt.levels.remote.contents import remote_steps
from lazyckpt.storage.fsspec import FsspecStorage


def test_an_unreachable_remote_fails_at_construction_naming_the_url(tmp_path):
    url = "s3://bucket/run"
    with pytest.raises(RemoteUnreachableError, match=r"remote='s3://bucket/run' is not reachable.*endpoint_url"):
        lazyckpt.LazyCheckpointer(tmp_path, remote=url, storage_options=s3_options(f"http://127.0.0.1:{free_port()}"))
    lazyckpt.LazyCheckpointer(tmp_path).close()  # the failed construction left the directory unlocked


def test_a_remote_lost_mid_run_leaves_the_local_level_working_and_the_missed_step_is_uploaded_at_the_next_commit(
        tmp_path, trained, s3_remote):
    url, options = s3_remote
    model, opt = trained
    ckpt = lazyckpt.LazyCheckpointer(tmp_path, remote=url, storage_options=options)
    flaky = ckpt.remote.storage = FlakyRemote(url, options)
    assert ckpt.save(snapshot(model, opt), step=1, optimizers=[opt]).wait_remote() == f"{url}/step-0000001"
    flaky.fail = True
    step(model, opt, seed=2)
    assert ckpt.save(snapshot(model, opt), step=2, optimizers=[opt]).wait() == str(tmp_path / "step-0000002")
    ckpt.remote.drain()
    assert lazyckpt.latest(url, storage_options=options) == f"{url}/step-0000001"
    flaky.fail = False
    with pytest.raises(ConnectionError, match="injected") as failure:
        ckpt.save(snapshot(model, opt), step=3, optimizers=[opt])  # step 2's failure, once step 3 is taken
    assert f"while uploading step 2 to {url}/step-0000002" in "\n".join(failure.value.__notes__)
    assert ckpt.in_flight.wait_remote() == f"{url}/step-0000003"
    ckpt.close()
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path))) == [1, 2, 3]
    committed, partial = remote_steps(FsspecStorage(url, options), url)
    assert sorted(committed) == [1, 2, 3] and partial == [], "step 2 was retried when step 3 committed"


def _first_upload_failed(tmp_path, trained, url, options):
    """A checkpointer whose upload of step 1 failed (its tensor file went up, then the connection was lost):
    ``(checkpointer, its FlakyRemote, still failing, step 1's local directory)``."""
    model, opt = trained
    ckpt = lazyckpt.LazyCheckpointer(tmp_path, remote=url, storage_options=options)
    flaky = ckpt.remote.storage = FlakyRemote(url, options)
    flaky.fail = True
    local = ckpt.save(snapshot(model, opt), step=1, optimizers=[opt]).wait()
    ckpt.remote.drain()
    return ckpt, flaky, local


def test_a_failed_upload_is_retried_once_and_then_left_to_the_local_level(tmp_path, trained, s3_remote):
    url, options = s3_remote
    model, opt = trained
    ckpt, flaky, _ = _first_upload_failed(tmp_path, trained, url, options)
    with pytest.raises(ConnectionError) as failure:
        ckpt.save(snapshot(model, opt), step=2, optimizers=[opt])
    assert "step 1" in "\n".join(failure.value.__notes__) and "retried once" in "\n".join(failure.value.__notes__)
    assert "still took its own request" in "\n".join(failure.value.__notes__)
    ckpt.in_flight.wait()  # commit 2: step 1 retried, fails again
    ckpt.remote.drain()
    with pytest.raises(ConnectionError) as failure:
        ckpt.save(snapshot(model, opt), step=3, optimizers=[opt])
    assert "while uploading step 1" in "\n".join(failure.value.__notes__)
    assert "not retried again" in "\n".join(failure.value.__notes__)
    flaky.fail = False
    assert ckpt.in_flight.wait_remote() == f"{url}/step-0000003"
    ckpt.close()
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path))) == [1, 2, 3], "nothing deleted locally"
    committed, partial = remote_steps(FsspecStorage(url, options), url)
    assert sorted(committed) == [2, 3] and partial == [], "step 1's partial upload went once step 2 committed"


def test_wait_remote_and_close_raise_a_failed_upload_with_step_and_url(tmp_path, trained, s3_remote):
    url, options = s3_remote
    model, opt = trained
    ckpt = lazyckpt.LazyCheckpointer(tmp_path, remote=url, storage_options=options)
    ckpt.remote.storage = FlakyRemote(url, options)
    ckpt.remote.storage.fail = True
    pending = ckpt.save(snapshot(model, opt), step=4, optimizers=[opt])
    with pytest.raises(ConnectionError) as failure:
        pending.wait_remote()
    assert f"{url}/step-0000004" in "\n".join(failure.value.__notes__)
    ckpt.close()  # already delivered through wait_remote(): not raised twice
    step(model, opt, seed=5)
    other = lazyckpt.LazyCheckpointer(tmp_path / "other", remote=url, storage_options=options)
    other.remote.storage = FlakyRemote(url, options)
    other.remote.storage.fail = True
    other.save(snapshot(model, opt), step=5, optimizers=[opt])
    with pytest.raises(ConnectionError, match="injected"):
        other.close()
    assert os.path.isdir(tmp_path / "other" / "step-0000005"), "a failed upload deletes nothing"


_KILLED_CHILD = textwrap.dedent("""
    import sys, threading, torch, lazyckpt
    from lazyckpt.storage.fsspec import FsspecStorage
    url, endpoint, local = sys.argv[1:4]
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "eu-west-1"}}

    class Hanging(FsspecStorage):
        def upload_file(self, local_path, path):
            if path.endswith(".json"):              # the tensor file is up; stop before the manifests
                print("UPLOADING", flush=True)
                threading.Event().wait()
            super().upload_file(local_path, path)

    ckpt = lazyckpt.LazyCheckpointer(local, remote=url, storage_options=options)
    ckpt.remote.storage = Hanging(url, options)
    ckpt.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, step=9).wait()
    threading.Event().wait()
""")


@pytest.mark.slow
def test_an_upload_killed_midway_never_becomes_latest_and_the_next_run_cleans_it(tmp_path, s3_remote, moto_endpoint):
    url, options = s3_remote
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, url, moto_endpoint, str(tmp_path / "a")],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "UPLOADING"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    committed, partial = remote_steps(FsspecStorage(url, options), url)
    assert committed == {} and partial == [f"{url}/step-0000009"]
    assert lazyckpt.latest(url, storage_options=options) is None
    with lazyckpt.LazyCheckpointer(tmp_path / "b", remote=url, storage_options=options) as ckpt:
        assert remote_steps(FsspecStorage(url, options), url)[1] == [f"{url}/step-0000009"], \
            "nothing newer is committed: it may be a live job's upload, so the next run keeps it for now"
        ckpt.save({"w": torch.ones(4)}, step=10).wait_remote()
    assert remote_steps(FsspecStorage(url, options), url) == ({10: f"{url}/step-0000010"}, []), \
        "the next run removes it once it committed a newer step"


class ReplyLostAfterCommit(FsspecStorage):
    """The real remote, except that the first commit object's upload reports a failure after it went up."""

    def __init__(self, url, options):
        super().__init__(url, options)
        self.uploaded, self.lost_one = [], False

    def upload_file(self, local_path, path):
        super().upload_file(local_path, path)
        self.uploaded.append(path)
        if path.endswith("/manifest.json") and not self.lost_one:
            self.lost_one = True
            raise ConnectionError(f"reply to the upload of {path} lost (injected)")


def test_a_retry_finds_its_step_committed_already_and_uploads_nothing_again(tmp_path, trained, s3_remote):
    url, options = s3_remote
    model, opt = trained
    ckpt = lazyckpt.LazyCheckpointer(tmp_path, remote=url, storage_options=options)
    remote = ckpt.remote.storage = ReplyLostAfterCommit(url, options)
    ckpt.save(snapshot(model, opt), step=1, optimizers=[opt]).wait()
    ckpt.remote.drain()
    with pytest.raises(ConnectionError, match="reply .* lost"):
        ckpt.save(snapshot(model, opt), step=2, optimizers=[opt])
    assert ckpt.in_flight.wait_remote() == f"{url}/step-0000002"
    ckpt.close()
    step_1 = [p for p in remote.uploaded if "/step-0000001/" in p]
    assert len(step_1) == len(set(step_1)) == 3, "the retry of step 1 uploaded none of its objects again"
    assert sorted(remote_steps(FsspecStorage(url, options), url)[0]) == [1, 2]


@pytest.mark.parametrize("kept", [["manifest.json"], ["manifest.json", "rank-00000.json"]])
def test_a_remote_step_missing_its_other_objects_is_never_latest_and_goes_once_a_newer_step_commits(
        tmp_path, s3_remote, kept):
    url, options = s3_remote
    with lazyckpt.LazyCheckpointer(tmp_path / "a", remote=url, storage_options=options) as ckpt:
        for n in (1, 2):
            ckpt.save({"w": torch.full((4,), float(n))}, step=n).wait_remote()
    remote = FsspecStorage(url, options)
    remote.write_atomic(f"{url}/step-0000001/rank-00001-of-00002.safetensors", b"left by a 2-rank run", sync=True)
    step_2 = f"{url}/step-0000002"
    for name in remote.list_dir(step_2):
        if name not in kept:  # what an outage, a tool or an older job's removal could leave
            remote.remove_file(f"{step_2}/{name}")
    assert lazyckpt.latest(url, storage_options=options) == f"{url}/step-0000001"
    assert remote_steps(remote, url) == ({1: f"{url}/step-0000001"}, [step_2])
    assert torch.equal(lazyckpt.load(lazyckpt.latest(url, storage_options=options), storage_options=options)["w"],
                       torch.full((4,), 1.0))
    with lazyckpt.LazyCheckpointer(tmp_path / "b", remote=url, storage_options=options) as ckpt:
        assert remote_steps(remote, url)[1] == [step_2], "above every committed step: left alone at the start"
        ckpt.save({"w": torch.full((4,), 3.0)}, step=3).wait_remote()
    assert remote_steps(remote, url) == ({1: f"{url}/step-0000001", 3: f"{url}/step-0000003"}, []), \
        "removed as a partial upload once a newer step committed"
    assert remote.list_dir(url) == ["step-0000001", "step-0000003"]


class CutCleanup(FsspecStorage):
    """The real remote, except that while ``cut`` is set the removal of a step's objects dies after the first one
    (the connection lost midway)."""

    def __init__(self, url, options):
        super().__init__(url, options)
        self.cut = False

    def remove_tree(self, path):
        if self.cut:
            self.remove_file(f"{path}/{sorted(self.list_dir(path))[0]}")
            raise ConnectionError(f"connection to the object store lost (injected) while removing {path}")
        super().remove_tree(path)


def test_a_retention_clean_up_cut_by_an_outage_leaves_nothing_after_close(tmp_path, s3_remote):
    url, options = s3_remote
    ckpt = lazyckpt.LazyCheckpointer(tmp_path, remote=url, storage_options=options, remote_keep_last_k=1)
    cut = ckpt.remote.storage = CutCleanup(url, options)
    ckpt.save({"w": torch.ones(4)}, step=1).wait_remote()
    cut.cut = True
    ckpt.save({"w": torch.full((4,), 2.0)}, step=2).wait_remote()  # returns once step 1's removal was cut
    remote = FsspecStorage(url, options)
    assert remote_steps(remote, url) == ({2: f"{url}/step-0000002"}, [f"{url}/step-0000001"]), \
        "the manifest went first: what the cut left is no step"
    cut.cut = False  # the remote is back
    ckpt.close()
    assert remote.list_dir(url) == ["step-0000002"], "close() finished the clean-up"
    assert torch.equal(lazyckpt.load(f"{url}/step-0000002", storage_options=options)["w"], torch.full((4,), 2.0))


class HangingCleanup(CutCleanup):
    """As :class:`CutCleanup`; while ``hang`` is set a removal waits for ``release`` (an endpoint that never
    answers, as a remote still down at ``close()`` can be for the storage's own retries)."""

    def __init__(self, url, options):
        super().__init__(url, options)
        self.hang, self.release = False, threading.Event()

    def remove_tree(self, path):
        if self.hang:
            self.release.wait(120)
        super().remove_tree(path)


def test_a_clean_up_retried_at_close_is_bounded_by_remote_timeout_s(tmp_path, s3_remote, caplog):
    url, options = s3_remote
    ckpt = lazyckpt.LazyCheckpointer(tmp_path, remote=url, storage_options=options, remote_keep_last_k=1,
                                     remote_timeout_s=1.0)
    remote = ckpt.remote.storage = HangingCleanup(url, options)
    ckpt.save({"w": torch.ones(4)}, step=1).wait_remote()
    remote.cut = True
    ckpt.save({"w": torch.full((4,), 2.0)}, step=2).wait_remote()  # step 1's removal cut: retried at close()
    remote.cut, remote.hang = False, True
    try:
        with caplog.at_level(logging.WARNING, logger="lazyckpt"):
            ckpt.close()  # returns after remote_timeout_s, not when the endpoint answers
        assert "left for the next run" in caplog.text
    finally:
        remote.release.set()
    assert lazyckpt.latest(url, storage_options=options) == f"{url}/step-0000002"


def test_a_retry_finding_only_its_commit_object_uploads_the_step_again(tmp_path, trained, s3_remote):
    url, options = s3_remote
    model, opt = trained
    ckpt, flaky, local = _first_upload_failed(tmp_path, trained, url, options)
    remote = FsspecStorage(url, options)
    for name in remote.list_dir(f"{url}/step-0000001"):  # the first try left its tensor file: take it away too
        remote.remove_file(f"{url}/step-0000001/{name}")
    remote.upload_file(os.path.join(local, "manifest.json"), f"{url}/step-0000001/manifest.json")  # alone
    flaky.fail = False
    with pytest.raises(ConnectionError, match="injected"):
        ckpt.save(snapshot(model, opt), step=2, optimizers=[opt])  # step 1 is retried before step 2 goes up
    assert ckpt.in_flight.wait_remote() == f"{url}/step-0000002"
    ckpt.close()
    assert remote_steps(remote, url) == ({1: f"{url}/step-0000001", 2: f"{url}/step-0000002"}, [])
    lazyckpt.verify(f"{url}/step-0000001", storage_options=options)
