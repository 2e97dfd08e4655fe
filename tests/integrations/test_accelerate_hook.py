"""LazyCheckpointHook in one process: step counting, capture timing, resume fidelity, save_state, errors."""

from __future__ import annotations

import os
import random
import threading
import time

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import set_seed
from conftest import GatedBackend, assert_tree_equal, clone_tree

import lazyckpt
from lazyckpt import LazyCheckpointHook
from lazyckpt.format.catalog import committed_steps
from lazyckpt.integrations.accelerate import CheckpointMismatchError

STEPS_PER_EPOCH = 4
pytestmark = pytest.mark.filterwarnings("error:lazyckpt. no forward:RuntimeWarning")  # every request must overlap


def reset_accelerate() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    reset_accelerate()
    yield
    reset_accelerate()


class Counter:
    """A user object given to ``register_for_checkpointing``; the loop updates it after ``optimizer.step()``."""

    def __init__(self) -> None:
        self.updates = 0
        self.ema = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"updates": self.updates, "ema": self.ema}

    def load_state_dict(self, state: dict) -> None:
        self.updates = state["updates"]
        self.ema = state["ema"].clone()


def build(*, hidden: int = 8, accum: int = 1, precision: str = "no", optimizer: str = "adamw", scaler=None):
    """A prepared run: dropout, BatchNorm, a shuffled loader, a step-wise LR scheduler and a registered object."""
    set_seed(0)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accum, mixed_precision=precision)
    if scaler is not None:
        acc.scaler = scaler  # Accelerate only makes one for fp16 on an accelerator; this drives its skip path on CPU
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(),
                                torch.nn.Dropout(0.3), torch.nn.Linear(hidden, 2))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(8 * STEPS_PER_EPOCH * accum, 4, generator=gen),
                                          torch.randint(0, 2, (8 * STEPS_PER_EPOCH * accum,), generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    counter = Counter()
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    acc.register_for_checkpointing(counter)
    return acc, model, opt, loader, sched, counter


def train_iteration(acc, model, opt, sched, counter, batch) -> None:
    x, y = batch
    with acc.accumulate(model):
        noise = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())  # python and numpy RNGs matter too
        loss = torch.nn.functional.cross_entropy(model(x), y) * noise
        acc.backward(loss)
        opt.step()
        if acc.sync_gradients and not acc.optimizer_step_was_skipped:
            counter.updates += 1
            counter.ema.mul_(0.9).add_(loss.detach().float())
        sched.step()
        opt.zero_grad()


def train(run, epochs: range, on_iteration=None) -> None:
    acc, model, opt, loader, sched, counter = run
    for _ in epochs:
        for batch in loader:
            train_iteration(acc, model, opt, sched, counter, batch)
            if on_iteration is not None:
                on_iteration()


class _Stop(Exception):
    pass


def final_state(run) -> dict:
    _, model, opt, _, sched, counter = run
    return clone_tree({"model": model.state_dict(), "opt": opt.optimizer.state_dict(), "sched": sched.state_dict(),
                       "counter": counter.state_dict(), "torch_rng": torch.get_rng_state(),
                       "np_rng": torch.from_numpy(np.random.get_state()[1].copy()),
                       "py_rng": random.getstate()})


def checkpoint_of(dirpath, step: int) -> dict:
    return numpy_as_torch(lazyckpt.load(os.path.join(dirpath, f"step-{step:07d}")))


def numpy_as_torch(tree):
    """The same tree with numpy arrays (the numpy RNG state) as tensors, so assert_tree_equal compares them."""
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(tree.copy())
    if isinstance(tree, dict):
        return {k: numpy_as_torch(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(numpy_as_torch(v) for v in tree)
    return tree


@pytest.mark.parametrize(("precision", "accum"), [("no", 1), ("bf16", 1), ("no", 2)])
def test_resume_at_an_epoch_boundary_ends_bit_exact_where_the_uninterrupted_run_ends(tmp_path, precision, accum):
    reference = build(precision=precision, accum=accum)
    train(reference, range(3))
    expected = final_state(reference)
    reset_accelerate()

    first = build(precision=precision, accum=accum)
    hook = LazyCheckpointHook(tmp_path, every_n_steps=STEPS_PER_EPOCH).register(first[0])
    assert hook.resume() == 0

    def stop_in_epoch_three():  # training goes on past the checkpoint, as it would before a crash
        if hook.step == 2 * STEPS_PER_EPOCH + 2:
            raise _Stop

    with pytest.raises(_Stop):
        train(first, range(3), on_iteration=stop_in_epoch_three)
    hook.close()
    reset_accelerate()

    second = build(precision=precision, accum=accum)
    hook = LazyCheckpointHook(tmp_path, every_n_steps=STEPS_PER_EPOCH).register(second[0])
    step = hook.resume()
    assert step == 2 * STEPS_PER_EPOCH
    train(second, range(step // STEPS_PER_EPOCH, 3))
    hook.close()
    assert_tree_equal(final_state(second), expected)
    assert hook.step == 3 * STEPS_PER_EPOCH


@pytest.mark.parametrize("every_n_steps", [1, 2])
def test_each_checkpoint_holds_the_state_after_its_iteration_including_the_scheduler_step(tmp_path, every_n_steps):
    run = build(accum=2)
    acc, model, opt, _, sched, counter = run
    hook = LazyCheckpointHook(tmp_path, every_n_steps=every_n_steps).register(acc)
    expected, seen = {}, [0]

    def record():
        if hook.step != seen[0]:  # the iteration that made a real update has just ended
            seen[0] = hook.step
            expected[hook.step] = clone_tree({"model": model.state_dict(), "opt": opt.optimizer.state_dict(),
                                              "sched": sched.state_dict(), "counter": counter.state_dict(),
                                              "rng": torch.get_rng_state()})

    train(run, range(2), on_iteration=record)
    hook.close()
    assert sorted(expected) == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    committed = [s.step for s in hook.checkpointer.stats]
    assert committed == list(range(every_n_steps, 2 * STEPS_PER_EPOCH + 1, every_n_steps))
    for step in committed:
        saved = checkpoint_of(tmp_path, step)
        assert saved["step"] == step
        assert_tree_equal(saved["models"][0], expected[step]["model"])
        assert_tree_equal(saved["optimizers"][0], expected[step]["opt"])
        assert_tree_equal(saved["schedulers"][0], expected[step]["sched"])  # _step_count of micro-batches excluded
        assert_tree_equal(saved["objects"][0], expected[step]["counter"])
        assert torch.equal(saved["rng"]["torch"], expected[step]["rng"])


def test_gradient_accumulation_counts_only_sync_steps(tmp_path):
    run = build(accum=4)
    acc, _, opt, _, _, counter = run
    hook = LazyCheckpointHook(tmp_path, every_n_steps=2).register(acc)
    pre_hook_calls = []
    opt.optimizer.register_step_pre_hook(lambda *a: pre_hook_calls.append(acc.sync_gradients))
    train(run, range(1))  # 16 batches, 4 updates
    hook.close()
    assert hook.step == 4 == counter.updates
    assert pre_hook_calls == [True] * 4
    assert [s.step for s in hook.checkpointer.stats] == [2, 4]


def test_steps_skipped_by_the_grad_scaler_do_not_count(tmp_path):
    run = build(scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1))
    acc, model, opt, loader, sched, counter = run
    hook = LazyCheckpointHook(tmp_path, every_n_steps=1).register(acc)
    batches = iter(loader)
    train_iteration(acc, model, opt, sched, counter, next(batches))
    assert hook.step == 1
    x, y = next(batches)
    x[0, 0] = float("inf")  # an overflow: the scaler skips the update and halves its scale
    train_iteration(acc, model, opt, sched, counter, (x, y))
    assert acc.optimizer_step_was_skipped and hook.step == 1
    train_iteration(acc, model, opt, sched, counter, next(batches))
    expected_scaler = acc.scaler.state_dict()
    hook.close()
    assert hook.step == 2 and [s.step for s in hook.checkpointer.stats] == [1, 2]
    assert checkpoint_of(tmp_path, 2)["scaler"] == expected_scaler  # read after the scaler's update()


def test_two_optimizers_make_one_step_when_both_have_updated(tmp_path):
    set_seed(0)
    acc = Accelerator(cpu=True)
    gen, disc = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    gen, disc, opt_g, opt_d = acc.prepare(gen, disc, opt_g, opt_d)
    hook = LazyCheckpointHook(tmp_path, every_n_steps=1).register(acc)
    for _ in range(3):
        acc.backward(disc(gen(torch.randn(4, 2)).detach()).mean())
        opt_d.step()
        assert hook.step == _  # the discriminator alone does not complete the step
        opt_d.zero_grad()
        acc.backward(-disc(gen(torch.randn(4, 2))).mean())
        opt_g.step()
        opt_g.zero_grad()
    hook.close()
    assert hook.step == 3
    saved = checkpoint_of(tmp_path, 3)
    assert_tree_equal(saved["models"][0], dict(gen.state_dict()))
    assert_tree_equal(saved["models"][1], dict(disc.state_dict()))


def test_save_state_interleaved_with_lazy_checkpoints_agrees_and_load_state_carries_the_step(tmp_path):
    from safetensors.torch import load_file

    run = build()
    acc = run[0]
    lazy_a = tmp_path / "lazy-a"
    hook = LazyCheckpointHook(lazy_a, every_n_steps=2).register(acc)

    def save_state_sometimes():
        if hook.step in (3, 4):
            acc.save_state(tmp_path / f"accelerate-{hook.step}")

    train(run, range(2), on_iteration=save_state_sometimes)
    hook.close()
    saved = checkpoint_of(lazy_a, 4)
    written = load_file(tmp_path / "accelerate-4" / "model.safetensors")
    assert_tree_equal({k: written[k] for k in saved["models"][0]}, dict(saved["models"][0]))
    written = torch.load(tmp_path / "accelerate-4" / "optimizer.bin", weights_only=True)
    assert_tree_equal(written["state"], saved["optimizers"][0]["state"])
    assert written["param_groups"] == saved["optimizers"][0]["param_groups"]
    reset_accelerate()

    second = build()
    acc = second[0]
    hook = LazyCheckpointHook(tmp_path / "lazy-b", every_n_steps=2).register(acc)
    acc.load_state(tmp_path / "accelerate-4")
    assert hook.step == 4
    train(second, range(1, 2))
    hook.close()
    for step in (6, 8):
        resumed, original = checkpoint_of(tmp_path / "lazy-b", step), checkpoint_of(lazy_a, step)
        # Accelerate's load_state does not restore a loader's epoch counter (lazyckpt's resume does).
        assert [d["iteration"] for d in original["dataloaders"]] == [1 + (step == 8)]
        resumed.pop("dataloaders"), original.pop("dataloaders")
        assert_tree_equal(resumed, original)


def test_resume_without_a_checkpoint_returns_zero_and_changes_nothing(tmp_path):
    run = build()
    before = final_state(run)
    hook = LazyCheckpointHook(tmp_path / "empty").register(run[0])
    assert hook.resume() == 0
    assert hook.step == 0
    hook.close()
    assert_tree_equal(final_state(run), before)


def test_save_is_lazy_returns_one_handle_per_step_and_none_for_a_resumed_step(tmp_path):
    run = build()
    hook = LazyCheckpointHook(tmp_path).register(run[0])
    train(run, range(1))
    pending = hook.save()
    assert hook.save() is pending
    assert pending.wait() == str(tmp_path / "step-0000004")
    hook.close()
    reset_accelerate()
    run = build()
    hook = LazyCheckpointHook(tmp_path).register(run[0])
    assert hook.resume() == 4
    assert hook.save() is None
    hook.close()


def test_a_mismatched_checkpoint_is_refused_naming_every_difference_and_nothing_changes(tmp_path):
    run = build(hidden=8)
    hook = LazyCheckpointHook(tmp_path).register(run[0])
    train(run, range(1))
    hook.save()
    hook.close()
    reset_accelerate()

    run = build(hidden=16, optimizer="sgd")
    before = final_state(run)
    hook = LazyCheckpointHook(tmp_path).register(run[0])
    with pytest.raises(CheckpointMismatchError) as caught:
        hook.resume()
    message = str(caught.value)
    assert "step-0000004 does not match this run" in message
    assert "optimizers: the checkpoint holds ['AdamW'], this run registered ['SGD']" in message
    assert "model 0 (Sequential): '0.weight' is float32[8, 4] in the checkpoint and float32[16, 4] here" in message
    assert "'1.running_mean' is float32[8] in the checkpoint and float32[16] here" in message
    hook.close()
    assert_tree_equal(final_state(run), before)


def test_a_corrupt_checkpoint_is_refused_naming_the_file_and_tensor(tmp_path):
    run = build()
    hook = LazyCheckpointHook(tmp_path).register(run[0])
    train(run, range(1))
    path = hook.save().wait()
    hook.close()
    tensor_file = os.path.join(path, "rank-00000-of-00001.safetensors")
    with open(tensor_file, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    reset_accelerate()
    run = build()
    hook = LazyCheckpointHook(tmp_path).register(run[0])
    with pytest.raises(lazyckpt.CheckpointCorruptError, match=r"rank-00000-of-00001\.safetensors: tensor .* corrupt"):
        hook.resume()
    hook.close()


def test_a_checkpoint_not_written_by_the_hook_is_refused(tmp_path):
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        ckpt.save({"model": {"w": torch.ones(2)}}, step=3).wait()
    run = build()
    hook = LazyCheckpointHook(tmp_path).register(run[0])
    with pytest.raises(CheckpointMismatchError, match="not written by LazyCheckpointHook"):
        hook.resume()
    hook.close()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"every_n_steps": 0}, "every_n_steps=0 must be a positive int"),
    ({"rank": 1}, r"LazyCheckpointHook\(rank=...\) is not accepted"),
    ({"keep_last_k": 0}, "keep_last_k=0 must be a positive int"),
    ({"on_busy": "later"}, "on_busy='later' is not valid"),
])
def test_invalid_options_are_refused_at_construction(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LazyCheckpointHook(tmp_path, **kwargs)


def test_register_twice_and_calls_before_register_are_refused(tmp_path):
    hook = LazyCheckpointHook(tmp_path)
    with pytest.raises(RuntimeError, match=r"call hook.register\(accelerator\) before hook.resume\(\)"):
        hook.resume()
    run = build()
    hook.register(run[0])
    with pytest.raises(RuntimeError, match="registered already"):
        hook.register(run[0])
    hook.close()
    hook.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        hook.save()


def test_an_unstorable_registered_object_fails_at_register_naming_its_key_path(tmp_path):
    run = build()
    run[-1].schedule = lambda step: step  # a callable in state_dict(): no checkpoint can store it
    run[-1].state_dict = lambda: {"updates": 0, "schedule": run[-1].schedule}
    hook = LazyCheckpointHook(tmp_path / "ckpt")
    with pytest.raises(lazyckpt.UnsupportedValueError, match=r"state\['objects'\]\[0\]\['schedule'\].*plain data"):
        hook.register(run[0])
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir()), "nothing written"
    run[-1].state_dict = lambda: {"updates": 0}
    LazyCheckpointHook(tmp_path / "ckpt").register(run[0]).close()


def project_run(**project):
    """An Accelerator with a ProjectConfiguration, one prepared model and optimizer."""
    from accelerate.utils import ProjectConfiguration

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(**project))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def train_steps(acc, model, opt, steps):
    for _ in range(steps):
        acc.backward(model(torch.randn(8, 4)).square().mean())
        opt.step()
        opt.zero_grad()
    model(torch.randn(1, 4))  # the forward after the last update issues its checkpoint


def test_project_dir_and_total_limit_are_the_defaults_of_dirpath_and_keep_last_k(tmp_path):
    acc, model, opt = project_run(project_dir=str(tmp_path / "proj"), total_limit=2)
    with LazyCheckpointHook(every_n_steps=1).register(acc) as hook:
        train_steps(acc, model, opt, 4)
    assert hook.dirpath == str(tmp_path / "proj" / "lazyckpt")
    assert sorted(committed_steps(hook.dirpath)) == [3, 4]
    reset_accelerate()
    acc, model, opt = project_run(project_dir=str(tmp_path / "proj"), total_limit=2)
    with LazyCheckpointHook(tmp_path / "mine", every_n_steps=1, keep_last_k=3).register(acc) as hook:
        train_steps(acc, model, opt, 4)
    assert sorted(committed_steps(str(tmp_path / "mine"))) == [2, 3, 4], "the hook's own arguments win"


def test_no_dirpath_and_no_project_dir_is_refused_at_register(tmp_path):
    acc, _, _ = project_run()
    with pytest.raises(ValueError, match=r"dirpath=None.*ProjectConfiguration\(project_dir=...\)"):
        LazyCheckpointHook(every_n_steps=1).register(acc)


def test_close_removes_the_hooks(tmp_path):
    run = build()
    hook = LazyCheckpointHook(tmp_path, every_n_steps=1).register(run[0])
    train(run, range(1))
    hook.close()
    train(run, range(1))
    assert hook.step == STEPS_PER_EPOCH
    assert lazyckpt.checkpoint_step(lazyckpt.latest(tmp_path)) == STEPS_PER_EPOCH


def test_stalls_are_recorded_per_checkpoint(tmp_path):
    run = build()
    hook = LazyCheckpointHook(tmp_path, every_n_steps=2).register(run[0])
    train(run, range(1))
    hook.close()
    assert sorted(hook.stalls) == [2, 4]
    assert all(0 < s < 5 for s in hook.stalls.values())


class SlowFetch(torch.utils.data.Dataset):
    """Samples whose fetch does known work outside lazyckpt (a timed wait); ``took`` records each fetch's time."""

    def __init__(self, samples: int, work_s: float) -> None:
        self.samples, self.work_s, self.took = samples, work_s, []

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> torch.Tensor:
        started = time.monotonic()
        threading.Event().wait(self.work_s)
        self.took.append(time.monotonic() - started)
        return torch.full((4,), float(index))


def test_stalls_count_lazyckpt_time_only_not_the_loops_batch_fetch_nor_the_drain_at_close(tmp_path):
    work_s = 0.2
    acc = Accelerator(cpu=True)
    data = SlowFetch(6, work_s)
    model = torch.nn.Linear(4, 2)
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     torch.utils.data.DataLoader(data, batch_size=1))
    backend = GatedBackend()
    hook = LazyCheckpointHook(tmp_path, every_n_steps=2, backend=backend)
    # right before lazyckpt's barrier of update 3, whose copy (of step 2) waits at the gate: known work inside lazyckpt
    opt.optimizer.register_step_pre_hook(
        lambda *_: threading.Timer(work_s, backend.gate.set).start() if hook.step == 2 else None)
    hook.register(acc)
    for batch in loader:
        acc.backward(model(batch).sum())
        opt.step()
        opt.zero_grad()
    backend.gate.clear()  # step 6 goes out at close(), its copy held there: the drain waits
    threading.Timer(work_s, backend.gate.set).start()
    hook.close()
    engine = {stats.step: stats for stats in hook.checkpointer.stats}
    assert sorted(hook.stalls) == sorted(engine) == [2, 4, 6]
    assert engine[2].wait_s > 0, "step 2's copy held the barrier"
    for step in (2, 4, 6):
        assert hook.stalls[step] >= engine[step].stall_s, "everything the engine counts"
        assert hook.stalls[step] - engine[step].stall_s < min(data.took), "none of the loop's batch fetch"
    assert engine[6].wait_s == 0.0, "the drain at close() is no training stall"


def test_the_short_name_is_the_integration_class():
    from lazyckpt.integrations import accelerate as integration

    assert LazyCheckpointHook is integration.LazyCheckpointHook


def test_processes_the_accelerator_does_not_group_are_refused(tmp_path, monkeypatch):
    run = build()
    monkeypatch.setenv("WORLD_SIZE", "2")  # e.g. torchrun without CUDA and without Accelerator(cpu=True)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 processes but the Accelerator runs 1.*cpu=True"):
        LazyCheckpointHook(tmp_path).register(run[0])


def test_close_logs_the_run_summary_once_and_gives_it_to_the_trackers(tmp_path, caplog):
    run = build()
    logged = []
    run[0].log = lambda values, step=None: logged.append((dict(values), step))
    hook = LazyCheckpointHook(tmp_path, every_n_steps=2).register(run[0])
    train(run, range(1))
    with caplog.at_level("INFO"):
        hook.close()
        hook.close()
    lines = [r.getMessage() for r in caplog.records if "checkpoints committed" in r.getMessage()]
    assert lines == [lines[0]] and lines[0].startswith("lazyckpt: 2 checkpoints committed, stall median")
    assert [(values["lazyckpt/checkpoints"], step) for values, step in logged] == [(2.0, STEPS_PER_EPOCH)]
    assert logged[0][0]["lazyckpt/stall_max_ms"] == pytest.approx(1e3 * max(s.stall_s for s in hook.checkpointer.stats))
