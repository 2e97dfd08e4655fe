"""Turning the per-run results into per-method metrics, the targets check, the markdown table and the plots."""

from __future__ import annotations

import math
import os
from typing import Any

from workload import MiB, median

TARGETS = "the stall, durability and memory targets"


def spread(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return None
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


def aggregate(methods: list[Any], runs: list[dict[str, Any]], state_bytes: int,
              baseline_for: dict[str, str]) -> list[dict[str, Any]]:
    """One entry per method: medians with min-max over repeats. Overheads and extra memory are against the
    median of the same driver's no-checkpoint runs (plain loop, Trainer or Accelerate)."""
    by_key: dict[str, list[dict]] = {}
    for r in runs:
        by_key.setdefault(r["method"], []).append(r)
    base: dict[str, dict[str, float]] = {}
    for driver, key in baseline_for.items():
        ok = [r for r in by_key.get(key, []) if r.get("available") and "error" not in r]
        if ok:
            loops = [r["loop_s"] for r in ok]
            base[driver] = {"loop_s": median(loops), "e2e_s": median([r["e2e_s"] for r in ok]),
                            "peak_rss_bytes": median([r["peak_rss_bytes"] for r in ok]),
                            "loop_half_range_s": (max(loops) - min(loops)) / 2,
                            "quiet_step_s": median([q for r in ok if (q := _quiet(r)) is not None] or [math.nan])}
    out = []
    for method in methods:
        mine = by_key.get(method.key, [])
        entry: dict[str, Any] = {"name": method.label, "key": method.key, "kind": method.kind,
                                 "driver": method.driver, "baseline": baseline_for[method.driver]}
        unavailable = [r for r in mine if not r.get("available")]
        if not mine or unavailable:
            reason = unavailable[0]["reason"] if unavailable else "not run"
            out.append({**entry, "available": False, "verified": False, "unavailable": reason})
            continue
        good = [r for r in mine if "error" not in r]
        errors = [f"repeat {r['repeat']}: {r['error']}" for r in mine if "error" in r]
        problems = [p for r in good for p in r.get("verify_problems", [])]
        entry.update(available=True, verified=bool(good) and not errors and all(r["verified"] for r in good),
                     repeats=len(mine), errors=errors, verify_problems=problems)
        b = base.get(method.driver)
        entry["step_ms"] = spread([r["step_ms_median"] for r in good])
        entry["quiet_step_ms"] = spread([1e3 * q for r in good if (q := _quiet(r)) is not None])
        if b is not None and not math.isnan(b["quiet_step_s"]):
            entry["quiet_step_x"] = spread([q / b["quiet_step_s"] for r in good if (q := _quiet(r)) is not None])
        entry["loop_s"] = spread([r["loop_s"] for r in good])
        entry["drain_s"] = spread([r["drain_s"] for r in good])
        entry["peak_rss_mb"] = spread([r["peak_rss_bytes"] / MiB for r in good])
        entry["gc_training_thread_ms"] = spread([1e3 * r["gc_training_thread_s"] for r in good
                                                 if "gc_training_thread_s" in r])
        entry["gc_full_collections"] = spread([r["gc_full_collections"] for r in good if "gc_full_collections" in r])
        if method.kind == "baseline":
            out.append(entry)
            continue
        entry["stall_ms"] = spread([1e3 * sum(r["stall_s"]) / len(r["stall_s"]) for r in good if r["stall_s"]])
        entry["stall_max_ms"] = spread([1e3 * max(r["stall_s"]) for r in good if r["stall_s"]])
        entry["time_to_durable_s"] = spread([median(r["durable_s"]) for r in good if r["durable_s"]])
        entry["raw_write_s"] = spread([r.get("raw_write_s") for r in good])
        entry["restore_s"] = spread([r.get("restore_s") for r in good])
        entry["ckpt_mb"] = spread([r["ckpt_bytes"] / MiB for r in good if r.get("ckpt_bytes")])
        entry["child_rss_mb"] = spread([r.get("peak_child_rss_bytes", 0) / MiB for r in good])
        entry["first_checkpoint_stall_s"] = spread([r.get("first_checkpoint_stall_s") for r in good])
        entry["first_checkpoint_durable_s"] = spread([r.get("first_checkpoint_durable_s") for r in good])
        engine = [r for r in good if r.get("engine_stats")]
        if engine:  # where lazyckpt's stall and latency go, from the engine's own CheckpointStats
            def mean_of(run: dict, name: str) -> float:
                return sum(s[name] for s in run["engine_stats"]) / len(run["engine_stats"])

            entry["engine_save_ms"] = spread([1e3 * mean_of(r, "save_s") for r in engine])
            entry["engine_wait_ms"] = spread([1e3 * mean_of(r, "wait_s") for r in engine])
            entry["engine_copy_s"] = spread([mean_of(r, "copy_s") for r in engine])
            entry["first_checkpoint_stall_ms"] = spread([1e3 * (s["save_s"] + s["wait_s"]) for r in engine
                                                         for s in r.get("engine_warmup_stats") or []])
        if b is not None:
            entry["in_loop_overhead_ms"] = spread([1e3 * (r["loop_s"] - b["loop_s"]) / r["n_checkpoints"]
                                                   for r in good])
            # Run-to-run noise of the yardstick: half the spread of the baseline's loop times, per checkpoint.
            if good:
                entry["baseline_noise_ms"] = 1e3 * b["loop_half_range_s"] / good[0]["n_checkpoints"]
            entry["e2e_slowdown_pct"] = spread([100 * (r["e2e_s"] / b["e2e_s"] - 1) for r in good])
            # Every run forks from the same server image, so absolute peaks of one driver compare directly; the
            # peak of a no-checkpoint run already holds the model, the optimizer state and the activations.
            extra = [(r["peak_rss_bytes"] - b["peak_rss_bytes"]) for r in good]
            entry["extra_rss_mb"] = spread([e / MiB for e in extra])
            entry["extra_rss_x_state"] = spread([e / state_bytes for e in extra])
        out.append(entry)
    return out


def _quiet(run: dict[str, Any]) -> float | None:
    """A run's median quiet step (see ``runner.quiet_step_durations``); None when it had none."""
    steps = run.get("quiet_step_s")
    return median(steps) if steps else None


def metric(entry: dict | None, name: str) -> float | None:
    value = (entry or {}).get(name)
    return value["median"] if isinstance(value, dict) else None


def check_targets(entries: list[dict[str, Any]], state_bytes: int) -> dict[str, list[dict[str, Any]]]:
    """The stall, durability and memory targets for every lazyckpt method (medians; a target whose yardstick is missing is
    reported with ``met: null``)."""
    by_key = {e["key"]: e for e in entries if e.get("available") and e.get("verified")}
    peers = [e for e in by_key.values() if e["kind"] == "peer"]
    out = {}
    for e in entries:
        if e["kind"] != "lazyckpt" or not e.get("available"):
            continue
        stall, loop, durable = metric(e, "stall_ms"), metric(e, "in_loop_overhead_ms"), metric(e, "time_to_durable_s")
        raw = by_key.get("raw")
        best = min((p for p in peers if metric(p, "in_loop_overhead_ms") is not None),
                   key=lambda p: metric(p, "in_loop_overhead_ms"), default=None)
        rows = [
            target_row("stall <= 1/20 of torch.save's", stall, _div(metric(by_key.get("torch_save"), "stall_ms"), 20)),
            target_row("stall <= 1/3 of DCP + DefaultStager's", stall,
                    _div(metric(by_key.get("dcp_stager"), "stall_ms"), 3)),
            target_row("in-loop overhead <= 1.25x the raw floor's", loop, scaled(metric(raw, "in_loop_overhead_ms"), 1.25),
                    noise=_noise(e, raw)),
            target_row("in-loop overhead below every peer's", loop, metric(best, "in_loop_overhead_ms"), strict=True,
                    noise=_noise(e, best)),
            target_row("time to durable <= 1.3x the raw write of the same bytes", durable,
                    scaled(metric(e, "raw_write_s"), 1.3)),
            target_row("time to durable <= 1.3x the O_DIRECT floor's", durable,
                    scaled(metric(by_key.get("raw_direct"), "time_to_durable_s"), 1.3)),
            target_row("peak extra RSS <= 1.2x the state", metric(e, "extra_rss_mb"), 1.2 * state_bytes / MiB),
            target_row("quiet step <= 1.03x the no-checkpoint loop's", metric(e, "quiet_step_x"), 1.03),
        ]
        out[e["key"]] = rows + against_torch_checkpointing(e, by_key.get("torch_checkpointing"))
    return out


def against_torch_checkpointing(e: dict[str, Any], peer: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The targets against torch-checkpointing, when it ran and verified (issue 28)."""
    if peer is None or e["driver"] != peer["driver"]:
        return []
    return [
        target_row("stall <= 1/3 of torch-checkpointing's", metric(e, "stall_ms"), _div(metric(peer, "stall_ms"), 3)),
        target_row("in-loop overhead below torch-checkpointing's", metric(e, "in_loop_overhead_ms"),
                   metric(peer, "in_loop_overhead_ms"), strict=True, noise=_noise(e, peer)),
        target_row("time to durable below torch-checkpointing's", metric(e, "time_to_durable_s"),
                   metric(peer, "time_to_durable_s"), strict=True),
        target_row("peak extra RSS <= torch-checkpointing's", metric(e, "extra_rss_mb"), metric(peer, "extra_rss_mb")),
    ]


def first_checkpoints_line(entries: list[dict[str, Any]]) -> str | None:
    """One line with every method's untimed warm-up checkpoint: its stall and its time to durable."""
    parts = []
    for e in entries:
        stall, durable = metric(e, "first_checkpoint_stall_s"), metric(e, "first_checkpoint_durable_s")
        if e.get("available") and e["kind"] != "baseline" and stall is not None:
            parts.append(f"{e['key']} {stall:.2f} s" + (f" (durable {durable:.2f} s)" if durable is not None else ""))
    return "first checkpoint (untimed warm-up), stall: " + ", ".join(parts) if parts else None


def _noise(a: dict | None, b: dict | None) -> float | None:
    """How far apart two in-loop overheads must be to tell them apart: the sum of their baselines' noise."""
    if not a or not b or a.get("baseline_noise_ms") is None or b.get("baseline_noise_ms") is None:
        return None
    return a["baseline_noise_ms"] + b["baseline_noise_ms"]


def _div(value: float | None, by: float) -> float | None:
    return None if value is None else value / by


def scaled(value: float | None, by: float) -> float | None:
    return None if value is None else value * by


def target_row(name: str, value: float | None, limit: float | None, strict: bool = False,
            noise: float | None = None) -> dict[str, Any]:
    """``met`` is None when a yardstick is missing, or when value and limit differ by less than the run-to-run
    noise of the baseline (then the measurement cannot tell)."""
    met = None if value is None or limit is None else (value < limit if strict else value <= limit)
    row = {"target": name, "value": value, "limit": limit, "met": met}
    if noise is not None and met is not None:
        row["noise"] = noise
        if abs(value - limit) < noise:
            row["met"] = None
    return row


# --- the markdown table ----------------------------------------------------------------------------------------


def cell(entry: dict, name: str, fmt: str, scale: float = 1.0) -> str:
    value = entry.get(name)
    if not isinstance(value, dict):
        return "–"
    text = format(value["median"] * scale, fmt)
    if value["n"] > 1:
        text += f" ({format(value['min'] * scale, fmt)}–{format(value['max'] * scale, fmt)})"
    return text


def markdown_table(entries: list[dict[str, Any]]) -> str:
    head = ["method", "verified", "stall ms/ckpt", "in-loop overhead ms/ckpt", "end-to-end slowdown %",
            "time to durable s", "raw write+fsync s", "peak extra RSS MB", "extra RSS / state", "restore s",
            "step ms", "quiet step ms", "quiet step / baseline"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        if not e.get("available"):
            lines.append(f"| {e['name']} | unavailable: {e['unavailable']} |" + " |" * (len(head) - 2))
            continue
        verified = "n/a (baseline, training matches)" if e["kind"] == "baseline" and e["verified"] else \
            "yes" if e["verified"] else "**FAIL**"
        if e["kind"] == "baseline" and not e["verified"]:
            verified = "**FAIL**"
        row = [e["name"], verified, cell(e, "stall_ms", ".1f"), cell(e, "in_loop_overhead_ms", ".0f"),
               cell(e, "e2e_slowdown_pct", "+.1f"), cell(e, "time_to_durable_s", ".2f"),
               cell(e, "raw_write_s", ".2f"), cell(e, "extra_rss_mb", ".0f"), cell(e, "extra_rss_x_state", ".2f"),
               cell(e, "restore_s", ".2f"), cell(e, "step_ms", ".0f"), cell(e, "quiet_step_ms", ".0f"),
               cell(e, "quiet_step_x", ".3f")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def targets_table(targets: dict[str, list[dict[str, Any]]], entries: list[dict[str, Any]]) -> str:
    names = {e["key"]: e["name"] for e in entries}
    lines = ["| lazyckpt method | target | value | limit | met |", "|---|---|---|---|---|"]
    for key, rows in targets.items():
        for row in rows:
            value = "–" if row["value"] is None else f"{row['value']:.3g}"
            limit = "–" if row["limit"] is None else f"{row['limit']:.3g}"
            met = {True: "yes", False: "**no**", None: "n/a"}[row["met"]]
            if row["met"] is None and row.get("noise") is not None:
                met = f"within noise (±{row['noise']:.0f})"
            lines.append(f"| {names[key]} | {row['target']} | {value} | {limit} | {met} |")
    return "\n".join(lines)


# --- plots -----------------------------------------------------------------------------------------------------


def plot_stalls(entries: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [e for e in entries if e.get("available") and e["kind"] != "baseline" and e.get("stall_ms")]
    colors = {"lazyckpt": "tab:green", "floor": "tab:gray", "peer": "tab:blue", "diagnostic": "tab:olive"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(shown) + 1.6), sharey=True)
    ys = list(range(len(shown)))[::-1]
    for ax, name, title, log in ((axes[0], "stall_ms", "training stall per checkpoint (ms, log scale)", True),
                                 (axes[1], "in_loop_overhead_ms", "in-loop overhead per checkpoint (ms)", False)):
        for y, e in zip(ys, shown, strict=True):
            v = e.get(name)
            if not v:
                continue
            value = max(v["median"], 1e-2) if log else v["median"]
            err = [[value - (max(v["min"], 1e-2) if log else v["min"])], [v["max"] - value]]
            ax.barh(y, value, xerr=err, color=colors[e["kind"]], alpha=0.85 if e["verified"] else 0.3,
                    capsize=3)
            label = f"{v['median']:.1f}" if abs(v["median"]) < 10 else f"{v['median']:.0f}"
            ax.text(max(value, v["max"]), y, "  " + label + ("" if e["verified"] else "  FAIL"), va="center",
                    fontsize=8)
        if log:
            ax.set_xscale("log")
        ax.set_title(title, fontsize=10)
        ax.axvline(0, color="black", lw=0.5)
    axes[0].set_yticks(ys, [e["name"] for e in shown], fontsize=8)
    fig.suptitle("Checkpoint cost to the training loop, per method (median, min–max over repeats)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timeline(run: dict[str, Any], base_step_ms: float | None, path: str) -> None:
    """One lazyckpt checkpoint's life (request, copy, writes, fsync, commit) against the training steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl, stats = run["timeline"], {s["step"]: s for s in run["engine_stats"]}
    phases = {int(s): p for s, p in tl["phases"].items()}
    requests = {int(s): t for s, t in tl["requests"].items() if int(s) in stats}
    ckpts = sorted(requests)
    step = ckpts[len(ckpts) // 2]
    st, t_req = stats[step], requests[step]
    # CheckpointStats count from the job's creation inside save() (after waiting for the previous checkpoint);
    # anchor them on the commit (the rename) the storage recorded, which ends the job's flush_s.
    renames = [b for kind, _a, b, _n, s in tl["events"] if kind == "rename" and s == step]
    t_commit = renames[0] if renames else t_req + st["save_s"] + st["flush_s"]
    t_job = t_commit - st["flush_s"]
    step_s = (base_step_ms or 300) / 1e3
    lo, hi = t_req - 0.6 * step_s, t_commit + 1.2 * step_s
    fig, ax = plt.subplots(figsize=(13, 3.6))
    colors = {"compute": "#9ecae1", "wait": "tab:red", "opt": "#636363", "save": "tab:orange"}
    for s, (t0, t1, t2, t3, t4) in sorted(phases.items()):
        if t4 < lo or t0 > hi:
            continue
        for a, b, kind in ((t0, t1, "compute"), (t1, t2, "wait"), (t2, t3, "opt"), (t3, t4, "save")):
            if b > a:
                ax.barh(3, b - a, left=a, height=0.6, color=colors[kind], edgecolor="none")
        ax.text((t0 + t4) / 2, 3.42, f"step {s}\n{1e3 * (t4 - t0):.0f} ms", ha="center", fontsize=7)
    ax.barh(2, st["copy_s"], left=t_job, height=0.5, color="tab:green")
    for kind, a, b, _n, _s in tl["events"]:
        if lo <= a <= hi:  # work of the previous checkpoint (before this job existed) is drawn faded
            color = {"write": "tab:blue", "fsync": "tab:purple", "manifest": "black", "rename": "black"}[kind]
            ax.barh(1, max(b - a, 1e-3), left=a, height=0.5, color=color, alpha=1.0 if a >= t_job else 0.3)
    ax.axvline(t_req, color="tab:orange", ls="--", lw=1)
    ax.axvline(t_commit, color="black", ls="--", lw=1)
    ax.text(t_req, 0.25, f" request (step {step})", fontsize=8, color="tab:orange")
    ax.text(t_commit, 0.25, f" committed, {t_commit - t_req:.2f} s after the request", fontsize=8)
    ax.set_yticks([1, 2, 3], ["writer: write / fsync / commit", "copier: staging copy", "training thread"],
                  fontsize=8)
    ax.set_xlim(lo, hi)
    ax.set_ylim(0, 4.1)
    ax.set_xlabel("seconds since the measured loop started")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in
               (colors["compute"], colors["opt"], colors["save"], colors["wait"], "tab:green", "tab:blue",
                "tab:purple", "black")]
    ax.legend(handles, ["forward+backward", "optimizer.step", "save() request", "wait_staged() stall",
                        "copy to host buffers", "write", "fsync", "manifest + rename"], fontsize=7, ncol=8,
              loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    base = f"; no-checkpoint step ≈ {base_step_ms:.0f} ms" if base_step_ms else ""
    ax.set_title(f"lazyckpt: one checkpoint of {st['nbytes'] / MiB:.0f} MiB against the training steps{base}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(entries: list[dict[str, Any]], runs: list[dict[str, Any]], directory: str) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    written = []
    stalls = os.path.join(directory, "stall_per_method.png")
    plot_stalls(entries, stalls)
    written.append(stalls)
    base = next((e for e in entries if e["key"] == "none" and e.get("step_ms")), None)
    for key in sorted({r["method"] for r in runs if r.get("timeline") and r.get("engine_stats")}):
        lazy = sorted((r for r in runs if r["method"] == key and r.get("timeline") and r.get("engine_stats")),
                      key=lambda r: r["loop_s"])
        path = os.path.join(directory, f"{key}_timeline.png")
        plot_timeline(lazy[len(lazy) // 2], base["step_ms"]["median"] if base else None, path)
        written.append(path)
    return written
