"""Segments of a batch of pieces, addressed by slot, and their copy on the host: shared by every copy backend."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lazyckpt.format.checksum import copy_checksum
from lazyckpt.write.plan import Piece, Segment

SegmentRef = tuple[int, Segment]
"""A segment together with the index of the piece (and slot) it belongs to."""


def segment_refs(pieces: Sequence[Piece]) -> list[SegmentRef]:
    """Every segment of ``pieces`` in order, tagged with its piece index (= its slot's index)."""
    return [(i, seg) for i, piece in enumerate(pieces) for seg in piece.segments]


def split_by_piece(pieces: Sequence[Piece], flat: Sequence[int]) -> list[list[int]]:
    """Cut a flat list of per-segment values back into one list per piece."""
    out, start = [], 0
    for piece in pieces:
        out.append(list(flat[start : start + len(piece.segments)]))
        start += len(piece.segments)
    return out


def slot_range(slot: torch.Tensor, seg: Segment) -> torch.Tensor:
    return slot[seg.dst_offset : seg.dst_offset + seg.nbytes]


def source_range(source: torch.Tensor, seg: Segment) -> torch.Tensor:
    return source[seg.src_offset : seg.src_offset + seg.nbytes]


def copy_on_host(
    sources: Sequence[torch.Tensor],
    slots: Sequence[torch.Tensor],
    refs: Sequence[SegmentRef],
    *,
    checksum: bool = True,
) -> list[int]:
    """Copy CPU-resident segments; their checksums if ``checksum`` (computed in the copy's pass), else ``[]``."""
    sums = []
    for piece, seg in refs:
        dst, src = slot_range(slots[piece], seg), source_range(sources[seg.tensor_index], seg)
        if checksum:
            sums.append(copy_checksum(dst.numpy(), src.numpy()))
        else:
            dst.copy_(src)
    return sums
