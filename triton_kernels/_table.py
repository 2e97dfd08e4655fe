"""Segment tables: the plain-data description of one launch, its validation, and a per-layout cache.

Pure Python plus torch only (no triton), so it is importable and testable without triton.

A launch is described by *segments* (:class:`CopySegment`): ``nbytes`` bytes from ``sources[src]`` at
``src_offset`` to ``dsts[dst]`` at ``dst_offset``, each at most one checksum chunk. The kernels read one
int64 row per segment (``ROW_WIDTH`` columns, row-major) plus a small per-launch vector of destination base
addresses:

=====  ==============  =========================================================================
col    name            meaning
=====  ==============  =========================================================================
0      ``SRC_ADDR``    base address of the source tensor (as the device sees it)
1      ``SRC_OFF``     byte offset of the segment in the source
2      ``NBYTES``      segment length in bytes (``0 <= NBYTES <= MAX_SEGMENT_BYTES``)
3      ``DST_INDEX``   which destination: index into the launch's destination-address vector
4      ``DST_OFF``     byte offset of the segment in that destination
5      ``OUT``         index of the segment's checksum in the output (its position in the caller's list)
6, 7   (reserved)      zero; pads rows to 64 bytes
=====  ==============  =========================================================================

Why destinations go through an index: source addresses (parameters, optimizer states) are stable across
checkpoints, but the host staging slot a piece lands in changes from one checkpoint to the next. Keeping slot
addresses out of the table lets one cached table serve every checkpoint with the same layout; only the few
destination addresses travel per launch.

Rows are sorted by ``NBYTES``, largest first, so the kernels' strided persistent loop hands every program a
similar number of bytes. A cached table is keyed on everything it was built from (:func:`layout_key`:
device, source addresses and sizes, destination sizes, segments), so a reallocated tensor simply misses.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

from lazyckpt.format.checksum import CHUNK_BYTES

COL_SRC_ADDR, COL_SRC_OFF, COL_NBYTES, COL_DST_INDEX, COL_DST_OFF, COL_OUT = range(6)
ROW_WIDTH = 8
WORD_ALIGN = 16
"""Alignment (bytes) both ends of a segment need for the uint64-word path; matches its ``tl.multiple_of``."""
MAX_SEGMENT_BYTES = CHUNK_BYTES
"""A segment is at most one checksum chunk: its checksum is one ``lzc64-v1`` value."""


class CopySegment(NamedTuple):
    """``nbytes`` bytes from ``sources[src]`` at ``src_offset`` to ``dsts[dst]`` at ``dst_offset``."""

    src: int
    src_offset: int
    nbytes: int
    dst: int = 0
    dst_offset: int = 0


def chunk_segments(
    nbytes: int, *, src: int = 0, dst: int = 0, dst_offset: int = 0, chunk_bytes: int = CHUNK_BYTES
) -> list[CopySegment]:
    """Segments covering ``nbytes`` bytes of one source in checksum chunks (none for an empty source).

    Example:
        >>> chunk_segments(5, dst_offset=3)
        [CopySegment(src=0, src_offset=0, nbytes=5, dst=0, dst_offset=3)]
    """
    return [
        CopySegment(src, start, min(chunk_bytes, nbytes - start), dst, dst_offset + start)
        for start in range(0, nbytes, chunk_bytes)
    ]


def validate_segments(
    segments: Sequence[CopySegment], src_sizes: Sequence[int], dst_sizes: Sequence[int] | None
) -> None:
    """Raise ValueError naming the first segment that is out of bounds, oversized or overlapping.

    Args:
        segments: The launch's segments.
        src_sizes: Byte length of each source.
        dst_sizes: Byte length of each destination, or None for a checksum-only launch (no destinations).
    """
    for i, seg in enumerate(segments):
        _check_segment(i, seg, src_sizes, dst_sizes)
    if dst_sizes is not None:
        _check_no_overlap(segments)


def _check_segment(i: int, seg: CopySegment, src_sizes: Sequence[int], dst_sizes: Sequence[int] | None) -> None:
    name = f"segments[{i}]={seg}"
    if not all(isinstance(v, int) for v in seg):
        raise ValueError(f"{name}: every field must be an int")
    if seg.nbytes < 0 or seg.src_offset < 0 or seg.dst_offset < 0:
        raise ValueError(f"{name}: nbytes and offsets must be >= 0")
    if seg.nbytes > MAX_SEGMENT_BYTES:
        raise ValueError(f"{name}: nbytes exceeds one checksum chunk ({MAX_SEGMENT_BYTES}); use chunk_segments()")
    if not 0 <= seg.src < len(src_sizes):
        raise ValueError(f"{name}: src index out of range for {len(src_sizes)} sources")
    if seg.src_offset + seg.nbytes > src_sizes[seg.src]:
        raise ValueError(
            f"{name}: reads bytes [{seg.src_offset}, {seg.src_offset + seg.nbytes}) past the end of "
            f"sources[{seg.src}] ({src_sizes[seg.src]} bytes)"
        )
    if dst_sizes is None:
        return
    if not 0 <= seg.dst < len(dst_sizes):
        raise ValueError(f"{name}: dst index out of range for {len(dst_sizes)} destinations")
    if seg.dst_offset + seg.nbytes > dst_sizes[seg.dst]:
        raise ValueError(
            f"{name}: writes bytes [{seg.dst_offset}, {seg.dst_offset + seg.nbytes}) past the end of "
            f"dsts[{seg.dst}] ({dst_sizes[seg.dst]} bytes); enlarge the buffer or fix the offset"
        )


def _check_no_overlap(segments: Sequence[CopySegment]) -> None:
    # Programs run concurrently on a GPU: two segments writing the same bytes would race.
    spans = sorted((s.dst, s.dst_offset, s.dst_offset + s.nbytes, i) for i, s in enumerate(segments) if s.nbytes)
    for (dst_a, _, end_a, i), (dst_b, start_b, _, j) in zip(spans, spans[1:]):
        if dst_a == dst_b and start_b < end_a:
            raise ValueError(
                f"segments[{i}] and segments[{j}] write overlapping bytes of dsts[{dst_a}]; "
                "give each segment its own destination range"
            )


def build_rows(segments: Sequence[CopySegment], src_addrs: Sequence[int]) -> list[list[int]]:
    """The table rows for ``segments`` (unvalidated; see :func:`validate_segments`), largest first."""
    rows = [
        [src_addrs[seg.src], seg.src_offset, seg.nbytes, seg.dst, seg.dst_offset, out, 0, 0]
        for out, seg in enumerate(segments)
    ]
    rows.sort(key=lambda row: -row[COL_NBYTES])
    return rows


def layout_key(
    device: torch.device,
    src_spans: Sequence[tuple[int, int]],
    dst_sizes: Sequence[int] | None,
    segments: Sequence[CopySegment],
) -> Hashable:
    """Everything a table depends on: device, (address, size) of each source, destination sizes, segments."""
    return (str(device), tuple(src_spans), None if dst_sizes is None else tuple(dst_sizes), tuple(segments))


class TableCache:
    """A small thread-safe LRU of device-resident segment tables, one per layout.

    Parameters and optimizer states keep their addresses across steps, so after the first checkpoint every
    launch finds its table here instead of rebuilding it and copying it to the device.

    Args:
        max_entries: How many layouts to keep (each table is ``64 * num_segments`` bytes of device memory).
    """

    def __init__(self, max_entries: int = 8) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries!r} must be at least 1")
        self.max_entries = max_entries
        self._tables: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> torch.Tensor | None:
        with self._lock:
            table = self._tables.get(key)
            if table is None:
                self.misses += 1
                return None
            self._tables.move_to_end(key)
            self.hits += 1
            return table

    def put(self, key: Hashable, table: torch.Tensor) -> None:
        with self._lock:
            self._tables[key] = table
            self._tables.move_to_end(key)
            while len(self._tables) > self.max_entries:
                self._tables.popitem(last=False)

    def __len__(self) -> int:
        return len(self._tables)

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
