"""The Hugging Face Trainer's own checkpoint against ``LazyCheckpointCallback``, on the same GPT-2, in one process.

A GPT-2 from ``GPT2Config`` (untied head, shaped by ``Workload``: ~19M parameters by default) on random tokens,
three runs per repeat, in rotation: no checkpoint (the baseline), the Trainer's own save (``save_steps=every``;
``_save_checkpoint`` is timed by a subclass and the checkpoint's files are fsynced before it returns, as
``compare.py`` fsyncs Lightning's and Accelerate's saves: none of them fsyncs), and ``LazyCheckpointCallback``
with the same ``TrainingArguments``. A first, untimed run without checkpoints warms the process up and keeps the
state at the steps verified. Every run's last two checkpoints (the one at ``verified_step``, followed by more
updates, and the Trainer's save at its last step) are read back with the method's own reader and compared bit
for bit with that state, and every run's final training state with the reference's.

Stall per save: for the Trainer the time inside ``_save_checkpoint`` (fsync included); for lazyckpt the session's
own stall (capture + request + the barrier in the next ``on_pre_optimizer_step``), and, beside it, all the time
the callback's hooks took per save (naming, the Trainer's files after each commit). docs/benchmarks.md ("Hugging
Face Trainer") explains the columns and holds the results.

Usage:
    python benchmarks/transformers_save.py                  # ~19M parameters, 3 repeats (torch's default threads)
    python benchmarks/transformers_save.py --threads 1
    python benchmarks/transformers_save.py --small          # a tiny model, 1 repeat: seconds
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import emit, log, run_facts, work_root  # noqa: E402
from report import cell, spread, target_row  # noqa: E402
from runner import Recorder, now, quiet_step_durations  # noqa: E402 - runner pins lazyckpt to this checkout
from workload import MiB, Workload, compare, fsync_tree, median, normalize, set_threads, tree_bytes  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)
from transformers.utils import logging as hf_logging  # noqa: E402

import lazyckpt  # noqa: E402
from lazyckpt import LazyCheckpointCallback  # noqa: E402

DEFAULT = {"params_m": 20.0, "batch": 4, "seq": 32, "every": 10, "checkpoints": 3, "repeats": 5}
SMALL = {"params_m": 0.3, "batch": 2, "seq": 16, "every": 3, "checkpoints": 1, "repeats": 1}
METHODS = {"none": "no checkpoint", "trainer_save": "Trainer's own save (_save_checkpoint + fsync)",
           "lazyckpt": "LazyCheckpointCallback"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="a tiny model, 1 repeat, few steps (seconds)")
    p.add_argument("--params-m", type=float, help="model size in millions of parameters (default 20)")
    p.add_argument("--batch", type=int, help="sequences per step (default 4)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 32)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own default here)")
    p.add_argument("--every", type=int, help="save_steps (default 10)")
    p.add_argument("--checkpoints", type=int, help="measured saves per run (default 3)")
    p.add_argument("--repeats", type=int, help="runs per method, in rotation (default 5)")
    p.add_argument("--save-total-limit", type=int, help="the TrainingArguments' save_total_limit of both saving "
                   "runs (default None, the Trainer's: every checkpoint kept; N: the oldest deleted as they go)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="checkpoints go in a fresh directory under it, removed at the end")
    p.add_argument("--json", help="write machine, config, per-method results and every run here")
    args = p.parse_args(argv)
    for name, value in (SMALL if args.small else DEFAULT).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.threads is None:
        args.threads = torch.get_num_threads()
    if min(args.every, args.checkpoints, args.repeats, args.threads) < 1:
        p.error("--every, --checkpoints, --repeats and --threads must be >= 1")
    return args


# --- the model, the data, the Trainer ----------------------------------------------------------------------------


def gpt2(w: Workload) -> GPT2LMHeadModel:
    torch.manual_seed(w.seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=w.vocab, n_positions=w.seq, n_embd=w.d_model, n_layer=w.layers,
                                      n_head=w.heads, tie_word_embeddings=False))


def tokens(w: Workload) -> list[dict[str, torch.Tensor]]:
    """Random tokens, one epoch of exactly ``total_steps`` batches (a GPT-2 shifts its labels itself)."""
    ids = torch.randint(w.vocab, (w.total_steps * w.batch, w.seq), generator=torch.Generator().manual_seed(w.seed + 1))
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(w: Workload, output_dir: str, *, save: bool, limit: int | None = None) -> TrainingArguments:
    return TrainingArguments(output_dir=output_dir, max_steps=w.total_steps, per_device_train_batch_size=w.batch,
                             save_strategy="steps" if save else "no", save_steps=w.every, save_total_limit=limit,
                             logging_strategy="no", learning_rate=w.lr, seed=w.seed, report_to=[], use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0)


def saves(w: Workload, step: int) -> bool:
    """The Trainer saves every ``save_steps`` and at its last step."""
    return step % w.every == 0 or step == w.total_steps


class TimedTrainer(Trainer):
    """The Trainer, its own save timed on the training thread: ``_save_checkpoint``, then an fsync of its files."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.save_s: dict[int, float] = {}

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        started = now()
        super()._save_checkpoint(model, trial)
        fsync_tree(os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}"))
        self.save_s[self.state.global_step] = now() - started


class Clock(TrainerCallback):
    """First in the callbacks: step boundaries (a step ends where the next begins, its save included), the
    reference state at the steps in ``capture``, and the lazy callback's session before ``on_train_end`` closes it."""

    def __init__(self, w: Workload, capture: tuple[int, ...] = (), lazy: LazyCheckpointCallback | None = None) -> None:
        self.w, self.rec, self.capture, self.lazy = w, Recorder(w), set(capture), lazy
        self.step = 0
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.hook_s: dict[int, float] = defaultdict(float)
        self.session: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        started = now()
        if self.step:
            self.rec.end[self.step] = started
        self.step = state.global_step + 1
        self.rec.start[self.step] = started
        if self.step == self.w.first_measured_step:
            self.rec.loop_start = started

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    **kwargs: Any) -> None:
        self.rec.request_at[state.global_step] = now()
        if state.global_step in self.capture:
            self.states[state.global_step] = live_state(model, optimizer, clone=True)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.rec.end[self.step] = now()  # one epoch: the end of the last step, after its save

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.lazy is not None:
            self.session = self.lazy.session


def time_hooks(callback: TrainerCallback, clock: Clock) -> None:
    """Add the time each of ``callback``'s hooks takes to the step it runs in (``on_train_end``'s drain is not a
    step's: it counts in the end-to-end time only)."""
    for name in dir(TrainerCallback):
        if not name.startswith("on_") or name == "on_train_end":
            continue

        def timed(*args: Any, _original: Any = getattr(callback, name), **kwargs: Any) -> Any:
            started = now()
            try:
                return _original(*args, **kwargs)
            finally:
                clock.hook_s[clock.step] += now() - started

        setattr(callback, name, timed)


def live_state(model: torch.nn.Module, optimizer: Any, *, clone: bool) -> dict[str, torch.Tensor]:
    state = normalize(model.state_dict(), optimizer.state_dict()["state"])
    return {k: v.detach().clone() for k, v in state.items()} if clone else state


# --- one run ---------------------------------------------------------------------------------------------------


def run_one(key: str, w: Workload, root: str, repeat: int, reference: dict | None,
            limit: int | None = None) -> dict[str, Any]:
    """One training run of method ``key``; without ``reference`` it is the untimed reference run itself."""
    output_dir = os.path.join(root, f"{key}-r{repeat}")
    lazy = LazyCheckpointCallback(fsync=True) if key == "lazyckpt" else None
    clock = Clock(w, capture=() if reference else (w.verified_step,), lazy=lazy)
    if lazy is not None:
        time_hooks(lazy, clock)
    trainer = TimedTrainer(model=gpt2(w), args=arguments(w, output_dir, save=key != "none", limit=limit),
                           train_dataset=tokens(w), callbacks=[clock] + ([lazy] if lazy else []))
    trainer.remove_callback(PrinterCallback)  # the run's summary dict on stdout
    started = now()
    trainer.train()
    clock.rec.finish_end = now()  # after the lazy callback's on_train_end: its last write is done
    e2e = clock.rec.finish_end - started
    final = live_state(trainer.model, trainer.optimizer, clone=reference is None)
    try:
        if reference is None:
            return {"at_step": clock.states[w.verified_step], "final": final}
        out = {"method": key, "repeat": repeat, "e2e_s": e2e, "loadavg": os.getloadavg(),
               **summarize(key, w, clock, trainer)}
        out.update(verify(key, w, output_dir, final, reference, trainer))
        return out
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)


def summarize(key: str, w: Workload, clock: Clock, trainer: TimedTrainer) -> dict[str, Any]:
    rec = clock.rec
    measured = rec.measured_checkpoints()  # every * 2 .. verified_step: each followed by a step
    stall: dict[int, float] = {"trainer_save": trainer.save_s, "none": {}}.get(key) or {}
    durable: dict[int, float] = {}
    if key == "lazyckpt":
        stall = clock.session.stalls
        durable = {s.step: s.flush_s for s in clock.session.engine.stats}
    steps = range(w.first_measured_step, w.total_steps + 1)
    # the callback's hooks from the step after the warm-up save's barrier to the last measured save's barrier
    callback = [clock.hook_s[s] for s in range(w.first_measured_step + 1, w.verified_step + 2)]
    return {"loop_s": rec.end[w.total_steps] - rec.loop_start, "drain_s": rec.finish_end - rec.end[w.total_steps],
            "measured_s": rec.finish_end - rec.loop_start, "saves": sum(saves(w, s) for s in steps),
            "step_s": [rec.end[s] - rec.start[s] for s in steps],
            "after_save_s": [rec.end[s + 1] - rec.start[s + 1] for s in measured],
            "quiet_step_s": quiet_step_durations(w, rec, durable, lambda s: saves(w, s)),
            "stall_s": [stall[s] for s in measured if s in stall], "first_stall_s": stall.get(w.every),
            "last_stall_s": stall.get(w.total_steps), "durable_s": [durable[s] for s in measured if s in durable],
            "callback_s_per_save": sum(callback) / len(measured) if key == "lazyckpt" else None,
            "threads": torch.get_num_threads()}


def verify(key: str, w: Workload, output_dir: str, final: dict, reference: dict,
           trainer: TimedTrainer) -> dict[str, Any]:
    """Training must match the reference; the checkpoints of ``verified_step`` and of the last step, read back
    through their ``checkpoint-N`` names with the method's own reader, must equal the state at those steps."""
    problems = [] if (p := compare(final, reference["final"])) is None else [f"final training state: {p}"]
    out: dict[str, Any] = {}
    if key == "lazyckpt" and trainer.save_s:
        problems.append(f"the Trainer's own save ran at steps {sorted(trainer.save_s)}")
    if key == "trainer_save" and sorted(trainer.save_s) != [s for s in range(1, w.total_steps + 1) if saves(w, s)]:
        problems.append(f"the Trainer saved at steps {sorted(trainer.save_s)}")
    if key != "none":
        read = read_trainer_checkpoint if key == "trainer_save" else read_lazy_checkpoint
        for step, expected in ((w.verified_step, reference["at_step"]), (w.total_steps, reference["final"])):
            path = os.path.join(output_dir, f"checkpoint-{step}")
            out["ckpt_bytes"] = tree_bytes(path)
            if (p := compare(read(path), expected)) is not None:
                problems.append(f"checkpoint-{step}: {p}")
    return {**out, "verified": not problems, "verify_problems": problems}


def read_trainer_checkpoint(path: str) -> dict[str, torch.Tensor]:
    optimizer = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=True)
    return normalize(load_file(os.path.join(path, "model.safetensors")), optimizer["state"])


def read_lazy_checkpoint(path: str) -> dict[str, torch.Tensor]:
    tree = lazyckpt.load(path)  # every chunk checked against its checksum
    trainer = tree["lazyckpt.trainer"]
    return normalize({k: tree[k] for k in trainer["model_keys"]}, trainer["optimizer"]["state"])


# --- medians, ratios, the table ----------------------------------------------------------------------------------


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per method: medians (min–max) over the repeats of each run's value, and of its ratio to (or
    difference from) the run of the same repeat it is compared with (the baseline's; for the stall ratio the
    Trainer's own save's over lazyckpt's): the runs of one repeat follow each other, so they share the machine's
    load more than runs far apart."""
    by = {key: [r for r in runs if r["method"] == key] for key in METHODS}
    base = {r["repeat"]: r for r in by["none"]}

    def paired(mine: list[dict], fn: Any, against: dict[int, dict] = base) -> dict[str, float] | None:
        return spread([fn(r, b) for r in mine if (b := against.get(r["repeat"])) is not None])  # None: left out

    def ratio(name: str) -> Any:
        return lambda r, b: median(r[name]) / median(b[name]) if r[name] and b[name] else None

    entries = []
    for key, label in METHODS.items():
        mine = by[key]
        entry: dict[str, Any] = {
            "key": key, "name": label, "kind": {"none": "baseline", "lazyckpt": "lazyckpt"}.get(key, "peer"),
            "verified": bool(mine) and all(r["verified"] for r in mine), "repeats": len(mine),
            "verify_problems": [f"repeat {r['repeat']}: {p}" for r in mine for p in r["verify_problems"]],
            "step_ms": spread([1e3 * median(r["step_s"]) for r in mine]),
            "quiet_step_ms": spread([1e3 * median(r["quiet_step_s"]) for r in mine if r["quiet_step_s"]]),
            "quiet_step_x": paired(mine, ratio("quiet_step_s")), "after_save_x": paired(mine, ratio("after_save_s")),
            "e2e_s": spread([r["e2e_s"] for r in mine]), "e2e_x": paired(mine, lambda r, b: r["e2e_s"] / b["e2e_s"]),
            "drain_s": spread([r["drain_s"] for r in mine])}
        if key != "none":
            entry.update(stall_ms=spread([1e3 * median(r["stall_s"]) for r in mine if r["stall_s"]]),
                         first_save_ms=spread([1e3 * r["first_stall_s"] for r in mine if r["first_stall_s"]]),
                         callback_ms=spread([1e3 * r["callback_s_per_save"] for r in mine
                                             if r["callback_s_per_save"] is not None]),
                         overhead_ms=paired(mine, lambda r, b: 1e3 * (r["measured_s"] - b["measured_s"]) / r["saves"]),
                         durable_s=spread([median(r["durable_s"]) for r in mine if r["durable_s"]]),
                         ckpt_mb=spread([r["ckpt_bytes"] / MiB for r in mine if r.get("ckpt_bytes")]))
            # run-to-run noise of the yardstick: half the spread of the baseline's times, per save
            measured = [b["measured_s"] for b in by["none"]]
            entry["baseline_noise_ms"] = 1e3 * (max(measured) - min(measured)) / 2 / mine[0]["saves"] if mine else None
        entries.append(entry)
    entries[-1]["stall_ratio"] = paired(by["lazyckpt"], lambda z, t: median(t["stall_s"]) / median(z["stall_s"])
                                        if t["stall_s"] and z["stall_s"] else None,
                                        against={r["repeat"]: r for r in by["trainer_save"]})
    return entries


def targets(entries: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    def value(key: str, name: str) -> float | None:
        found = next(e for e in entries if e["key"] == key).get(name)
        return found["median"] if found else None

    trainer = value("trainer_save", "stall_ms")
    limit = None if trainer is None else trainer / 20
    return {"lazyckpt": [
        target_row("stall <= 1/20 of the Trainer's own save", value("lazyckpt", "stall_ms"), limit),
        target_row("the callback's time per save <= 1/20 of the Trainer's own save", value("lazyckpt", "callback_ms"),
                   limit),
        target_row("quiet step <= 1.05x no checkpoint", value("lazyckpt", "quiet_step_x"), 1.05),
        target_row("overhead per save below the Trainer's own save's", value("lazyckpt", "overhead_ms"),
                   value("trainer_save", "overhead_ms"), strict=True,
                   noise=next(e for e in entries if e["key"] == "lazyckpt").get("baseline_noise_ms"))]}


def markdown_table(entries: list[dict[str, Any]]) -> str:
    head = ["method", "verified", "stall ms/save", "first save ms", "callback ms/save", "overhead ms/save", "step ms",
            "quiet step ms", "quiet step / baseline", "step after a save / baseline", "end-to-end s",
            "end-to-end / baseline", "after the last step s", "time to durable s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        verified = "**FAIL**" if not e["verified"] else "n/a (training matches)" if e["kind"] == "baseline" else "yes"
        row = [e["name"], verified, cell(e, "stall_ms", ".1f"), cell(e, "first_save_ms", ".0f"),
               cell(e, "callback_ms", ".1f"), cell(e, "overhead_ms", ".0f"), cell(e, "step_ms", ".0f"),
               cell(e, "quiet_step_ms", ".0f"), cell(e, "quiet_step_x", ".3f"), cell(e, "after_save_x", ".2f"),
               cell(e, "e2e_s", ".2f"), cell(e, "e2e_x", ".3f"),
               cell(e, "drain_s", ".2f"), cell(e, "durable_s", ".2f")]
        lines.append("| " + " | ".join(row) + " |")
    lazy = entries[-1]
    if lazy.get("stall_ratio"):
        lines.append(f"\nStall ratio, the Trainer's own save / lazyckpt (each repeat's pair): "
                     f"{cell(lazy, 'stall_ratio', '.0f')}x")
    return "\n".join(lines)


# --- the benchmark ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    w = Workload(params_m=args.params_m, batch=args.batch, seq=args.seq, threads=args.threads, every=args.every,
                 checkpoints=args.checkpoints, seed=args.seed)
    set_threads(w)
    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
    hf_logging.set_verbosity_error()
    root = work_root(args, "lazyckpt-hf-bench-")
    started = time.monotonic()
    try:
        return benchmark(args, w, root, started)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def benchmark(args: argparse.Namespace, w: Workload, root: str, started: float) -> int:
    from compare import machine_info

    n_params = sum(p.numel() for p in gpt2(w).parameters())
    log(f"GPT-2: {n_params / 1e6:.1f}M parameters, {w.layers} layers, d={w.d_model}, vocab {w.vocab}; "
        f"{w.total_steps} steps, save_steps={w.every}, {w.checkpoints} measured saves; {args.repeats} repeat(s), "
        f"torch threads {w.threads}; work dir {root}")
    machine = machine_info(root, max(12 * n_params, 64 * MiB))  # ~12 bytes a parameter with AdamW
    reference = run_one("none", w, root, -1, None)  # untimed: warms the process up, keeps the states verified
    keys, runs = list(METHODS), []
    for repeat in range(args.repeats):
        for key in keys[repeat % len(keys):] + keys[:repeat % len(keys)]:
            result = run_one(key, w, root, repeat, reference, args.save_total_limit)
            runs.append(result)
            status = "verified" if result["verified"] else "FAIL " + "; ".join(result["verify_problems"])
            stall = f", stall {1e3 * median(result['stall_s']):.1f} ms" if result["stall_s"] else ""
            log(f"[repeat {repeat + 1}/{args.repeats}] {key:13s} {result['e2e_s']:6.1f} s{stall}  {status}  "
                f"(load {result['loadavg'][0]:.1f})")
    entries = aggregate(runs)
    config = {**w.describe(), "model": "GPT2LMHeadModel (GPT2Config, untied head)", "parameters": n_params,
              "transformers": transformers.__version__,
              "optim": arguments(w, root, save=False).optim, "save_total_limit": args.save_total_limit,
              "repeats": args.repeats, "threads": w.threads,
              "small": args.small, **run_facts(started, "transformers_save.py")}
    emit(args, f"GPT-2 {n_params / 1e6:.1f}M parameters, save_steps={w.every}, save_total_limit="
         f"{args.save_total_limit}, torch threads {w.threads}; medians "
         f"(min–max) over {args.repeats} repeat(s)", markdown_table(entries), targets(entries), entries,
         {"machine": machine, "config": config, "methods": entries, "targets": targets(entries), "runs": runs})
    log(f"total {time.monotonic() - started:.0f}s")
    return 0 if all(e["verified"] for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
