"""lazyckpt against the checkpointing methods users would use instead, side by side on one workload.

Every (method, repeat) runs in a fresh process (``runner.py``, forked from a server that imported the libraries
once), methods interleaved in a shuffled order per repeat. The parent measures the machine, trains the reference
state once, collects the runs and reports medians with min–max. docs/benchmarks.md explains each metric and
holds the latest results.

Usage:
    python benchmarks/compare.py                                  # the default benchmark (~15 minutes, 2 cores)
    python benchmarks/compare.py --quick                          # under 2 minutes, a smaller model
    python benchmarks/compare.py --json out.json --plots docs/img --every 1 --methods none,raw,lazyckpt
    python benchmarks/compare.py --world-size 2 --checkpoints 3 --repeats 2   # FSDP2 and DDP on 2 gloo ranks
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from importlib import metadata
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import (HERE, chosen_keys, emit, fork_server, log, run_facts, work_root,  # noqa: E402
                     workload_of)
from report import aggregate, check_targets, first_checkpoints_line, markdown_table, write_plots  # noqa: E402
from workload import MiB, Workload, median, raw_write_seconds  # noqa: E402

FULL = {"params_m": 25.0, "batch": 4, "seq": 32, "every": 5, "checkpoints": 6, "repeats": 3}
QUICK = {"params_m": 4.0, "batch": 2, "seq": 16, "every": 3, "checkpoints": 2, "repeats": 1}
TIMELINES = ("lazyckpt", "lazyckpt_two")
"""The methods whose runs keep a timeline (``--plots`` draws ``<method>_timeline.png`` from them)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, 1 repeat, few steps (< 2 minutes)")
    p.add_argument("--params-m", type=float, help="model size in millions of parameters (default 25: ~300 MB "
                   "of state with AdamW; quick: 4)")
    p.add_argument("--batch", type=int, help="sequences per step (default 4)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 32)")
    p.add_argument("--threads", type=int, help="training threads, torch.set_num_threads (default: torch's own "
                   "default on this machine, as users run it; 1 isolates the training thread on one core)")
    p.add_argument("--every", type=int, help="checkpoint every k optimizer steps (default 5; 1 is allowed)")
    p.add_argument("--checkpoints", type=int, help="measured checkpoints per run (default 6)")
    p.add_argument("--repeats", type=int, help="runs per method, interleaved (default 3)")
    p.add_argument("--adamw", choices=("fused", "foreach", "loop"), default="fused")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", help="comma-separated method keys (default: all); see --list")
    p.add_argument("--list", action="store_true", help="list the method keys and exit")
    p.add_argument("--workdir", help="checkpoints go in a fresh directory under it, removed at the end "
                   "(default: the system temp dir)")
    p.add_argument("--json", help="write machine, config and per-method results to this file")
    p.add_argument("--plots", help="write the stall bar chart and the lazyckpt timeline (PNG) to this directory")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds before one run is killed")
    p.add_argument("--world-size", type=int, help="run the distributed methods (FSDP2, DDP) on this many gloo "
                   "ranks on CPU instead of the single-process ones (dist_compare.py)")
    p.add_argument("--from-json", help="do not run: re-aggregate and re-plot the runs of an earlier --json file")
    p.add_argument("--malloc-mmap-threshold", type=int, metavar="BYTES",
                   help="pin glibc's mmap threshold in every run (MALLOC_MMAP_THRESHOLD_): glibc's own threshold "
                   "moves with the allocation history, so freed activations stay resident in some runs and not in "
                   "others and peak RSS scatters by ~100 MB between repeats; pinned, extra RSS is measurable to a "
                   "few MB. Timings under it are not those of the default allocator (default: unset)")
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.threads is None:  # ranks share the cores: each gets its share, as a launcher would set it
        args.threads = max(1, default_threads() // (args.world_size or 1))
    if args.world_size is not None and (args.world_size < 1 or args.from_json):
        p.error("--world-size must be >= 1 and cannot be combined with --from-json")
    if args.every < 1 or args.checkpoints < 1 or args.repeats < 1 or args.threads < 1:
        p.error("--every, --checkpoints, --repeats and --threads must be >= 1")
    return args


def default_threads() -> int:
    """torch's default intra-op thread count here (it honours ``OMP_NUM_THREADS`` when the user set it)."""
    import torch

    return torch.get_num_threads()


# --- the machine -----------------------------------------------------------------------------------------------


def machine_info(workdir: str, probe_bytes: int) -> dict[str, Any]:
    import psutil

    versions = {}
    for dist in ("torch", "lightning", "accelerate", "lazyckpt", "safetensors", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    buffered = [raw_write_seconds(workdir, probe_bytes) for _ in range(3)]
    try:
        direct = [raw_write_seconds(workdir, probe_bytes, direct=True) for _ in range(3)]
    except OSError as e:
        direct, direct_error = [], f"{type(e).__name__}: {e}"
    else:
        direct_error = None
    return {
        "cpu": _cpu_model(), "logical_cores": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "platform": platform.platform(), "python": platform.python_version(), "versions": versions,
        "workdir_filesystem": _filesystem(workdir),
        "disk_write_mb_s": round(probe_bytes / 1e6 / median(buffered), 1),
        "disk_write_direct_mb_s": round(probe_bytes / 1e6 / median(direct), 1) if direct else None,
        "disk_write_direct_error": direct_error,
        "disk_probe": f"{probe_bytes / MiB:.0f} MiB from a warm buffer + fsync, median of 3 (buffered: one "
                      "write(); direct: O_DIRECT 8 MiB blocks)",
        "loadavg_at_start": os.getloadavg(),
        "lazyckpt_source": _source_id(),
    }


def _source_id() -> dict[str, Any]:
    """Which engine was measured: the git commit, whether the tree differs from it, and a hash of the sources."""
    import hashlib

    from runner import ROOT as root

    digest = hashlib.sha256()
    for folder in ("lazyckpt", "integrations"):
        for base, _, names in sorted(os.walk(os.path.join(root, folder))):
            for name in sorted(n for n in names if n.endswith(".py")):
                with open(os.path.join(base, name), "rb") as f:
                    digest.update(name.encode() + f.read())

    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--", "lazyckpt", "integrations")
    return {"commit": git("rev-parse", "--short", "HEAD"), "uncommitted_changes": bool(status),
            "sources_sha256": digest.hexdigest()[:16]}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _filesystem(path: str) -> str | None:
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[:3] for line in f]
    except OSError:
        return None
    path = os.path.realpath(path)
    best = max((m for m in mounts if path == m[1] or path.startswith(m[1].rstrip("/") + "/")),
               key=lambda m: len(m[1]), default=None)
    return f"{best[2]} ({best[0]} on {best[1]})" if best else None


# --- running -------------------------------------------------------------------------------------------------


def run_one(server: Any, key: str, repeat: int, workload: Workload, root: str, reference: str,
            timeout: float) -> dict:
    """One (method, repeat) in a fresh process forked from ``server``; its checkpoints live under ``root`` and
    are removed afterwards."""
    from runner import execute_to_file

    tag = f"{key}-r{repeat}"
    spec = {"workload": dataclasses.asdict(workload), "method": key, "repeat": repeat,
            "dirpath": os.path.join(root, tag), "reference": reference, "timeline": key in TIMELINES,
            "out": os.path.join(root, f"{tag}.json")}
    log_path = os.path.join(root, f"{tag}.log")
    started = time.monotonic()
    proc = server.Process(target=execute_to_file, args=(spec, log_path), name=f"bench-{tag}")
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
    rc = proc.exitcode
    shutil.rmtree(spec["dirpath"], ignore_errors=True)
    if rc == 0 and os.path.exists(spec["out"]):
        with open(spec["out"]) as f:
            result = json.load(f)
    else:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        result = {"method": key, "repeat": repeat, "available": True, "verified": False,
                  "error": f"run process ended with exit code {rc}" + (" (timeout)" if rc == -9 else ""),
                  "traceback": tail}
    result["wall_s"] = time.monotonic() - started
    result["loadavg"] = os.getloadavg()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return republish(args)
    if args.world_size is not None:
        return distributed(args)
    from runner import BASELINE_FOR, METHODS, make_reference

    if args.list:
        return list_methods(METHODS)
    keys = chosen_keys(args.methods, METHODS, BASELINE_FOR)
    workload = workload_of(args)
    root = work_root(args, "lazyckpt-bench-")
    started = time.monotonic()
    try:
        return _benchmark(args, workload, keys, root, METHODS, BASELINE_FOR, make_reference, started)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def list_methods(methods: dict) -> int:
    for key, cls in methods.items():
        print(f"{key:24s} {cls.label} [{cls.driver}]")
    return 0


def distributed(args: argparse.Namespace) -> int:
    import dist_compare
    from dist_methods import DIST_METHODS

    if args.list:
        return list_methods(DIST_METHODS)
    return dist_compare.main(args, machine_info)


def _benchmark(args, workload, keys, root, methods, baseline_for, make_reference, started) -> int:
    import torch

    from workload import build_model, make_optimizer, state_bytes

    model = build_model(workload)
    opt = make_optimizer(workload, model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # materialize the AdamW state, to count its bytes
    nbytes = state_bytes(model, opt)
    n_params = sum(p.numel() for p in model.parameters())
    del model, opt
    log(f"workload: {n_params / 1e6:.1f}M parameters, {nbytes / MiB:.0f} MiB of state, {workload.layers} layers; "
        f"checkpoint every {workload.every} steps, {workload.checkpoints} measured per run, {args.repeats} "
        f"repeat(s), {len(keys)} methods; work dir {root}")
    machine = machine_info(root, max(nbytes, 64 * MiB))
    log(f"disk: {machine['disk_write_mb_s']} MB/s buffered write+fsync, {machine['disk_write_direct_mb_s']} MB/s "
        "O_DIRECT")
    reference = os.path.join(root, "reference.pt")
    make_reference(workload, reference)
    server = fork_server(workload, args.malloc_mmap_threshold)
    runs = []
    for repeat in range(args.repeats):
        order = list(keys)
        random.Random(args.seed * 1000 + repeat).shuffle(order)
        for key in order:
            result = run_one(server, key, repeat, workload, root, reference, args.run_timeout)
            runs.append(result)
            status = ("unavailable: " + result.get("reason", "")) if not result.get("available") else \
                ("ERROR " + result["error"]) if "error" in result else \
                ("verified" if result.get("verified") else "FAIL " + "; ".join(result.get("verify_problems", [])))
            log(f"[repeat {repeat + 1}/{args.repeats}] {key:22s} {result['wall_s']:6.1f}s  {status}")
            if "error" in result and result.get("traceback"):
                log(result["traceback"][-1500:])
    foreign = sorted({f for r in runs for f in (r.get("engine_files") or {}).values()
                      if f and not os.path.abspath(f).startswith(os.path.dirname(HERE) + os.sep)})
    if foreign:
        log(f"WARNING: some runs imported lazyckpt from outside this checkout: {foreign}")
    config = {**workload.describe(), "repeats": args.repeats, "methods": keys, "quick": args.quick,
              "parameters": n_params, "state_bytes": nbytes, "foreign_engine_files": foreign,
              **run_facts(started)}
    publish(args, machine, config, runs, methods, baseline_for)
    log(f"total {time.monotonic() - started:.0f}s")
    return 0


def publish(args: argparse.Namespace, machine: dict, config: dict, runs: list[dict], methods: dict,
            baseline_for: dict) -> None:
    """Aggregate the runs; print the table and the targets; write the plots and the JSON."""
    nbytes = config["state_bytes"]
    entries = aggregate([methods[k] for k in methods if k in config["methods"]], runs, nbytes, baseline_for)
    targets = check_targets(entries, nbytes)
    emit(args, f"{config['parameters'] / 1e6:.1f}M parameters, {nbytes / MiB:.0f} MiB state; checkpoint every "
         f"{config['every']} steps; medians (min–max) over {config['repeats']} repeat(s)", markdown_table(entries),
         targets, entries, {"machine": machine, "config": config, "methods": entries, "targets": targets, "runs": runs},
         footer=first_checkpoints_line(entries))
    if args.plots:
        for path in write_plots(entries, runs, args.plots):
            log(f"wrote {path}")


def republish(args: argparse.Namespace) -> int:
    """``--from-json``: aggregate, print and plot the runs stored in an earlier ``--json`` file again."""
    from runner import BASELINE_FOR, METHODS

    with open(args.from_json) as f:
        data = json.load(f)
    runs = data["runs"]
    if data.get("timeline"):  # files written before timelines were kept with their runs
        first = next((r for r in runs if r.get("method") == "lazyckpt"), None)
        if first is not None:
            first.setdefault("timeline", data["timeline"])
    publish(args, data["machine"], data["config"], runs, METHODS, BASELINE_FOR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
