"""The ``cpu`` copy backend: plain ``copy_`` chunk by chunk on the copier thread (it releases the GIL)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lazyckpt.checksum import checksum_bytes
from lazyckpt.plan import Piece
from lazyckpt.staging.base import CopyBackend


class CpuCopyBackend(CopyBackend):
    """Copies with ``Tensor.copy_`` and checksums the staged bytes while they are still in cache."""

    name = "cpu"

    def copy_pieces(
        self, sources: Sequence[torch.Tensor], pieces: Sequence[Piece], slots: Sequence[torch.Tensor]
    ) -> list[list[int]]:
        return [self._copy_piece(sources, piece, slot) for piece, slot in zip(pieces, slots)]

    @staticmethod
    def _copy_piece(sources: Sequence[torch.Tensor], piece: Piece, slot: torch.Tensor) -> list[int]:
        sums = []
        for seg in piece.segments:
            dst = slot[seg.dst_offset : seg.dst_offset + seg.nbytes]
            src = sources[seg.tensor_index][seg.src_offset : seg.src_offset + seg.nbytes]
            dst.copy_(src)
            sums.append(checksum_bytes(dst.numpy()))
        return sums
