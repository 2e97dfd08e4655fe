"""DeepSpeed ZeRO with lazy checkpoints: train on 2 processes, crash on purpose, resume, and check the result.

Run it end to end on CPU (it launches itself with ``torch.distributed.run`` for the uninterrupted, the crashing and
the resumed run, and compares the final weights):

    python examples/deepspeed_train.py --demo --stage 2

or drive the pieces yourself:

    python -m torch.distributed.run --nproc_per_node 2 examples/deepspeed_train.py --dirpath runs/ds --crash-at 13
    python -m torch.distributed.run --nproc_per_node 2 examples/deepspeed_train.py --dirpath runs/ds

The only lazyckpt line is ``use_lazy_checkpoints(engine)``; ``engine.save_checkpoint`` and
``engine.load_checkpoint`` are DeepSpeed's own calls (docs/deepspeed.md).
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile

import torch


def build(stage: int):
    import deepspeed

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # On CPU DeepSpeed JIT-compiles a shared-memory op for its collectives at init; gloo does without it.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                                torch.nn.GELU(), torch.nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randn(8, 32, generator=gen)
    return x, x.sin().sum(dim=1, keepdim=True)


def train(args: argparse.Namespace) -> None:
    from lazyckpt.integrations.deepspeed import use_lazy_checkpoints

    engine = build(args.stage)
    lazy = use_lazy_checkpoints(engine, keep_last_k=2)
    path, _ = engine.load_checkpoint(args.dirpath)  # (None, None) when there is no checkpoint yet
    rank = torch.distributed.get_rank()
    if path is not None and rank == 0:
        print(f"resumed from {path} (step {engine.global_steps})", flush=True)
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = batch(step, micro, rank)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()                      # the update runs at the accumulation boundary
        if step % args.every == 0:
            engine.save_checkpoint(args.dirpath)  # returns at once; the bytes are copied during the next steps
        if step == args.crash_at:
            print(f"rank {rank}: crashing on purpose at step {step}", flush=True)
            os._exit(1)                        # no clean-up at all, like a killed job
    lazy.close()                               # the last checkpoint committed, latest in place
    if rank == 0:
        stalls = sorted(s * 1e3 for s in lazy.stalls.values())
        print(f"trained to step {args.steps}; median stall {stalls[len(stalls) // 2] if stalls else 0:.2f} ms",
              flush=True)
    if args.save_params:
        weights = [p.detach().clone() for p in _full_parameters(engine)]
        torch.save(weights, f"{args.save_params}-{rank}.pt")


def _full_parameters(engine) -> list[torch.Tensor]:
    """The whole weights on every rank (ZeRO-3 partitions them: gathered for the comparison)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return [p.detach().clone() for p in params]


def demo(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                  str(_free_port()), os.path.abspath(__file__), "--stage", str(args.stage), "--steps",
                  str(args.steps), "--every", str(args.every)]
        for name, extra in [("uninterrupted", ["--dirpath", os.path.join(tmp, "reference")]),
                            ("crashed", ["--dirpath", os.path.join(tmp, "run"), "--crash-at", str(args.crash_at)]),
                            ("resumed", ["--dirpath", os.path.join(tmp, "run")])]:
            launch[6] = str(_free_port())
            result = subprocess.run(launch + extra + ["--save-params", os.path.join(tmp, name)], text=True,
                                    capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            lines = [line for line in result.stdout.splitlines() if line.startswith(("resumed", "trained", "rank"))]
            print(f"[{name}] exit {result.returncode}: {' | '.join(lines)}", flush=True)
            if result.returncode not in (0, 1) or (name != "crashed" and result.returncode != 0):
                print(result.stderr[-3000:], file=sys.stderr)
                return 1
        same = all(all(torch.equal(a, b) for a, b in zip(torch.load(os.path.join(tmp, f"uninterrupted-{r}.pt")),
                                                        torch.load(os.path.join(tmp, f"resumed-{r}.pt"))))
                   for r in range(2))
        print(f"resumed run matches the uninterrupted one bit for bit: {same}")
        return 0 if same else 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirpath", default="runs/deepspeed")
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N optimizer steps")
    parser.add_argument("--crash-at", type=int, default=None, help="hard-exit after this step")
    parser.add_argument("--save-params", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--demo", action="store_true", help="train, crash, resume and compare, end to end")
    args = parser.parse_args()
    if args.demo:
        args.crash_at = args.crash_at or 14
        return demo(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
