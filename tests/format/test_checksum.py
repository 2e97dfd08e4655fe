"""The format's checksum: pinned values, and the changes it must catch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lazyckpt.format.checksum import CHUNK_BYTES, checksum_bytes, checksum_run, chunk_checksums, copy_checksum


def test_checksum_values_are_pinned_for_the_format_s_life():
    data = np.arange(20, dtype=np.uint8)  # 20 bytes: two words plus a zero-padded tail
    assert checksum_bytes(data) == 0x2B067BE1214F76A5
    assert checksum_bytes(np.empty(0, np.uint8)) == 0


def test_a_flipped_bit_and_two_swapped_words_change_the_checksum():
    words = np.random.default_rng(0).integers(0, 2**63, 1000, dtype=np.uint64)
    base = checksum_bytes(words.view(np.uint8))
    flipped = words.copy().view(np.uint8)
    flipped[4321] ^= 0x10
    assert checksum_bytes(flipped) != base
    swapped = words.copy()
    swapped[[10, 500]] = swapped[[500, 10]]
    assert checksum_bytes(swapped.view(np.uint8)) != base


def test_zero_padding_is_not_the_same_as_stored_zeros():
    assert checksum_bytes(np.zeros(5, np.uint8)) != checksum_bytes(np.zeros(8, np.uint8))


def test_chunks_are_counted_from_each_tensor_s_first_byte():
    t = torch.arange(CHUNK_BYTES // 4 + 3, dtype=torch.float32)
    sums = chunk_checksums(t)
    raw = t.numpy().view(np.uint8)
    assert sums == [checksum_bytes(raw[:CHUNK_BYTES]), checksum_bytes(raw[CHUNK_BYTES:])]


def _formula(data: np.ndarray) -> int:
    """The format's definition, written out in one pass over the whole chunk."""
    padded = np.zeros(data.size + (-data.size % 8), np.uint8)
    padded[: data.size] = data
    words = padded.view("<u8")
    x = (words ^ (np.arange(1, words.size + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    return (int(x.sum(dtype=np.uint64)) + data.size * 0x9E3779B97F4A7C15) % 2**64


def test_chunks_mixed_in_cache_sized_blocks_match_the_formula_at_every_size():
    data = np.random.default_rng(1).integers(0, 256, CHUNK_BYTES, dtype=np.uint8)
    for size in (CHUNK_BYTES, CHUNK_BYTES - 3, 256 << 10, (256 << 10) + 8, 777_777):
        assert checksum_bytes(data[:size]) == _formula(data[:size]), size
    run = np.concatenate([data, data[:12345]])
    assert checksum_run(run) == [_formula(data), _formula(data[:12345])]


def test_a_copy_checksummed_block_by_block_equals_the_copied_bytes_and_their_checksum():
    data = np.random.default_rng(2).integers(0, 256, CHUNK_BYTES, dtype=np.uint8)
    for size in (CHUNK_BYTES, CHUNK_BYTES - 3, 256 << 10, (256 << 10) + 5, 13, 0):
        dest = np.zeros(size, np.uint8)
        assert copy_checksum(dest, data[:size]) == _formula(data[:size]), size
        assert np.array_equal(dest, data[:size]), size


def test_a_copy_between_arrays_of_different_sizes_is_refused():
    with pytest.raises(ValueError, match="dest of 8 and source of 16 bytes"):
        copy_checksum(np.zeros(8, np.uint8), np.zeros(16, np.uint8))


@pytest.mark.parametrize("dest_offset", [0, 8, 13])
def test_large_copies_into_aligned_and_unaligned_memory_give_the_same_bytes_and_checksum(dest_offset):
    # Copies of at least 256 KiB into 64-byte-aligned memory take the streaming-store path where the CPU has one.
    data = np.random.default_rng(3).integers(0, 256, CHUNK_BYTES + 64, dtype=np.uint8)
    raw = np.zeros(CHUNK_BYTES + 128, np.uint8)
    start = -raw.ctypes.data % 64 + dest_offset
    for size in (CHUNK_BYTES, (256 << 10), (256 << 10) + 8 * 7, CHUNK_BYTES - 3):
        dest = raw[start : start + size]
        dest[:] = 0
        assert copy_checksum(dest, data[1 : 1 + size]) == _formula(data[1 : 1 + size]), (dest_offset, size)
        assert np.array_equal(dest, data[1 : 1 + size]), (dest_offset, size)
