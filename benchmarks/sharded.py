"""lazyckpt on several gloo ranks (CPU): how time to durable and host staging memory per rank scale with N.

For each world size N, fresh forked ranks build the same model and AdamW state (~``--mb`` MB in all) and save it
``--saves`` times; the last save is reported (the first warms the copier and the page cache). Modes:

* ``ddp``: plain tensors, identical on every rank, written once in total and split across ranks by bytes.
* ``ddp-rank0``: the same state, but rank 0 writes all of it (no store: what the integrations did before).
* ``fsdp2``: ``fully_shard`` on each layer over a 1-D mesh of N ranks; each rank writes its shards.

Reported per rank, as the maximum over ranks: ``durable_s`` (request until the commit every rank sees),
``stall_ms`` (``save()`` plus the barrier), ``written_mb`` (bytes this rank staged and wrote) and ``rss_mb``
(growth of the process's peak RSS over the saves: the host staging memory it really took).

Usage:
    python benchmarks/sharded.py --world-size 1,2,4 --mb 96 --modes ddp,ddp-rank0,fsdp2
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import lazyckpt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(mb: float, mode: str, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Square layers of ~``mb``/3 MB of parameters in all (AdamW adds twice that), one step taken."""
    torch.manual_seed(0)
    width = 1024
    layers = max(1, round(mb / 3 * 1e6 / (4 * width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    return model, opt


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, mode: str) -> dict:
    if mode == "fsdp2":
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, [opt])
        return {"model": msd, "optim": osd}
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, mode: str, dirpath: str,
              results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    model, opt = build(args.mb, mode, world_size)
    store = None if mode == "ddp-rank0" else lazyckpt.rendezvous.default_store()
    ckpt = lazyckpt.LazyCheckpointer(dirpath, store=store, rank=rank, world_size=world_size, commit_timeout_s=600)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for step in range(1, args.saves + 1):
        dist.barrier()
        state = state_of(model, opt, mode)
        if mode == "ddp-rank0" and rank != 0:
            state = {}
        started = time.monotonic()
        pending = ckpt.save(state, step=step, optimizers=[opt] if state else [])
        ckpt.wait_staged()
        stall = time.monotonic() - started
        path = pending.wait()
        durable = time.monotonic() - started
    written = os.path.getsize(os.path.join(path, f"rank-{rank:05d}-of-{world_size:05d}.safetensors"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ckpt.close()
    results.put((rank, {"durable_s": durable, "stall_ms": 1e3 * stall, "written_mb": written / 1e6,
                        "rss_mb": (peak - baseline) / 1024}))
    dist.barrier()
    dist.destroy_process_group()


def run(world_size: int, mode: str, args: argparse.Namespace) -> dict[str, float]:
    context = multiprocessing.get_context("fork")
    results = context.SimpleQueue()
    port = free_port()
    with tempfile.TemporaryDirectory(dir=args.workdir) as dirpath:
        procs = [context.Process(target=rank_main, args=(r, world_size, port, args, mode, dirpath, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"{mode} at world size {world_size}: exit codes {[p.exitcode for p in procs]}")
    per_rank = dict(results.get() for _ in range(world_size))
    return {metric: max(r[metric] for r in per_rank.values()) for metric in per_rank[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", default="1,2,4", help="comma-separated world sizes")
    parser.add_argument("--modes", default="ddp,ddp-rank0,fsdp2")
    parser.add_argument("--mb", type=float, default=96.0, help="model + optimizer state in MB (all ranks together)")
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: the temp dir)")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    print(f"# {os.cpu_count()} logical cores, load average {load:.1f} at start; {args.mb:g} MB of state")
    print(f"{'mode':<10} {'N':>2} {'durable_s':>9} {'stall_ms':>9} {'written_mb/rank':>15} {'rss_mb/rank':>11}")
    for mode in args.modes.split(","):
        for world_size in (int(n) for n in args.world_size.split(",")):
            if mode == "ddp-rank0" and world_size == 1:
                continue  # the same as ddp at one rank
            row = run(world_size, mode, args)
            print(f"{mode:<10} {world_size:>2} {row['durable_s']:>9.2f} {row['stall_ms']:>9.1f} "
                  f"{row['written_mb']:>15.1f} {row['rss_mb']:>11.1f}", flush=True)
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    sys.exit(main())
