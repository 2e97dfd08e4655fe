"""Fresh CPU tensors for loaded bytes, on transparent huge pages where the kernel offers them.

A restore writes every byte of a fresh tensor once. With 4 KiB pages that first touch costs one page fault per
4 KiB (measured here: 289 MiB read from a tmpfs into ``torch.empty`` memory took 0.19-0.20 s, about 1.5 GB/s); on
2 MiB pages the kernel takes one fault per 2 MiB and the same read took 0.13-0.15 s. Large tensors therefore get
their own private anonymous mapping, advised ``MADV_HUGEPAGE`` (honoured when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``; otherwise it is ordinary memory).

The memory is the tensor's alone: no file is behind it, and it is unmapped when the last tensor using it is
freed (``torch.frombuffer`` keeps the mapping alive). Such a tensor cannot be resized in place
(``Tensor.resize_``), as for any tensor made from a buffer; everything else works as for ``torch.empty``.
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

HUGE_PAGE_BYTES = 2 << 20
"""The x86-64 and arm64 (4 KiB base page) transparent huge page; a mapping is aligned to it."""
MIN_MAPPED_BYTES = HUGE_PAGE_BYTES
"""Smaller tensors come from torch's allocator: they fill no huge page."""
_CAN_ADVISE = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")


def empty_cpu(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor of ``shape`` and ``dtype``, on huge pages when it is large enough."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not _CAN_ADVISE or nbytes < MIN_MAPPED_BYTES:
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    skip = -np.frombuffer(region, np.uint8, count=1).ctypes.data % HUGE_PAGE_BYTES
    # Before the first touch, so the faults take whole huge pages; only the huge pages the tensor fills, so its
    # tail (and the alignment slack, never touched) costs no memory beyond its bytes.
    region.madvise(mmap.MADV_HUGEPAGE, skip, nbytes - nbytes % HUGE_PAGE_BYTES)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=skip).view(dtype).view(shape)
