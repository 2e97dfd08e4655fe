"""DeepSpeed's own checkpoint engine against ``LazyCheckpointEngine``, ZeRO 1 and 3, on 2 gloo processes (CPU).

Each (stage, method, repeat) runs in two fresh processes (forked, one per rank) that build the same DeepSpeed engine
(``benchmarks/workload.py``'s decoder, AdamW as a client optimizer) and train ``--steps`` steps, saving with
``engine.save_checkpoint(dir)`` every ``--every`` steps. Methods:

* ``none``: no checkpoint (the baseline of the end-to-end slowdown);
* ``torch``: DeepSpeed's default ``TorchCheckpointEngine`` (``torch.save`` per file; its files are fsynced before
  ``save_checkpoint`` returns, counted in its stall: DeepSpeed does not fsync);
* ``lazy``: ``use_lazy_checkpoints(engine)``.

Stall per checkpoint (rank 0, median): ``torch``: the time inside ``save_checkpoint`` plus its fsync; ``lazy``: the
time inside ``save_checkpoint`` (DeepSpeed's own state dicts and barriers included) plus the barrier it caused in
the next step (``LazyCheckpointEngine.stats``' ``wait_s``). Time to durable:
``torch``: the same; ``lazy``: request to commit (the engine's stats). The last checkpoint's optimizer file of rank
0 is read back with the method's own ``load`` and compared bit for bit with the state at its step.
DeepSpeed's ``FastCheckpointEngine``/``DecoupledCheckpointEngine`` need its async-I/O op (libaio, a compiler) and
the DataStates engine its own package: not run here. docs/benchmarks.md ("DeepSpeed") holds the results.

Usage:
    python benchmarks/deepspeed_save.py                 # ZeRO 1 and 3, 2 ranks, 3 repeats, ~10 min
    python benchmarks/deepspeed_save.py --small         # a tiny model, 1 repeat: a minute
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import free_port, log  # noqa: E402
from runner import now  # noqa: E402 - runner pins lazyckpt to this checkout
from workload import Workload, build_model, fsync_tree, lm_loss  # noqa: E402

import torch  # noqa: E402

METHODS = ("none", "torch", "lazy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-m", type=float, default=12.0, help="model size in millions of parameters")
    parser.add_argument("--stages", default="1,3")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (2 ranks share the cores)")
    parser.add_argument("--small", action="store_true", help="a tiny model, 1 repeat")
    parser.add_argument("--json", help="write every run's figures here")
    args = parser.parse_args(argv)
    if args.small:
        args.params_m, args.repeats, args.steps = 0.3, 1, 12
    return args


def build_engine(args: argparse.Namespace, stage: int, rank: int):
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2")
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # a JIT-built op gloo does without
    deepspeed.init_distributed(dist_backend="gloo")
    w = Workload(params_m=args.params_m, threads=args.threads)
    model = build_model(w)
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr)
    config = {"train_micro_batch_size_per_gpu": w.batch, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine, w


def run_rank(rank: int, port: int, args: argparse.Namespace, stage: int, method: str, root: str, out: str) -> None:
    torch.set_num_threads(args.threads)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    engine, w = build_engine(args, stage, rank)
    lazy = None
    if method == "lazy":
        from lazyckpt.integrations.deepspeed import use_lazy_checkpoints

        lazy = use_lazy_checkpoints(engine)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(w.vocab, (w.batch, w.seq + 1), generator=gen)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    saves, reference, started = {}, None, None
    for step in range(1, args.steps + 1):
        if step == 2:
            started = now()  # the first step builds buffers: not counted
        loss = lm_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        if method != "none" and step % args.every == 0:
            if step == args.steps // args.every * args.every:
                reference = {k: v.clone() for k, v in _optimizer_tensors(engine.optimizer.state_dict()).items()}
            saves[step] = _save(engine, root, method)
    loop_s = now() - started
    figures = {"loop_s": loop_s, "saves": saves}
    if lazy is not None:
        lazy.close()
        figures["waits"] = {str(s.step): s.wait_s for s in lazy.stats}  # the barrier each save caused
        figures["durable"] = {str(s.step): s.flush_s for s in lazy.stats}
        figures["own"] = {str(s.step): s.save_s for s in lazy.stats}  # lazyckpt's own part of save_checkpoint
    if reference is not None:
        figures["verified"] = _verify(engine, root, reference, rank)
    with open(out.format(rank=rank), "w") as f:
        json.dump(figures, f)
    torch.distributed.barrier()


def _save(engine, root: str, method: str) -> float:
    start = now()
    engine.save_checkpoint(root)
    if method == "torch":
        fsync_tree(os.path.join(root, f"global_step{engine.global_steps}"))
    return now() - start


def _optimizer_tensors(state, prefix: str = "") -> dict[str, torch.Tensor]:
    found = {}
    if isinstance(state, torch.Tensor):
        found[prefix] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            found.update(_optimizer_tensors(v, f"{prefix}/{k}"))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            found.update(_optimizer_tensors(v, f"{prefix}[{i}]"))
    return found


def _verify(engine, root: str, reference: dict[str, torch.Tensor], rank: int) -> bool:
    """The newest checkpoint's optimizer file of this rank, read with the method's own ``load``, is the state at
    its step, bit for bit."""
    with open(os.path.join(root, "latest")) as f:
        tag = f.read().strip()
    path = os.path.join(root, tag, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    loaded = _optimizer_tensors(engine.checkpoint_engine.load(path, map_location="cpu")["optimizer_state_dict"])
    return loaded.keys() == reference.keys() and all(torch.equal(loaded[k], reference[k]) for k in reference)


def one_run(args: argparse.Namespace, stage: int, method: str, workdir: str) -> dict:
    root = tempfile.mkdtemp(prefix=f"ds-{method}-", dir=workdir)
    out = os.path.join(root, "result-{rank}.json")
    context = multiprocessing.get_context("fork")
    port = free_port()
    procs = [context.Process(target=_guarded, args=(r, port, args, stage, method, os.path.join(root, "ckpt"), out))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"ZeRO-{stage} {method}: a rank failed (exit codes {[p.exitcode for p in procs]})")
    with open(out.format(rank=0)) as f:
        result = json.load(f)
    shutil.rmtree(root)
    return result


def _guarded(*args) -> None:
    try:
        run_rank(*args)
    except BaseException:  # noqa: BLE001 - the parent reports the exit code
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def summarize(runs: dict[tuple[int, str], list[dict]], stage: int) -> dict[str, dict]:
    base = statistics.median(r["loop_s"] for r in runs[(stage, "none")])
    rows = {}
    for method in METHODS[1:]:
        results = runs[(stage, method)]
        stalls = [s + r.get("waits", {}).get(step, 0.0) for r in results for step, s in r["saves"].items()]
        durable = stalls if method == "torch" else [s for r in results for s in r["durable"].values()]
        own = [s for r in results for s in r.get("own", {}).values()]
        rows[method] = {"stall_ms": 1e3 * statistics.median(stalls), "durable_s": statistics.median(durable),
                        "own_ms": 1e3 * statistics.median(own) if own else None,
                        "slowdown": statistics.median(r["loop_s"] for r in results) / base,
                        "verified": all(r.get("verified") for r in results)}
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    workdir = tempfile.mkdtemp(prefix="ds-bench-")
    runs: dict[tuple[int, str], list[dict]] = {}
    try:
        for repeat in range(args.repeats):
            for stage in stages:
                for method in METHODS:  # interleaved: drift on the machine spreads over every method
                    log(f"repeat {repeat + 1}/{args.repeats}: ZeRO-{stage} {method}")
                    runs.setdefault((stage, method), []).append(one_run(args, stage, method, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    table = {stage: summarize(runs, stage) for stage in stages}
    print("| ZeRO | method | stall / ckpt (ms) | of which lazyckpt's save() (ms) | time to durable (s) | "
          "end-to-end slowdown | verified |")
    print("|---|---|---|---|---|---|---|")
    for stage, rows in table.items():
        for method, row in rows.items():
            own = "–" if row["own_ms"] is None else f"{row['own_ms']:.1f}"
            print(f"| {stage} | {method} | {row['stall_ms']:.1f} | {own} | {row['durable_s']:.2f} | "
                  f"{row['slowdown']:.3f}x | {'yes' if row['verified'] else 'NO'} |")
        ratio = rows["lazy"]["stall_ms"] / rows["torch"]["stall_ms"]
        print(f"ZeRO-{stage}: lazy stall / torch engine stall = {ratio:.3f} (target <= 0.1: "
              f"{'met' if ratio <= 0.1 else 'NOT met'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": {f"{s}-{m}": r for (s, m), r in runs.items()}, "table": table}, f)
    return 0 if all(row["verified"] for rows in table.values() for row in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
