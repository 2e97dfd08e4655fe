"""The ``cpu`` copy backend: each checksum chunk copied and checksummed in one pass on the copier thread."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lazyckpt.write.plan import Piece
from lazyckpt.write.staging.base import CopyBackend
from lazyckpt.write.staging.segments import copy_on_host, segment_refs, split_by_piece


class CpuCopyBackend(CopyBackend):
    """Copies with :func:`lazyckpt.format.checksum.copy_checksum`, which mixes each word into the checksum as it moves it.

    The fused copy costs what a plain copy does (289 MiB on one core: 23 against 21 ms), so the writer is left
    with writing only. It releases the GIL. One piece per batch: the writer starts on the first piece while the
    next one is copied, instead of after the whole checkpoint is staged.
    """

    name = "cpu"
    max_batch_pieces = 1

    def copy_pieces(
        self, sources: Sequence[torch.Tensor], pieces: Sequence[Piece], slots: Sequence[torch.Tensor]
    ) -> list[list[int]]:
        return split_by_piece(pieces, copy_on_host(sources, slots, segment_refs(pieces)))
