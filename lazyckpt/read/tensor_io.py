"""Tensor bytes from a tensor file into tensors: large reads straight into the destination tensors' memory, and
checksums on worker threads while the next piece is read.

CPU destinations get the file's bytes with no intermediate copy. Device destinations (and ``verify``, which keeps
nothing) go through a small ring of reused host buffers (pinned for CUDA), so no full host copy of the state is
ever made. Numpy's checksum loops release the GIL, so the workers run in parallel with the reads.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lazyckpt.errors import CheckpointCorruptError
from lazyckpt.format.checksum import CHUNK_BYTES, checksum_run, format_checksum, num_chunks, tensor_bytes
from lazyckpt.storage import ReadHandle
from lazyckpt.threads import limit_torch_threads_here

READ_BYTES = 16 * CHUNK_BYTES
"""One read; large enough that a read costs its bytes, not its call, and a whole number of checksum chunks."""
WORKERS = max(1, min(4, (os.cpu_count() or 2) - 1))
"""Checksum threads beside the reading thread."""
_INLINE_BYTES = 256 << 10
"""Pieces this small are checked on the reading thread: handing them over costs more than checking them."""


@dataclass(frozen=True, slots=True)
class _Piece:
    key: str
    start: int
    """Offset inside the tensor."""
    nbytes: int
    file_offset: int
    expected: list[str]
    """The manifest's checksums of the chunks this piece covers."""


def _pieces(entries: dict[str, Any], data_start: int) -> Iterator[_Piece]:
    for key, entry in sorted(entries.items(), key=lambda item: item[1]["offsets"][0]):
        begin, end = entry["offsets"]
        for start in range(0, end - begin, READ_BYTES):
            nbytes = min(READ_BYTES, end - begin - start)
            first = start // CHUNK_BYTES
            yield _Piece(key, start, nbytes, data_start + begin + start,
                         entry["checksums"][first : first + num_chunks(nbytes)])


def read_tensor_bytes(handle: ReadHandle, file: str, data_start: int, entries: dict[str, Any],
                      targets: dict[str, torch.Tensor] | None, *, verify: bool,
                      progress: Callable[[int], None] | None = None) -> None:
    """Fill ``targets`` (or, when ``None``, only check) with every tensor's bytes, checking each chunk."""
    # Workers run numpy and (for a device) one copy_ per piece: one torch thread each, so no OpenMP team outlives
    # the load; they keep normal priority because the caller is waiting for them.
    transfer = _Transfer(handle, file, targets, verify, progress)
    # Into CPU tensors the workers read too (the reading thread only hands pieces out): a read from a tmpfs or the
    # page cache is a memory copy, and copies on every core overlap as checks do.
    threads = WORKERS + 1 if transfer.parallel else WORKERS
    with ThreadPoolExecutor(threads, thread_name_prefix="lazyckpt-load", initializer=limit_torch_threads_here) as pool:
        transfer.run(pool, _pieces(entries, data_start))


class _Transfer:
    """One rank's tensor bytes on their way: where each piece lands, and which checks are still running."""

    def __init__(self, handle: ReadHandle, file: str, targets: dict[str, torch.Tensor] | None, verify: bool,
                 progress: Callable[[int], None] | None) -> None:
        self.handle, self.file, self.targets, self.verify, self.progress = handle, file, targets, verify, progress
        direct = targets is not None and all(t.device.type == "cpu" for t in targets.values())
        self.ring = None if direct else _ring(targets)
        self.parallel = direct and getattr(handle, "parallel_reads", False)
        """Pieces are read on the workers too (a handle whose positional reads may run at once, CPU targets)."""
        self.slot_users: list[Future | None] = [None] * (len(self.ring) if self.ring else 0)
        self.views: dict[str, np.ndarray] = {}

    def run(self, pool: ThreadPoolExecutor, pieces: Iterator[_Piece]) -> None:
        pending: deque[Future] = deque()
        for index, piece in enumerate(pieces):
            if len(pending) >= 2 * (WORKERS + self.parallel):
                pending.popleft().result()
            buffer, staged = self._buffer_for(index, piece)
            if self.parallel and piece.nbytes > _INLINE_BYTES:
                pending.append(pool.submit(self._read_and_finish, piece, buffer))
                continue
            read_exact(self.handle, piece.file_offset, buffer, self.file, f"tensor {piece.key!r}")
            target = self.targets[piece.key] if self.targets is not None and staged is not None else None
            args = (piece, buffer, staged, target, self.file, self.verify, self.progress)
            if piece.nbytes <= _INLINE_BYTES:
                _finish(*args)
                continue
            pending.append(pool.submit(_finish, *args))
            if self.ring is not None:
                self.slot_users[index % len(self.ring)] = pending[-1]
        while pending:
            pending.popleft().result()

    def _read_and_finish(self, piece: _Piece, buffer: np.ndarray) -> None:
        """A piece into its CPU tensor's own bytes, then its checks (on a worker: nothing else touches them)."""
        read_exact(self.handle, piece.file_offset, buffer, self.file, f"tensor {piece.key!r}")
        _finish(piece, buffer, None, None, self.file, self.verify, self.progress)

    def _buffer_for(self, index: int, piece: _Piece) -> tuple[np.ndarray, torch.Tensor | None]:
        """The destination tensor's own bytes (CPU), or a free ring buffer to stage the piece in."""
        if self.ring is None:
            if piece.key not in self.views:
                self.views[piece.key] = tensor_bytes(self.targets[piece.key])
            return self.views[piece.key][piece.start : piece.start + piece.nbytes], None
        slot = index % len(self.ring)
        if self.slot_users[slot] is not None:
            self.slot_users[slot].result()  # the piece that used this buffer last is checked (and copied)
        staged = self.ring[slot][: piece.nbytes]
        return staged.numpy(), staged


def read_exact(handle: ReadHandle, offset: int, buffer: Any, file: str, what: str) -> None:
    """Fill ``buffer`` from ``offset``; a short read or an I/O error names the file and what was being read."""
    try:
        got = handle.read_into(offset, memoryview(buffer))
    except OSError as e:
        raise OSError(e.errno, f"{file}: reading {what} failed: {e.strerror or e}") from e
    if got != memoryview(buffer).nbytes:
        raise CheckpointCorruptError(f"{file}: file is truncated inside {what}")


def _ring(targets: dict[str, torch.Tensor] | None) -> list[torch.Tensor]:
    pin = targets is not None and any(t.device.type == "cuda" for t in targets.values())
    return [torch.empty(READ_BYTES, dtype=torch.uint8, pin_memory=pin) for _ in range(WORKERS + 1)]


def _finish(piece: _Piece, buffer: np.ndarray, staged: torch.Tensor | None, target: torch.Tensor | None,
            file: str, verify: bool, progress: Callable[[int], None] | None) -> None:
    if verify:
        check_chunks(buffer, piece.start, piece.expected, file, piece.key)
    if target is not None and staged is not None:
        target.reshape(-1).view(torch.uint8)[piece.start : piece.start + piece.nbytes].copy_(staged)
    if progress is not None:
        progress(piece.nbytes)


def check_chunks(data: np.ndarray, start: int, expected: list[str], where: str, key: str) -> None:
    """Check the bytes ``data`` of tensor ``key`` (from offset ``start``, a chunk boundary) against the checksums
    ``expected`` of the chunks they cover; the error names ``where`` (a file or a memory snapshot) and the chunk.

    Raises:
        CheckpointCorruptError: a chunk's checksum differs from the recorded one.
    """
    for index, actual in enumerate(checksum_run(data)):
        chunk = start // CHUNK_BYTES + index
        check_chunk(actual, expected[index], where, key, chunk, min((chunk + 1) * CHUNK_BYTES, start + data.size))


def check_chunk(actual: int, expected: str, where: str, key: str, chunk: int, end: int) -> None:
    """Check one chunk's checksum ``actual`` against the recorded ``expected``; ``end``: the byte of tensor
    ``key`` where the chunk ends.

    Raises:
        CheckpointCorruptError: they differ; the message names ``where``, the tensor and the chunk's bytes.
    """
    if format_checksum(actual) != expected:
        raise CheckpointCorruptError(
            f"{where}: tensor {key!r} is corrupt: chunk {chunk} (bytes {chunk * CHUNK_BYTES}..{end} of the tensor) "
            f"has checksum {format_checksum(actual)}, the manifest recorded {expected}")
