"""Where a sharded checkpoint request's stall goes, part by part: FSDP2 on gloo ranks (CPU), saves only.

Each rank trains the benchmark's model (``workload.py``) under ``fully_shard`` and alternates two kinds of
checkpoint, so both see the same state and the same machine: lazyckpt (``get_state_dict``, ``save()``, one
forward/backward, ``wait_staged()``) and DCP ``async_save`` with ``DefaultStager`` (``get_state_dict``,
``async_save``, one forward/backward, ``staging_completion``). Every part is timed on the training thread;
each rank prints the medians in ms (JSON). ``compare.py --world-size`` measures the same methods end to end in training;
this shows what the stall is made of (docs/benchmarks.md, "Several ranks").

    python benchmarks/stall_parts.py [--world-size 2] [--saves 6] [--params-m 25]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The checkout this script sits in, not whichever lazyckpt is installed (the ranks inherit this path).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARTS = ("get_state_dict", "lazy_save", "lazy_wait_staged", "dcp_async_save", "dcp_staging_wait")


def one_rank(rank: int, args: argparse.Namespace, port: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import lazyckpt
    from dist_methods import Parallel, dcp_upload_group
    from methods import default_stager
    from workload import Batches, Workload, build_model, lm_loss, make_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    w = Workload(params_m=args.params_m)
    model = Parallel().wrap(build_model(w))
    opt, data = make_optimizer(w, model.parameters()), Batches(w)
    ckpt = lazyckpt.LazyCheckpointer(os.path.join(root, "lazy"), fsync=True)
    stager, upload_group = default_stager(cuda=False), dcp_upload_group()
    times: dict[str, list[float]] = {part: [] for part in PARTS}

    def train_step(step: int) -> None:
        lm_loss(model, data[step % len(data)]).backward()

    def update() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    for step in range(1, 2 * args.saves + 3):
        train_step(step)
        update()
        started = time.perf_counter()
        msd, osd = get_state_dict(model, [opt])
        requested = time.perf_counter()
        measured = step > 2  # the first save of each kind plans and allocates
        if step % 2 == 0:
            pending = ckpt.save({"model": msd, "optim": osd, "step": step}, step=step, optimizers=[opt])
            staged, durable, parts = ckpt.wait_staged, pending.wait, ("lazy_save", "lazy_wait_staged")
        else:
            future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"dcp-{step}"),
                                    async_stager=stager, process_group=upload_group)
            staged, durable = future.staging_completion.result, future.upload_completion.result
            parts = ("dcp_async_save", "dcp_staging_wait")
        returned = time.perf_counter()
        train_step(step)
        before_wait = time.perf_counter()
        staged()
        waited = time.perf_counter()
        update()
        if measured:
            times["get_state_dict"].append(requested - started)
            times[parts[0]].append(returned - requested)
            times[parts[1]].append(waited - before_wait)
        durable()  # one checkpoint at a time
    ckpt.close()
    stager.close()
    medians = {part: round(1e3 * statistics.median(v), 2) for part, v in times.items() if v}
    print(f"rank {rank}: median ms {json.dumps(medians)}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--saves", type=int, default=6, help="measured saves of each kind per rank")
    parser.add_argument("--params-m", type=float, default=25.0, help="model size in millions of parameters")
    args = parser.parse_args()
    from harness import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="lazyckpt-stall-parts-") as root:
        mp.spawn(one_rank, args=(args, port, root), nprocs=args.world_size)


if __name__ == "__main__":
    main()
