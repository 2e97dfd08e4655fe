"""The peer copy (``keep_in_memory="host", memory_peers=1``) on two simulated nodes of one rank each: how fast a
restart resumes from it after a lost node, and what sending the copies costs the training loop.

One rank per node because this machine has two cores: two processes already share them (and with torch's default
thread count, two threads each oversubscribe them). Each node is a process with ``GROUP_RANK`` of its own, a
``dirpath`` of its own and a host memory root (tmpfs) of its own, as tests/levels/test_peer_copy.py simulates them.
The rank side is ``peer_ranks.py``; every phase starts two fresh processes (gloo over 127.0.0.1).

* **Restore**: step 2 of each rank's state (its half of the default state, in ``lazyckpt.PerRank``: each rank loads
  only its own file) is written with the peer copy and kept at close; the node folders are then saved aside and
  put back before every restart. A restart times, in each rank, process start to its first resumed step: build
  the model and optimizer, construct the checkpointer, ``latest`` + ``load`` (checksums verified),
  ``load_state_dict``, one step. Three sources, in rotation:
  * ``host``: both nodes' host folders intact, each rank reads its own;
  * ``peer``: node 0 lost (its host folder and ``dirpath`` removed); the construction brings its step back from
    node 1's copy and commits it to the new ``dirpath``; node 0 then reads its restored host folder;
  * ``disk``: both host folders and the kept copies gone (every node rebooted); each rank reads its ``dirpath``,
    its pages dropped first (``posix_fadvise(POSIX_FADV_DONTNEED)``, as host_level.py does).
  A restart lasts until its slower rank resumes. Every source's first step gives the same loss per rank.
* **Loop**: ``keep_in_memory="host"`` with ``memory_peers=1`` and ``=0`` and no checkpoint, interleaved and
  rotated, at torch's default thread count and at 1 thread; stall = ``save()`` + the next ``wait_staged()``;
  quiet steps start with the newest checkpoint in ``dirpath`` and (with the peer copy) at the peer. Both ranks'
  steps are pooled.

Usage:
    python benchmarks/peer_copy.py --json peer.json   # half the default state per rank (see docs/benchmarks.md)
    python benchmarks/peer_copy.py --small            # a tiny model, 1 repeat: the smoke test runs it
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's lazyckpt, whatever is installed

from harness import free_port, log, run_facts, work_root  # noqa: E402
from host_level import half_range, per_repeat, pooled  # noqa: E402
from lazyckpt.storage.urls import DEFAULT_HOST_ROOT  # noqa: E402
from peer_ranks import LOOPS, node_paths  # noqa: E402
from report import cell, spread, target_row, targets_table  # noqa: E402
from workload import MiB, Workload, evict_from_page_cache, tree_bytes  # noqa: E402

SMALL = {"params_m": 0.3, "batch": 2, "seq": 16, "every": 3, "checkpoints": 2, "repeats": 1}
DEFAULTS = {"params_m": 12.6, "batch": 8, "seq": 64, "every": 10, "checkpoints": 3, "repeats": 3}
"""Half compare.py's default model per rank (25.2M parameters in all, 289 MiB of state with AdamW)."""
SOURCES = ("host", "peer", "disk")
RANKS = 2


def launch(spec: dict, timeout: float = 600.0) -> tuple[list[dict], float]:
    """Both ranks of one phase as fresh processes (torchrun's environment); their results by rank and the wall
    time until the last one ended."""
    port, script = free_port(), os.path.join(HERE, "peer_ranks.py")
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, script, json.dumps(spec)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(r), "WORLD_SIZE": str(RANKS), "GROUP_RANK": str(r)})
             for r in range(RANKS)]
    outputs = [p.communicate(timeout=timeout) for p in procs]
    wall = time.perf_counter() - started
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            raise RuntimeError(f"rank {rank} of the {spec['phase']} phase failed:\n{err[-3000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs], wall


# --- restore -----------------------------------------------------------------------------------------------------


def save_aside(spec: dict, aside: str) -> None:
    for rank in range(RANKS):
        for where, name in zip(node_paths(spec, rank), ("disk", "shm")):
            shutil.copytree(where, os.path.join(aside, f"node{rank}", name))


def put_back(spec: dict, aside: str, source: str) -> None:
    """Every node as the write left it, then what ``source``'s restart lost removed (a lost node's tmpfs and
    disk come back empty)."""
    for rank in range(RANKS):
        for where, name in zip(node_paths(spec, rank), ("disk", "shm")):
            shutil.rmtree(where, ignore_errors=True)
            lost = (source == "peer" and rank == 0) or (source == "disk" and name == "shm")
            if lost:
                os.makedirs(where)
            else:
                shutil.copytree(os.path.join(aside, f"node{rank}", name), where)
        if source == "disk":
            evict_from_page_cache(node_paths(spec, rank)[0])


def measure_restores(spec: dict, repeats: int) -> dict[str, list[dict]]:
    launch({**spec, "phase": "write"})
    aside = os.path.join(spec["work"], "aside")
    save_aside(spec, aside)
    state_mib = sum(tree_bytes(node_paths(spec, r)[0]) for r in range(RANKS)) / MiB
    runs: dict[str, list[dict]] = {name: [] for name in SOURCES}
    for repeat in range(repeats):
        for source in SOURCES[repeat % 3:] + SOURCES[:repeat % 3]:
            put_back(spec, aside, source)
            ranks, wall = launch({**spec, "phase": "restore", "source": source})
            runs[source].append({"restart_s": wall, "ranks": ranks})
            log(f"restore from {source}: {wall:.2f} s")
    check_restores(spec, runs)
    for rank in range(RANKS):
        for where in node_paths(spec, rank):
            shutil.rmtree(where)
    shutil.rmtree(aside)
    return {"state_mib": state_mib, "runs": runs}


def check_restores(spec: dict, runs: dict[str, list[dict]]) -> None:
    """Each rank read the copy its source names, and each rank's first step gave one loss whatever the source."""
    for source, done in runs.items():
        for rank in range(RANKS):
            dirpath, shm = node_paths(spec, rank)
            where = dirpath if source == "disk" else shm
            wrong = [r["ranks"][rank]["path"] for r in done if not r["ranks"][rank]["path"].startswith(where + "/")]
            if wrong:
                raise RuntimeError(f"rank {rank}'s {source} restore read {wrong[0]}, not a checkpoint under {where}")
    for rank in range(RANKS):
        losses = {r["ranks"][rank]["loss"] for done in runs.values() for r in done}
        if len(losses) != 1:
            raise RuntimeError(f"rank {rank}'s first resumed step's loss differs between sources: {sorted(losses)}")


def summarize_restores(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per source: the parent's wall time and, per key, the slower rank's value of each restart."""
    keys = ("imports_s", "build_s", "construct_s", "load_s", "resume_s", "in_process_s")
    return {source: {"restart_s": spread([r["restart_s"] for r in done]),
                     **{k: spread([max(rank[k] for rank in r["ranks"]) for r in done]) for k in keys}}
            for source, done in runs.items()}


# --- the loop ----------------------------------------------------------------------------------------------------


def measure_loops(spec: dict, threads: int, repeats: int) -> list[dict]:
    ranks, wall = launch({**spec, "phase": "loop", "threads": threads, "repeats": repeats}, timeout=1200)
    log(f"loops at {threads} thread(s): {wall:.0f} s")
    runs = [run for rank in ranks for run in rank["runs"]]
    failed = sum(r["peer_failures"] for r in runs)
    if failed:
        raise RuntimeError(f"{failed} peer copies failed during the loops")
    leftovers = [n for r in range(RANKS) if os.path.isdir(shm := node_paths(spec, r)[1]) for n in os.listdir(shm)]
    if leftovers:  # a clean close frees the host folders and the kept copies
        raise RuntimeError(f"host folders left after clean closes: {leftovers}")
    return runs


def summarize_loops(runs: list[dict]) -> dict[str, dict]:
    by = {v: [r for r in runs if r["variant"] == v] for v in LOOPS}
    out = {}
    for variant, done in by.items():
        entry = {"stall_ms": pooled(done, "stall_s"), "stall_ms_per_repeat": per_repeat(done, "stall_s"),
                 "drain_s": spread([r["drain_s"] for r in done])}
        for kind in ("between_step", "quiet_step"):
            ms, base = pooled(done, f"{kind}_s"), pooled(by["none"], f"{kind}_s")
            entry.update({f"{kind}_ms": ms, f"{kind}_x": None if ms is None or not base else ms / base,
                          f"{kind}_ms_per_repeat": per_repeat(done, f"{kind}_s"),
                          f"{kind}_n": sum(len(r[f"{kind}_s"]) for r in done)})
        out[variant] = entry
    return out


# --- the report ----------------------------------------------------------------------------------------------------


def targets(loops: dict[int, dict[str, dict]]) -> dict[str, list[dict]]:
    rows = {}
    for threads, s in loops.items():
        peer, alone, base = s["peers1"], s["peers0"], s["none"]
        noise = half_range(peer["stall_ms_per_repeat"]) + half_range(alone["stall_ms_per_repeat"])
        rows[f"peer_t{threads}"] = [
            target_row("stall ms unchanged (<= memory_peers=0's)", peer["stall_ms"], alone["stall_ms"], noise=noise),
            target_row("quiet step ms (in dirpath and at the peer) <= 1.05x the no-checkpoint loop's",
                       peer["quiet_step_ms"], None if base["quiet_step_ms"] is None else 1.05 * base["quiet_step_ms"],
                       noise=half_range(base["quiet_step_ms_per_repeat"]))]
    return rows


def restore_table(restore: dict[str, dict]) -> str:
    names = {"host": "own host folder (tmpfs)", "peer": "node 0 lost: the peer's copy", "disk": "`dirpath`, cold"}
    lines = ["| source | restart wall s | imports s | rendezvous + model + optimizer s | checkpointer built s | "
             "latest + load s | built → first resumed step s | vs host |", "|---|---|---|---|---|---|---|---|"]
    host = restore["host"]["resume_s"]["median"]
    for name, r in restore.items():
        lines.append(f"| {names[name]} | {cell(r, 'restart_s', '.2f')} | {cell(r, 'imports_s', '.2f')} | "
                     f"{cell(r, 'build_s', '.2f')} | {cell(r, 'construct_s', '.3f')} | {cell(r, 'load_s', '.3f')} | "
                     f"{cell(r, 'resume_s', '.3f')} | {r['resume_s']['median'] / host:.2f}x |")
    return "\n".join(lines)


def loop_table(loops: dict[int, dict[str, dict]]) -> str:
    names = {"none": "no checkpoint", "peers0": "`memory_peers=0`", "peers1": "`memory_peers=1`"}
    lines = ["| threads | loop | stall ms/ckpt [per-repeat medians] | steps between saves ms | / none | quiet steps "
             "ms (n) | / none | drain at close s |", "|---|---|---|---|---|---|---|---|"]
    for threads, summary in loops.items():
        for variant, s in summary.items():
            stall = "–" if s["stall_ms"] is None else f"{s['stall_ms']:.1f} [{cell(s, 'stall_ms_per_repeat', '.1f')}]"
            quiet = "–" if s["quiet_step_ms"] is None else f"{s['quiet_step_ms']:.0f} ({s['quiet_step_n']})"
            quiet_x = "–" if s["quiet_step_x"] is None else f"{s['quiet_step_x']:.3f}"
            lines.append(f"| {threads} | {names[variant]} | {stall} | {s['between_step_ms']:.0f} | "
                         f"{s['between_step_x']:.3f} | {quiet} | {quiet_x} | {cell(s, 'drain_s', '.2f')} |")
    return "\n".join(lines)


# --- the benchmark -------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="a tiny model, 1 repeat (the smoke test)")
    for name, kind in (("params-m", float), ("batch", int), ("seq", int), ("every", int), ("checkpoints", int),
                       ("repeats", int)):
        p.add_argument(f"--{name}", type=kind, help=f"per rank; default {DEFAULTS[name.replace('-', '_')]}")
    p.add_argument("--host-memory-dir", help="a tmpfs directory for the nodes' host memory roots (default: the "
                   f"tmpfs of {DEFAULT_HOST_ROOT})")
    p.add_argument("--workdir", help="the nodes' dirpaths go in a fresh directory under it (default: the system "
                   "temp dir)")
    p.add_argument("--json", help="write the configuration, every run and the summaries here")
    args = p.parse_args(argv)
    for name, value in (SMALL if args.small else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def shm_root_under(parent: str | None, rank_bytes: int) -> str:
    """A fresh tmpfs directory with room for every rank's snapshots: its own two, two kept for its peer."""
    parent = parent or os.path.dirname(DEFAULT_HOST_ROOT)
    if not os.path.isdir(parent):
        raise SystemExit(f"--host-memory-dir {parent!r} is not a directory; pass a tmpfs directory")
    need, free = 4 * RANKS * rank_bytes, shutil.disk_usage(parent).free
    if free < need:
        raise SystemExit(f"{parent} has {free / MiB:.0f} MiB free and the benchmark needs {need / MiB:.0f}; pass "
                         "--host-memory-dir a larger tmpfs or a smaller --params-m")
    return tempfile.mkdtemp(prefix="lazyckpt-bench-peer-", dir=parent)


def run(args: argparse.Namespace, spec: dict) -> dict:
    restore = measure_restores(spec, args.repeats)
    threads = sorted({torch.get_num_threads(), 1}, reverse=True)
    loop_runs = [r for t in threads for r in measure_loops(spec, t, args.repeats)]
    loops = {t: summarize_loops([r for r in loop_runs if r["threads"] == t]) for t in threads}
    summary = summarize_restores(restore["runs"])
    return {"state_mib": restore["state_mib"], "restore": summary, "loops": loops, "targets": targets(loops),
            "restore_runs": restore["runs"], "loop_runs": loop_runs}


def print_report(result: dict, facts: dict) -> None:
    w = facts["workload"]
    print(f"\nworkload: 2 nodes x 1 rank, {w['params_m']:g}M parameters per rank, {result['state_mib']:.0f} MiB of "
          f"state in all, a checkpoint every {w['every']} steps, {w['checkpoints']} measured per loop, "
          f"{facts['repeats']} repeats; load average {facts['loadavg_at_start'][0]:.1f} at the start, "
          f"{facts['loadavg_at_end'][0]:.1f} at the end; {facts['wall_s']:.0f} s\n")
    print(restore_table(result["restore"]) + "\n")
    print(loop_table(result["loops"]) + "\n")
    entries = [{"key": k, "name": f"peer copy, {k.split('_t')[1]} thread(s)"} for k in result["targets"]]
    print(targets_table(result["targets"], entries))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, load_start = time.monotonic(), os.getloadavg()
    w = Workload(params_m=args.params_m, batch=args.batch, seq=args.seq, every=args.every,
                 checkpoints=args.checkpoints, threads=torch.get_num_threads())
    shm = shm_root_under(args.host_memory_dir, int(args.params_m * 1e6 * 12))
    work = work_root(args, "lazyckpt-bench-peer-")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still frees its tmpfs folder
    spec = {"workload": dataclasses.asdict(w), "work": work, "shm": shm}
    try:
        result = run(args, spec)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    facts = {**run_facts(started, "peer_copy.py"), "workload": w.describe(), "repeats": args.repeats,
             "torch_threads": torch.get_num_threads(), "loadavg_at_start": load_start}
    print_report(result, facts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": facts, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
