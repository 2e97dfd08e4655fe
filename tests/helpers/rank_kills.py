"""SIGKILL one rank of a 2-rank gloo job at a random moment of its checkpoints, and check the survivor:

    python tests/helpers/rank_kills.py --trials 40 [--seed 1] [--peer-timeout-s 1]

Each trial runs two ranks that train a small model and save every step through the process group's store (rank 0
hosts it, so killing rank 0 takes the store down too). The victim and the moment (after ``save()``, after the
barrier, or a timer started once its checkpointer is built) are drawn at random. The survivor must end every call (``save``,
``wait_staged``, ``close``) with a result or an exception within ``peer_timeout_s`` plus a margin, never at
``commit_timeout_s``; afterwards every committed step must verify and hold both ranks' values of its step. Prints one
JSON line with the figures docs/reliability.md records and exits 1 on the first violation.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers.*

import lazyckpt  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402
from lazyckpt.format.catalog import committed_steps  # noqa: E402

STEPS, COMMIT_TIMEOUT_S, MARGIN_S = 8, 120.0, 15.0


def _rank(rank: int, world_size: int, dirpath: str, plan: dict, out: str) -> None:
    faulthandler.dump_traceback_later(COMMIT_TIMEOUT_S / 2, exit=False)  # where a hung rank waits, on stderr
    victim = rank == plan["victim"]
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[list] = []
    built: list = []
    _timed(calls, "construct", lambda: built.append(
        lazyckpt.LazyCheckpointer(dirpath, commit_timeout_s=COMMIT_TIMEOUT_S, peer_timeout_s=plan["peer_s"])))
    if victim and plan["moment"] == "timer":  # a rank that dies while building its checkpointer: see liveness.py
        threading.Timer(plan["delay_s"], os.kill, (os.getpid(), signal.SIGKILL)).start()
    if built:
        _train(built[0], rank, victim, plan, model, opt, calls)
    with open(out.format(rank=rank) + ".tmp", "w") as f:
        json.dump(calls, f)
    os.replace(out.format(rank=rank) + ".tmp", out.format(rank=rank))  # a victim killed while writing leaves none


def _train(ckpt, rank: int, victim: bool, plan: dict, model, opt, calls: list) -> None:
    for step in range(1, STEPS + 1):
        model(torch.randn(8, 64)).square().mean().backward()
        _timed(calls, "wait_staged", ckpt.wait_staged)
        opt.step()
        opt.zero_grad()
        state = {"model": model.state_dict(), "rank": lazyckpt.PerRank(rank), "step": step}
        _timed(calls, "save", lambda: ckpt.save(state, step=step, optimizers=[opt]))
        if victim and step == plan["step"] and plan["moment"] == "after save":
            os.kill(os.getpid(), signal.SIGKILL)
        if victim and step == plan["step"] and plan["moment"] == "after barrier":
            ckpt.wait_staged()
            os.kill(os.getpid(), signal.SIGKILL)
    _timed(calls, "close", ckpt.close)


def _timed(calls: list, name: str, fn) -> None:
    started = time.monotonic()
    try:
        fn()
        outcome = "ok"
    except Exception as e:  # noqa: BLE001 - the trial records what each call ended with
        outcome = type(e).__name__
    calls.append([name, outcome, time.monotonic() - started])


def trial(workdir: str, plan: dict) -> dict:
    """One trial; returns the calls of every rank that lived to the end (the victim too, when its timer came after
    its last call) and the committed steps (raises AssertionError on a violation)."""
    dirpath, out = os.path.join(workdir, "ckpt"), os.path.join(workdir, "calls-{rank}.json")
    run_ranks(_rank, 2, dirpath, plan, out, meet_at_end=False, timeout=COMMIT_TIMEOUT_S)
    files = [out.format(rank=r) for r in range(2) if os.path.exists(out.format(rank=r))]
    calls = [call for file in files for call in json.load(open(file))]
    slowest = max(seconds for _, _, seconds in calls)
    assert slowest < plan["peer_s"] + MARGIN_S, f"a survivor call took {slowest:.1f}s: {plan} {calls}"
    for step, path in committed_steps(dirpath).items():
        lazyckpt.verify(path)
        for rank in range(2):
            state = lazyckpt.load(path, rank=rank)
            assert (state["step"], state["rank"]) == (step, rank), (plan, path)
    return {"calls": calls, "committed": len(committed_steps(dirpath)), "slowest_s": slowest}


def draw(rng: random.Random, peer_s: float) -> dict:
    return {"victim": rng.randrange(2), "step": rng.randrange(1, STEPS + 1), "peer_s": peer_s,
            "moment": rng.choice(["after save", "after barrier", "timer"]), "delay_s": rng.uniform(0.5, 3.0)}


def run(trials: int, seed: int, peer_s: float, root: str | None = None) -> dict:
    """``trials`` trials (each in a temporary directory under ``root``); the figures, or AssertionError/TimeoutError."""
    rng = random.Random(seed)
    slowest, errors, committed = [], {}, 0
    for _ in range(trials):
        plan = draw(rng, peer_s)
        with tempfile.TemporaryDirectory(dir=root) as workdir:
            try:
                result = trial(workdir, plan)
            except TimeoutError as e:
                raise TimeoutError(f"{e} (trial {plan})") from None
        slowest.append(result["slowest_s"])
        committed += result["committed"]
        for _, outcome, _ in result["calls"]:
            if outcome != "ok":
                errors[outcome] = errors.get(outcome, 0) + 1
    slowest.sort()
    return {"trials": trials, "hangs": 0, "wrong_or_broken_steps": 0, "committed_steps_checked": committed,
            "survivor_errors": errors, "slowest_call_s_median": round(slowest[len(slowest) // 2], 2),
            "slowest_call_s_max": round(slowest[-1], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--peer-timeout-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        result = run(args.trials, args.seed, args.peer_timeout_s)
    except (AssertionError, TimeoutError) as e:
        print(json.dumps({"violation": str(e)[:2000]}))
        return 1
    print(json.dumps({"command": "rank-kills", **result, "seconds": round(time.monotonic() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
