"""The restore half of host_level.py: one checkpoint of the default state in the host folder, in ``dirpath`` on
the local disk and optionally in S3, and a fresh process per restart from each source to its first resumed step.

Each restart does what a user's resume does, the same for every source: import torch and lazyckpt, build the model
and optimizer, ``lazyckpt.latest``, ``lazyckpt.load`` (checksums verified), ``load_state_dict`` for both, one
training step. The child reports each phase, so the part the source decides (``latest`` + ``load``) is seen apart
from the part no source changes (``load_state_dict`` and the step's compute).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import torch

import lazyckpt
from harness import log
from lazyckpt.storage.urls import host_dir
from report import cell, spread
from workload import Batches, Workload, build_model, evict_from_page_cache, lm_loss, make_optimizer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PHASES = ("restart_s", "imports_s", "build_s", "load_s", "state_dict_s", "step_s", "resume_s")
"""What each restart reports: the wall time the parent saw, then the child's phases in order (``resume_s``: from
the built model to the end of the first step, i.e. ``load_s + state_dict_s + step_s``)."""

RESTORE = """
import json, sys, time
started = time.perf_counter()
spec = json.loads(sys.argv[1])
sys.path[:0] = [spec["root"], spec["bench"]]
import torch, lazyckpt
from workload import Batches, Workload, build_model, lm_loss, make_optimizer
imported = time.perf_counter()
w = Workload(**spec["workload"])
model = build_model(w); opt = make_optimizer(w, model.parameters())
built = time.perf_counter()
options = {"storage_options": spec["storage_options"]} if spec["storage_options"] else {}
path = lazyckpt.latest(spec["where"], host_memory_dir=spec["host_memory_dir"], **options)
state = lazyckpt.load(path, **options)
loaded = time.perf_counter()
model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
restored = time.perf_counter()
loss = lm_loss(model, Batches(w)[0]); loss.backward(); opt.step()
stepped = time.perf_counter()
print(json.dumps({"path": path, "loss": loss.item(), "imports_s": imported - started, "build_s": built - imported,
                  "load_s": loaded - built, "state_dict_s": restored - loaded, "step_s": stepped - restored,
                  "resume_s": stepped - built, "in_process_s": stepped - started}))
"""


# --- restore: a fresh process from each source to its first resumed step ------------------------------------------


def trained_state(w: Workload) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    model, data = build_model(w), Batches(w)
    opt = make_optimizer(w, model.parameters())
    for step in range(2):
        lm_loss(model, data[step]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, {"model": model.state_dict(), "opt": opt.state_dict()}


def write_sources(w: Workload, work: str, host_root: str, s3: dict | None) -> dict[str, dict]:
    """One checkpoint (step 2) in the host folder and ``dirpath`` (the host level, kept at close), and in S3:
    ``{source: {"where": what latest() is given, "storage_options": ...}}``."""
    _, opt, state = trained_state(w)
    dirpath = os.path.join(work, "restore")
    with lazyckpt.LazyCheckpointer(dirpath, keep_in_memory="host", host_memory_dir=host_root,
                                   keep_on_close=True) as ckpt:
        ckpt.save(state, step=2, optimizers=[opt])
    sources = {"host": {"where": host_dir(dirpath, host_root), "storage_options": None},
               "disk": {"where": dirpath, "storage_options": None}}
    if s3 is not None:
        with lazyckpt.LazyCheckpointer(os.path.join(work, "spool"), remote=s3["url"], remote_keep_last_k=1,
                                       storage_options=s3["options"]) as ckpt:
            ckpt.save(state, step=2, optimizers=[opt])
        sources["s3"] = {"where": s3["url"], "storage_options": s3["options"]}
    return sources


def restore_once(w: Workload, source: dict, host_root: str, cold_dir: str | None) -> dict:
    """One restart from ``source`` in a fresh process (``cold_dir``'s pages dropped first); its timings and the
    wall time the parent saw."""
    if cold_dir is not None:
        evict_from_page_cache(cold_dir)
    spec = {"root": ROOT, "bench": HERE, "workload": dataclasses.asdict(w), "host_memory_dir": host_root, **source}
    started = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", RESTORE, json.dumps(spec)], capture_output=True, text=True)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        raise RuntimeError(f"the restore from {source['where']} failed:\n{child.stderr[-3000:]}")
    return {**json.loads(child.stdout.strip().splitlines()[-1]), "restart_s": wall}


def measure_restores(w: Workload, sources: dict[str, dict], host_root: str, repeats: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in sources}
    for _ in range(repeats):
        for name, source in sources.items():
            cold = lazyckpt.latest(source["where"], host_memory_dir=host_root) if name == "disk" else None
            runs[name].append(restore_once(w, source, host_root, cold))
            log(f"restore from {name}: {runs[name][-1]['restart_s']:.2f} s")
    check_restores(runs, sources)
    return runs


def check_restores(runs: dict[str, list[dict]], sources: dict[str, dict]) -> None:
    """Each source's restore read its own copy, and every first step computed the same loss."""
    for name, done in runs.items():
        where = sources[name]["where"].rstrip("/")
        wrong = [r["path"] for r in done if not r["path"].startswith(where + "/")]
        if wrong:
            raise RuntimeError(f"the {name} restore read {wrong[0]}, not a checkpoint of {where}")
    losses = {r["loss"] for done in runs.values() for r in done}
    if len(losses) != 1:
        raise RuntimeError(f"the first resumed step's loss differs between the sources: {sorted(losses)}")


def summarize_restores(runs: dict[str, list[dict]]) -> dict[str, dict]:
    return {name: {key: spread([r[key] for r in done]) for key in PHASES} for name, done in runs.items()}


def restore_table(restore: dict[str, dict]) -> str:
    names = {"host": "host folder (tmpfs)", "disk": "`dirpath`, local disk, cold", "s3": "S3 (moto server)"}
    lines = ["| source | process start → first resumed step s | imports s | model + optimizer built s | latest + "
             "load s | load_state_dict s | first step s | load → first resumed step s | vs host: load, resume |",
             "|---|---|---|---|---|---|---|---|---|"]
    host = restore["host"]
    for name, r in restore.items():
        ratios = "1.00x, 1.00x" if name == "host" else ", ".join(
            f"{r[key]['median'] / host[key]['median']:.2f}x" for key in ("load_s", "resume_s"))
        lines.append(f"| {names[name]} | {cell(r, 'restart_s', '.2f')} | {cell(r, 'imports_s', '.2f')} | "
                     f"{cell(r, 'build_s', '.2f')} | {cell(r, 'load_s', '.3f')} | {cell(r, 'state_dict_s', '.3f')} | "
                     f"{cell(r, 'step_s', '.3f')} | {cell(r, 'resume_s', '.3f')} | {ratios} |")
    return "\n".join(lines)
