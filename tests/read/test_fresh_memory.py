"""Loaded CPU tensors live in their own memory (huge pages for large ones), filled by reads on several threads."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import lazyckpt
from lazyckpt.format.checksum import CHUNK_BYTES
from lazyckpt.read.fresh_memory import HUGE_PAGE_BYTES, empty_cpu
from lazyckpt.read.tensor_io import READ_BYTES
from lazyckpt.storage import LocalStorage

from helpers.forge import FILE, split_tensor_file


@pytest.fixture
def saved(tmp_path):
    generator = torch.Generator().manual_seed(1)
    state = {"big": torch.randn(READ_BYTES // 4 * 3 + 999, generator=generator),  # several pieces, odd tail
             "mid": torch.randint(0, 2**15, (3 * HUGE_PAGE_BYTES // 2 + 7,), dtype=torch.int16, generator=generator),
             "small": torch.arange(11, dtype=torch.float64)}
    with lazyckpt.LazyCheckpointer(tmp_path / "c") as ckpt:
        path = ckpt.save(state, step=1).wait()
    return path, {k: v.clone() for k, v in state.items()}


def _flip(file: str, tensor: str, offset: int) -> None:
    header, data = split_tensor_file(file)
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) - len(data) + header[tensor]["data_offsets"][0] + offset)
        old = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([old[0] ^ 0x40]))


def test_loaded_tensors_do_not_change_when_the_file_is_rewritten_or_removed(saved):
    path, state = saved
    loaded = lazyckpt.load(path)
    _flip(os.path.join(path, FILE), "big", 5)  # in place, as another writer could: the load's bytes are its own
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    shutil.rmtree(path)
    loaded["big"] += 1  # writable, and still alive with the file gone
    assert torch.equal(loaded["big"], state["big"] + 1) and torch.equal(loaded["mid"], state["mid"])


@pytest.mark.parametrize(("tensor", "offset"), [("big", 0), ("big", 2 * READ_BYTES + 3), ("mid", 3 * CHUNK_BYTES - 1)])
def test_a_flipped_byte_read_on_a_worker_is_refused_and_named(saved, tensor, offset):
    path, _ = saved
    _flip(os.path.join(path, FILE), tensor, offset)
    with pytest.raises(lazyckpt.CheckpointCorruptError,
                       match=f"tensor '{tensor}' is corrupt: chunk {offset // CHUNK_BYTES} "):
        lazyckpt.load(path)


class ShortReads(LocalStorage):
    """A tensor file that ends early for reads past ``cut`` (as if truncated after its header was checked)."""

    def __init__(self, cut: int) -> None:
        super().__init__()
        self.cut = cut

    def open_read(self, path):
        handle = super().open_read(path)
        read, cut = handle.read_into, self.cut
        handle.read_into = lambda offset, buffer: 0 if offset >= cut else read(offset, buffer)
        return handle


def test_a_short_read_on_a_worker_is_a_truncation_error(saved):
    path, _ = saved
    storage = ShortReads(os.path.getsize(os.path.join(path, FILE)) - READ_BYTES)
    assert storage.open_read(os.path.join(path, FILE)).parallel_reads
    with pytest.raises(lazyckpt.CheckpointCorruptError, match="file is truncated inside tensor 'big'"):
        lazyckpt.load(path, storage=storage)


@pytest.mark.parametrize("shape", [[0], [3], [HUGE_PAGE_BYTES // 4], [5, HUGE_PAGE_BYTES // 8 + 3], []])
def test_empty_cpu_gives_private_writable_tensors_of_the_shape(shape):
    first, second = empty_cpu(shape, torch.float32), empty_cpu(shape, torch.float32)
    assert list(first.shape) == shape and first.dtype == torch.float32 and first.is_contiguous()
    first.fill_(1.5)
    second.fill_(-2.0)
    assert bool((first == 1.5).all()) and bool((second == -2.0).all())
