"""Shared fixtures: small models, and backends/storages that tests use to hold or break the pipeline."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU tensors; it must be chosen before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lazyckpt.staging.cpu import CpuCopyBackend
from lazyckpt.storage import LocalStorage


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class GatedBackend(CpuCopyBackend):
    """A CPU backend whose copies wait until the test opens the gate; ``entered`` fires when a copy starts."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    def copy_pieces(self, sources, pieces, slots):
        self.entered.set()
        self.gate.wait()
        return super().copy_pieces(sources, pieces, slots)


class FailingStorage(LocalStorage):
    """Local files, except that writes fail with ENOSPC while ``fail`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False
        self.error: OSError | None = None

    def write(self, handle, offset, buffers):
        if self.fail:
            self.error = OSError(errno.ENOSPC, "No space left on device (injected)")
            raise self.error
        super().write(handle, offset, buffers)


@pytest.fixture
def trained():
    """A small model and AdamW after one step, so the optimizer has state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt)
    return model, opt


def step(model, opt, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def snapshot(model, opt) -> dict:
    return {"model": model.state_dict(), "opt": opt.state_dict()}


def clone_tree(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(clone_tree(v) for v in tree)
    return tree


def assert_tree_equal(actual, expected, path="state"):
    """Bit-exact equality of nested structures, types included (tuple vs list, int keys)."""
    assert type(actual) is type(expected) or (isinstance(actual, dict) and isinstance(expected, dict)), \
        f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(actual.reshape(-1).view(torch.uint8) if actual.numel() else actual,
                           expected.contiguous().reshape(-1).view(torch.uint8) if expected.numel() else expected), path
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_tree_equal(actual[k], expected[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_tree_equal(a, e, f"{path}[{i}]")
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, f"{path}: expected nan"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
