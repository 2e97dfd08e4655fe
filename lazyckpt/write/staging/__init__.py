"""Host staging: the bounded buffer pool and the copy backends behind one interface (:func:`make_backend`).

| module | owns |
|---|---|
| ``base`` | the :class:`CopyBackend` seam: request-time ordering, eager copies, piece copies with their checksums |
| ``cpu`` | :class:`CpuCopyBackend`: each chunk copied and checksummed in one pass on the copier thread |
| ``cuda`` | ``CudaCopyBackend``: non-blocking copies on a dedicated stream ordered after the compute stream by an event |
| ``triton`` | ``TritonCopyBackend``: one Triton launch per batch copies every segment with fused checksums |
| ``pool`` | :class:`HostBufferPool`: the bounded, page-aligned (pinned on GPUs) staging slots, reused across checkpoints |
| ``segments`` | the segments of a batch of pieces addressed by slot, and their copy on the host |
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from lazyckpt.config import CopyBackendName
from lazyckpt.write.staging.base import CopyBackend
from lazyckpt.write.staging.cpu import CpuCopyBackend
from lazyckpt.write.staging.pool import HostBufferPool


def make_backend(name: CopyBackendName, tensors: Sequence[torch.Tensor] = ()) -> CopyBackend:
    """The backend for ``name``; ``auto`` resolves from where the tensors live."""
    if name is CopyBackendName.AUTO:
        if not (torch.cuda.is_available() and any(t.is_cuda for t in tensors)):
            return CpuCopyBackend()
        if importlib.util.find_spec("triton") is None:
            from lazyckpt.write.staging.cuda import CudaCopyBackend

            return CudaCopyBackend()
        # Copy engines for large tensors, one packing Triton launch for the many small ones (docs/triton.md).
        from lazyckpt.write.staging.triton import AUTO_CE_MIN_BYTES, TritonCopyBackend

        return TritonCopyBackend(ce_min_bytes=AUTO_CE_MIN_BYTES)
    if name is CopyBackendName.CPU:
        return CpuCopyBackend()
    if name is CopyBackendName.CUDA:
        from lazyckpt.write.staging.cuda import CudaCopyBackend

        return CudaCopyBackend()
    from lazyckpt.write.staging.triton import TritonCopyBackend

    return TritonCopyBackend()


__all__ = ["CopyBackend", "CpuCopyBackend", "HostBufferPool", "make_backend"]
