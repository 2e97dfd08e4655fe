"""Where a resumed Accelerate loop starts, as docs/accelerate.md tells users to compute it: epochs and batches from
``hook.step`` under gradient accumulation, and what a stateful loader does and does not restore mid-epoch."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from test_accelerate_hook import fresh_accelerate_state, reset_accelerate  # noqa: F401 - the autouse fixture
from torch.utils.data import DataLoader

from lazyckpt import LazyCheckpointHook

SAMPLES, BATCH = 10, 2  # 5 batches per epoch: with 2 accumulation steps the last window is short


def prepared(*, accum: int = 1, stateful: bool = False, shuffle: bool = False, seedable: bool = False,
             seed: int = 0):
    """The accelerator, model, optimizer and loader of one run; with ``seedable`` Accelerate's seedable sampler and a
    model with dropout that trains (its weights are under test too)."""
    reset_accelerate()
    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=stateful, use_seedable_sampler=seedable))
    model = (torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)) if seedable
             else torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01 if seedable else 0.0)  # lr 0: only the samples seen count
    dl = DataLoader(torch.arange(float(SAMPLES)).unsqueeze(1), batch_size=BATCH, shuffle=shuffle or seedable)
    return (accelerator, *accelerator.prepare(model, opt, dl))


def train(dirpath, *, epochs: int = 2, stop_at: int | None = None, resume: bool = False, accum: int = 1,
          documented_skip: bool = True, **loader) -> tuple[list[list[float]], int, dict[str, torch.Tensor]]:
    """The docs' loop; returns the samples each batch held, the step resumed from and the model's final weights."""
    accelerator, model, opt, dl = prepared(accum=accum, **loader)
    hook = LazyCheckpointHook(dirpath).register(accelerator)
    step = hook.resume() if resume else 0
    updates_per_epoch = math.ceil(len(dl) / accelerator.gradient_accumulation_steps)
    start_epoch, updates_done = divmod(step, updates_per_epoch)
    skip = updates_done * accelerator.gradient_accumulation_steps if documented_skip else 0
    resume_dl = accelerator.skip_first_batches(dl, skip) if skip else dl  # a stateful loader skips by itself
    seen = []
    with hook:
        for epoch in range(start_epoch, epochs):
            epoch_dl = resume_dl if epoch == start_epoch else dl
            epoch_dl.set_epoch(epoch)
            for batch in epoch_dl:
                with accelerator.accumulate(model):
                    seen.append(batch.flatten().tolist())
                    accelerator.backward(model(batch).sum())
                    opt.step()
                    opt.zero_grad()
                if stop_at is not None and hook.step == stop_at and accelerator.sync_gradients:
                    hook.save()
                    return seen, step, model.state_dict()
    return seen, step, model.state_dict()


def test_the_documented_arithmetic_resumes_at_the_next_batch_under_gradient_accumulation(tmp_path):
    full, _, _ = train(tmp_path / "full", accum=2)
    first, _, _ = train(tmp_path / "run", accum=2, stop_at=4)  # epoch 0: 3 updates (2 + 2 + 1 batches), then 1 more
    rest, resumed, _ = train(tmp_path / "run", accum=2, resume=True)
    assert resumed == 4 and len(first) == 5 + 2
    assert first + rest == full


def test_a_stateful_sequential_loader_resumes_exactly_mid_epoch_without_skipping(tmp_path):
    pytest.importorskip("torchdata")
    full, _, _ = train(tmp_path / "full", stateful=True)
    first, _, _ = train(tmp_path / "run", stateful=True, stop_at=3)
    rest, _, _ = train(tmp_path / "run", stateful=True, resume=True, documented_skip=False)
    assert first + rest == full


def test_a_stateful_shuffled_loader_resumes_mid_epoch_with_a_new_permutation(tmp_path):
    pytest.importorskip("torchdata")
    full, _, _ = train(tmp_path / "full", stateful=True, shuffle=True)
    first, _, _ = train(tmp_path / "run", stateful=True, shuffle=True, stop_at=3)
    rest, _, _ = train(tmp_path / "run", stateful=True, shuffle=True, resume=True, documented_skip=False)
    assert len(first + rest) == len(full), "the loader skips the batches it had yielded"
    epoch = sorted(x for batch in first + rest[:2] for x in batch)
    assert epoch != sorted(float(i) for i in range(SAMPLES)), "not every sample once: a new permutation"


@pytest.mark.parametrize("stop_at", [3, 7], ids=["epoch-0", "epoch-1"])
def test_a_seedable_sampler_resumes_bit_exact_mid_epoch(tmp_path, stop_at):
    full, _, full_weights = train(tmp_path / "full", seedable=True, epochs=3)
    first, _, _ = train(tmp_path / "run", seedable=True, epochs=3, stop_at=stop_at)
    # The resumed process seeds itself otherwise: the sampler's initial_seed (the seed at prepare()) comes back too.
    rest, resumed, weights = train(tmp_path / "run", seedable=True, epochs=3, resume=True, seed=1)
    assert resumed == stop_at and len(first) == stop_at
    assert first + rest == full, "the same permutation, resumed at the next batch"
    for name, tensor in full_weights.items():
        assert torch.equal(weights[name], tensor), name
