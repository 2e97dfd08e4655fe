"""The peer copy (``memory_peers=1``) on simulated nodes: 2 nodes x 2 gloo ranks on this machine, each node with a
``dirpath`` and a shared-memory root of its own (``GROUP_RANK`` tells the nodes apart, as ``torchrun`` sets it).

A node is lost by killing every rank (SIGKILL, the job dies with the node) and removing that node's directory and
host folders; the job restarted on its "replacement" must get those ranks' newest step back from the copies the
other node keeps, bit-exact, and commit it to the new node's empty ``dirpath``. With both copies of a node gone,
its ranks resume from its disk.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import threading

import pytest
import torch
import torch.distributed as dist

import lazyckpt
from helpers.distributed import run_ranks
from lazyckpt.format.catalog import committed_steps
from lazyckpt.levels.remote.upload import RemoteLevel
from lazyckpt.storage.urls import host_dir

RANKS, PER_NODE = 4, 2


def _where(tmp: str, rank: int) -> tuple[str, str]:
    """``(dirpath, host_memory_dir)`` of ``rank``'s node."""
    node = os.path.join(tmp, f"node{rank // PER_NODE}")
    return os.path.join(node, "disk"), os.path.join(node, "shm")


def _state(rank: int, step: int) -> dict:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": lazyckpt.PerRank(torch.randn(3000, generator=generator)),
            "opt": lazyckpt.PerRank({"m": torch.randn(257, generator=generator), "step": step})}


def _checkpointer(tmp: str, rank: int) -> lazyckpt.LazyCheckpointer:
    os.environ["GROUP_RANK"] = str(rank // PER_NODE)
    dirpath, shm = _where(tmp, rank)
    return lazyckpt.LazyCheckpointer(dirpath, keep_in_memory="host", host_memory_dir=shm, memory_peers=1,
                                     keep_last_k=2, fsync=False, peer_timeout_s=30.0)


def _train_then_die(rank: int, world_size: int, tmp: str, steps: int, hold_disk_from: int | None) -> None:
    """Save ``steps`` steps, wait until every rank's peer copy of the last one is in, then SIGKILL this rank.
    ``hold_disk_from``: from that step on, the copy to ``dirpath`` never happens (the crash comes first)."""
    if hold_disk_from is not None:
        upload = RemoteLevel.upload_step

        def held(self, url, *args, **kwargs):
            if int(url.rstrip("/").rsplit("-", 1)[1]) >= hold_disk_from:
                threading.Event().wait()  # never returns: the process is killed while it waits
            return upload(self, url, *args, **kwargs)

        RemoteLevel.upload_step = held
    ckpt = _checkpointer(tmp, rank)
    for step in range(1, steps + 1):
        ckpt.save(_state(rank, step), step=step).wait()
    ckpt._host.peer.wait_backlog(0)
    assert ckpt._host.peer.failures == 0
    dist.barrier()  # every rank's copies are in
    os.kill(os.getpid(), signal.SIGKILL)


def _resume(rank: int, world_size: int, tmp: str, expected: dict[int, int]) -> None:
    ckpt = _checkpointer(tmp, rank)
    dirpath, shm = _where(tmp, rank)
    step = expected[rank // PER_NODE]
    path = lazyckpt.latest(dirpath, host_memory_dir=shm)
    assert path is not None and path.endswith(f"step-{step:07d}"), (rank, path)
    loaded = lazyckpt.load(path, rank=rank)
    want = _state(rank, step)
    assert torch.equal(loaded["w"], want["w"].value) and torch.equal(loaded["opt"]["m"], want["opt"].value["m"])
    assert loaded["opt"]["step"] == step
    assert step in committed_steps(dirpath), f"rank {rank}: step {step} is not committed in its node's dirpath"
    ckpt.save(_state(rank, step + 1), step=step + 1).wait()  # training goes on, peer copies too
    ckpt._host.peer.wait_backlog(0)
    assert ckpt._host.peer.failures == 0
    ckpt.close()


def _lose_node(tmp: str, node: int) -> None:
    shutil.rmtree(os.path.join(tmp, f"node{node}"))


def _kept(tmp: str, keeper_rank: int, source: int) -> str:
    dirpath, shm = _where(tmp, keeper_rank)
    return os.path.join(host_dir(dirpath, shm), f"peer-rank{source:05d}")


def test_a_lost_node_comes_back_from_its_peers_copies_bit_exact(tmp_path):
    tmp = str(tmp_path)
    codes = run_ranks(_train_then_die, RANKS, tmp, 3, 3, meet_at_end=False)
    assert set(codes.values()) == {-signal.SIGKILL}
    for source, keeper in ((0, 2), (1, 3), (2, 0), (3, 1)):  # the ring: node 0 keeps node 1's copies, and back
        assert sorted(os.listdir(_kept(tmp, keeper, source))) == ["step-0000002", "step-0000003"]
    _lose_node(tmp, 0)  # its processes are dead; now its disk and its shared memory go too
    run_ranks(_resume, RANKS, tmp, {0: 3, 1: 3})
    assert not os.listdir(os.path.join(tmp, "node0", "shm")), "a clean close frees the host folder and the copies"


def test_with_both_copies_of_a_node_gone_its_ranks_resume_from_its_disk(tmp_path):
    tmp = str(tmp_path)
    run_ranks(_train_then_die, RANKS, tmp, 3, 3, meet_at_end=False)  # step 3 is in host memory only
    shutil.rmtree(os.path.join(tmp, "node0", "shm"))  # node 0 rebooted: its disk stays
    for source in (0, 1):
        shutil.rmtree(_kept(tmp, source + PER_NODE, source))
    # node 1 holds step 3 in its host folder, node 0 nowhere: every rank resumes at step 2, and node 1 keeps its
    # step 3 aside (never resumed from)
    run_ranks(_resume, RANKS, tmp, {0: 2, 1: 2})


def test_memory_peers_needs_the_host_level_and_a_process_group(tmp_path):
    with pytest.raises(ValueError, match="memory_peers=1 sends copies over torch.distributed"):
        lazyckpt.LazyCheckpointer(tmp_path / "d", keep_in_memory="host", host_memory_dir=str(tmp_path / "shm"),
                                  memory_peers=1)
    with pytest.raises(ValueError, match="memory_peers=1 applies to keep_in_memory='host' only"):
        lazyckpt.LazyCheckpointer(tmp_path / "e", memory_peers=1)


MOMENTS = ("saved", "committed", "copied")
"""Where each rank kills itself after the save of the chosen step: ``save()`` returned (the copy and the commit
under way), that step committed in the host folder (its transfers to the peers under way), its peer copies in."""


def _train_then_die_at(rank: int, world_size: int, tmp: str, kill_step: int, moment: str) -> None:
    """Every rank dies together (the job dies with a node: rank 0's process also serves the store)."""
    ckpt = _checkpointer(tmp, rank)
    for step in range(1, kill_step + 1):
        pending = ckpt.save(_state(rank, step), step=step)
        if step == kill_step and moment == "saved":
            break
        pending.wait()
    if moment == "copied":
        ckpt._host.peer.wait_backlog(0)
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _resume_anywhere(rank: int, world_size: int, tmp: str, at_least: int) -> None:
    ckpt = _checkpointer(tmp, rank)
    dirpath, shm = _where(tmp, rank)
    path = lazyckpt.latest(dirpath, host_memory_dir=shm)
    assert path is not None, f"rank {rank} finds no step although every keeper held one"
    step = lazyckpt.checkpoint_step(path)
    loaded, want = lazyckpt.load(path, rank=rank), _state(rank, step)
    assert torch.equal(loaded["w"], want["w"].value) and torch.equal(loaded["opt"]["m"], want["opt"].value["m"])
    assert step >= at_least and step in committed_steps(dirpath), (rank, step, at_least)
    folder = host_dir(dirpath, shm)
    assert not [n for n in os.listdir(folder) if n.endswith(".partial")], "a torn copy is left in the host folder"
    steps = [None] * world_size
    dist.all_gather_object(steps, step)  # also: no rank closes (and frees the folder) before all looked
    assert len(set(steps)) == 1, f"the ranks resume at different steps: {steps}"
    ckpt.close()


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("lost", [0, 1])
def test_a_node_lost_at_any_moment_resumes_every_rank_at_one_complete_step(tmp_path, moment, lost):
    """At each moment after the save of step k, step k-2's peer copies are complete (a save lets one transfer run
    behind it) and so is its copy to ``dirpath``: every rank resumes at one step >= k-2, bit-exact."""
    kill_step = 3 + (MOMENTS.index(moment) + lost) % 3
    tmp = str(tmp_path)
    run_ranks(_train_then_die_at, RANKS, tmp, kill_step, moment, meet_at_end=False)
    _lose_node(tmp, lost)
    run_ranks(_resume_anywhere, RANKS, tmp, kill_step - 2)


def _keeper_runs_out_of_room(rank: int, world_size: int, tmp: str) -> None:
    """Node 1's tmpfs is full while step 2's copies come in: they fail there, and nothing else does."""
    from lazyckpt.storage import LocalStorage

    open_write = LocalStorage.open_write

    def full(self, path):
        if rank >= PER_NODE and "peer-rank" in path and "step-0000002" in path:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return open_write(self, path)

    LocalStorage.open_write = full
    ckpt = _checkpointer(tmp, rank)
    for step in (1, 2, 3):
        ckpt.save(_state(rank, step), step=step).wait()
    peer = ckpt._host.peer
    peer.wait_backlog(0)
    assert peer.failures == (1 if rank >= PER_NODE else 0), (rank, peer.failures)
    dist.barrier()  # every keeper is done
    kept = sorted(os.listdir(_kept(tmp, peer.keeper[rank], rank)))
    dist.barrier()  # every rank looked before any keeper closes (and frees its copies)
    assert kept == (["step-0000001", "step-0000003"] if rank < PER_NODE else ["step-0000002", "step-0000003"]), kept
    ckpt.close()


def test_a_keeper_out_of_room_keeps_its_older_copy_and_nobody_waits(tmp_path):
    run_ranks(_keeper_runs_out_of_room, RANKS, str(tmp_path))


def _one_ring_stuck_then_die(rank: int, world_size: int, tmp: str) -> None:
    """Rank 1's transfer of step 4 never ends (its ring 1->3 hangs), while the saves go on to step 5."""
    import lazyckpt.levels.peer.level as peer_level

    transfer = peer_level.transfer

    def stuck(group, storage, sends, receives, landing):
        if rank == 1 and any(out.step == 4 for out in sends.values()):
            threading.Event().wait()
        return transfer(group, storage, sends, receives, landing)

    peer_level.transfer = stuck
    ckpt = _checkpointer(tmp, rank)
    for step in range(1, 6):
        ckpt.save(_state(rank, step), step=step).wait()
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def test_transfers_start_together_so_a_stuck_ring_still_leaves_a_common_step(tmp_path):
    """Each local position is a ring of its own (0->2->0, 1->3->1); one that hangs must not let the other run ahead
    until the lost node's keepers share no step."""
    tmp = str(tmp_path)
    run_ranks(_one_ring_stuck_then_die, RANKS, tmp, meet_at_end=False)
    _lose_node(tmp, 0)
    run_ranks(_resume_anywhere, RANKS, tmp, 3)


def _expect_disagreement(rank: int, world_size: int, tmp: str) -> None:
    with pytest.raises(lazyckpt.RanksDisagreeError, match="hold no checkpoint step in common"):
        _checkpointer(tmp, rank)


def test_ranks_holding_no_step_in_common_are_told_instead_of_resuming_apart(tmp_path):
    tmp = str(tmp_path)
    run_ranks(_train_then_die, RANKS, tmp, 3, None, meet_at_end=False)
    _lose_node(tmp, 0)
    for source in (0, 1):
        shutil.rmtree(_kept(tmp, source + PER_NODE, source))
    run_ranks(_expect_disagreement, RANKS, tmp)
