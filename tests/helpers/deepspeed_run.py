"""A small DeepSpeed training run on CPU (gloo, ``DS_ACCELERATOR=cpu``), for the DeepSpeed tests: one function per
rank (see :func:`helpers.distributed.run_ranks`) builds the engine, resumes, trains and saves as a scenario says.

Every rank's batch of step ``s`` is drawn from a generator seeded by ``(s, rank)``, so a resumed run sees the
batches the uninterrupted one saw. A fingerprint is every tensor of the module's and the optimizer's state dicts
(ZeRO: this rank's fp32 partition and optimizer state), cloned.
"""

from __future__ import annotations

import json
import os

import torch

CRASH_EXIT_CODE = 13


def build(stage: int, rank: int, world_size: int, *, bf16: bool = False):
    """A fresh ``DeepSpeedEngine`` (seeded model, AdamW as a client optimizer) under ZeRO ``stage``."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    import importlib

    import deepspeed

    # Its CPU shared-memory op is JIT-compiled (minutes, a compiler): gloo does without. (The module, not the
    # attribute: ``deepspeed.comm.torch`` is the torch package.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": bf16}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def train(engine, rank: int, until: int) -> None:
    """Train from ``engine.global_steps`` up to step ``until``."""
    while engine.global_steps < until:
        gen = torch.Generator().manual_seed(1000 * (engine.global_steps + 1) + rank)
        x = torch.randn(2, 8, generator=gen)
        loss = engine(x.to(next(engine.module.parameters()).dtype)).float().square().mean()
        engine.backward(loss)
        engine.step()


def fingerprint(engine) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}

    def walk(value, path):
        if isinstance(value, torch.Tensor):
            found[path] = value.detach().clone()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}/{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
    walk(engine.module.state_dict(), "module")
    walk(engine.optimizer.state_dict(), "optimizer")
    return found


def save_fingerprint(engine, out: str, rank: int, name: str) -> None:
    torch.save(fingerprint(engine), os.path.join(out, f"{name}-{rank}.pt"))


def assert_fingerprint(engine, out: str, rank: int, name: str) -> None:
    expected, actual = torch.load(os.path.join(out, f"{name}-{rank}.pt")), fingerprint(engine)
    assert expected.keys() == actual.keys(), (sorted(expected), sorted(actual))
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), f"rank {rank}: {key} differs from {name}"


def exit_at_commit(step: int):
    """A storage that ends the process (``os._exit``) where the directory of ``step`` would be renamed into place:
    that checkpoint is written on every rank but never committed."""
    from lazyckpt.format.files import step_dirname
    from lazyckpt.storage import LocalStorage

    class ExitAtCommit(LocalStorage):
        def rename(self, src, dst, *, sync):
            if os.path.basename(dst) == step_dirname(step):
                os._exit(CRASH_EXIT_CODE)
            return super().rename(src, dst, sync=sync)
    return ExitAtCommit()


def edge_cases(rank: int, world_size: int, stage: int, dirpath: str, out: str) -> None:
    """``save_latest=False``, a second tag at one step, and ``save_16bit_model`` next to lazy checkpoints."""
    import pytest

    from lazyckpt.integrations.deepspeed import use_lazy_checkpoints

    engine = build(stage, rank, world_size)
    lazy = use_lazy_checkpoints(engine)
    train(engine, rank, 2)
    engine.save_checkpoint(dirpath)
    train(engine, rank, 4)
    engine.save_checkpoint(dirpath, tag="eval", save_latest=False)
    with pytest.raises(ValueError, match="at global step 4, which this run saved already as tag 'eval'"):
        engine.save_checkpoint(dirpath, tag="other")
    export = os.path.join(out, "export")
    engine.save_16bit_model(export)  # a plain model file, written at once
    assert os.listdir(export) == ["pytorch_model.bin"], os.listdir(export)
    lazy.wait()
    with open(os.path.join(dirpath, "latest")) as f:
        assert f.read() == "global_step2"
    train(engine, rank, 5)
    lazy.close()
    engine.load_checkpoint(dirpath)  # the repair passes over the save that did not ask to be latest
    assert engine.global_steps == 2


def gated_barrier(rank: int, world_size: int, stage: int, dirpath: str) -> None:
    """The copy of the step-4 checkpoint is held at a gate that opens only once the next update has reached the
    optimizer's step pre-hooks; a hook placed after the barrier's records whether every copy was done when the
    update went on (without the barrier it would run while the copy is still at the gate)."""
    import threading

    from lazyckpt.integrations.deepspeed import use_lazy_checkpoints
    from lazyckpt.write.staging.cpu import CpuCopyBackend

    class Gate(CpuCopyBackend):
        def __init__(self) -> None:
            self.open, self.lock, self.started, self.done = threading.Event(), threading.Lock(), 0, 0

        def copy_pieces(self, sources, pieces, slots):
            with self.lock:
                self.started += 1
            self.open.wait()
            result = super().copy_pieces(sources, pieces, slots)
            with self.lock:
                self.done += 1
            return result

    engine = build(stage, rank, world_size)
    base = engine.optimizer.optimizer
    arrived, seen, gate = threading.Event(), [], Gate()
    base.register_step_pre_hook(lambda *_: arrived.set())  # before the barrier's hook (registered next)
    lazy = use_lazy_checkpoints(engine, backend=gate)
    base.register_step_pre_hook(lambda *_: seen.append((gate.started, gate.done)))  # after the barrier
    gate.open.set()
    train(engine, rank, 4)
    gate.open.clear()
    arrived.clear()
    seen.clear()
    engine.save_checkpoint(dirpath)
    opener = threading.Thread(target=lambda: (arrived.wait(), gate.open.set()))
    opener.start()
    train(engine, rank, 5)
    opener.join()
    lazy.close()
    assert seen and seen[0][0] > 0 and seen[0][0] == seen[0][1], seen  # every copy done before the update


def scenario(rank: int, world_size: int, stage: int, dirpath: str, out: str, plan: str) -> None:
    """``plan``:

    * ``first``: save at 2 and 4 (fingerprints ``fp2``, ``fp4`` taken right before; step 4 also with DeepSpeed's
      own engine into ``out/torch-engine``), train on to 6 (``fp6``).
    * ``resume``: resume from ``dirpath``; the state must be ``fp4`` at step 4; train to 6: it must be ``fp6``.
    * ``crash-before-commit``: save at 2 (committed), then at 4 with a commit that ends the process.
    * ``resume-2``: resume; the state must be ``fp2`` at step 2, and ``latest`` names ``global_step2``.
    * ``resume-4``: resume; the state must be ``fp4`` at step 4, and ``latest`` names ``global_step4``.
    * ``fixed-tag``: save at 2, 4, 6 and 8 under the one tag ``last`` (``keep_last_k=3``).
    * ``crash-after-commit``: save at 2 and 4, end the process once 4 is committed, before ``latest`` moves.
    """
    from lazyckpt.integrations.deepspeed import use_lazy_checkpoints

    engine = build(stage, rank, world_size)
    options = {"storage": exit_at_commit(4)} if plan == "crash-before-commit" and rank == 0 else {}
    lazy = use_lazy_checkpoints(engine, keep_last_k=3, **options)
    if plan.startswith("resume"):
        _resume(engine, rank, dirpath, out, plan)
        return
    if plan == "fixed-tag":  # one tag saved again and again, as a "last" checkpoint is
        for step in (2, 4, 6, 8):
            train(engine, rank, step)
            engine.save_checkpoint(dirpath, tag="last")
        lazy.close()
        return
    for step in (2, 4):
        train(engine, rank, step)
        save_fingerprint(engine, out, rank, f"fp{step}")
        engine.save_checkpoint(dirpath)
        if step == 2 and plan != "first":
            lazy.wait()
    if plan == "first":  # the same state through DeepSpeed's own engine, for its own consolidation to compare with
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        engine.checkpoint_engine = TorchCheckpointEngine(engine._config)  # its configured serialization
        engine.save_checkpoint(os.path.join(out, "torch-engine"))
        engine.checkpoint_engine = lazy
    if plan == "crash-before-commit":  # rank 0 ends in the rename that would commit step 4 (ExitAtCommit)
        try:
            lazy.in_flight.wait()  # rank 1: its part is written; the commit never comes (rank 0 is gone)
        except BaseException:  # noqa: BLE001 - the store went down with rank 0
            pass
        os._exit(CRASH_EXIT_CODE if rank == 1 else 1)  # rank 0 must not get here
    if plan == "crash-after-commit":
        lazy.in_flight.wait()
        torch.distributed.barrier()  # rank 0 hosts the store: it leaves once every rank saw the commit
        os._exit(CRASH_EXIT_CODE)
    train(engine, rank, 6)
    save_fingerprint(engine, out, rank, "fp6")
    lazy.close()
    _write(out, rank, {"stalls": lazy.stalls})


def _resume(engine, rank: int, dirpath: str, out: str, plan: str) -> None:
    path, _ = engine.load_checkpoint(dirpath)
    expected = 2 if plan == "resume-2" else 4
    assert path is not None and engine.global_steps == expected, (path, engine.global_steps)
    assert_fingerprint(engine, out, rank, f"fp{expected}")
    with open(os.path.join(dirpath, "latest")) as f:
        assert f.read() == f"global_step{expected}"
    if plan == "resume":
        train(engine, rank, 6)
        assert_fingerprint(engine, out, rank, "fp6")
    engine.checkpoint_engine.close()


def _write(out: str, rank: int, data: dict) -> None:
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(data, f)


def host_scenario(rank: int, world_size: int, stage: int, dirpath: str, out: str, shm: str, plan: str) -> None:
    """With ``keep_in_memory="host"`` (host folders under ``shm``). ``plan``:

    * ``host-crash``: save at 2 (in ``dirpath``), then at 4, and die once step 4 is committed in the host folder
      only (its copy to ``dirpath`` never begins: :mod:`helpers.host_faults`).
    * ``host-resume``: ``engine.load_checkpoint(dirpath)`` must resume step 4 (``fp4``) from ``dirpath``, its
      markers, tag and ``latest`` there; train to 6 and save it (its markers in ``dirpath`` too).
    """
    from helpers.host_faults import crash_once_stalled, stall_copy_to_disk
    from lazyckpt.integrations.deepspeed import use_lazy_checkpoints

    engine = build(stage, rank, world_size)
    lazy = use_lazy_checkpoints(engine, keep_in_memory="host", host_memory_dir=shm)
    if plan == "host-crash":
        train(engine, rank, 2)
        engine.save_checkpoint(dirpath)
        lazy.wait()
        reached = stall_copy_to_disk(4)
        train(engine, rank, 4)
        save_fingerprint(engine, out, rank, "fp4")
        engine.save_checkpoint(dirpath)
        crash_once_stalled(reached, CRASH_EXIT_CODE)
    path, _ = engine.load_checkpoint(dirpath)
    assert engine.global_steps == 4, (path, engine.global_steps)
    assert_fingerprint(engine, out, rank, "fp4")
    with open(os.path.join(dirpath, "latest")) as f:
        assert f.read() == "global_step4"
    assert os.readlink(os.path.join(dirpath, "global_step4")) == "step-0000004"
    train(engine, rank, 6)
    engine.save_checkpoint(dirpath)
    lazy.close()
