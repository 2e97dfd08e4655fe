"""The copy-backend seam: how staged bytes move from live tensors into host buffers, with their checksums.

The engine's copier thread calls one backend for the whole life of a checkpointer:

* :meth:`CopyBackend.on_request` runs on the training thread inside ``save()``; the CUDA backends record an
  event on the current (compute) stream there, so the copy stream is ordered after the optimizer step.
* :meth:`CopyBackend.copy_eager` runs on the training thread inside ``save()`` for tensors outside the
  immutability window and returns a private, contiguous CPU copy.
* :meth:`CopyBackend.copy_pieces` runs on the copier thread; it copies each piece's segments from the flat
  ``uint8`` sources into its destination slot and returns every segment's checksum (``lazyckpt.format.checksum``)
  when it computed them in the same pass, else ``None``. It returns only when the bytes are in host memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from lazyckpt.write.plan import Piece


class CopyBackend(ABC):
    """One way of copying tensors to host staging buffers (see the module docstring for the contract)."""

    name: str = "abstract"
    max_batch_pieces: int = 64
    """Pieces handed to :meth:`copy_pieces` at once: many for the GPU backends (one Triton launch, one stream
    sync per batch), one for a backend that copies synchronously, so the writer can start on the first piece."""

    def on_request(self, sources: Sequence[torch.Tensor]) -> None:
        """Called in ``save()`` on the training thread with the lazy sources (default: nothing to order)."""

    def copy_eager(self, tensor: torch.Tensor) -> torch.Tensor:
        """A private contiguous CPU copy of ``tensor``, made now (default: a synchronous ``copy_``)."""
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        out.copy_(tensor.detach())
        return out

    def prepare_source(self, tensor: torch.Tensor) -> torch.Tensor:
        """The flat ``uint8`` view of a lazy tensor the copies read from (made contiguous if needed)."""
        flat = tensor.detach()
        if not flat.is_contiguous():
            flat = flat.contiguous()
        flat = flat.reshape(-1)
        return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)

    @abstractmethod
    def copy_pieces(
        self, sources: Sequence[torch.Tensor], pieces: Sequence[Piece], slots: Sequence[torch.Tensor]
    ) -> list[list[int]] | None:
        """Copy ``pieces[i]`` into ``slots[i]`` (CPU ``uint8``); return when the bytes are in host memory.

        Returns each piece's segment checksums when the backend computed them in the same pass (a fused
        kernel), or ``None``: then the writer checksums the staged bytes, off the barrier's critical path.
        """

    def pin_memory(self) -> bool:
        """Whether the host pool should be pinned (page-locked) for this backend."""
        return False
