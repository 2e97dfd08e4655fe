"""Private ``@triton.jit`` kernels: multi-segment copy with a fused ``lzc64-v1`` checksum, and checksum only.

Importing this module imports triton and decorates the kernels, so it is imported lazily by the launchers
(``lazyckpt.triton_kernels._launch``). Whether the kernels run in the interpreter is fixed here, at
decoration time, by ``TRITON_INTERPRET``; :data:`INTERPRETED` records the outcome so the launchers never
disagree with the kernels about it.

Both kernels walk one int64 *segment table* (see ``_table.py`` for the columns) with a persistent grid:
program ``p`` of ``K`` handles rows ``p, p + K, p + 2K, ...``. Each row is at most one checksum chunk, and the
host orders rows by size (largest first) so that striding spreads the bytes evenly over the programs.

The checksum (``lazyckpt/format/checksum.py``) is additive over mixed words, so each program accumulates
``mix(w[i], i)`` lane-wise over its tiles and reduces once per segment:

    x = (w[i] ^ ((i + 1) * K1)) * M1;  x ^= x >> 29;  checksum = sum(x) + nbytes * K1   (all mod 2**64)

Two paths per segment, chosen at run time from the addresses: when source and destination are both 16-byte
aligned, whole uint64 words with ``tl.multiple_of`` hints (16-byte vector loads and stores on a GPU),
then a masked byte tile for the last partial word; otherwise ``[words, 8]`` byte tiles assembled into
little-endian words. Addresses are read from tables and cast to pointers, so the kernels can write pinned
host memory that was never a kernel argument (zero-copy through unified addressing).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lazyckpt.triton_kernels._table import (COL_DST_INDEX, COL_DST_OFF, COL_NBYTES, COL_OUT, COL_SRC_ADDR,
                                            COL_SRC_OFF, WORD_ALIGN)

# The lzc64-v1 constants (lazyckpt.format.checksum.K1/M1/SHIFT). Literals above 2**63 become uint64 in Triton,
# so every product below wraps mod 2**64 exactly like the numpy reference.
_K1: tl.constexpr = tl.constexpr(0x9E3779B97F4A7C15)
_M1: tl.constexpr = tl.constexpr(0xBF58476D1CE4E5B9)
_SHIFT: tl.constexpr = tl.constexpr(29)

_C_SRC_ADDR: tl.constexpr = tl.constexpr(COL_SRC_ADDR)
_C_SRC_OFF: tl.constexpr = tl.constexpr(COL_SRC_OFF)
_C_NBYTES: tl.constexpr = tl.constexpr(COL_NBYTES)
_C_DST_INDEX: tl.constexpr = tl.constexpr(COL_DST_INDEX)
_C_DST_OFF: tl.constexpr = tl.constexpr(COL_DST_OFF)
_C_OUT: tl.constexpr = tl.constexpr(COL_OUT)
_ALIGN_MASK: tl.constexpr = tl.constexpr(WORD_ALIGN - 1)


@triton.jit
def _add(a, b):
    return a + b


# tl.sum and tl.zeros are themselves @triton.jit functions of triton.language. If triton was imported before
# TRITON_INTERPRET was set (a test session in which another module imported it first), they stay compiled-mode
# functions that the interpreter cannot call. Core builtins (tl.full, tl.reduce) have no such problem, and the
# interpreter reduces with numpy when the combine function is triton's own _sum_combine (what tl.sum uses).
_SUM_COMBINE = getattr(tl.standard, "_sum_combine", None) or _add


@triton.jit
def _sum(x, AXIS: tl.constexpr):
    """``tl.sum`` for uint64 (no promotion), safe under the interpreter whatever the import order."""
    return tl.reduce(x, AXIS, _SUM_COMBINE)


@triton.jit
def _mix(words, word_index):
    """The per-word term of lzc64-v1 (uint64 in, uint64 out)."""
    key = (word_index + 1).to(tl.uint64) * _K1
    x = (words ^ key) * _M1
    return x ^ (x >> _SHIFT)


@triton.jit
def _byte_tile(src, dst, first_word, nbytes, NUM_WORDS: tl.constexpr, STORE: tl.constexpr):
    """Copy (if ``STORE``) and mix words ``[first_word, first_word + NUM_WORDS)`` read byte by byte.

    Bytes past ``nbytes`` read as zero, which is exactly the reference's zero padding of the last word;
    words wholly past the end contribute nothing. Returns the ``NUM_WORDS`` mixed terms.
    """
    word = first_word + tl.arange(0, NUM_WORDS).to(tl.int64)
    lane = tl.arange(0, 8)
    offs = word[:, None] * 8 + lane[None, :].to(tl.int64)
    mask = offs < nbytes
    data = tl.load(src + offs, mask=mask, other=0, eviction_policy="evict_first")
    if STORE:
        tl.store(dst + offs, data, mask=mask)
    # Little-endian assembly: byte j of a word is bits [8j, 8j + 8).
    words = _sum(data.to(tl.uint64) << (lane[None, :] * 8).to(tl.uint64), 1)
    return tl.where(word * 8 < nbytes, _mix(words, word), 0)


@triton.jit
def _word_segment(src_addr, dst_addr, nbytes, BLOCK_WORDS: tl.constexpr, STORE: tl.constexpr):
    """Copy/mix a segment whose source and destination are 16-byte aligned; returns its lane sums."""
    src = tl.multiple_of(src_addr.to(tl.pointer_type(tl.uint64)), 16)
    dst = tl.multiple_of(dst_addr.to(tl.pointer_type(tl.uint64)), 16)
    n_words = nbytes // 8
    n_full = n_words // BLOCK_WORDS * BLOCK_WORDS
    acc = tl.full([BLOCK_WORDS], 0, tl.uint64)
    # Full tiles carry no mask, so the compiler can emit 16-byte vector accesses.
    for first in range(0, n_full, BLOCK_WORDS):
        word = first + tl.arange(0, BLOCK_WORDS).to(tl.int64)
        data = tl.load(src + word, eviction_policy="evict_first")
        if STORE:
            tl.store(dst + word, data)
        acc += _mix(data, word)
    if n_full < n_words:
        word = n_full + tl.arange(0, BLOCK_WORDS).to(tl.int64)
        mask = word < n_words
        data = tl.load(src + word, mask=mask, other=0, eviction_policy="evict_first")
        if STORE:
            tl.store(dst + word, data, mask=mask)
        acc += tl.where(mask, _mix(data, word), 0)
    tail = tl.full([2], 0, tl.uint64)
    if n_words * 8 < nbytes:
        src_b = src_addr.to(tl.pointer_type(tl.uint8))
        dst_b = dst_addr.to(tl.pointer_type(tl.uint8))
        tail = _byte_tile(src_b, dst_b, n_words, nbytes, 2, STORE)
    return _sum(acc, 0) + _sum(tail, 0)


@triton.jit
def _byte_segment(src_addr, dst_addr, nbytes, BLOCK_WORDS: tl.constexpr, STORE: tl.constexpr):
    """Copy/mix a segment with any alignment through ``[BLOCK_WORDS, 8]`` byte tiles; returns its sum."""
    src = src_addr.to(tl.pointer_type(tl.uint8))
    dst = dst_addr.to(tl.pointer_type(tl.uint8))
    acc = tl.full([BLOCK_WORDS], 0, tl.uint64)
    for first in range(0, (nbytes + 7) // 8, BLOCK_WORDS):
        acc += _byte_tile(src, dst, first, nbytes, BLOCK_WORDS, STORE)
    return _sum(acc, 0)


@triton.jit
def _run_segments(
    table_ptr, stride_row, n_segments, dst_addrs_ptr, sums_ptr, BLOCK_BYTES: tl.constexpr, STORE: tl.constexpr
):
    """The persistent loop shared by both kernels: this program's rows, one checksum store per row."""
    BLOCK_WORDS: tl.constexpr = BLOCK_BYTES // 8
    for seg in range(tl.program_id(0), n_segments, tl.num_programs(0)):
        # int64 row offsets (the loop index is int32 on a GPU and a Python int in the interpreter).
        row = table_ptr + seg * stride_row.to(tl.int64)
        nbytes = tl.load(row + _C_NBYTES)
        src_addr = tl.load(row + _C_SRC_ADDR) + tl.load(row + _C_SRC_OFF)
        dst_addr = src_addr
        if STORE:
            dst_addr = tl.load(dst_addrs_ptr + tl.load(row + _C_DST_INDEX)) + tl.load(row + _C_DST_OFF)
        # Decided here, not on the host: destination addresses change from launch to launch.
        if ((src_addr | dst_addr) & _ALIGN_MASK) == 0:
            total = _word_segment(src_addr, dst_addr, nbytes, BLOCK_WORDS, STORE)
        else:
            total = _byte_segment(src_addr, dst_addr, nbytes, BLOCK_WORDS, STORE)
        total += nbytes.to(tl.uint64) * _K1
        # torch has no general uint64 tensors: store the bit pattern as int64.
        tl.store(sums_ptr + tl.load(row + _C_OUT), total.to(tl.int64, bitcast=True))


@triton.jit
def _copy_checksum_kernel(table_ptr, stride_row, n_segments, dst_addrs_ptr, sums_ptr, BLOCK_BYTES: tl.constexpr):
    """Copy every table row's bytes to its destination and store the row's checksum in ``sums_ptr``.

    ``dst_addrs_ptr`` holds one base address per destination buffer; rows name theirs by index, so a cached
    table serves every launch whatever staging slots the bytes land in.
    """
    _run_segments(table_ptr, stride_row, n_segments, dst_addrs_ptr, sums_ptr, BLOCK_BYTES, True)


@triton.jit
def _checksum_kernel(table_ptr, stride_row, n_segments, sums_ptr, BLOCK_BYTES: tl.constexpr):
    """Store every table row's checksum in ``sums_ptr`` without copying (destination columns unused)."""
    _run_segments(table_ptr, stride_row, n_segments, table_ptr, sums_ptr, BLOCK_BYTES, False)


def _is_interpreted(kernel: object) -> bool:
    # triton.jit returns an InterpretedFunction instead of a JITFunction when TRITON_INTERPRET was set.
    return type(kernel).__name__ == "InterpretedFunction"


INTERPRETED: bool = _is_interpreted(_copy_checksum_kernel)
"""True when these kernels were decorated under ``TRITON_INTERPRET=1`` (they run on CPU tensors only)."""

COPY_CHECKSUM_KERNEL = _copy_checksum_kernel
CHECKSUM_KERNEL = _checksum_kernel
