"""Accelerate's DeepSpeed plugin on CPU with ``LazyCheckpointHook``: one function per rank (see
:func:`helpers.distributed.run_ranks`) trains a small model with a shuffled loader and an LR scheduler, saving
every 4 steps, and either runs to the end, crashes on purpose, or resumes from the newest checkpoint."""

from __future__ import annotations

import importlib
import os

import torch

from helpers.deepspeed_run import CRASH_EXIT_CODE, fingerprint

STEPS_PER_EPOCH, EPOCHS = 8, 3
CRASH_AFTER = {"crash-at-epoch-end": 9, "crash-mid-epoch": 13}
"""The step each crashing plan ends after: the checkpoint of step 8 (an epoch's end) or 12 (mid-epoch) is the
newest one then."""


def _accelerator(stage: int, rank: int, world_size: int):
    # What `accelerate launch --use_deepspeed` sets for each process it starts
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), ACCELERATE_USE_DEEPSPEED="true")
    import deepspeed  # noqa: F401 - the CPU accelerator is chosen at import

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # JIT-built; gloo does without
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1)
    # Without a GPU Accelerate picks no backend for DeepSpeed (and runs one process): name gloo
    return Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])


def scenario(rank: int, world_size: int, stage: int, dirpath: str, out: str, plan: str) -> None:
    """``plan``: ``full`` (no crash), ``crash-at-epoch-end`` / ``crash-mid-epoch`` (hard exit once the checkpoint
    of step 8 / 12 is committed), ``resume`` (from the newest step)."""
    from lazyckpt import LazyCheckpointHook

    accelerator = _accelerator(stage, rank, world_size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    gen = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(2 * STEPS_PER_EPOCH * world_size, 6, generator=gen),
                                          torch.randint(0, 3, (2 * STEPS_PER_EPOCH * world_size,), generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    engine, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    hook = LazyCheckpointHook(dirpath, every_n_steps=4).register(accelerator)
    step = hook.resume() if plan == "resume" else 0
    assert plan != "resume" or step > 0, "nothing to resume from"
    for _ in range(step // STEPS_PER_EPOCH, EPOCHS):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(engine(x), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            if plan.startswith("crash") and step == CRASH_AFTER[plan]:
                hook.close()  # the step before is committed: the resume starts there, whatever the machine's speed
                if world_size > 1:
                    torch.distributed.barrier()  # rank 0 hosts the store: it leaves once every rank closed
                os._exit(CRASH_EXIT_CODE)
    hook.close()
    torch.save({**fingerprint(engine), "rng": torch.get_rng_state(), "step": torch.tensor(step)},
               os.path.join(out, f"final-{plan}-{rank}.pt"))
