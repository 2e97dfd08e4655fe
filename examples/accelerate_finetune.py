"""Fine-tune MiniLM with a plain Accelerate loop and lazy checkpoints; crash on purpose; resume.

The task is the one the Lightning example trains (``examples/finetune_task.py``). Every ``--every-n-steps``
optimizer updates ``LazyCheckpointHook`` takes a lazy checkpoint; half-way between two of them the same run
calls ``accelerator.save_state()`` so both stalls are measured on the same model, data and disk::

    python examples/accelerate_finetune.py --dirpath runs/accelerate --crash-at 40   # dies at step 40
    python examples/accelerate_finetune.py --dirpath runs/accelerate --resume        # continues, prints stalls

Run it with ``accelerate launch`` for several processes. A resume from an epoch boundary is bit-exact; from
the middle of an epoch the remaining batches of that epoch come from a fresh shuffle (a plain DataLoader
cannot replay its order; a stateful one can, see docs/accelerate.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed

import lazyckpt
from lazyckpt import LazyCheckpointHook

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_task import accuracy, build_dataloaders, build_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dirpath", default="runs/accelerate", help="where checkpoints go")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=6, help="pretrained encoder layers to keep (1-6)")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--every-n-steps", type=int, default=8, help="lazy checkpoint period (optimizer updates)")
    parser.add_argument("--keep-last-k", type=int, default=2)
    parser.add_argument("--no-save-state", action="store_true", help="do not measure accelerator.save_state()")
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--crash-at", type=int, default=0, help="os._exit(1) right after this optimizer update")
    parser.add_argument("--resume", action="store_true", help="continue from the newest committed checkpoint")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    lazy_dir, state_dir = os.path.join(args.dirpath, "lazy"), os.path.join(args.dirpath, "save_state")
    # Without CUDA, cpu=True makes processes started by `accelerate launch --multi_gpu` join one gloo group.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision)
    if not args.resume and lazyckpt.latest(lazy_dir) is not None:
        sys.exit(f"{lazy_dir} holds checkpoints already: pass --resume, or a new --dirpath")
    set_seed(0)
    model = build_model(args.layers)
    train_loader, val_loader = build_dataloaders(args.batch_size, seed=0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10) * (1 - s / total))
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler)

    hook = LazyCheckpointHook(lazy_dir, every_n_steps=args.every_n_steps, keep_last_k=args.keep_last_k)
    hook.register(accelerator)
    step = hook.resume() if args.resume else 0
    steps_per_epoch = len(train_loader)
    start_epoch, skip = divmod(step, steps_per_epoch)
    if args.resume:
        where = "an epoch boundary: bit-exact" if skip == 0 else f"batch {skip} of epoch {start_epoch}: approximate"
        accelerator.print(f"resumed at step {step} ({where})" if step else "nothing to resume; starting at step 0")

    save_state_s = []
    for epoch in range(start_epoch, args.epochs):
        model.train()
        batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        skip = 0
        for batch in batches:
            loss = F.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step = hook.step
            if step == args.crash_at:
                accelerator.print(f"crashing at step {step}; newest committed checkpoint: {lazyckpt.latest(lazy_dir)}")
                os._exit(1)
            if not args.no_save_state and step % args.every_n_steps == args.every_n_steps // 2:
                save_state_s.append(timed_save_state(accelerator, state_dir, step))
        accelerator.print(f"epoch {epoch}: step {step}, loss {loss.item():.4f}, "
                          f"val accuracy {evaluate(accelerator, model, val_loader):.3f}")
    hook.close()
    report(accelerator, hook, save_state_s)
    accelerator.end_training()


def timed_save_state(accelerator: Accelerator, state_dir: str, step: int) -> float:
    """Seconds the loop stalls in ``accelerator.save_state()``; only the newest of those directories is kept."""
    target = os.path.join(state_dir, f"step-{step:07d}")
    started = time.monotonic()
    accelerator.save_state(target)
    accelerator.wait_for_everyone()
    elapsed = time.monotonic() - started
    if accelerator.is_main_process:
        for name in os.listdir(state_dir):
            if name != os.path.basename(target):
                shutil.rmtree(os.path.join(state_dir, name))
    return elapsed


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader) -> float:
    model.eval()
    correct = []
    for batch in loader:
        logits = model(batch["input_ids"], batch["attention_mask"])
        correct.append(accelerator.gather_for_metrics(accuracy(logits, batch["labels"]).reshape(1)))
    model.train()
    return torch.cat(correct).mean().item()


def report(accelerator: Accelerator, hook: LazyCheckpointHook, save_state_s: list[float]) -> None:
    stats = hook.checkpointer.stats
    lazy = sorted(hook.stalls.values())
    lines = ["", "training-loop stall per checkpoint (median, this process):"]
    if lazy:
        size = statistics.median(s.nbytes for s in stats) / 1e6 if stats else 0.0
        durable = statistics.median(s.flush_s for s in stats) if stats else float("nan")
        lines.append(f"  lazyckpt               {1e3 * statistics.median(lazy):9.1f} ms  (n={len(lazy)}, "
                     f"{size:.0f} MB, durable after {1e3 * durable:.0f} ms)")
    if save_state_s:
        lines.append(f"  accelerator.save_state {1e3 * statistics.median(save_state_s):9.1f} ms  "
                     f"(n={len(save_state_s)})")
    if lazy and save_state_s:
        lines.append(f"  -> {statistics.median(save_state_s) / max(statistics.median(lazy), 1e-9):.0f}x less stall")
    accelerator.print("\n".join(lines))


if __name__ == "__main__":
    main()
