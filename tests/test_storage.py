"""LocalStorage: direct I/O and buffered writes give identical files; the seam conforms to its Protocol."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lazyckpt
from lazyckpt.storage import LocalStorage, Storage


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
