"""The direct-I/O file writer: aligned buffers go to the disk in place, everything else through bounce buffers."""

from __future__ import annotations

import numpy as np
import pytest

from lazyckpt.storage import LocalStorage
from lazyckpt.write.staging.pool import HostBufferPool

ALIGN = 4096


def _aligned(nbytes: int, seed: int) -> np.ndarray:
    raw = np.empty(nbytes + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    out = raw[skip : skip + nbytes]
    out[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return out


@pytest.fixture
def direct_file(tmp_path):
    storage = LocalStorage()
    path = tmp_path / "t.bin"
    handle = storage.open_write(str(path))
    if handle.stream is None:
        storage.close(handle, sync=False)
        pytest.skip("this file system refuses O_DIRECT")
    yield storage, handle, path


def test_mixed_writes_land_byte_for_byte(direct_file):
    storage, handle, path = direct_file
    header = np.full(ALIGN, 7, np.uint8)
    slot = _aligned(3 * ALIGN + 100, 1)  # in place, then a 100-byte tail through the bounce buffer
    unaligned = _aligned(5 * ALIGN + 1, 2)[1:]  # starts off the boundary: bounced
    second_slot = _aligned(2 * ALIGN, 3)  # the file position is no longer aligned: bounced
    offset = 0
    for data in (header, slot, unaligned, second_slot):
        storage.write(handle, offset, [data])
        offset += data.size
    storage.close(handle, sync=True)
    assert path.read_bytes() == b"".join(d.tobytes() for d in (header, slot, unaligned, second_slot))


def test_an_aligned_buffer_is_in_the_file_when_write_returns_and_an_unaligned_one_waits_in_a_bounce(direct_file):
    storage, handle, path = direct_file
    slot = _aligned(3 * ALIGN, 4)
    storage.write(handle, 0, [slot])
    assert path.read_bytes() == slot.tobytes()  # written in place, synchronously: no bounce copy
    storage.write(handle, slot.size, [_aligned(ALIGN + 1, 5)[1:]])
    assert path.stat().st_size == slot.size  # still in the bounce buffer, written by close
    storage.close(handle, sync=True)
    assert path.stat().st_size == 4 * ALIGN


def test_pool_slots_start_on_page_boundaries():
    pool = HostBufferPool(3, slot_bytes=1 << 20)
    assert all(pool.slot(i).data_ptr() % ALIGN == 0 for i in range(3))


def test_tensors_whose_sizes_are_whole_pages_are_laid_out_first_so_their_offsets_stay_page_aligned():
    from lazyckpt.format.header import TensorEntry
    from lazyckpt.write.plan import layout

    sizes = {"odd": 1000 * 4, "page": 1024 * 4, "big": 3 * 1024 * 4, "word": 12 * 4}
    entries = [TensorEntry(k, "F32", (n // 4,), n, lazy=True) for k, n in sizes.items()]
    placed, _ = layout(entries)
    assert [e.key for e in placed[:2]] == ["page", "big"]
    assert all(e.offset % ALIGN == 0 for e in placed[:3])  # up to and including the first other size
