"""Loading reads tensor bytes in large pieces straight into the result, with checksums checked alongside."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
import torch

import lazyckpt
from lazyckpt import cli
from lazyckpt.format.checksum import CHUNK_BYTES
from lazyckpt.read.tensor_io import READ_BYTES
from lazyckpt.storage import LocalStorage

from helpers.forge import FILE, split_tensor_file


@pytest.fixture
def large(tmp_path):
    """Tensors spanning several reads, mixed with small ones that are checked on the reading thread."""
    generator = torch.Generator().manual_seed(0)
    state = {"big": torch.randn(READ_BYTES // 4 * 2 + 12345, generator=generator),
             "small": [torch.full((7,), float(i)) for i in range(9)],
             "half": torch.randn(3 * CHUNK_BYTES // 2, generator=generator).to(torch.bfloat16),
             "array": np.arange(5)}
    with lazyckpt.LazyCheckpointer(tmp_path / "c") as ckpt:
        path = ckpt.save(state, step=1).wait()
    return path, state


def test_tensors_spanning_several_reads_load_bit_exact(large):
    path, state = large
    loaded = lazyckpt.load(path)
    assert torch.equal(loaded["big"], state["big"]) and torch.equal(loaded["half"], state["half"])
    assert all(torch.equal(a, b) for a, b in zip(loaded["small"], state["small"]))
    lazyckpt.verify(path)


def test_a_corrupt_chunk_in_a_later_read_is_named(large):
    path, _ = large
    file = os.path.join(path, FILE)
    header, data = split_tensor_file(file)
    data_start = os.path.getsize(file) - len(data)
    with open(file, "r+b") as f:  # a byte of the second read of 'big'
        f.seek(data_start + header["big"]["data_offsets"][0] + READ_BYTES + 5)
        old = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([old[0] ^ 1]))
    chunk = READ_BYTES // CHUNK_BYTES
    for reader in (lazyckpt.load, lazyckpt.verify):
        with pytest.raises(lazyckpt.CheckpointCorruptError, match=f"tensor 'big' is corrupt: chunk {chunk} "):
            reader(path)


@pytest.mark.gpu
def test_load_to_a_cuda_device_is_bit_exact_and_checked(large):
    path, state = large
    loaded = lazyckpt.load(path, map_location="cuda")
    assert loaded["big"].device.type == "cuda"
    assert torch.equal(loaded["big"].cpu(), state["big"]) and torch.equal(loaded["half"].cpu(), state["half"])
    assert all(torch.equal(a.cpu(), b) for a, b in zip(loaded["small"], state["small"]))
    assert isinstance(loaded["array"], np.ndarray) and loaded["array"].tolist() == [0, 1, 2, 3, 4]


class MountedStorage(LocalStorage):
    """Serves a local directory as ``mount://c``: code that bypasses the storage finds nothing."""

    def __init__(self, root):
        super().__init__()
        self.root = str(root)

    def real(self, path):
        assert path.startswith("mount://c"), f"reader passed a path the storage did not give out: {path}"
        return self.root + path.removeprefix("mount://c")

    def stat(self, path):
        return super().stat(self.real(path))

    def list_dir(self, path):
        return super().list_dir(self.real(path))

    def resolve(self, path):
        return path

    def open_read(self, path):
        return super().open_read(self.real(path))

    def read_bytes(self, path, *, max_bytes):
        return super().read_bytes(self.real(path), max_bytes=max_bytes)

    def read_link(self, path):
        return super().read_link(self.real(path))


class FailingReads(MountedStorage):
    def open_read(self, path):
        handle = super().open_read(path)
        if path.endswith(".safetensors"):
            def fail(offset, buffer):
                raise OSError(errno.EIO, "Input/output error")
            handle.read_into = fail
        return handle


def test_the_reader_and_the_cli_touch_files_only_through_the_storage(large, capsys):
    path, state = large
    storage = MountedStorage(os.path.dirname(path))
    mounted = "mount://c/" + os.path.basename(path)
    assert lazyckpt.latest("mount://c", storage=storage) == mounted
    assert torch.equal(lazyckpt.load(mounted, storage=storage)["big"], state["big"])
    lazyckpt.verify(mounted, storage=storage)
    assert lazyckpt.checkpoint_step(mounted, storage=storage) == 1
    for command in (["ls", "mount://c"], ["show", mounted], ["verify", mounted]):
        assert cli.main(command, storage=storage) == 0, capsys.readouterr()


def test_an_io_error_while_reading_names_the_file(large):
    path, _ = large
    storage = FailingReads(os.path.dirname(path))
    with pytest.raises(OSError, match=f"{FILE}: reading the header length failed: Input/output error"):
        lazyckpt.load("mount://c/" + os.path.basename(path), storage=storage)


def test_loading_leaves_no_thread_behind_and_the_torch_thread_count_unchanged(large):
    path, _ = large
    threads = torch.get_num_threads()
    lazyckpt.load(path)
    lazyckpt.verify(path)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("lazyckpt-load")]
    assert torch.get_num_threads() == threads


def test_a_partial_directory_named_with_a_trailing_dot_is_still_not_a_checkpoint(tmp_path):
    import shutil

    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        path = ckpt.save({"w": torch.ones(2)}, step=1).wait()
    partial = tmp_path / "step-0000002.partial"
    shutil.copytree(path, partial)  # every file there, but never committed
    for name in (f"{partial}/.", f"{partial}/", f"{tmp_path}/./step-0000002.partial"):
        with pytest.raises(lazyckpt.CheckpointNotFoundError, match="partial"):
            lazyckpt.load(name)
        with pytest.raises(lazyckpt.CheckpointNotFoundError):
            lazyckpt.verify(name)


def test_load_into_a_tree_naming_a_tensor_no_file_holds_is_a_format_error(tmp_path):
    from helpers.forge import edit_manifest, reseal

    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        path = ckpt.save({"w": torch.ones(2)}, step=1).wait()
    edit_manifest(os.path.join(path, "rank-00000.json"),
                  lambda doc: doc["tree"]["$dict"].append(["g", {"$tensor": "ghost"}]))
    reseal(path)
    with pytest.raises(lazyckpt.CheckpointFormatError, match="'ghost'"):
        lazyckpt.load_into(path, {"w": torch.zeros(2)})
