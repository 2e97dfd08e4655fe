"""Host staging: the bounded buffer pool and the copy backends behind one interface."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from lazyckpt.config import CopyBackendName
from lazyckpt.staging.base import CopyBackend
from lazyckpt.staging.cpu import CpuCopyBackend
from lazyckpt.staging.pool import HostBufferPool


def make_backend(name: CopyBackendName, tensors: Sequence[torch.Tensor] = ()) -> CopyBackend:
    """The backend for ``name``; ``auto`` resolves from where the tensors live."""
    if name is CopyBackendName.AUTO:
        if not (torch.cuda.is_available() and any(t.is_cuda for t in tensors)):
            return CpuCopyBackend()
        if importlib.util.find_spec("triton") is None:
            from lazyckpt.staging.cuda import CudaCopyBackend

            return CudaCopyBackend()
        # Copy engines for large tensors, one packing Triton launch for the many small ones (docs/triton.md).
        from lazyckpt.staging.triton import AUTO_CE_MIN_BYTES, TritonCopyBackend

        return TritonCopyBackend(ce_min_bytes=AUTO_CE_MIN_BYTES)
    if name is CopyBackendName.CPU:
        return CpuCopyBackend()
    if name is CopyBackendName.CUDA:
        from lazyckpt.staging.cuda import CudaCopyBackend

        return CudaCopyBackend()
    from lazyckpt.staging.triton import TritonCopyBackend

    return TritonCopyBackend()


__all__ = ["CopyBackend", "CpuCopyBackend", "HostBufferPool", "make_backend"]
