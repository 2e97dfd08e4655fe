"""One run of one method, in a fresh process: train with checkpoints, drain, then verify, restore and time a raw
write of the same bytes. ``compare.py`` forks one such process per (method, repeat) from a fork server that has
imported the libraries once, and reads the JSON each writes.

Schedule of a run (``Workload``): steps 1..every-1 warm up; the RSS sampler starts before step ``every``, whose
checkpoint warms the method up (buffers, threads) and is drained untimed; the measured loop runs from step
``every + 1`` to the end, with checkpoints on every multiple of ``every`` up to ``verified_step`` and a few more
steps after it (so a snapshot torn by a later update would not match the reference).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import gc
import shutil
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pin_sources() -> None:
    """Make ``lazyckpt`` (and ``lazyckpt.integrations``) import from this checkout, whatever the global editable
    install points at right now (other checkouts on a shared machine re-install it)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    name, folder = "lazyckpt.integrations", os.path.join(ROOT, "integrations")
    if name not in sys.modules and os.path.isdir(folder):
        spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def engine_files() -> dict[str, str | None]:
    """Where the measured lazyckpt code came from (recorded with every run)."""
    return {name: getattr(sys.modules.get(name), "__file__", None)
            for name in ("lazyckpt", "lazyckpt.integrations")}


pin_sources()

import torch  # noqa: E402

from floors import RawDirect, RawFloor, RawPaced  # noqa: E402
from frameworks import AccelerateSaveState, LazyHook, LazyLightning, LightningAsync, LightningSync  # noqa: E402
from peer_torch_checkpointing import TorchCheckpointing  # noqa: E402
from methods import (  # noqa: E402
    DcpStager, DcpThread, LazyEngine, LazyEngineBuffered, LazyEngineTwoInFlight, LazyEngineTwoPools, Method,
    NoCheckpoint, NoCheckpointAccelerate, NoCheckpointTrainer, Run, TorchSave, Unavailable)
from workload import (  # noqa: E402
    Batches, RssSampler, Workload, build_model, compare, evict_from_page_cache, lm_loss, make_optimizer, median,
    normalize, raw_write_seconds, set_threads, tree_bytes)

METHODS: dict[str, type[Method]] = {cls.key: cls for cls in (
    NoCheckpoint, RawFloor, RawDirect, RawPaced, TorchSave, DcpThread, DcpStager, TorchCheckpointing, LazyEngine, LazyEngineBuffered,
    LazyEngineTwoInFlight, LazyEngineTwoPools, NoCheckpointTrainer, LightningSync, LightningAsync, LazyLightning,
    NoCheckpointAccelerate, AccelerateSaveState, LazyHook,
)}
"""Every method, in table order."""

BASELINE_FOR = {"loop": "none", "trainer": "none_trainer", "accelerate": "none_accelerate"}
PRE_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
             "on_before_zero_grad")
PRELOAD_ENV = "LAZYCKPT_BENCH_PRELOAD"
now = time.monotonic


@dataclasses.dataclass
class Recorder:
    """Timestamps of one run (``time.monotonic()``), filled by the drivers."""

    workload: Workload
    phases: dict[int, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    """Loop drivers: step -> (start, after backward, after the pre-step wait, after optimizer.step, end)."""
    start: dict[int, float] = dataclasses.field(default_factory=dict)
    end: dict[int, float] = dataclasses.field(default_factory=dict)
    request_at: dict[int, float] = dataclasses.field(default_factory=dict)
    stalls: list[tuple[int, str, float]] = dataclasses.field(default_factory=list)
    """(step, "pre" | "post", seconds): training-thread time spent in the method before / after the update."""
    loop_start: float = 0.0
    finish_end: float = 0.0
    sampler: RssSampler | None = None
    peak_rss: int = 0
    peak_child_rss: int = 0
    start_rss: int = 0
    gc_pauses: list[tuple[str, int, float]] = dataclasses.field(default_factory=list)
    """(thread name, generation, seconds) of every garbage collection while memory was sampled."""

    def start_memory(self, children: bool = False) -> None:
        self.sampler = RssSampler(children=children)
        self.start_rss = self.sampler.start_rss
        gc.callbacks.append(self._on_gc)

    def stop_memory(self) -> None:
        if self.sampler is not None:
            self.peak_rss = self.sampler.stop()
            self.peak_child_rss = self.sampler.peak_children
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif hasattr(self, "_gc_started"):
            self.gc_pauses.append((threading.current_thread().name, info["generation"],
                                   time.perf_counter() - self._gc_started))

    def measured_checkpoints(self) -> list[int]:
        w = self.workload
        return [s for s in range(w.first_measured_step, w.total_steps + 1) if w.is_checkpoint(s)]

    def stall_per_checkpoint(self, own: dict[int, float] | None) -> list[float]:
        """Each measured checkpoint's stall: its request plus everything the method took until the next one."""
        ckpts = self.measured_checkpoints()
        if own is not None:
            return [own.get(s, 0.0) for s in ckpts]
        per = {c: 0.0 for c in ckpts}
        for step, phase, seconds in self.stalls:
            owner = [c for c in ckpts if c <= step - (phase == "pre")]
            if owner:
                per[owner[-1]] += seconds
        return [per[c] for c in ckpts]


# --- drivers ---------------------------------------------------------------------------------------------------


def run_loop(w: Workload, method: Method, dirpath: str, rec: Recorder) -> Run:
    """A plain PyTorch loop (optionally through ``accelerate.Accelerator``) calling the method's interface."""
    model = method.wrap(build_model(w))
    opt = make_optimizer(w, model.parameters())
    data = Batches(w)
    accelerator = None
    if method.driver == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
    run = Run(w, dirpath, model, opt, accelerator)
    method.setup(run)
    backward = accelerator.backward if accelerator is not None else torch.Tensor.backward
    for step in range(1, w.total_steps + 1):
        if step == w.every:
            rec.start_memory(children=method.child_processes)
        if step == w.first_measured_step:
            method.drain()
            rec.loop_start = now()
        t0 = now()
        backward(lm_loss(model, data[step - 1]))
        t1 = now()
        method.before_step()
        t2 = now()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = now()
        if w.is_checkpoint(step):
            rec.request_at[step] = t3
            method.request(step)
        t4 = now()
        rec.phases[step] = (t0, t1, t2, t3, t4)
        rec.start[step], rec.end[step] = t0, t4
        rec.stalls += [(step, "pre", t2 - t1), (step, "post", t4 - t3)]
    method.finish()
    rec.finish_end = now()
    rec.stop_memory()
    return run


def run_trainer(w: Workload, method: Method, dirpath: str, rec: Recorder) -> Run:
    """A Lightning ``Trainer`` with the method's callbacks and plugins; their hooks are timed as the stall."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    class BenchModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_model(w)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return lm_loss(self.net, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(w, self.net.parameters())

    class Bench(pl.Callback):
        step = 0
        lightning_own: set[int] = set()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            torch.set_num_threads(w.threads)
            for cb in trainer.callbacks:  # after every setup(): includes callbacks the method added there
                if cb is not self and id(cb) not in self.lightning_own:
                    for name in (*PRE_HOOKS, "on_train_batch_end"):
                        _time_hook(cb, name, self, rec)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.step = trainer.global_step + 1
            if self.step == w.every:
                rec.start_memory()
            if self.step == w.first_measured_step:
                method.drain()
                rec.loop_start = now()
            rec.start[self.step] = now()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            rec.end[self.step] = max(rec.end.get(self.step, 0.0), now())

    module = BenchModule()
    run = Run(w, dirpath, model=module.net)
    bench = Bench()
    callbacks = method.callbacks(run)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=w.total_steps, max_epochs=1, logger=False,
                         callbacks=[bench, *callbacks], plugins=method.plugins(run) or None,
                         enable_checkpointing=method.enable_checkpointing, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         default_root_dir=dirpath)
    bench.lightning_own = {id(cb) for cb in trainer.callbacks if cb is not bench and cb not in callbacks}
    run.trainer = trainer
    trainer.fit(module, DataLoader(Batches(w), batch_size=None, shuffle=False))
    rec.finish_end = now()
    rec.stop_memory()
    run.optimizer = trainer.optimizers[0]
    return run


def _time_hook(callback: Any, name: str, bench: Any, rec: Recorder) -> None:
    original = getattr(callback, name)
    phase = "post" if name == "on_train_batch_end" else "pre"

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = now()
        try:
            return original(*args, **kwargs)
        finally:
            ended = now()
            rec.stalls.append((bench.step, phase, ended - started))
            if phase == "post":
                rec.request_at.setdefault(bench.step, started)
                rec.end[bench.step] = max(rec.end.get(bench.step, 0.0), ended)

    setattr(callback, name, timed)


# --- one run, end to end ---------------------------------------------------------------------------------------


def execute(spec: dict[str, Any]) -> dict[str, Any]:
    w = Workload(**spec["workload"])
    set_threads(w)
    warnings.filterwarnings("ignore")
    method = METHODS[spec["method"]]()
    out: dict[str, Any] = {"method": method.key, "repeat": spec["repeat"], "driver": method.driver,
                           "available": True}
    try:
        method.check()
    except Unavailable as e:
        return {**out, "available": False, "reason": str(e)}
    dirpath = spec["dirpath"]
    os.makedirs(dirpath, exist_ok=True)
    rec = Recorder(w)
    try:
        run = (run_trainer if method.driver == "trainer" else run_loop)(w, method, dirpath, rec)
        out.update(summarize(w, method, rec))
        out.update(check_and_restore(w, method, run, spec["reference"]))
        if spec.get("timeline"):
            out["timeline"] = timeline(method, rec)
        out["engine_files"] = engine_files()
    except Exception as e:  # noqa: BLE001 - a failing method is a result, not a crash of the benchmark
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(), verified=False)
    finally:
        shutil.rmtree(dirpath, ignore_errors=True)
    return out


def summarize(w: Workload, method: Method, rec: Recorder) -> dict[str, Any]:
    last = w.total_steps
    ckpts = rec.measured_checkpoints()
    durable = method.durable_seconds()
    if durable is None:
        stamps = method.durable_timestamps()
        durable = {s: stamps[s] - rec.request_at[s] for s in (w.every, *ckpts) if s in stamps and s in rec.request_at}
    durations = [rec.end[s] - rec.start[s] for s in range(w.first_measured_step, last + 1)]
    engine = getattr(getattr(method, "ckpt", None), "stats", None) or getattr(
        getattr(method, "callback", None), "stats", None) or (
        method.hook.checkpointer.stats if isinstance(method, LazyHook) else None)
    return {
        "n_checkpoints": len(ckpts) if method.kind != "baseline" else 0,
        "loop_s": rec.end[last] - rec.loop_start,
        "e2e_s": rec.finish_end - rec.loop_start,
        "drain_s": rec.finish_end - rec.end[last],
        "step_ms_median": 1e3 * median(durations),
        "step_s": durations,
        "quiet_step_s": quiet_step_durations(w, rec, durable),
        "stall_s": rec.stall_per_checkpoint(method.own_stalls()) if method.kind != "baseline" else [],
        "durable_s": [durable[s] for s in ckpts if s in durable],
        "peak_rss_bytes": rec.peak_rss,
        "peak_child_rss_bytes": rec.peak_child_rss,
        **first_checkpoint(w, rec, durable),
        "gc_training_thread_s": sum(s for name, _, s in rec.gc_pauses if name == "MainThread"),
        "gc_full_collections": sum(1 for _, gen, _ in rec.gc_pauses if gen == 2),
        "start_rss_bytes": rec.start_rss,
        "threads": torch.get_num_threads(),
        "engine_stats": [dataclasses.asdict(s) for s in engine if s.step in ckpts] if engine else None,
        "engine_warmup_stats": [dataclasses.asdict(s) for s in engine if s.step not in ckpts] if engine else None,
    }


def first_checkpoint(w: Workload, rec: Recorder, durable: dict[int, float]) -> dict[str, float | None]:
    """What the untimed warm-up checkpoint (step ``every``) cost: the training thread's time in its request and
    the wait before the next step, and its request-to-durable time (a method's first save may start threads or a
    writer process, so it is reported apart from the measured ones)."""
    stall = sum(s for step, phase, s in rec.stalls if (step, phase) in ((w.every, "post"), (w.every + 1, "pre")))
    return {"first_checkpoint_stall_s": stall if rec.stalls else None,
            "first_checkpoint_durable_s": durable.get(w.every)}


def quiet_step_durations(w: Workload, rec: Recorder, durable: dict[int, float],
                         saves: Callable[[int], bool] | None = None) -> list[float]:
    """Durations of the measured steps far from any checkpoint: a step that neither requests one nor follows a
    request, and starts after the previous checkpoint is durable (where the method reports when). A slow quiet
    step is a cost the method leaves behind between checkpoints (e.g. a thread that keeps competing for cores).
    The same steps of the no-checkpoint baseline are its yardstick. ``saves(step)`` tells the steps that save
    (default ``w.is_checkpoint``; a Hugging Face Trainer also saves at its last step)."""
    saves = saves or w.is_checkpoint
    out = []
    for step in range(w.first_measured_step, w.total_steps + 1):
        if saves(step) or saves(step - 1):
            continue
        previous = max(c for c in range(w.every, step) if saves(c))
        if previous in durable and previous in rec.request_at and \
                rec.request_at[previous] + durable[previous] > rec.start[step]:
            continue
        out.append(rec.end[step] - rec.start[step])
    return out


def check_and_restore(w: Workload, method: Method, run: Run, reference_path: str) -> dict[str, Any]:
    """The training state must match the reference run; the checkpoint of ``verified_step`` must match the
    reference state at that step, bit for bit. Restore is timed cold (page cache dropped first)."""
    reference = torch.load(reference_path, weights_only=True)
    out: dict[str, Any] = {}
    final = normalize(run.model.state_dict(), run.optimizer.state_dict()["state"])
    problem = compare(final, reference["final"])
    out["training_matches_reference"] = problem is None
    problems = [] if problem is None else [f"final training state: {problem}"]
    if method.kind != "baseline":
        path = method.path_for(w.verified_step)
        out["ckpt_bytes"] = tree_bytes(path)
        if hasattr(method, "prepare_load"):
            method.prepare_load()
        evict_from_page_cache(path)
        started = time.perf_counter()
        loaded = method.load(path)
        out["restore_s"] = time.perf_counter() - started
        problem = compare(method.normalize(loaded), reference["at_step"])
        out["checkpoint_matches"] = problem is None
        if problem is not None:
            problems.append(f"checkpoint of step {w.verified_step}: {problem}")
        out["raw_write_s"] = raw_write_seconds(run.dirpath, out["ckpt_bytes"])
    out["verified"] = not problems
    out["verify_problems"] = problems
    return out


def timeline(method: Method, rec: Recorder) -> dict[str, Any]:
    """Raw material for the timeline plot: step phases, and the engine's stats and storage events."""
    t0 = rec.loop_start
    return {
        "phases": {s: [t - t0 for t in p] for s, p in rec.phases.items() if p[0] >= t0},
        "requests": {s: t - t0 for s, t in rec.request_at.items() if t >= t0},
        "events": [(k, a - t0, b - t0, n, s) for k, a, b, n, s in getattr(getattr(method, "storage", None),
                                                                             "events", []) if a >= t0],
    }


def make_reference(w: Workload, path: str) -> None:
    """Train without checkpoints and store the state at ``verified_step`` and at the end (``torch.save``)."""
    set_threads(w)
    model = build_model(w)
    opt = make_optimizer(w, model.parameters())
    data = Batches(w)
    at_step = None
    for step in range(1, w.total_steps + 1):
        lm_loss(model, data[step - 1]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == w.verified_step:
            at_step = {k: v.clone() for k, v in normalize(model.state_dict(), opt.state_dict()["state"]).items()}
    final = normalize(model.state_dict(), opt.state_dict()["state"])
    torch.save({"at_step": at_step, "final": final}, path)


def execute_to_file(spec: dict[str, Any], log_path: str) -> None:
    """The body of one run's process: output goes to ``log_path``, the result to ``spec["out"]`` (JSON)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    result = execute(spec)
    with open(spec["out"], "w") as f:
        json.dump(result, f, default=_jsonable)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)


def _preload(names: str) -> None:
    """Import what the runs need once, in the fork server, so each run's process starts in well under a second
    instead of re-importing torch, Lightning and Accelerate. Nothing is computed here: no threads exist yet."""
    for name in filter(None, names.split(",")):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the run itself reports the method as unavailable
            pass


if os.environ.get(PRELOAD_ENV):
    _preload(os.environ[PRELOAD_ENV])

