"""Several gloo ranks uploading to one remote level (the moto S3 server): the remote commit meets through the
process group's store, a failed upload on one rank commits nothing on any rank, and the ranks sharing a node's
directory fetch a remote checkpoint once."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist

import lazyckpt
from helpers.distributed import run_ranks
from helpers.remote import FlakyRemote, moto_endpoint, s3_remote  # noqa: F401 - fixtures
from lazyckpt.errors import CommitAbandoned
from lazyckpt.levels.remote import fetch
from lazyckpt.levels.remote.contents import remote_steps
from lazyckpt.levels.remote.meeting import StoreMeeting
from lazyckpt.ranks.group import default_store
from lazyckpt.storage.fsspec import FsspecStorage


class WatchedRemote(FlakyRemote):
    """The flaky remote, remembering every object it was asked about."""

    def __init__(self, url, options):
        super().__init__(url, options)
        self.looked_up = []

    def stat(self, path):
        self.looked_up.append(path)
        return super().stat(path)


def _state(rank, step):
    return {"w": torch.arange(1000.0) * step, "rank": lazyckpt.PerRank(rank), "step": step}


def _one_rank_fails_its_upload(rank, world_size, url, options, dirpath):
    ckpt = lazyckpt.LazyCheckpointer(os.path.join(dirpath, f"node{rank}"), remote=url, storage_options=options,
                                     remote_timeout_s=120.0)
    assert isinstance(ckpt.remote.meeting, StoreMeeting)
    remote = ckpt.remote.storage = WatchedRemote(url, options)
    assert ckpt.save(_state(rank, 1), step=1).wait_remote() == f"{url}/step-0000001"
    remote.fail = rank == 1  # rank 1's tensor file goes up, its manifest does not
    assert ckpt.save(_state(rank, 2), step=2).wait().endswith("step-0000002"), "the local level commits"
    ckpt.remote.drain()
    assert lazyckpt.latest(url, storage_options=options) == f"{url}/step-0000001", "on every rank"
    remote.fail = False
    with pytest.raises(ConnectionError if rank == 1 else CommitAbandoned) as failure:
        ckpt.save(_state(rank, 3), step=3)  # raises step 2's upload failure, once it took step 3's request
    assert f"while uploading step 2 to {url}/step-0000002 (rank {rank})" in "\n".join(failure.value.__notes__)
    assert ckpt.in_flight.wait_remote() == f"{url}/step-0000003", "step 2 retried first"
    assert not [p for p in remote.looked_up if "/rank-" in p], "no rank polls the remote for another's upload"
    dist.barrier()  # both ranks are past every attempt: its keys are gone from the store
    prefix = ckpt._rendezvous.prefix
    attempts = ["1.0", "2.0", "3.0", "remote/1.0/0", "remote/2.0/0", "remote/2.0/1", "remote/3.0/0"]
    keys = [f"{prefix}/{a}/{kind}/{r}" for a in attempts for kind in ("durable", "committed", "done") for r in (0, 1)]
    assert not [k for k in keys + [f"{prefix}/remote/2.0/0/failed"] if default_store().check([k])]
    ckpt.close()


def test_one_rank_failing_its_upload_commits_nothing_remotely_and_the_retry_commits_through_the_store(
        tmp_path, s3_remote):
    url, options = s3_remote
    run_ranks(_one_rank_fails_its_upload, 2, url, options, str(tmp_path))
    committed, partial = remote_steps(FsspecStorage(url, options), url)
    assert sorted(committed) == [1, 2, 3] and partial == []
    for rank in range(2):
        restored = lazyckpt.load(committed[2], rank=rank, storage_options=options)
        assert restored["rank"] == rank and torch.equal(restored["w"], torch.arange(1000.0) * 2)


def test_ranks_sharing_a_directory_fetch_a_remote_checkpoint_once(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/shared/run"
    with lazyckpt.LazyCheckpointer(tmp_path / "trained", remote=url) as ckpt:
        ckpt.save(_state(0, 7), step=7).wait_remote()
    both_looked, second_fetch, fetches = threading.Barrier(2), threading.Event(), []

    def listed_then_meet(*args):  # both ranks see only the remote copy before either fetches it
        found = lazyckpt.levels.remote.contents.remote_steps(*args)
        both_looked.wait(timeout=60)
        return found

    def fetch_in_step(*args, **kwargs):
        fetches.append(args)
        if len(fetches) == 1:  # the first fetch stays open while the other rank could start one too
            second_fetch.wait(timeout=2)
        else:
            second_fetch.set()
        return real_fetch_step(*args, **kwargs)

    real_fetch_step = fetch.fetch_step
    monkeypatch.setattr(fetch, "remote_steps", listed_then_meet)
    monkeypatch.setattr(fetch, "fetch_step", fetch_in_step)
    node, found = str(tmp_path / "fresh-node"), [None, None]
    threads = [threading.Thread(target=lambda r=r: found.__setitem__(r, fetch.newest_on_this_node(node, url, None)))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fetches) == 1, "the second rank found the first one's copy"
    assert found == [os.path.join(node, "step-0000007")] * 2
    assert torch.equal(lazyckpt.load(found[0])["w"], torch.arange(1000.0) * 7)
