"""A small Fabric training loop (CPU, one process) with ``LazyFabricIO``, for the host-level crash test: it saves
every iteration to ``dirpath/last.ckpt``, may crash once a step is committed in the host folder only
(:mod:`helpers.host_faults`), may resume with ``fabric.load(dirpath)``, and writes its final weights and the
iteration it resumed from to ``--out``.

Iteration ``i``'s batch is drawn from a generator seeded by ``i``, so a resumed run sees the batches the
uninterrupted one saw.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ITERS = 6
CRASH_EXIT_CODE = 19


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dirpath", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--host-memory-dir", help="keep_in_memory='host' with this host_memory_dir")
    parser.add_argument("--stall-copy-of", type=int, help="the copy of this step to dirpath never begins, and the "
                        "process dies once it would have (after the save of that iteration)")
    parser.add_argument("--resume", action="store_true", help="fabric.load(dirpath) first")
    args = parser.parse_args(argv)
    from lightning.fabric import Fabric

    import lazyckpt

    options = {} if args.host_memory_dir is None else {"keep_in_memory": "host",
                                                       "host_memory_dir": args.host_memory_dir}
    stalled = None
    if args.stall_copy_of is not None:
        from helpers.host_faults import stall_copy_to_disk
        stalled = stall_copy_to_disk(args.stall_copy_of)
    io = lazyckpt.LazyFabricIO(**options)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    start = fabric.load(args.dirpath, {"model": model, "optimizer": opt})["iter"] if args.resume else 0
    for i in range(start, ITERS):
        batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + i))
        fabric.backward(model(batch).square().mean())
        opt.step()
        opt.zero_grad()
        fabric.save(os.path.join(args.dirpath, "last.ckpt"), {"model": model, "optimizer": opt, "iter": i + 1})
        if stalled is not None and i + 1 == args.stall_copy_of:
            from helpers.host_faults import crash_once_stalled
            crash_once_stalled(stalled, CRASH_EXIT_CODE)
    io.close()
    torch.save({"resumed_from": start, "model": {k: v.clone() for k, v in model.state_dict().items()}}, args.out)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers.*
    main()
