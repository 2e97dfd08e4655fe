"""The ``cuda`` copy backend: ``copy_(non_blocking=True)`` on a dedicated stream into pinned slots.

Ordering (design brief, "Stream ordering"): :meth:`CudaCopyBackend.on_request` records an event on the
training thread's current stream inside ``save()``, right after ``optimizer.step()`` was queued; the copier's
dedicated stream waits on that event before reading any source, so the copies see the post-step values
however far the host runs ahead. Each stream a batch used ends with a done event that the copier thread
synchronizes on before returning, so the bytes are in host memory and the sources (referenced by the caller
for the whole call) are no longer read when :meth:`copy_pieces` returns.

Checksums: when triton is installed (and not in interpreter mode), one launch of the checksum-only Triton
kernel on a second copy stream (ordered after the same request event, running beside the copy engines)
checksums the *sources* on the device: an HBM read on a few SMs instead of a CPU pass over the staged bytes,
and end to end, since a corrupted transfer then fails verification at load. :meth:`copy_pieces` returns
them. Otherwise it returns ``None`` and the writer checksums the staged bytes with
:func:`lazyckpt.format.checksum.checksum_bytes`, off the barrier's critical path. Both agree bit for bit.
CPU-resident sources are copied on the host.

Example:
    >>> ckpt = LazyCheckpointer("runs/ckpt", copy_backend="cuda")  # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from lazyckpt.triton_kernels import (CopySegment, TableCache, checksum_segments, checksums_to_list,
                                     interpreter_active, triton_available)
from lazyckpt.write.plan import Piece
from lazyckpt.write.staging.base import CopyBackend
from lazyckpt.write.staging.segments import (SegmentRef, copy_on_host, segment_refs, slot_range, source_range,
                                             split_by_piece)

_NO_CUDA = (
    "copy_backend={name!r} needs a CUDA device, but torch.cuda.is_available() is False; use copy_backend='cpu' "
    "(or 'auto')"
)

def require_cuda(name: str) -> None:
    """Raise RuntimeError naming the backend when CUDA is unavailable."""
    if not torch.cuda.is_available():
        raise RuntimeError(_NO_CUDA.format(name=name))


class StreamOrder:
    """The per-device copy streams and the request/done events shared by the GPU backends.

    ``record_request`` runs on the training thread; ``copy_stream`` and ``finish`` run on the copier thread.
    A fresh event per request means a late copy can never wait on a *newer* request by mistake. Each device
    has a few *lanes* (streams), so a checksum kernel can run beside the copy engines instead of after them.
    """

    def __init__(self) -> None:
        self._streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
        self._requests: dict[torch.device, torch.cuda.Event] = {}
        self._done: list[torch.cuda.Event] = []
        self._lock = threading.Lock()

    def record_request(self, sources: Sequence[torch.Tensor | None]) -> None:
        """Record an event on the current stream of every device holding a source."""
        devices = {t.device for t in sources if t is not None and t.is_cuda}
        events = {}
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events[device] = event
        with self._lock:
            self._requests = events

    def _request_event(self, device: torch.device) -> torch.cuda.Event:
        with self._lock:
            event = self._requests.get(device)
        if event is None:
            # No on_request for this device (a caller outside the engine): order after its current stream.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        return event

    @contextmanager
    def copy_stream(self, device: torch.device, lane: int = 0) -> Iterator[torch.cuda.Stream]:
        """Make a copy stream of ``device`` current, ordered after the request event; record a done event."""
        stream = self._streams.get((device, lane))
        if stream is None:
            stream = self._streams[(device, lane)] = torch.cuda.Stream(device)
        stream.wait_event(self._request_event(device))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield stream
            done = torch.cuda.Event()
            done.record(stream)
            self._done.append(done)

    def finish(self) -> None:
        """Block the calling (copier) thread until every copy stream used since the last call is done."""
        done, self._done = self._done, []
        for event in done:
            event.synchronize()


def remap_sources(
    sources: Sequence[torch.Tensor | None], refs: Sequence[SegmentRef]
) -> tuple[list[torch.Tensor], list[CopySegment]]:
    """The sources ``refs`` use (in first-use order) and their segments as launcher ``CopySegment``s.

    Launch cost and the table-cache key then scale with this call's segments, not with every tensor of the
    checkpoint (the engine passes ``None`` for eager entries). A segment's destination is its piece's slot.
    """
    index: dict[int, int] = {}
    used: list[torch.Tensor] = []
    segments = []
    for piece, seg in refs:
        if seg.tensor_index not in index:
            index[seg.tensor_index] = len(used)
            used.append(sources[seg.tensor_index])
        segments.append(CopySegment(index[seg.tensor_index], seg.src_offset, seg.nbytes, piece, seg.dst_offset))
    return used, segments


def fill(sums: list[int], positions: Sequence[int], values: Sequence[int]) -> None:
    for position, value in zip(positions, values, strict=True):
        sums[position] = value


class CudaCopyBackend(CopyBackend):
    """Copy-engine transfers on a dedicated stream; checksums on the device when triton is available.

    Args:
        device_checksum: Checksum the sources with the Triton checksum-only kernel on the copy stream (None:
            when triton is installed and not interpreting); when False the writer checksums the staged bytes.

    Raises:
        RuntimeError: CUDA is not available (the message names the backend and the alternative).
    """

    name = "cuda"

    def __init__(self, *, device_checksum: bool | None = None) -> None:
        require_cuda(self.name)
        self._order = StreamOrder()
        if device_checksum is None:
            device_checksum = triton_available() and not interpreter_active()
        self.device_checksum = device_checksum
        self._tables = TableCache(max_entries=1024)

    def on_request(self, sources: Sequence[torch.Tensor]) -> None:
        self._order.record_request(sources)

    def prepare_source(self, tensor: torch.Tensor) -> torch.Tensor:
        # .contiguous() reads the live tensor: on the copy stream, after the request event, never before it.
        if tensor.is_cuda and not tensor.is_contiguous():
            with self._order.copy_stream(tensor.device):
                return super().prepare_source(tensor)
        return super().prepare_source(tensor)

    def pin_memory(self) -> bool:
        return torch.cuda.is_available()

    def copy_pieces(
        self, sources: Sequence[torch.Tensor], pieces: Sequence[Piece], slots: Sequence[torch.Tensor]
    ) -> list[list[int]] | None:
        """Copy on the copy stream; returns device checksums, or None (the writer checksums the staged bytes)."""
        refs = segment_refs(pieces)
        on_host: list[int] = []
        launched = []
        for device, positions in positions_by_device(sources, refs).items():
            if device is None:
                on_host = positions
                continue
            with self._order.copy_stream(device):
                for position in positions:
                    piece, seg = refs[position]
                    dst = slot_range(slots[piece], seg)
                    dst.copy_(source_range(sources[seg.tensor_index], seg), non_blocking=True)
            if self.device_checksum:
                # A second lane: the checksum reads HBM while the copy engines drain over PCIe.
                with self._order.copy_stream(device, lane=1):
                    used, segments = remap_sources(sources, [refs[p] for p in positions])
                    launched.append((positions, checksum_segments(used, segments, cache=self._tables)))
        host_sums = copy_on_host(sources, slots, [refs[p] for p in on_host], checksum=self.device_checksum)
        self._order.finish()
        if not self.device_checksum:
            return None
        sums = [0] * len(refs)
        fill(sums, on_host, host_sums)
        for positions, result in launched:
            fill(sums, positions, checksums_to_list(result))
        return split_by_piece(pieces, sums)


def positions_by_device(
    sources: Sequence[torch.Tensor], refs: Sequence[SegmentRef]
) -> dict[torch.device | None, list[int]]:
    """Segment positions grouped by their source's CUDA device (``None``: the source is on the CPU)."""
    groups: dict[torch.device | None, list[int]] = {}
    for position, (_, seg) in enumerate(refs):
        source = sources[seg.tensor_index]
        groups.setdefault(source.device if source.is_cuda else None, []).append(position)
    return groups
