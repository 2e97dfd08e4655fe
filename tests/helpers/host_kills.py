"""SIGKILL a trainer that uses the host level at random moments; every restart must resume from the newest
complete snapshot, bit-exact.

    python tests/helpers/host_kills.py DIRPATH HOST_ROOT --trials 30 [--seed 1]

Each trial forks one life from this process (which imported torch and lazyckpt once and ran torch on one thread
only, so a fork is safe and cheap): the life opens ``LazyCheckpointer(DIRPATH, keep_in_memory="host")`` (which commits a
host step newer than DIRPATH's newest first), resumes from ``lazyckpt.latest`` and reports a digest of the resumed state (checked here against an
uninterrupted run), then trains and saves every step until a timer SIGKILLs it (during
the recovery, a copy, a write or a commit: wherever the timer falls). Before each life this process notes the
newest step committed on either level; the life must resume from exactly that step, find it committed in DIRPATH,
and the host root must hold one folder with at most two committed steps. A last life closes cleanly; then no
folder may be left. Prints one JSON line of counts; exits 1 at the first violation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import threading

import torch

import lazyckpt
from lazyckpt.format.catalog import committed_steps
from lazyckpt.storage.urls import host_dir

STEPS_PER_LIFE = 60


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    model(torch.randn(16, 256, generator=gen)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """The bytes of every parameter and momentum buffer (what a bit-exact resume must give back)."""
    sha = hashlib.sha256()
    for tensor in [*model.state_dict().values(), *(s["momentum_buffer"] for s in opt.state.values())]:
        sha.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


class Reference:
    """The uninterrupted run, advanced as far as asked (the resumed steps only grow)."""

    def __init__(self) -> None:
        self.model, self.opt = fresh()
        self.step = 0

    def digest_at(self, step: int) -> str:
        assert step >= self.step, "a restart resumed from an older step than an earlier one"
        while self.step < step:
            self.step += 1
            train_step(self.model, self.opt, self.step)
        return digest(self.model, self.opt)


def life(dirpath: str, root: str, kill_after: float | None, report: int) -> None:
    """One trainer process: resume, check, train and save until killed (or close cleanly without a timer)."""
    torch.set_num_threads(1)
    if kill_after is not None:
        threading.Timer(kill_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
    ckpt = lazyckpt.LazyCheckpointer(dirpath, keep_in_memory="host", host_memory_dir=root, keep_last_k=3)
    newest = lazyckpt.latest(dirpath, host_memory_dir=root)
    on_disk = max(committed_steps(dirpath), default=0)
    model, opt = fresh()
    start = 0
    if newest is not None:
        start = lazyckpt.checkpoint_step(newest)
        state = lazyckpt.load(newest)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    said = {"resumed": start, "on_disk": on_disk, "digest": digest(model, opt) if start else None}
    os.write(report, json.dumps(said).encode() + b"\n")
    for step in range(start + 1, start + 1 + STEPS_PER_LIFE):
        train_step(model, opt, step)
        ckpt.save({"model": model.state_dict(), "opt": opt.state_dict()}, step=step, optimizers=[opt])
        ckpt.wait_staged()
    ckpt.close()


def newest_complete(dirpath: str, root: str) -> int:
    return max([*committed_steps(dirpath), *committed_steps(host_dir(dirpath, root))], default=0)


def trial(dirpath: str, root: str, kill_after: float | None) -> dict:
    expected = newest_complete(dirpath, root)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the life: it never returns into this loop
        os.close(read_end)
        code = 0
        try:
            life(dirpath, root, kill_after, write_end)
        except BaseException as e:  # noqa: BLE001 - reported through the exit code
            print(f"life failed: {e!r}", file=sys.stderr)
            code = 3
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as lines:
        said = lines.readline()
    _, status = os.waitpid(pid, 0)
    seen = json.loads(said) if said else None
    return {"expected": expected, "seen": seen, "status": status,
            "folders": sorted(os.listdir(root)) if os.path.isdir(root) else [],
            "host_steps": len(committed_steps(host_dir(dirpath, root)))}


def check(result: dict, last: bool, reference: Reference) -> str | None:
    seen = result["seen"]
    if seen is not None and seen["resumed"] != result["expected"]:
        return f"resumed from step {seen['resumed']}, the newest complete snapshot was {result['expected']}"
    if seen is not None and seen["resumed"] and seen["digest"] != reference.digest_at(seen["resumed"]):
        return f"the state resumed from step {seen['resumed']} is not the uninterrupted run's (not bit-exact)"
    if seen is not None and seen["on_disk"] != result["expected"]:
        return f"dirpath's newest is {seen['on_disk']} after the restart, expected {result['expected']}"
    if last:
        return None if result["folders"] == [] and os.WEXITSTATUS(result["status"]) == 0 else \
            f"a clean close left {result['folders']} (exit status {result['status']})"
    if len(result["folders"]) > 1 or result["host_steps"] > 2:
        return f"host root holds {result['folders']} with {result['host_steps']} committed steps"
    if os.WIFEXITED(result["status"]) and os.WEXITSTATUS(result["status"]) != 0:
        return f"the life failed (exit {os.WEXITSTATUS(result['status'])})"
    return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dirpath")
    parser.add_argument("root")
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-delay", type=float, default=1.5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # before any op: no thread pool exists when a life is forked
    reference = Reference()  # the optimizer's first construction imports for seconds: paid once, not per life
    rng = random.Random(args.seed)
    counts = {"trials": 0, "from_host": 0, "resumed": 0, "killed_before_report": 0}
    for number in range(args.trials + 1):
        last = number == args.trials
        host_newer = newest_complete(args.dirpath, args.root) > max(committed_steps(args.dirpath), default=0)
        result = trial(args.dirpath, args.root, None if last else rng.uniform(0.0, args.max_delay))
        problem = check(result, last, reference)
        if problem is not None:
            print(json.dumps({**counts, "violation": problem, "trial": number}))
            return 1
        counts["trials"] += 1
        counts["from_host"] += host_newer and result["seen"] is not None
        counts["resumed"] += bool(result["seen"] and result["seen"]["resumed"] > 0)
        counts["killed_before_report"] += result["seen"] is None
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
