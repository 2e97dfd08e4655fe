"""Triton chunked copy kernels with fused ``lzc64-v1`` checksums, and their host launchers.

Importing this package never imports triton (an optional dependency); the kernels are compiled on first
launch. On a CUDA machine they copy CUDA tensors into pinned host memory on the current stream; with
``TRITON_INTERPRET=1`` set before triton is imported they run in the Triton interpreter on CPU tensors,
which is how CI tests them. Design notes: docs/triton.md.

| module | owns |
|---|---|
| ``_table`` | the segment table a launch reads (built, validated and cached per layout) |
| ``_kernels`` | the Triton kernels: chunked copy with fused checksums, checksum only |
| ``_launch`` | the host launchers: inputs checked, table built or reused, grid sized, kernel launched |

Example:
    >>> import torch
    >>> from lazyckpt.triton_kernels import chunk_segments, checksums_to_list, copy_with_checksums
    >>> src = torch.arange(100, dtype=torch.uint8, device="cuda")  # doctest: +SKIP
    >>> dst = torch.empty(100, dtype=torch.uint8, pin_memory=True)  # doctest: +SKIP
    >>> sums = copy_with_checksums([src], [dst], chunk_segments(100))  # doctest: +SKIP
    >>> torch.cuda.current_stream().synchronize(); checksums_to_list(sums)  # doctest: +SKIP
"""

from __future__ import annotations

from lazyckpt.triton_kernels._launch import (DEFAULT_BLOCK_BYTES, DEFAULT_NUM_PROGRAMS, DEFAULT_NUM_WARPS,
                                             check_launch_options, checksum_segments, checksums_to_list, copy_tensor,
                                             copy_with_checksums, interpreter_active, require_runtime,
                                             triton_available)
from lazyckpt.triton_kernels._table import MAX_SEGMENT_BYTES, CopySegment, TableCache, chunk_segments

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_NUM_PROGRAMS",
    "DEFAULT_NUM_WARPS",
    "MAX_SEGMENT_BYTES",
    "CopySegment",
    "TableCache",
    "check_launch_options",
    "checksum_segments",
    "checksums_to_list",
    "chunk_segments",
    "copy_tensor",
    "copy_with_checksums",
    "interpreter_active",
    "require_runtime",
    "triton_available",
]
