"""Hard crashes (``os._exit``) and resume with LazyCheckpointHook, in one process and under ``accelerate launch``.

This file is also the training script the tests run: ``python tests/integrations/test_accelerate_crash.py --out ...``.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

CRASH_EXIT_CODE = 13
EPOCHS = 4
SAMPLES = 64
BATCH = 8


# --- the training script ----------------------------------------------------------------------------------------

def build():
    """Dropout, BatchNorm, a shuffled loader and a step-wise LR scheduler, prepared by a fresh Accelerator."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    set_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    gen = torch.Generator().manual_seed(1234)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 6, generator=gen),
                                          torch.randint(0, 3, (SAMPLES,), generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    return accelerator, model, opt, loader, sched


def train(args: argparse.Namespace) -> None:
    from lazyckpt import LazyCheckpointHook

    warnings.filterwarnings("error", "lazyckpt. no forward", RuntimeWarning)  # every request must overlap

    accelerator, model, opt, loader, sched = build()
    hook = stalled = None
    start_epoch = resumed_from = 0
    if args.dirpath:
        host = {"keep_in_memory": "host", "host_memory_dir": args.host_memory_dir} if args.host_memory_dir else {}
        hook = LazyCheckpointHook(args.dirpath, every_n_steps=len(loader), **host).register(accelerator)
        resumed_from = hook.resume()
        if resumed_from % len(loader):
            raise SystemExit(f"resumed from step {resumed_from}, which is not an epoch boundary")
        start_epoch = resumed_from // len(loader)
    if args.stall_copy_of:
        from helpers.host_faults import stall_copy_to_disk

        stalled = stall_copy_to_disk(args.stall_copy_of)
    step = resumed_from
    for _ in range(start_epoch, EPOCHS):
        for x, y in loader:
            scale = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())
            loss = torch.nn.functional.cross_entropy(model(x + 0.01 * torch.randn_like(x)), y) * scale
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            if step == args.crash_at and stalled is not None:
                from helpers.host_faults import crash_once_stalled

                crash_once_stalled(stalled, CRASH_EXIT_CODE)  # that step is in the host folder, not in dirpath
            if step == args.crash_at:
                os._exit(CRASH_EXIT_CODE)  # no atexit, no close(): whatever is in flight is lost
    if hook is not None:
        hook.close()
    unwrapped = accelerator.unwrap_model(model)
    torch.save({"model": unwrapped.state_dict(), "opt": opt.optimizer.state_dict(), "sched": sched.state_dict(),
                "torch_rng": torch.get_rng_state(), "np_rng": torch.from_numpy(np.random.get_state()[1].copy()),
                "py_rng": torch.tensor(random.getstate()[1]), "resumed_from": resumed_from, "step": step},
               os.path.join(args.out, f"final-{accelerator.process_index}.pt"))
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="directory for final-<rank>.pt")
    parser.add_argument("--dirpath", help="checkpoint directory (none: train without checkpoints)")
    parser.add_argument("--crash-at", type=int, default=0, help="os._exit right after this step")
    parser.add_argument("--host-memory-dir", help="keep_in_memory='host' with this host_memory_dir")
    parser.add_argument("--stall-copy-of", type=int, help="the copy of this step to dirpath never begins; "
                        "--crash-at waits until it would have")
    train(parser.parse_args())


# --- the tests ----------------------------------------------------------------------------------------------------

def run_script(tmp_path, name: str, *args: str, processes: int = 1) -> subprocess.CompletedProcess:
    out = tmp_path / name
    out.mkdir()
    script = [os.path.abspath(__file__), "--out", str(out), *args]
    if processes == 1:
        command = [sys.executable, *script]
    else:
        # `accelerate launch --cpu` starts a single process (its CPU launcher needs mpirun for more); `--multi_gpu`
        # goes through torchrun, and without CUDA every process runs Accelerate's MULTI_CPU mode over gloo.
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(free_port()), *script]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def final(tmp_path, name: str, rank: int = 0) -> dict:
    return torch.load(tmp_path / name / f"final-{rank}.pt", weights_only=True)


def assert_same_training_state(resumed: dict, reference: dict) -> None:
    from conftest import assert_tree_equal

    for key in ("model", "opt", "sched", "torch_rng", "np_rng", "py_rng", "step"):
        assert_tree_equal(resumed[key], reference[key], key)


def check(result: subprocess.CompletedProcess, returncode: object = 0) -> None:
    assert result.returncode == returncode, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


@pytest.mark.slow
def test_a_hard_crash_then_resume_ends_bit_exact_where_the_uninterrupted_run_ends(tmp_path):
    steps_per_epoch = SAMPLES // BATCH
    ckpt = str(tmp_path / "ckpt")
    check(run_script(tmp_path, "reference"))
    check(run_script(tmp_path, "crashed", "--dirpath", ckpt, "--crash-at", str(2 * steps_per_epoch + 3)),
          CRASH_EXIT_CODE)
    check(run_script(tmp_path, "resumed", "--dirpath", ckpt))
    resumed = final(tmp_path, "resumed")
    assert resumed["resumed_from"] in (steps_per_epoch, 2 * steps_per_epoch)
    assert_same_training_state(resumed, final(tmp_path, "reference"))


@pytest.mark.slow
def test_two_processes_save_crash_and_resume_bit_exact_under_accelerate_launch(tmp_path):
    steps_per_epoch = SAMPLES // BATCH // 2
    ckpt = tmp_path / "ckpt"
    check(run_script(tmp_path, "reference", processes=2))
    check(run_script(tmp_path, "crashed", "--dirpath", str(ckpt), "--crash-at", str(2 * steps_per_epoch + 1),
                     processes=2), _any_failure())
    committed = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-") and "." not in p.name)
    assert committed and set(committed) <= {f"step-{steps_per_epoch:07d}", f"step-{2 * steps_per_epoch:07d}"}
    newest = ckpt / committed[-1]
    assert sorted(p.name for p in newest.iterdir()) == [
        "manifest.json", "rank-00000-of-00002.safetensors", "rank-00000.json", "rank-00001-of-00002.safetensors",
        "rank-00001.json"]
    sizes = [(newest / f"rank-0000{r}-of-00002.safetensors").stat().st_size for r in (0, 1)]
    assert min(sizes) > 0.25 * sum(sizes)  # the replicated model and optimizer are split, not all on rank 0
    check(run_script(tmp_path, "resumed", "--dirpath", str(ckpt), processes=2))
    for rank in (0, 1):
        resumed = final(tmp_path, "resumed", rank)
        assert resumed["resumed_from"] == int(committed[-1].removeprefix("step-"))
        assert_same_training_state(resumed, final(tmp_path, "reference", rank))
    assert_one_process_cannot_resume_it(ckpt)


def assert_one_process_cannot_resume_it(ckpt) -> None:
    from accelerate.state import AcceleratorState, GradientState
    from lazyckpt.integrations.accelerate import CheckpointMismatchError

    from lazyckpt import LazyCheckpointHook

    try:
        accelerator = build()[0]
        hook = LazyCheckpointHook(ckpt).register(accelerator)
        with pytest.raises(CheckpointMismatchError, match=r"written by 2 process\(es\), this run has 1"):
            hook.resume()
        hook.close()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


class _any_failure:
    """Matches any non-zero exit status (the launcher reports a crashed worker its own way)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, int) and other != 0

    def __repr__(self) -> str:
        return "non-zero"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers.*
    main()
