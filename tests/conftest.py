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

import lazyckpt
from lazyckpt.storage import FileKind, LocalStorage, Storage
from lazyckpt.storage.in_memory import MemoryStorage
from lazyckpt.write.staging.cpu import CpuCopyBackend


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --- storage backends ---------------------------------------------------------------------------------------
# Every backend in STORAGE_BACKENDS must pass tests/storage/test_storage_conformance.py, and the core round trips run on
# each. A backend is a function of pytest's tmp_path returning (storage, root directory to work under); add a
# new backend with one line here.
STORAGE_BACKENDS = {
    "local": lambda tmp_path: (LocalStorage(), str(tmp_path)),
    "memory": lambda tmp_path: (MemoryStorage(), "/checkpoints"),
    "fsspec-memory": lambda tmp_path: (_fsspec_storage("memory://"), f"memory://{tmp_path}"),
    "fsspec-file": lambda tmp_path: (_fsspec_storage("file://"), f"file://{tmp_path}"),
    "fsspec-s3": lambda tmp_path: _s3_storage(),
}


def _s3_storage() -> tuple[Storage, str]:
    from helpers.remote import fresh_bucket, shared_moto_endpoint
    from lazyckpt.storage.fsspec import FsspecStorage

    url, options = fresh_bucket(shared_moto_endpoint())
    return FsspecStorage(url, options), url


def _fsspec_storage(url: str) -> Storage:
    from lazyckpt.storage.fsspec import FsspecStorage

    return FsspecStorage(url)


@pytest.fixture(params=sorted(STORAGE_BACKENDS))
def storage_root(request, tmp_path) -> tuple[Storage, str]:
    """Each storage backend in turn, with an existing, empty directory to work under."""
    storage, root = STORAGE_BACKENDS[request.param](tmp_path)
    storage.make_dir(root)
    return storage, root


def load_through(storage: Storage, path: str, tmp_path, **kwargs):
    """``lazyckpt.load`` of a checkpoint held by any storage: its files are copied out through the storage's
    read side into a local directory first."""
    if isinstance(storage, LocalStorage):
        return lazyckpt.load(path, **kwargs)
    local = tmp_path / "exported" / os.path.basename(path)
    _export(storage, path, str(local))
    return lazyckpt.load(str(local), **kwargs)


def _export(storage: Storage, src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in storage.list_dir(src):
        path, info = os.path.join(src, name), storage.stat(os.path.join(src, name))
        if info.kind is FileKind.DIR:
            _export(storage, path, os.path.join(dst, name))
        elif info.kind is FileKind.FILE:
            with open(os.path.join(dst, name), "wb") as f:
                f.write(storage.read_bytes(path, max_bytes=1 << 40))


class FaultyStorage:
    """Wraps any storage; :meth:`fail` makes the next matching call of one method raise (fault injection)."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self._faults: list[list] = []
        self._mutex = threading.Lock()

    def fail(self, method: str, *, when=lambda *args: True, error: BaseException | None = None, times: int = 1,
             after: bool = False) -> BaseException:
        """Make the next ``times`` calls of ``method`` whose arguments satisfy ``when`` raise ``error`` (EIO by
        default); with ``after`` the call is made first and the error raised once it succeeded."""
        error = error if error is not None else OSError(errno.EIO, f"Input/output error (injected in {method})")
        with self._mutex:
            self._faults.append([method, when, error, times, after])
        return error

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            fault = self._take_fault(name, args)
            if fault is not None and not fault[4]:
                raise fault[2]
            result = attr(*args, **kwargs)
            if fault is not None:
                raise fault[2]
            return result

        return call

    def _take_fault(self, name: str, args: tuple):
        with self._mutex:
            for fault in self._faults:
                if fault[0] == name and fault[3] > 0 and fault[1](*args):
                    fault[3] -= 1
                    return fault
        return None


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
