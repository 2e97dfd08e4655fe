"""Rollback after a non-finite loss: from memory vs from the newest disk checkpoint vs restarting the process.

On the default benchmark workload (``benchmarks/workload.py``), for each path the time from "the loss of step N
is nan" until model and optimizer hold the state of the newest checkpoint before N again:

* ``memory``: ``RollbackPolicy.roll_back`` with ``keep_in_memory=True`` (copied out of the staging pool straight
  into the live model and optimizer tensors, each chunk checked as it is copied) plus ``load_state_dict``;
* ``disk``: the same with ``keep_in_memory=False`` (``lazyckpt.load`` of the newest committed checkpoint, checked,
  page cache dropped first: written back and ``posix_fadvise(DONTNEED)``);
* ``restart``: a new Python process that imports torch and lazyckpt, builds the model and optimizer, loads the
  newest checkpoint and ``load_state_dict``s it (what a manual restart costs at least, without any scheduler).

``of it read`` is the part before ``load_state_dict`` (the policy's read of the target, checks included). It also
reports the training stall per checkpoint (save + barrier wait) with and without ``keep_in_memory``, since
keeping the snapshot must not change it. Every restored state is compared bit for bit with the checkpointed one.

Usage:
    python benchmarks/rollback.py                 # the default workload (25M parameters), 3 repeats
    python benchmarks/rollback.py --params-m 4 --repeats 1   # quick
    python benchmarks/rollback.py --threads 1               # torch (and the memory restore) on one thread
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lazyckpt  # noqa: E402
from benchmarks.workload import (Batches, Workload, build_model, compare, evict_from_page_cache,  # noqa: E402
                                 lm_loss, make_optimizer, normalize, set_threads, state_bytes)

RESTART = """
import sys, time, torch, lazyckpt
sys.path.insert(0, {root!r})
from benchmarks.workload import Workload, build_model, make_optimizer
w = Workload(**{workload!r})
model = build_model(w); opt = make_optimizer(w, model.parameters())
state = lazyckpt.load(lazyckpt.latest({dirpath!r}))
model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
"""


def train(w: Workload, dirpath: str, *, keep_in_memory: bool, bad_step: int) -> dict:
    """Train to ``bad_step`` with checkpoints every ``w.every`` steps, then roll back once; return the timings."""
    model = build_model(w)
    opt = make_optimizer(w, model.parameters())
    data = Batches(w)
    with lazyckpt.LazyCheckpointer(dirpath, keep_in_memory=keep_in_memory) as ckpt:
        policy = lazyckpt.RollbackPolicy(ckpt)
        for step in range(1, bad_step + 1):
            lm_loss(model, data[step - 1]).backward()
            ckpt.wait_staged()
            opt.step()
            opt.zero_grad()
            if step % w.every == 0 and step < bad_step:
                ckpt.save({"model": model.state_dict(), "opt": opt.state_dict()}, step=step, optimizers=[opt])
        if ckpt.in_flight is not None:
            ckpt.in_flight.wait()  # measure the rollback itself, not the last write
        expected = normalize(*_reference(dirpath))
        evict_from_page_cache(dirpath)
        started = time.monotonic()
        restored = policy.roll_back(bad_step=bad_step, into={"model": model.state_dict(), "opt": opt.state_dict()})
        read_s = time.monotonic() - started
        model.load_state_dict(restored.state["model"])
        opt.load_state_dict(restored.state["opt"])
        rollback_s = time.monotonic() - started
        stalls = [s.stall_s for s in list(ckpt.stats)[1:] or ckpt.stats]  # the first one warms the pool and threads up
    problem = compare(normalize(model.state_dict(), opt.state_dict()["state"]), expected)
    return {"rollback_s": rollback_s, "read_s": read_s, "source": restored.source, "step": restored.step,
            "stall_s": statistics.median(stalls), "verified": problem is None, "problem": problem,
            "state_mib": state_bytes(model, opt) / 2**20}


def _reference(dirpath: str) -> tuple[dict, dict]:
    state = lazyckpt.load(lazyckpt.latest(dirpath))
    return state["model"], state["opt"]["state"]


def restart(w: Workload, dirpath: str) -> float:
    evict_from_page_cache(dirpath)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = RESTART.format(root=root, workload=asdict(w), dirpath=dirpath)
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-m", type=float, default=Workload.params_m)
    parser.add_argument("--every", type=int, default=Workload.every)
    parser.add_argument("--checkpoints", type=int, default=4, help="checkpoints before the bad step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads (default: torch's default for this machine)")
    parser.add_argument("--json", help="write the raw runs here")
    args = parser.parse_args(argv)
    w = Workload(params_m=args.params_m, every=args.every, threads=args.threads)
    set_threads(w)
    bad_step = args.every * args.checkpoints + 2  # between two checkpoints
    runs: dict[str, list] = {"memory": [], "disk": [], "restart": []}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        for keep in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                run = train(w, tmp, keep_in_memory=keep, bad_step=bad_step)
                runs["memory" if keep else "disk"].append(run)
                if not keep:
                    runs["restart"].append({"rollback_s": restart(w, tmp)})
    _report(runs, w, bad_step)
    print(f"load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": asdict(w), "bad_step": bad_step, "runs": runs}, f, indent=1)


def _report(runs: dict[str, list], w: Workload, bad_step: int) -> None:
    med = {k: statistics.median(r["rollback_s"] for r in v) for k, v in runs.items()}
    state_mib = runs["memory"][0]["state_mib"]
    print(f"workload: {w.params_m:g}M parameters, {state_mib:.0f} MiB of state; checkpoint every {w.every} steps; "
          f"nan at step {bad_step}; medians of {len(runs['memory'])} repeats, torch threads {w.threads}")
    print(f"{'path':10} {'rollback ms':>12} {'of it read':>11} {'vs memory':>10} {'stall/ckpt ms':>14} verified")
    for key in ("memory", "disk", "restart"):
        stall = statistics.median(r["stall_s"] for r in runs[key]) * 1e3 if "stall_s" in runs[key][0] else None
        read = statistics.median(r["read_s"] for r in runs[key]) * 1e3 if "read_s" in runs[key][0] else None
        verified = all(r.get("verified", True) for r in runs[key])
        print(f"{key:10} {med[key] * 1e3:12.1f} {'' if read is None else f'{read:11.1f}':>11} "
              f"{med[key] / med['memory']:9.1f}x {'' if stall is None else f'{stall:14.1f}':>14} "
              f"{'yes' if verified else 'NO'}")


if __name__ == "__main__":
    main()
