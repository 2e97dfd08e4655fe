"""LocalStorage: direct I/O and buffered writes give identical files; the seam conforms to its Protocol."""

from __future__ import annotations

import errno
import fcntl
import os
import threading

import numpy as np
import pytest
import torch

import lazyckpt
from lazyckpt.storage import FileKind, LocalStorage, Storage, _direct, kind_of


def test_local_storage_satisfies_the_protocol():
    assert isinstance(LocalStorage(), Storage)


@pytest.mark.parametrize("direct_io", [True, False])
def test_in_order_out_of_order_and_unaligned_writes_land_exactly(tmp_path, direct_io):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (20 << 20) + 123, dtype=np.uint8)  # spans several bounce blocks, odd tail
    storage = LocalStorage(direct_io=direct_io)
    handle = storage.open_write(str(tmp_path / "f"))
    cuts = [0, 4096, 5000, (9 << 20) + 7, 17 << 20, data.size]
    for start, end in zip(cuts[:-2], cuts[1:-1]):  # in order, in uneven pieces
        storage.write(handle, start, [memoryview(data[start:end])])
    storage.write(handle, cuts[-2], [memoryview(data[cuts[-2]:])])
    storage.write(handle, 10, [memoryview(data[10:20])])  # an out-of-order rewrite of the same bytes
    storage.close(handle, sync=True)
    assert np.array_equal(np.fromfile(tmp_path / "f", dtype=np.uint8), data)


@pytest.mark.parametrize("direct_io", [True, False])
def test_checkpoints_are_byte_identical_with_and_without_direct_io(tmp_path, direct_io):
    state = {"w": torch.arange(3_000_000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int8)}
    with lazyckpt.LazyCheckpointer(tmp_path / str(direct_io), storage=LocalStorage(direct_io=direct_io)) as c:
        path = c.save(state, step=1).wait()
    loaded = lazyckpt.load(path)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])


def _direct_io_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "lazyckpt-direct-io"]


def test_a_failed_direct_write_surfaces_in_the_writer_and_leaves_no_thread(tmp_path, monkeypatch):
    real_pwrite_all = _direct.pwrite_all

    def refuse_direct_fd(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset >= (8 << 20):  # the direct stream's 2nd block
            raise OSError(errno.ENOSPC, "No space left on device")
        real_pwrite_all(fd, buffers, offset)

    monkeypatch.setattr(_direct, "pwrite_all", refuse_direct_fd)
    data = np.zeros(40 << 20, np.uint8)
    handle = LocalStorage(direct_io=True).open_write(str(tmp_path / "f"))
    assert handle.stream is not None, "this test needs a file system that accepts O_DIRECT"
    with pytest.raises(OSError, match="No space left"):
        for start in range(0, data.size, 1 << 20):  # the error reaches a later write or, at the latest, close
            handle.write(start, [memoryview(data[start : start + (1 << 20)])])
        handle.close(sync=True)
    with pytest.raises(OSError, match="No space left"):  # closing never hides the lost bytes
        handle.close(sync=False)
    assert not _direct_io_threads()


def test_kind_of_follows_links_and_says_none_for_a_broken_or_looping_one(tmp_path):
    storage = LocalStorage()
    (tmp_path / "step").mkdir()
    (tmp_path / "file").write_bytes(b"x")
    os.symlink(tmp_path / "step", tmp_path / "last.ckpt")
    os.symlink(tmp_path / "gone", tmp_path / "broken")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    assert kind_of(storage, str(tmp_path / "last.ckpt")) is FileKind.DIR
    assert kind_of(storage, str(tmp_path / "file")) is FileKind.FILE
    assert kind_of(storage, str(tmp_path / "broken")) is None
    assert kind_of(storage, str(tmp_path / "loop")) is None
    assert kind_of(storage, str(tmp_path / "loop" / "inside")) is None  # ELOOP on the way: not there, as os.path says
