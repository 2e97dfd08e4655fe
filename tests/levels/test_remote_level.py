"""The remote level: cadence, retention, bit-exact restore from the remote alone, and what readers may see."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

import lazyckpt
from helpers.remote import any_remote, moto_endpoint, s3_remote  # noqa: F401 - fixtures
from conftest import assert_tree_equal, clone_tree, snapshot, step
from lazyckpt.levels.remote.contents import remote_steps
from lazyckpt.storage.fsspec import FsspecStorage


def test_remote_holds_exactly_the_due_steps_and_prunes_only_after_a_newer_commit(tmp_path, trained, any_remote):
    url, options = any_remote
    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path / "local", keep_last_k=2, remote=url, remote_every_n=2,
                                   remote_keep_last_k=2, storage_options=options) as ckpt:
        remote_urls = {}
        for s in range(1, 7):
            step(model, opt, seed=s)
            pending = ckpt.save(snapshot(model, opt), step=s, optimizers=[opt])
            pending.wait()
            remote_urls[s] = pending.wait_remote()
    assert [s for s, u in remote_urls.items() if u is None] == [1, 3, 5]
    assert remote_urls[6] == f"{url}/step-0000006"
    committed, partial = remote_steps(FsspecStorage(url, options), url)
    assert sorted(committed) == [4, 6] and partial == []
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path / "local"))) == [5, 6]
    assert lazyckpt.latest(url, storage_options=options) == remote_urls[6]


def test_restore_from_the_remote_with_the_local_directory_deleted_is_bit_exact(tmp_path, trained, any_remote):
    url, options = any_remote
    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path / "local", remote=url, storage_options=options) as ckpt:
        ckpt.save(snapshot(model, opt), step=3, optimizers=[opt])
        expected = clone_tree(snapshot(model, opt))
    shutil.rmtree(tmp_path / "local")
    newest = lazyckpt.latest(url, storage_options=options)
    assert newest == f"{url}/step-0000003" and lazyckpt.checkpoint_step(newest, storage_options=options) == 3
    assert_tree_equal(lazyckpt.load(newest, storage_options=options), expected)
    lazyckpt.verify(newest, storage_options=options)


def test_load_into_fills_targets_from_the_remote_with_the_local_directory_deleted(tmp_path, trained, any_remote):
    url, options = any_remote
    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path / "local", remote=url, storage_options=options) as ckpt:
        remote_step = ckpt.save(snapshot(model, opt), step=3, optimizers=[opt]).wait_remote()
        expected = clone_tree(snapshot(model, opt))
    shutil.rmtree(tmp_path / "local")
    targets = {k: torch.zeros_like(v) for k, v in expected["model"].items()}
    loaded = lazyckpt.load_into(remote_step, {"model": targets}, storage_options=options)
    assert all(loaded["model"][k] is t for k, t in targets.items()), "filled in place"
    assert_tree_equal(loaded, expected)


def test_uploads_read_the_local_level_through_its_storage(trained, any_remote):
    from lazyckpt.storage.in_memory import MemoryStorage

    url, options = any_remote
    model, opt = trained
    local = MemoryStorage()  # not plain files: the upload must go through the Storage seam, piece by piece
    with lazyckpt.LazyCheckpointer("/node/ckpt", storage=local, remote=url, storage_options=options) as ckpt:
        assert ckpt.save(snapshot(model, opt), step=5, optimizers=[opt]).wait_remote() == f"{url}/step-0000005"
        expected = clone_tree(snapshot(model, opt))
    assert_tree_equal(lazyckpt.load(f"{url}/step-0000005", storage_options=options), expected)


def test_a_corrupted_remote_object_is_named_by_load_and_verify(tmp_path, trained, s3_remote):
    url, options = s3_remote
    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path / "local", remote=url, storage_options=options) as ckpt:
        target = ckpt.save(snapshot(model, opt), step=1, optimizers=[opt]).wait_remote()
    storage = FsspecStorage(url, options)
    tensor_url = f"{target}/rank-00000-of-00001.safetensors"
    data = bytearray(storage.fs.cat_file(storage._path(tensor_url)))
    data[-3] ^= 0xFF
    storage.fs.pipe_file(storage._path(tensor_url), bytes(data))
    for read in (lambda: lazyckpt.verify(target, storage_options=options),
                 lambda: lazyckpt.load(target, storage_options=options),
                 lambda: lazyckpt.load_into(target, {"model": clone_tree(model.state_dict())},
                                            storage_options=options)):
        with pytest.raises(lazyckpt.CheckpointCorruptError, match=f"{tensor_url}: tensor .* is corrupt"):
            read()


def test_a_url_dirpath_goes_remote_and_writes_nothing_under_the_working_directory(tmp_path, trained, any_remote,
                                                                                  monkeypatch):
    url, options = any_remote
    model, opt = trained
    cwd, temp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    temp.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr("tempfile.tempdir", str(temp))
    with lazyckpt.LazyCheckpointer(url, keep_last_k=2, storage_options=options) as ckpt:
        assert ckpt.dirpath.startswith(str(temp)) and ckpt.remote.url == url
        for s in range(1, 4):
            step(model, opt, seed=s)
            assert ckpt.save(snapshot(model, opt), step=s, optimizers=[opt]).wait_remote() == f"{url}/step-{s:07d}"
        expected = clone_tree(snapshot(model, opt))
    assert list(cwd.iterdir()) == []
    assert sorted(remote_steps(FsspecStorage(url, options), url)[0]) == [2, 3]
    assert_tree_equal(lazyckpt.load(lazyckpt.latest(url, storage_options=options), storage_options=options),
                      expected)


def test_latest_sees_a_step_another_checkpointer_committed_a_moment_ago(tmp_path, s3_remote):
    url, options = s3_remote
    with lazyckpt.LazyCheckpointer(tmp_path / "a", remote=url, storage_options=options) as first:
        first.save({"w": torch.zeros(8)}, step=1).wait_remote()
    assert lazyckpt.latest(url, storage_options=options) == f"{url}/step-0000001"
    with lazyckpt.LazyCheckpointer(tmp_path / "b", remote=url, storage_options=options) as second:
        second.save({"w": torch.ones(8)}, step=2).wait_remote()
        assert lazyckpt.latest(url, storage_options=options) == f"{url}/step-0000002"


def test_the_cli_lists_and_verifies_remote_checkpoints(tmp_path, trained, s3_remote, capsys):
    import json

    from lazyckpt.cli import main

    url, options = s3_remote
    model, opt = trained
    with lazyckpt.LazyCheckpointer(tmp_path / "local", remote=url, storage_options=options) as ckpt:
        ckpt.save(snapshot(model, opt), step=7, optimizers=[opt])
    assert main(["ls", url, "--storage-options", json.dumps(options)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.count("│") > 3]
    assert len(rows) == 1 and "step-0000007" in rows[0] and "(latest)" in rows[0] and "kB" in rows[0]
    assert main(["verify", f"{url}/step-0000007", "--storage-options", json.dumps(options)]) == 0


@pytest.mark.parametrize(("options", "message"), [
    ({"remote": "bucket/run"}, "remote='bucket/run' must be an fsspec URL"),
    ({"remote": "s3://"}, "names no bucket"),
    ({"remote": "memory://x", "remote_every_n": 0}, "remote_every_n=0 must be a positive int"),
    ({"remote": "memory://x", "remote_keep_last_k": 0}, "remote_keep_last_k=0 must be a positive int"),
    ({"remote": "memory://x", "storage_options": "k=v"}, "storage_options='k=v' must be a dict"),
    ({"remote": "memory://x", "remote_timeout_s": 0}, "remote_timeout_s=0 must be a positive number"),
])
def test_bad_remote_options_are_refused_with_the_argument_and_value(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        lazyckpt.LazyCheckpointer(tmp_path, **options)


def test_a_url_dirpath_and_another_remote_url_are_refused(tmp_path):
    with pytest.raises(ValueError, match="names another one"):
        lazyckpt.LazyCheckpointer("memory://a/run", remote="memory://b/run", spool_dir=str(tmp_path))


def test_several_ranks_upload_their_own_files_and_rank_0_commits_last(tmp_path, s3_remote):
    url, options = s3_remote
    ranks = [lazyckpt.LazyCheckpointer(tmp_path, rank=r, world_size=2, remote=url, storage_options=options)
             for r in range(2)]
    pendings = [ranks[r].save({"w": torch.full((64,), float(r)), "rank": r}, step=5) for r in range(2)]
    import threading

    urls = [None, None]
    threads = [threading.Thread(target=lambda r=r: urls.__setitem__(r, pendings[r].wait_remote())) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert urls == [f"{url}/step-0000005"] * 2
    for r in range(2):
        assert lazyckpt.load(urls[0], rank=r, storage_options=options)["rank"] == r
        ranks[r].close()


class GatedRemote(FsspecStorage):
    """A remote whose uploads wait at a gate: a step is "still uploading" for as long as the test wants."""

    def __init__(self, url, options):
        super().__init__(url, options)
        self.gate, self.entered = threading.Event(), threading.Event()

    def upload_file(self, local_path, path):
        self.entered.set()
        self.gate.wait()
        super().upload_file(local_path, path)


def test_local_retention_never_deletes_a_checkpoint_that_is_still_uploading(tmp_path, trained, s3_remote):
    url, options = s3_remote
    model, opt = trained
    ckpt = lazyckpt.LazyCheckpointer(tmp_path, keep_last_k=1, remote=url, remote_every_n=2, storage_options=options)
    gated = ckpt.remote.storage = GatedRemote(url, options)
    ckpt.save(snapshot(model, opt), step=2, optimizers=[opt]).wait()
    gated.entered.wait()
    step(model, opt, seed=3)
    ckpt.save(snapshot(model, opt), step=3, optimizers=[opt]).wait()
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path))) == [2, 3], "step 2 is still uploading"
    gated.gate.set()
    ckpt.remote.drain()
    step(model, opt, seed=5)
    ckpt.save(snapshot(model, opt), step=5, optimizers=[opt]).wait()
    ckpt.close()
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path))) == [5]
    assert lazyckpt.latest(url, storage_options=options) == f"{url}/step-0000002"


class GatedFailingRemote(GatedRemote):
    """A gated remote whose uploads then fail (the connection is lost once the gate opens)."""

    def upload_file(self, local_path, path):
        if path.endswith(".json"):
            self.gate.wait()
            raise ConnectionError(f"connection to the object store lost (injected) while writing {path}")
        super().upload_file(local_path, path)


def _step_3_committed_while_step_2_uploads(tmp_path, trained, url, options, remote_class):
    """keep_last_k=1, uploads of every 2nd step through a gated ``remote_class``: step 3 is committed while step 2
    waits at the gate. Returns ``(checkpointer, the remote, step 2's handle)``."""
    model, opt = trained
    ckpt = lazyckpt.LazyCheckpointer(tmp_path, keep_last_k=1, remote=url, remote_every_n=2, storage_options=options)
    gated = ckpt.remote.storage = remote_class(url, options)
    uploading = ckpt.save(snapshot(model, opt), step=2, optimizers=[opt])
    gated.entered.wait()
    step(model, opt, seed=3)
    ckpt.save(snapshot(model, opt), step=3, optimizers=[opt]).wait()
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path))) == [2, 3], "step 2 is still uploading"
    return ckpt, gated, uploading


def test_a_step_kept_while_it_uploaded_is_purged_as_soon_as_its_upload_ends(tmp_path, trained, s3_remote):
    url, options = s3_remote
    ckpt, gated, uploading = _step_3_committed_while_step_2_uploads(tmp_path, trained, url, options, GatedRemote)
    gated.gate.set()
    assert uploading.wait_remote() == f"{url}/step-0000002"
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path))) == [3], "purged when its upload ended"
    ckpt.close()
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path))) == [3]


def test_a_step_whose_upload_failed_is_kept_for_its_retry_and_purged_at_close(tmp_path, trained, s3_remote):
    url, options = s3_remote
    ckpt, gated, failing = _step_3_committed_while_step_2_uploads(tmp_path, trained, url, options,
                                                                  GatedFailingRemote)
    gated.gate.set()
    with pytest.raises(ConnectionError, match="injected"):
        failing.wait_remote()
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path))) == [2, 3], "step 2 awaits its retry"
    ckpt.close()  # its failure was delivered by wait_remote()
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path))) == [3], "no retry comes after close()"


def _session_with_steps_1_and_2_uploading(tmp_path, trained, s3_remote):
    """A session without engine retention (names decide) whose uploads wait at a gate, steps 1 and 2 committed."""
    from lazyckpt.policy import CheckpointSession, SessionOptions

    url, options = s3_remote
    model, opt = trained
    session = CheckpointSession(tmp_path, SessionOptions(owner="Adapter", source="the framework", remote=url,
                                                         storage_options=options),
                                rank=0, world_size=1, engine_retention=False)
    gated = session.engine.remote.storage = GatedRemote(url, options)
    for s in (1, 2):
        step(model, opt, seed=s)
        session.save(s, replicated=snapshot(model, opt), per_rank={}, optimizers=[opt]).wait()
    gated.entered.wait()
    assert session.purge(released={1}) == [], "step 1 is still uploading"
    return session, gated


def test_a_released_name_never_deletes_a_checkpoint_that_is_still_uploading(tmp_path, trained, s3_remote):
    url, options = s3_remote
    model, opt = trained
    session, gated = _session_with_steps_1_and_2_uploading(tmp_path, trained, s3_remote)
    gated.gate.set()
    session.engine.remote.drain()
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path))) == [2], \
        "deleted as soon as its upload ended, not at the next commit's purge"
    step(model, opt, seed=3)
    session.save(3, replicated=snapshot(model, opt), per_rank={}, optimizers=[opt]).wait()
    assert session.purge() == []
    session.close()
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path))) == [2, 3]
    assert sorted(remote_steps(FsspecStorage(url, options), url)[0]) == [1, 2, 3]


def test_a_step_released_while_it_uploads_is_deleted_when_close_ends_the_upload(tmp_path, trained, s3_remote):
    url, options = s3_remote
    session, gated = _session_with_steps_1_and_2_uploading(tmp_path, trained, s3_remote)
    gated.gate.set()
    session.close()  # the uploads end inside close()
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path))) == [2]
    assert sorted(remote_steps(FsspecStorage(url, options), url)[0]) == [1, 2]


def test_a_purge_finished_after_the_upload_spares_what_a_name_on_disk_keeps(tmp_path, trained, s3_remote):
    # keep_last_k=1 and every step still uploading: the purge defers. A link an earlier process left (best.ckpt)
    # keeps step 1 when the uploads end; the released step 2 goes; step 3 is the newest.
    from lazyckpt.levels.aliases import link_alias
    from lazyckpt.policy import CheckpointNames, CheckpointSession, SessionOptions

    url, options = s3_remote
    model, opt = trained
    session = CheckpointSession(tmp_path, SessionOptions(owner="Adapter", source="the framework", remote=url,
                                                         storage_options=options, keep_last_k=1),
                                rank=0, world_size=1, engine_retention=False)
    CheckpointNames(session, lambda step: None)  # its protection: the names on disk too
    gated = session.engine.remote.storage = GatedRemote(url, options)
    for s in (1, 2, 3):
        step(model, opt, seed=s)
        session.save(s, replicated=snapshot(model, opt), per_rank={}, optimizers=[opt]).wait()
    link_alias(session.storage, str(tmp_path / "best.ckpt"), str(tmp_path / "step-0000001"))
    assert session.purge(released={2}) == [], "every step is still uploading"
    gated.gate.set()
    session.close()
    assert sorted(lazyckpt.format.catalog.committed_steps(str(tmp_path))) == [1, 3]
