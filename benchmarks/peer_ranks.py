"""The rank side of ``peer_copy.py``: one fresh process per simulated node, started as torchrun starts one (the
rendezvous from ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``, the node from ``GROUP_RANK``).

``python benchmarks/peer_ranks.py SPEC_JSON`` runs the spec's phase on this rank and prints one JSON line:

* ``write``: train two steps and save step 2 with the peer copy, kept at close (the restores' source);
* ``restore``: a restart, timed from process start: build the model and optimizer, construct the checkpointer
  (which brings a lost node's step back from its peer), load this rank's file, ``load_state_dict``, one step;
* ``loop``: the training loop without checkpoints and with ``memory_peers=0`` and ``=1`` (interleaved, the order
  rotated per repeat; every rank runs the same loop at the same time).
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from dataclasses import replace  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # this checkout's lazyckpt, whatever is installed

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lazyckpt  # noqa: E402
from lazyckpt.storage.urls import host_dir  # noqa: E402
from workload import Batches, Workload, build_model, lm_loss, make_optimizer  # noqa: E402

IMPORTED = time.perf_counter()
LOOPS = ("none", "peers0", "peers1")
"""No checkpoint; ``keep_in_memory="host"`` alone; and with ``memory_peers=1``."""


def node_paths(spec: dict, rank: int, name: str = "disk") -> tuple[str, str]:
    """``(dirpath, host_memory_dir)`` of ``rank``'s node: one rank per node, each with its own of both."""
    return os.path.join(spec["work"], f"node{rank}", name), os.path.join(spec["shm"], f"node{rank}")


def rank_workload(spec: dict, rank: int) -> Workload:
    return replace(Workload(**spec["workload"]), seed=rank)  # each rank its own weights and batches


def rank_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """This rank's state only: with a ``dirpath`` per node, each rank loads its own file."""
    return {"model": lazyckpt.PerRank(model.state_dict()), "opt": lazyckpt.PerRank(opt.state_dict())}


def write(spec: dict, rank: int) -> dict:
    w = rank_workload(spec, rank)
    model, data = build_model(w), Batches(w)
    opt = make_optimizer(w, model.parameters())
    for step in range(2):
        lm_loss(model, data[step]).backward()
        opt.step()
        opt.zero_grad()
    dirpath, shm = node_paths(spec, rank)
    with lazyckpt.LazyCheckpointer(dirpath, keep_in_memory="host", host_memory_dir=shm, memory_peers=1,
                                   keep_on_close=True) as ckpt:
        pending = ckpt.save(rank_state(model, opt), step=2, optimizers=[opt])
        pending.wait()
        pending.wait_remote()
    return {"rank": rank}  # the close finished the transfer to the peer and kept both copies


def restore(spec: dict, rank: int) -> dict:
    w = rank_workload(spec, rank)
    model = build_model(w)
    opt = make_optimizer(w, model.parameters())
    built = time.perf_counter()
    dirpath, shm = node_paths(spec, rank)
    ckpt = lazyckpt.LazyCheckpointer(dirpath, keep_in_memory="host", host_memory_dir=shm, memory_peers=1,
                                     keep_on_close=True)
    constructed = time.perf_counter()
    where = dirpath if spec["source"] == "disk" else host_dir(dirpath, shm)
    path = lazyckpt.latest(where, host_memory_dir=shm)
    state = lazyckpt.load(path, rank=rank)
    loaded = time.perf_counter()
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    loss = lm_loss(model, Batches(w)[0])
    loss.backward()
    opt.step()
    stepped = time.perf_counter()
    ckpt.close()
    return {"rank": rank, "path": path, "loss": loss.item(), "imports_s": IMPORTED - STARTED,
            "build_s": built - IMPORTED, "construct_s": constructed - built, "load_s": loaded - constructed,
            "resume_s": stepped - built, "in_process_s": stepped - STARTED}


# --- the loop ----------------------------------------------------------------------------------------------------


def loop_checkpointer(variant: str, dirpath: str, shm: str) -> lazyckpt.LazyCheckpointer | None:
    if variant == "none":
        return None
    return lazyckpt.LazyCheckpointer(dirpath, keep_in_memory="host", host_memory_dir=shm, keep_last_k=2,
                                     memory_peers=1 if variant == "peers1" else 0)


def quiet(ckpt: lazyckpt.LazyCheckpointer, pending: lazyckpt.PendingCheckpoint | None) -> bool:
    """The newest checkpoint is in ``dirpath`` and, with the peer copy, in the peer's memory; never blocks. The
    peer's transfers are read from the host level's private rounds: no public call says so without waiting."""
    if pending is None:
        return True
    if not pending.done():
        return False
    try:
        pending.wait_remote(timeout=0)
    except TimeoutError:
        return False
    peer = ckpt._host.peer
    return peer is None or all(done.is_set() for done in peer._rounds)


def train(w: Workload, variant: str, dirpath: str, shm: str) -> dict:
    """One loop: each measured checkpoint's stall, and the steps between saves (those starting quiet apart)."""
    model, data = build_model(w), Batches(w)
    opt = make_optimizer(w, model.parameters())
    ckpt = loop_checkpointer(variant, dirpath, shm)
    steps, calm, stalls, pending = {}, set(), {}, None
    for step in range(1, w.total_steps + 1):
        started = time.perf_counter()
        if ckpt is None or quiet(ckpt, pending):
            calm.add(step)
        lm_loss(model, data[step - 1]).backward()
        if ckpt is not None:
            before = time.perf_counter()
            ckpt.wait_staged()
            if pending is not None:
                stalls[pending.step] += time.perf_counter() - before
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ckpt is not None and w.is_checkpoint(step):
            before = time.perf_counter()
            pending = ckpt.save(rank_state(model, opt), step=step, optimizers=[opt])
            stalls[step] = time.perf_counter() - before
        steps[step] = time.perf_counter() - started
    before, failures = time.perf_counter(), 0
    if ckpt is not None:
        peer = ckpt._host.peer
        ckpt.close()
        failures = peer.failures if peer is not None else 0
    between = [s for s in range(w.every + 2, w.total_steps + 1) if not w.is_checkpoint(s)
               and not w.is_checkpoint(s - 1)]
    return {"variant": variant, "between_step_s": [steps[s] for s in between],
            "quiet_step_s": [steps[s] for s in between if s in calm], "drain_s": time.perf_counter() - before,
            "stall_s": [v for s, v in stalls.items() if s > w.every], "peer_failures": failures}


def loops(spec: dict, rank: int) -> dict:
    torch.set_num_threads(spec["threads"])
    w = rank_workload(spec, rank)
    dirpath, shm = node_paths(spec, rank, f"warm-up-t{spec['threads']}")
    train(replace(w, checkpoints=0), "none", dirpath, shm)  # untimed: the first loop of a process runs slower
    runs = []
    for repeat in range(spec["repeats"]):
        shift = repeat % len(LOOPS)
        for variant in LOOPS[shift:] + LOOPS[:shift]:
            dist.barrier()  # both nodes run the same loop at once: the transfers pair up
            dirpath, shm = node_paths(spec, rank, f"loop-t{spec['threads']}-{variant}-{repeat}")
            runs.append({"repeat": repeat, "threads": spec["threads"], "rank": rank, **train(w, variant, dirpath, shm)})
    return {"rank": rank, "runs": runs}


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="env://")
    result = {"write": write, "restore": restore, "loop": loops}[spec["phase"]](spec, rank)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
