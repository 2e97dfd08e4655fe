"""The distributed mode of ``compare.py`` (``--world-size N``): the same workload on N gloo ranks (CPU).

Every (method, repeat) runs as N fresh rank processes forked from the fork server ``compare.py`` starts; each
rank trains through ``runner.run_loop`` with the method's driver (FSDP2 or DDP), is summarized by
``runner.summarize`` and reads its checkpoint back against a reference run of its driver (one per driver, before
the measured runs). The parent reduces each run's ranks to the worst (max) and the median rank, then takes
medians with min–max over repeats. docs/benchmarks.md explains each metric and holds the latest results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time
import traceback
from typing import Any

from harness import chosen_keys, emit, fork_server, free_port, log, run_facts, work_root, workload_of
from report import cell, first_checkpoints_line, metric, scaled, target_row, spread
from workload import MiB, Workload, median

RANK_METRICS = ("stall_ms", "engine_stall_ms", "durable_s", "extra_rss_mb", "extra_rss_x_shard", "e2e_slowdown_pct",
                "written_mb", "child_rss_mb", "first_checkpoint_stall_s", "first_checkpoint_durable_s")


# --- one rank ----------------------------------------------------------------------------------------------------


def make_method(key: str) -> Any:
    from dist_methods import DIST_METHODS, Reference

    return Reference(key.removeprefix("reference_")) if key.startswith("reference_") else DIST_METHODS[key]()


def execute_rank(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """Train, checkpoint and verify on this rank; a reference run stores its states instead of verifying."""
    import torch
    import torch.distributed as dist
    from runner import Recorder, run_loop, summarize
    from workload import set_threads

    w = Workload(**spec["workload"])
    set_threads(w)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=spec["world_size"])
    method = make_method(spec["method"])
    out: dict[str, Any] = {"method": spec["method"], "repeat": spec["repeat"], "rank": rank}
    try:
        rec = Recorder(w)
        run = run_loop(w, method, spec["dirpath"], rec)
        reference = spec["reference"].format(driver=method.driver, rank=rank)
        if method.kind == "reference":
            torch.save({"at_step": method.at_step, "final": method.live_state()}, reference)
            return out
        out.update(summarize(w, method, rec))
        out.update(verify(w, method, reference))
    except Exception as e:  # noqa: BLE001 - a failing method is a result, not a crash of the benchmark
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(), verified=False)
    dist.destroy_process_group()
    return out


def verify(w: Workload, method: Any, reference_path: str) -> dict[str, Any]:
    """Training matches the reference run's; the verified step's checkpoint, read back into this rank's live
    state (resharded by the method's own reader), equals the reference state of that step bit for bit."""
    import torch
    from workload import compare

    reference = torch.load(reference_path, weights_only=True)
    live = method.live_state()
    out: dict[str, Any] = {"shard_bytes": sum(t.numel() * t.element_size() for t in live.values()),
                           "written_bytes": getattr(method, "written_bytes", lambda: None)()}
    problems = [f"final training state: {p}" for p in [compare(live, reference["final"])] if p]
    if method.kind != "baseline":
        started = time.perf_counter()
        loaded = method.load(method.path_for(w.verified_step))
        out["restore_s"] = time.perf_counter() - started
        problem = compare(method.normalize(loaded), reference["at_step"])
        problems += [f"checkpoint of step {w.verified_step}: {problem}"] if problem else []
    return {**out, "verified": not problems, "verify_problems": problems}


def rank_to_file(spec: dict[str, Any], rank: int, log_path: str) -> None:
    """The body of one rank's process: output to ``log_path``, the result to ``spec["out"]`` (JSON)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    result = execute_rank(spec, rank)
    with open(spec["out"].format(rank=rank), "w") as f:
        json.dump(result, f, default=str)


# --- the parent: one run = N rank processes ------------------------------------------------------------------


def run_ranks(server: Any, key: str, repeat: int, workload: Workload, world_size: int, root: str,
              timeout: float) -> dict[str, Any]:
    tag = f"{key}-r{repeat}"
    spec = {"workload": dataclasses.asdict(workload), "method": key, "repeat": repeat, "world_size": world_size,
            "port": free_port(), "dirpath": os.path.join(root, tag),
            "reference": os.path.join(root, "reference-{driver}-rank{rank}.pt"),
            "out": os.path.join(root, f"{tag}-rank{{rank}}.json")}
    os.makedirs(spec["dirpath"])
    started = time.monotonic()
    logs = [os.path.join(root, f"{tag}-rank{r}.log") for r in range(world_size)]
    procs = [server.Process(target=rank_to_file, args=(spec, r, logs[r]), name=f"bench-{tag}-rank{r}")
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, timeout - (time.monotonic() - started)))
    ranks = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
        out = spec["out"].format(rank=r)
        if p.exitcode == 0 and os.path.exists(out):
            with open(out) as f:
                ranks.append(json.load(f))
        else:
            with open(logs[r]) as f:
                ranks.append({"rank": r, "verified": False, "traceback": f.read()[-3000:],
                              "error": f"rank process ended with exit code {p.exitcode}"})
    shutil.rmtree(spec["dirpath"], ignore_errors=True)
    return {"method": key, "repeat": repeat, "ranks": ranks, "wall_s": time.monotonic() - started,
            "loadavg": os.getloadavg()}


# --- reducing ranks and repeats ----------------------------------------------------------------------------------


def per_rank_metrics(rank: dict[str, Any], base: dict[str, float] | None) -> dict[str, float | None]:
    """One rank's metrics of one run; extra RSS and slowdown are against the same rank of the driver's baseline."""
    stalls, durable = rank.get("stall_s") or [], rank.get("durable_s") or []
    written = rank.get("written_bytes")
    engine = rank.get("engine_stats") or []  # lazyckpt's own part of the stall: save() and wait_staged()
    out = {"stall_ms": 1e3 * sum(stalls) / len(stalls) if stalls else None,
           "engine_stall_ms": 1e3 * sum(s["save_s"] + s["wait_s"] for s in engine) / len(engine) if engine else None,
           "durable_s": median(durable) if durable else None,
           "written_mb": written / MiB if written is not None else None,
           "child_rss_mb": rank.get("peak_child_rss_bytes", 0) / MiB,
           "first_checkpoint_stall_s": rank.get("first_checkpoint_stall_s"),
           "first_checkpoint_durable_s": rank.get("first_checkpoint_durable_s"),
           "extra_rss_mb": None, "extra_rss_x_shard": None, "e2e_slowdown_pct": None}
    if base is not None:
        extra = rank["peak_rss_bytes"] - base["peak_rss_bytes"]
        out.update(extra_rss_mb=extra / MiB, extra_rss_x_shard=extra / rank["shard_bytes"],
                   e2e_slowdown_pct=100 * (rank["e2e_s"] / base["e2e_s"] - 1))
    return out


def baselines(runs: list[dict], baseline_for: dict[str, str]) -> dict[tuple[str, int], dict[str, float]]:
    """(driver, rank) -> that rank's median peak RSS and end-to-end time over the baseline's repeats."""
    out = {}
    for driver, key in baseline_for.items():
        ranks = [r for run in runs if run["method"] == key for r in run["ranks"] if "error" not in r]
        for index in {r["rank"] for r in ranks}:
            mine = [r for r in ranks if r["rank"] == index]
            out[(driver, index)] = {"peak_rss_bytes": median([r["peak_rss_bytes"] for r in mine]),
                                    "e2e_s": median([r["e2e_s"] for r in mine])}
    return out


def aggregate(methods: list[Any], runs: list[dict], baseline_for: dict[str, str]) -> list[dict[str, Any]]:
    """One entry per method: each metric over ranks (``<metric>`` the worst rank, ``<metric>_median`` the median
    rank), then median and min–max over repeats."""
    base = baselines(runs, baseline_for)
    out = []
    for method in methods:
        mine = [run for run in runs if run["method"] == method.key]
        errors = [f"repeat {run['repeat']} rank {r['rank']}: {r['error']}" for run in mine for r in run["ranks"]
                  if "error" in r]
        problems = [p for run in mine for r in run["ranks"] for p in r.get("verify_problems", [])]
        entry: dict[str, Any] = {"name": method.label, "key": method.key, "kind": method.kind, "available": True,
                                 "driver": method.driver, "repeats": len(mine), "errors": errors,
                                 "verify_problems": problems,
                                 "verified": bool(mine) and all(r.get("verified") for run in mine
                                                                for r in run["ranks"])}
        good = [run for run in mine if not any("error" in r for r in run["ranks"])]
        per_run = [[per_rank_metrics(r, base.get((method.driver, r["rank"]))) for r in run["ranks"]] for run in good]
        for name in RANK_METRICS:
            values = [[m[name] for m in ranks if m[name] is not None] for ranks in per_run]
            entry[name] = spread([max(v) for v in values if v])
            entry[f"{name}_median"] = spread([median(v) for v in values if v])
        out.append(entry)
    return out


def check_targets(entries: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The issue's targets, on the worst rank of each run (medians over repeats)."""
    by_key = {e["key"]: e for e in entries if e.get("verified")}
    out = {}
    if "lazyckpt_fsdp2" in by_key:
        lazy, dcp = by_key["lazyckpt_fsdp2"], by_key.get("dcp_stager_fsdp2")
        out["lazyckpt_fsdp2"] = [
            target_row("stall <= 1/10 of DCP + DefaultStager's", metric(lazy, "stall_ms"), scaled(metric(dcp, "stall_ms"), 0.1)),
            target_row("time to durable <= DCP + DefaultStager's", metric(lazy, "durable_s"), metric(dcp, "durable_s")),
            target_row("peak extra RSS per rank <= 1.2x its shard bytes", metric(lazy, "extra_rss_x_shard"), 1.2)]
    if "lazyckpt_ddp_split" in by_key:
        out["lazyckpt_ddp_split"] = [
            target_row("time to durable <= 0.7x rank 0 writing all", metric(by_key["lazyckpt_ddp_split"], "durable_s"),
                    scaled(metric(by_key.get("lazyckpt_ddp_rank0"), "durable_s"), 0.7))]
    return out


def markdown_table(entries: list[dict[str, Any]]) -> str:
    head = ["method", "verified", "stall ms/ckpt", "of which save() + wait_staged() ms", "time to durable s",
            "peak extra RSS MB / rank",
            "extra RSS / shard bytes", "end-to-end slowdown %", "written MB / rank"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        if not e.get("available", True):
            lines.append(f"| {e['name']} | unavailable: {e['unavailable']} |" + " |" * (len(head) - 2))
            continue
        verified = "yes" if e["verified"] else "**FAIL**"

        def both(name: str, fmt: str) -> str:
            return f"{cell(e, name, fmt)}; median rank {cell(e, name + '_median', fmt)}"

        row = [e["name"], verified, both("stall_ms", ".1f"), cell(e, "engine_stall_ms", ".1f"),
               both("durable_s", ".2f"), cell(e, "extra_rss_mb", ".0f"), cell(e, "extra_rss_x_shard", ".2f"),
               cell(e, "e2e_slowdown_pct", "+.1f"), cell(e, "written_mb", ".0f")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# --- the benchmark -----------------------------------------------------------------------------------------------


def unavailable_methods(keys: list[str]) -> dict[str, str]:
    """Key -> why, for the chosen methods that cannot run here (a missing optional peer)."""
    from dist_methods import DIST_METHODS
    from methods import Unavailable

    out = {}
    for key in keys:
        try:
            DIST_METHODS[key]().check()
        except Unavailable as e:
            out[key] = str(e)
    return out


def benchmark(args: Any, workload: Workload, server: Any, root: str) -> tuple[list[str], list[dict], dict]:
    """One reference run per driver, then every available method ``--repeats`` times, shuffled per repeat; also
    returns the unavailable ones with their reasons."""
    from dist_methods import DIST_BASELINE_FOR, DIST_METHODS

    keys = chosen_keys(args.methods, DIST_METHODS, DIST_BASELINE_FOR)
    unavailable = unavailable_methods(keys)
    for key, reason in unavailable.items():
        log(f"{key:22s} unavailable: {reason}")
    keys = [k for k in keys if k not in unavailable]
    for driver in dict.fromkeys(DIST_METHODS[k].driver for k in keys):
        run = run_ranks(server, f"reference_{driver}", 0, workload, args.world_size, root, args.run_timeout)
        failed = [r for r in run["ranks"] if "error" in r]
        if failed:
            raise SystemExit(f"the {driver} reference run failed: {failed[0]['error']}\n{failed[0]['traceback']}")
        log(f"reference run ({driver}) {run['wall_s']:6.1f}s")
    runs = []
    for repeat in range(args.repeats):
        order = list(keys)
        random.Random(args.seed * 1000 + repeat).shuffle(order)
        for key in order:
            run = run_ranks(server, key, repeat, workload, args.world_size, root, args.run_timeout)
            runs.append(run)
            failed = [r for r in run["ranks"] if "error" in r]
            status = f"ERROR rank {failed[0]['rank']}: {failed[0]['error']}" if failed else \
                "verified" if all(r["verified"] for r in run["ranks"]) else \
                "FAIL " + "; ".join(p for r in run["ranks"] for p in r.get("verify_problems", []))
            log(f"[repeat {repeat + 1}/{args.repeats}] {key:22s} {run['wall_s']:6.1f}s  {status}")
            if failed:
                log(failed[0].get("traceback", "")[-1500:])
    return keys, runs, unavailable


def main(args: Any, machine_info: Any) -> int:
    """``compare.py --world-size N``: run, print the table and the targets, write ``--json``."""
    from dist_methods import DIST_BASELINE_FOR, DIST_METHODS

    workload = workload_of(args)
    root = work_root(args, "lazyckpt-dist-bench-")
    started = time.monotonic()
    try:
        log(f"{args.world_size} gloo ranks, {workload.threads} thread(s) each; work dir {root}")
        machine = machine_info(root, 64 * MiB)
        keys, runs, unavailable = benchmark(args, workload, fork_server(workload, args.malloc_mmap_threshold),
                                            root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    entries = aggregate([DIST_METHODS[k] for k in DIST_METHODS if k in keys], runs, DIST_BASELINE_FOR)
    entries += [{"name": DIST_METHODS[k].label, "key": k, "kind": DIST_METHODS[k].kind, "driver": DIST_METHODS[k].driver,
                 "available": False, "verified": False, "unavailable": why} for k, why in unavailable.items()]
    targets = check_targets(entries)
    config = {**workload.describe(), "world_size": args.world_size, "repeats": args.repeats,
              "methods": keys + list(unavailable),
              **run_facts(started)}
    emit(args, f"{args.world_size} ranks x {workload.threads} thread(s), {args.params_m:g}M parameters; checkpoint "
         f"every {workload.every} steps; worst rank, median (min–max) over {args.repeats} repeat(s)",
         markdown_table(entries), targets, entries,
         {"machine": machine, "config": config, "methods": entries, "targets": targets, "runs": runs},
         footer=first_checkpoints_line(entries))
    return 0
