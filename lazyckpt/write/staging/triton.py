"""The ``triton`` copy backend: one Triton launch per batch copies every segment with fused checksums.

On CUDA the launch goes on a dedicated copy stream that first waits on the event :meth:`on_request` recorded
on the training stream inside ``save()``; the kernel writes the pinned host slots directly (zero-copy through
unified addressing) with a persistent grid of ``num_programs`` programs, so only a few SMs leave training.
The copier thread then synchronizes on a done event, so the bytes are in host memory and the sources are no
longer read when :meth:`copy_pieces` returns.

With ``TRITON_INTERPRET=1`` (set before triton is imported) the same kernels run in the Triton interpreter
on CPU tensors: that is how CI tests this backend on machines without a GPU. Without CUDA and without the
interpreter the constructor fails with an error that says so.

``ce_min_bytes`` turns this into the size-class hybrid meant for ``copy_backend="auto"``: segments of CUDA
tensors of at least that many bytes go through the copy engines (``copy_(non_blocking=True)``) with the
checksum-only kernel, the many small ones through one packing launch (thresholds: docs/triton.md).

Example:
    >>> ckpt = LazyCheckpointer("runs/ckpt", copy_backend="triton")  # doctest: +SKIP
    >>> backend = TritonCopyBackend(ce_min_bytes=AUTO_CE_MIN_BYTES)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lazyckpt.format.checksum import CHUNK_BYTES
from lazyckpt.triton_kernels import (DEFAULT_BLOCK_BYTES, DEFAULT_NUM_PROGRAMS, DEFAULT_NUM_WARPS, TableCache,
                                     check_launch_options, checksum_segments, checksums_to_list, copy_tensor,
                                     copy_with_checksums, interpreter_active, require_runtime)
from lazyckpt.write.plan import Piece
from lazyckpt.write.staging.base import CopyBackend
from lazyckpt.write.staging.cuda import StreamOrder, fill, remap_sources
from lazyckpt.write.staging.segments import (SegmentRef, copy_on_host, segment_refs, slot_range, source_range,
                                             split_by_piece)

AUTO_CE_MIN_BYTES = CHUNK_BYTES
"""Provisional ``auto`` threshold: tensors of at least one chunk go to the copy engines (docs/triton.md)."""

_KERNEL, _ENGINES, _HOST = "kernel", "engines", "host"


class TritonCopyBackend(CopyBackend):
    """Copies through ``lazyckpt.triton_kernels`` on a dedicated stream (or in the interpreter on CPU).

    Args:
        num_programs: Persistent grid size K: at most this many programs (SMs) copy at once.
        block_bytes: Bytes each program moves per loop iteration (a power of two, 64..65536).
        num_warps: Warps per program.
        ce_min_bytes: Send segments of CUDA tensors with at least this many bytes through the copy engines
            instead of the kernel (None: everything through the kernel).
        table_cache_entries: How many segment-table layouts to keep on the device for reuse.

    Raises:
        ImportError: triton is not installed.
        RuntimeError: neither CUDA nor ``TRITON_INTERPRET=1`` is available.
        ValueError: a launch option is out of range.
    """

    name = "triton"

    def __init__(
        self,
        *,
        num_programs: int = DEFAULT_NUM_PROGRAMS,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        num_warps: int = DEFAULT_NUM_WARPS,
        ce_min_bytes: int | None = None,
        table_cache_entries: int = 1024,
    ) -> None:
        require_runtime()
        check_launch_options(num_programs, block_bytes, num_warps)
        if ce_min_bytes is not None and ce_min_bytes < 1:
            raise ValueError(f"ce_min_bytes={ce_min_bytes!r} must be positive, or None to copy everything by kernel")
        self._launch_options = {"num_programs": num_programs, "block_bytes": block_bytes, "num_warps": num_warps}
        self.ce_min_bytes = ce_min_bytes
        self.interpreted = interpreter_active()
        self._order = StreamOrder()
        self._tables = TableCache(max_entries=table_cache_entries)

    def on_request(self, sources: Sequence[torch.Tensor]) -> None:
        self._order.record_request(sources)

    def pin_memory(self) -> bool:
        return torch.cuda.is_available()

    def prepare_source(self, tensor: torch.Tensor) -> torch.Tensor:
        # .contiguous() reads the live tensor: on the copy stream, after the request event, never before it.
        if tensor.is_cuda and not tensor.is_contiguous():
            with self._order.copy_stream(tensor.device):
                return super().prepare_source(tensor)
        return super().prepare_source(tensor)

    def copy_eager(self, tensor: torch.Tensor) -> torch.Tensor:
        """A private CPU copy made by the copy kernel on the current stream, then synchronized."""
        if tensor.is_cuda or self.interpreted:
            return copy_tensor(tensor, **self._launch_options)[0]
        return super().copy_eager(tensor)  # a CPU tensor on a CUDA machine: the kernel cannot read it

    def copy_pieces(
        self, sources: Sequence[torch.Tensor], pieces: Sequence[Piece], slots: Sequence[torch.Tensor]
    ) -> list[list[int]]:
        refs = segment_refs(pieces)
        sums = [0] * len(refs)
        launched = []
        routes = self._routes(sources, refs)
        for (route, device), positions in routes.items():
            if route == _HOST:
                fill(sums, positions, copy_on_host(sources, slots, [refs[p] for p in positions]))
            elif device.type == "cpu":  # the interpreter: synchronous, no streams
                launched.append((positions, self._launch_kernel(sources, slots, [refs[p] for p in positions])))
            else:
                launched.append((positions, self._launch(route, sources, slots, refs, positions, device)))
        self._order.finish()
        for positions, result in launched:
            fill(sums, positions, checksums_to_list(result))
        return split_by_piece(pieces, sums)

    def _routes(self, sources: Sequence[torch.Tensor], refs: Sequence[SegmentRef]) -> dict:
        """``{(route, device): [positions]}``: kernel, copy engines, or a host ``copy_`` per segment."""
        routes: dict[tuple[str, torch.device | None], list[int]] = {}
        for position, (_, seg) in enumerate(refs):
            source = sources[seg.tensor_index]
            if source.is_cuda and not self.interpreted:
                large = self.ce_min_bytes is not None and source.numel() >= self.ce_min_bytes
                key = (_ENGINES if large else _KERNEL, source.device)
            elif self.interpreted:
                key = (_KERNEL, source.device)  # the launcher names any CUDA tensor it cannot read here
            else:
                key = (_HOST, None)
            routes.setdefault(key, []).append(position)
        return routes

    def _launch(
        self,
        route: str,
        sources: Sequence[torch.Tensor],
        slots: Sequence[torch.Tensor],
        refs: Sequence[SegmentRef],
        positions: Sequence[int],
        device: torch.device,
    ) -> torch.Tensor:
        """Queue one group's copies on the copy streams; returns its (not yet final) checksum tensor."""
        group = [refs[p] for p in positions]
        if route == _KERNEL:
            with self._order.copy_stream(device):
                return self._launch_kernel(sources, slots, group)
        with self._order.copy_stream(device, lane=1):  # the copy engines, beside any kernel on lane 0
            for piece, seg in group:
                slot_range(slots[piece], seg).copy_(source_range(sources[seg.tensor_index], seg), non_blocking=True)
        with self._order.copy_stream(device, lane=2):  # their checksum reads HBM meanwhile
            used, segments = remap_sources(sources, group)
            return checksum_segments(used, segments, cache=self._tables, **self._launch_options)

    def _launch_kernel(
        self, sources: Sequence[torch.Tensor], slots: Sequence[torch.Tensor], group: Sequence[SegmentRef]
    ) -> torch.Tensor:
        used, segments = remap_sources(sources, group)
        return copy_with_checksums(used, slots, segments, cache=self._tables, **self._launch_options)
