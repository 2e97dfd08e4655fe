"""What the benchmark drivers share (``compare.py`` and its distributed mode ``dist_compare.py``): logging, the
methods chosen, the workload and work directory from the arguments, the fork server every run starts from, the
facts each run's JSON records, and the printed report."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

from report import targets_table
from workload import Workload

HERE = os.path.dirname(os.path.abspath(__file__))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def chosen_keys(requested: str | None, methods: dict, baseline_for: dict[str, str]) -> list[str]:
    """The requested method keys (default: all), with the no-checkpoint baseline of every driver used."""
    keys = list(methods) if not requested else [k.strip() for k in requested.split(",") if k.strip()]
    unknown = [k for k in keys if k not in methods]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {list(methods)}")
    for key in list(keys):
        base = baseline_for[methods[key].driver]
        if base not in keys:
            keys.insert(0, base)
    return keys


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(params_m=args.params_m, batch=args.batch, seq=args.seq, threads=args.threads,
                    every=args.every, checkpoints=args.checkpoints, seed=args.seed, adamw=args.adamw)


def work_root(args: argparse.Namespace, prefix: str) -> str:
    """A fresh directory for the runs' checkpoints, under ``--workdir`` when given (the caller removes it)."""
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=args.workdir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fork_server(workload: Workload, malloc_mmap_threshold: int | None = None) -> Any:
    """A multiprocessing context whose fork server imported torch and the plain-loop checkpoint libraries (with
    glibc's mmap threshold pinned when given: glibc reads it when the server starts, and every run forks from it)."""
    import multiprocessing

    from runner import PRELOAD_ENV

    # Only what every plain PyTorch run has anyway (AdamW imports torch._dynamo), plus the small checkpoint
    # libraries. Lightning and Accelerate are imported by the runs that use them: a preloaded module's objects
    # would sit in every run's heap and make each full garbage collection there ~50 % longer.
    modules = ["torch", "torch._dynamo", "psutil", "numpy", "safetensors", "torch.distributed.checkpoint", "lazyckpt"]
    # The server starts as `python -c ...`: it finds runner.py through PYTHONPATH, not through our sys.path.
    path = os.pathsep.join(p for p in (HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p)
    os.environ.update(OMP_NUM_THREADS=str(workload.threads), MKL_NUM_THREADS=str(workload.threads),
                      PYTHONWARNINGS="ignore", PYTHONPATH=path, **{PRELOAD_ENV: ",".join(modules)})
    if malloc_mmap_threshold is None:  # unset means glibc's default, whatever the caller's environment holds
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    else:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(malloc_mmap_threshold)
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(["runner"])
    return server


def run_facts(started: float, script: str = "compare.py") -> dict[str, Any]:
    """What every run's JSON config records about how it ran: the command, the allocator, time and load."""
    return {"command": " ".join([f"python benchmarks/{script}", *sys.argv[1:]]), "allocator_env": allocator_env(),
            "wall_s": round(time.monotonic() - started, 1), "loadavg_at_end": os.getloadavg()}


def allocator_env() -> dict[str, str]:
    """The glibc allocator settings every run started with (peak RSS depends on them; the JSON records them)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"}


def emit(args: argparse.Namespace, heading: str, table: str, targets: dict, entries: list[dict],
         document: dict, footer: str | None = None) -> None:
    """Print the heading, the results table (and ``footer`` under it) and the targets; write ``document`` to
    ``--json``."""
    print(f"\n{heading}\n")
    print(table)
    if footer:
        print(f"\n{footer}")
    if targets:
        print("\nTargets:\n")
        print(targets_table(targets, entries))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
        log(f"wrote {args.json}")
