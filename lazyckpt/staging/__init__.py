"""Host staging: the bounded buffer pool and the copy backends behind one interface."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lazyckpt.config import CopyBackendName
from lazyckpt.staging.base import CopyBackend
from lazyckpt.staging.cpu import CpuCopyBackend
from lazyckpt.staging.pool import HostBufferPool


def make_backend(name: CopyBackendName, tensors: Sequence[torch.Tensor] = ()) -> CopyBackend:
    """The backend for ``name``; ``auto`` resolves from where the tensors live."""
    if name is CopyBackendName.AUTO:
        on_gpu = any(t.is_cuda for t in tensors)
        name = CopyBackendName.CUDA if on_gpu and torch.cuda.is_available() else CopyBackendName.CPU
    if name is CopyBackendName.CPU:
        return CpuCopyBackend()
    if name is CopyBackendName.CUDA:
        from lazyckpt.staging.cuda import CudaCopyBackend

        return CudaCopyBackend()
    from lazyckpt.staging.triton import TritonCopyBackend

    return TritonCopyBackend()


__all__ = ["CopyBackend", "CpuCopyBackend", "HostBufferPool", "make_backend"]
