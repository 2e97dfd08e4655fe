"""The host level (``keep_in_memory="host"``) on the default workload: how fast a restart resumes from it, and
what it costs the training loop against ``keep_in_memory=False``.

* **Restore** (host_restore.py): one checkpoint of the default state (compare.py's workload, 289 MiB with AdamW)
  is held in the host folder (a tmpfs), in ``dirpath`` on the local disk, and optionally in S3 (moto's server in
  its own process). For each source in turn a fresh process imports torch and lazyckpt, builds the model and
  optimizer, finds the newest checkpoint (``lazyckpt.latest``), loads it (checksums verified),
  ``load_state_dict``s it and runs one training step: the same calls for every source. Before each disk restore
  the files are fsynced and their pages dropped from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``;
  dropping all caches needs root). Every source's first step must give the same loss, bit for bit.
* **Loop**: the same training loop, in this process, without checkpoints, with ``keep_in_memory=False`` and with
  ``keep_in_memory="host"`` (interleaved, the order rotated per repeat), at torch's default thread count and at
  one thread. The stall per checkpoint is the training-thread time in ``save()`` plus the ``wait_staged()``
  before the next update. Steps between saves neither save nor follow a save (the write and the copy to
  ``dirpath`` may run during them); quiet steps are those of them that start with the newest checkpoint durable
  in ``dirpath`` (compare.py's definition). Both are compared with the same steps of the loop without checkpoints.

Usage:
    python benchmarks/host_level.py --json host.json      # the default workload, ~8 min on 2 cores
    python benchmarks/host_level.py --small               # a tiny model, 1 repeat: the smoke test runs it
    python benchmarks/host_level.py --restore-only        # the restarts alone, ~1.5 min

The host folders go under a fresh directory in ``--host-memory-dir`` (default: a new folder in the tmpfs of the
host level's default root), removed at the end, as is the work directory.
"""

from __future__ import annotations

import argparse
import gc
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
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)  # this checkout's lazyckpt, whatever is installed

import lazyckpt  # noqa: E402
from compare import FULL  # noqa: E402
from harness import log, run_facts, work_root  # noqa: E402
from host_restore import measure_restores, restore_table, summarize_restores, write_sources  # noqa: E402
from lazyckpt.storage.urls import DEFAULT_HOST_ROOT, host_dir  # noqa: E402
from report import cell, spread, target_row, targets_table  # noqa: E402
from workload import Batches, MiB, Workload, build_model, lm_loss, make_optimizer, median, tree_bytes  # noqa: E402

SMALL = {"params_m": 0.3, "batch": 2, "seq": 16, "every": 3, "checkpoints": 2, "repeats": 1, "restore_repeats": 1}
DEFAULTS = {**{k: FULL[k] for k in ("params_m", "batch", "seq")}, "every": 15, "checkpoints": 3, "repeats": 3,
            "restore_repeats": 5}
"""``restore_repeats``: restarts per source (a restart takes seconds, and its load a tenth of one: more of them
keep the median of the load steady on a noisy machine)."""
VARIANTS = ("none", "disk", "host")
"""The loop without checkpoints, with ``keep_in_memory=False`` and with ``keep_in_memory="host"``."""

# --- the loop: stall per checkpoint and quiet steps ----------------------------------------------------------------


def checkpointer(variant: str, dirpath: str, host_root: str) -> lazyckpt.LazyCheckpointer | None:
    host = {"keep_in_memory": "host", "host_memory_dir": host_root} if variant == "host" else {}
    return None if variant == "none" else lazyckpt.LazyCheckpointer(dirpath, keep_last_k=2, **host)


def train(w: Workload, variant: str, dirpath: str, host_root: str) -> dict:
    """One loop: the stall of each measured checkpoint, the durations of the steps between saves (and of those
    among them that start with the newest checkpoint durable in ``dirpath``), and the drain at close."""
    model, data = build_model(w), Batches(w)
    opt = make_optimizer(w, model.parameters())
    ckpt = checkpointer(variant, dirpath, host_root)
    steps, idle, stalls, pending = {}, set(), {}, None
    for step in range(1, w.total_steps + 1):
        started = time.perf_counter()
        if pending is None or settled(pending):
            idle.add(step)
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
            pending = ckpt.save({"model": model.state_dict(), "opt": opt.state_dict()}, step=step, optimizers=[opt])
            stalls[step] = time.perf_counter() - before
        steps[step] = time.perf_counter() - started
    before, copies, committed = time.perf_counter(), [], []
    if ckpt is not None:
        ckpt.close()
        copies = [u.seconds for u in (ckpt.remote.completed if ckpt.remote else []) if u.step > w.every]
        committed = [s.flush_s for s in ckpt.stats if s.step > w.every]
    between = between_saves(w)
    return {"variant": variant, "between_step_s": [steps[s] for s in between],
            "quiet_step_s": [steps[s] for s in between if s in idle], "drain_s": time.perf_counter() - before,
            "stall_s": [v for s, v in stalls.items() if s > w.every], "commit_s": committed,
            "copy_to_dirpath_s": copies}


def settled(pending: lazyckpt.PendingCheckpoint) -> bool:
    """The checkpoint is committed in ``dirpath`` (for the host level: its copy there too); never blocks."""
    if not pending.done():
        return False
    try:
        pending.wait_remote(timeout=0)
    except TimeoutError:
        return False
    return True


def between_saves(w: Workload) -> list[int]:
    """Measured steps that neither save nor wait for the previous save's staging."""
    return [s for s in range(w.every + 2, w.total_steps + 1) if not w.is_checkpoint(s) and not w.is_checkpoint(s - 1)]


def measure_loops(w: Workload, threads: int, work: str, host_root: str, repeats: int) -> list[dict]:
    torch.set_num_threads(threads)
    runs = []
    for repeat in range(repeats):
        order = VARIANTS[repeat % 3:] + VARIANTS[:repeat % 3]
        for variant in order:
            dirpath = tempfile.mkdtemp(prefix=f"loop-{variant}-", dir=work)
            runs.append({"repeat": repeat, "threads": threads, **train(w, variant, dirpath, host_root)})
            log(f"loop {variant}, {threads} thread(s), repeat {repeat}: {sum(runs[-1]['between_step_s']):.1f} s "
                "between saves")
            shutil.rmtree(dirpath)
            gc.collect()
    leftovers = os.listdir(host_root) if os.path.isdir(host_root) else []
    if leftovers:  # a clean close frees the host folder
        raise RuntimeError(f"host folders left after clean closes: {leftovers}")
    return runs


def summarize_loops(runs: list[dict]) -> dict[str, dict]:
    """Per variant: stall and step medians (ms) over every checkpoint / step of every repeat, the steps over the
    baseline's, and the spread of the per-repeat medians (the noise)."""
    by = {v: [r for r in runs if r["variant"] == v] for v in VARIANTS}
    out = {}
    for variant, done in by.items():
        entry = {"stall_ms": pooled(done, "stall_s"), "stall_ms_per_repeat": per_repeat(done, "stall_s")}
        for kind in ("between_step", "quiet_step"):
            ms, base = pooled(done, f"{kind}_s"), pooled(by["none"], f"{kind}_s")
            entry.update({f"{kind}_ms": ms, f"{kind}_x": None if ms is None or not base else ms / base,
                          f"{kind}_ms_per_repeat": per_repeat(done, f"{kind}_s"),
                          f"{kind}_n": sum(len(r[f"{kind}_s"]) for r in done)})
        for key in ("commit_s", "copy_to_dirpath_s"):
            entry[key] = spread([v for r in done for v in r[key]])
        out[variant] = {**entry, "drain_s": spread([r["drain_s"] for r in done])}
    return out


def pooled(runs: list[dict], key: str) -> float | None:
    values = [v for r in runs for v in r[key]]
    return median(values) * 1e3 if values else None


def per_repeat(runs: list[dict], key: str) -> dict | None:
    return spread([median(r[key]) * 1e3 for r in runs if r[key]])


def half_range(value: dict | None) -> float:
    return 0.0 if not value else (value["max"] - value["min"]) / 2


# --- the report ------------------------------------------------------------------------------------------------


def targets(restore: dict[str, dict], loops: dict[int, dict[str, dict]]) -> dict[str, list[dict]]:
    def med(source: str, key: str) -> float:
        return restore[source][key]["median"]

    rows = {"host": [
        target_row("restart to the first resumed step (load + load_state_dict + step): host >= 5x faster than "
                   "cold disk", med("host", "resume_s"), med("disk", "resume_s") / 5),
        target_row("the load alone (latest + load): host >= 5x faster than cold disk", med("host", "load_s"),
                   med("disk", "load_s") / 5)]}
    for threads, summary in loops.items():
        host, disk, base = summary["host"], summary["disk"], summary["none"]
        stall_noise = half_range(host["stall_ms_per_repeat"]) + half_range(disk["stall_ms_per_repeat"])
        rows[f"host_t{threads}"] = [target_row("stall ms unchanged (<= keep_in_memory=False's)", host["stall_ms"],
                                               disk["stall_ms"], noise=stall_noise)]
        for kind, what in (("quiet_step", "quiet step ms (the newest checkpoint durable in dirpath)"),
                           ("between_step", "step ms between saves (the write and the copy may run)")):
            rows[f"host_t{threads}"].append(target_row(
                f"{what} <= 1.05x the no-checkpoint loop's", host[f"{kind}_ms"], 1.05 * base[f"{kind}_ms"],
                noise=half_range(base[f"{kind}_ms_per_repeat"])))
    return rows


def loop_table(loops: dict[int, dict[str, dict]]) -> str:
    names = {"none": "no checkpoint", "disk": "`keep_in_memory=False`", "host": "`keep_in_memory=\"host\"`"}
    lines = ["| threads | loop | stall ms/ckpt [per-repeat medians] | steps between saves ms | / none | quiet steps "
             "ms (n) | / none | committed s (host: in tmpfs) | copy to `dirpath` s | drain at close s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for threads, summary in loops.items():
        for variant, s in summary.items():
            stall = "–" if s["stall_ms"] is None else f"{s['stall_ms']:.1f} [{cell(s, 'stall_ms_per_repeat', '.1f')}]"
            steps = [f"{s['between_step_ms']:.0f}", f"{s['between_step_x']:.3f}",
                     "–" if s["quiet_step_ms"] is None else f"{s['quiet_step_ms']:.0f} ({s['quiet_step_n']})",
                     "–" if s["quiet_step_x"] is None else f"{s['quiet_step_x']:.3f}"]
            lines.append(f"| {threads} | {names[variant]} | {stall} | {' | '.join(steps)} | "
                         f"{cell(s, 'commit_s', '.2f')} | {cell(s, 'copy_to_dirpath_s', '.2f')} | "
                         f"{cell(s, 'drain_s', '.2f')} |")
    return "\n".join(lines)


# --- the benchmark ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="a tiny model, 1 repeat (the smoke test)")
    for name, kind in (("params-m", float), ("batch", int), ("seq", int), ("every", int), ("checkpoints", int),
                       ("repeats", int), ("restore-repeats", int)):
        p.add_argument(f"--{name}", type=kind, help=f"default {DEFAULTS[name.replace('-', '_')]}")
    p.add_argument("--no-remote", action="store_true", help="skip the restore from S3 (moto's server)")
    p.add_argument("--restore-only", action="store_true", help="measure the restarts and not the loops")
    p.add_argument("--host-memory-dir", help="a tmpfs directory to put the host folders under (default: the tmpfs "
                   f"of {DEFAULT_HOST_ROOT})")
    p.add_argument("--workdir", help="the checkpoints' dirpaths go in a fresh directory under it (default: the "
                   "system temp dir)")
    p.add_argument("--json", help="write the configuration, every run and the summaries here")
    args = p.parse_args(argv)
    for name, value in (SMALL if args.small else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def host_root_under(parent: str | None, state_bytes: int) -> str:
    """A fresh directory for the host folders, with room checked: the restore's copy plus the loop's two."""
    parent = parent or os.path.dirname(DEFAULT_HOST_ROOT)
    if not os.path.isdir(parent):
        raise SystemExit(f"--host-memory-dir {parent!r} is not a directory; pass a tmpfs directory")
    free = shutil.disk_usage(parent).free
    if free < 3 * state_bytes:
        raise SystemExit(f"{parent} has {free / MiB:.0f} MiB free and the benchmark needs {3 * state_bytes / MiB:.0f} "
                         "(three snapshots); pass --host-memory-dir a larger tmpfs or a smaller --params-m")
    return tempfile.mkdtemp(prefix="lazyckpt-bench-host-", dir=parent)


def start_s3() -> tuple[subprocess.Popen, dict]:
    from remote import start_moto

    server, endpoint = start_moto()
    options = {"endpoint_url": endpoint, "key": "bench", "secret": "bench", "client_kwargs": {"region_name": "eu-west-1"}}
    return server, {"url": "s3://bench-host-level/run", "options": options}


def run(args: argparse.Namespace, w: Workload, work: str, host_root: str, s3: dict | None) -> dict:
    sources = write_sources(w, work, host_root, s3)
    state_bytes = tree_bytes(lazyckpt.latest(sources["host"]["where"], host_memory_dir=host_root))
    restore_runs = measure_restores(w, sources, host_root, args.restore_repeats)
    shutil.rmtree(host_dir(sources["disk"]["where"], host_root))  # the restore's copy, kept at close
    threads = [] if args.restore_only else sorted({torch.get_num_threads(), 1}, reverse=True)
    loop_runs = [r for t in threads for r in measure_loops(w, t, work, host_root, args.repeats)]
    loops = {t: summarize_loops([r for r in loop_runs if r["threads"] == t]) for t in threads}
    restore = summarize_restores(restore_runs)
    return {"state_mib": state_bytes / MiB, "restore": restore, "loops": loops, "targets": targets(restore, loops),
            "restore_runs": restore_runs, "loop_runs": loop_runs}


def print_report(result: dict, facts: dict) -> None:
    w = facts["workload"]
    print(f"\nworkload: {w['params_m']:g}M parameters, {result['state_mib']:.0f} MiB of state, a checkpoint every "
          f"{w['every']} steps, {w['checkpoints']} measured per loop, {facts['repeats']} loop repeats, "
          f"{facts['restore_repeats']} restarts per source; load average "
          f"{facts['loadavg_at_start'][0]:.1f} at the start, {facts['loadavg_at_end'][0]:.1f} at the end; "
          f"{facts['wall_s']:.0f} s\n")
    print(restore_table(result["restore"]) + "\n")
    if result["loops"]:
        print(loop_table(result["loops"]) + "\n")
    entries = [{"key": k, "name": "host level" if k == "host" else f"host level, {k.split('_t')[1]} thread(s)"}
               for k in result["targets"]]
    print(targets_table(result["targets"], entries))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, load_start = time.monotonic(), os.getloadavg()
    w = Workload(params_m=args.params_m, batch=args.batch, seq=args.seq, every=args.every,
                 checkpoints=args.checkpoints, threads=torch.get_num_threads())
    host_root = host_root_under(args.host_memory_dir, int(args.params_m * 1e6 * 12))
    work = work_root(args, "lazyckpt-bench-host-level-")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still frees its tmpfs folder
    server, s3 = start_s3() if not args.no_remote else (None, None)
    try:
        result = run(args, w, work, host_root, s3)
    finally:
        shutil.rmtree(host_root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        if server is not None:
            server.terminate()
            server.wait()
    facts = {**run_facts(started, "host_level.py"), "workload": w.describe(), "repeats": args.repeats,
             "restore_repeats": args.restore_repeats,
             "torch_threads": torch.get_num_threads(), "loadavg_at_start": load_start}
    print_report(result, facts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": facts, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
