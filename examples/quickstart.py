"""Plain PyTorch with lazy checkpoints: train, crash on purpose, resume, and check the result.

Run it end to end (it re-launches itself for the crashing and the resumed run):

    python examples/quickstart.py --demo

or drive the pieces yourself:

    python examples/quickstart.py --dirpath runs/quick --steps 40 --crash-at 23
    python examples/quickstart.py --dirpath runs/quick --steps 40 --resume
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

import lazyckpt


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    return model, opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 32, generator=gen)
    return x, x.sum(dim=1, keepdim=True)


def state_of(model, opt, sched, step: int) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": lazyckpt.Deferred(sched.state_dict),  # the loop steps it after the request
            "rng": lazyckpt.capture_rng_state(), "step": step}


def train(dirpath: str, steps: int, every: int, crash_at: int | None, resume: bool) -> torch.Tensor:
    model, opt, sched = build()
    start = 0
    if resume and (path := lazyckpt.latest(dirpath)) is not None:
        saved = lazyckpt.load(path)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        lazyckpt.restore_rng_state(saved["rng"])
        start = saved["step"]
        print(f"resumed from {path} (step {start})")
    with lazyckpt.LazyCheckpointer(dirpath, keep_last_k=3) as ckpt:
        for step in range(start + 1, steps + 1):
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            ckpt.wait_staged()          # the barrier: the last snapshot no longer needs the live tensors
            opt.step()
            opt.zero_grad()
            if step % every == 0:
                ckpt.save(state_of(model, opt, sched, step), step=step, optimizers=[opt])
            sched.step()
            if step == crash_at:
                print(f"crashing on purpose at step {step}", flush=True)
                os._exit(1)             # no clean-up at all, like a killed job
    stalls = [s.stall_s * 1e3 for s in ckpt.stats]  # after close(): the last checkpoint is committed too
    print(f"trained to step {steps}; {len(stalls)} checkpoints committed by this run, "
          f"median stall {sorted(stalls)[len(stalls) // 2] if stalls else 0:.2f} ms")
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def demo(steps: int, every: int, crash_at: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        me = [sys.executable, os.path.abspath(__file__), "--steps", str(steps), "--every", str(every)]
        out = {}
        for name, extra in [("uninterrupted", []), ("crashed", ["--crash-at", str(crash_at)]),
                            ("resumed", ["--resume"])]:
            run_dir = os.path.join(tmp, "reference" if name == "uninterrupted" else "run")
            result = subprocess.run(me + ["--dirpath", run_dir, "--save-params", os.path.join(tmp, name)] + extra,
                                    capture_output=True, text=True)
            print(f"[{name}] exit {result.returncode}: {result.stdout.strip()}")
            out[name] = os.path.join(tmp, name)
        same = torch.equal(torch.load(out["uninterrupted"]), torch.load(out["resumed"]))
        print(f"resumed run matches the uninterrupted one bit for bit: {same}")
        return 0 if same else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirpath", default="runs/quickstart")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N optimizer steps")
    parser.add_argument("--crash-at", type=int, default=None, help="hard-exit after this step")
    parser.add_argument("--resume", action="store_true", help="continue from the newest committed checkpoint")
    parser.add_argument("--save-params", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--demo", action="store_true", help="train, crash, resume and compare, end to end")
    args = parser.parse_args()
    if args.demo:
        return demo(args.steps, args.every, crash_at=args.crash_at or 23)
    params = train(args.dirpath, args.steps, args.every, args.crash_at, args.resume)
    if args.save_params:
        torch.save(params, args.save_params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
