"""Copying a memory snapshot back: each chunk copied and checked in one pass, straight into the live tensors.

Reading a snapshot back costs three passes over its bytes if done one after the other: copy into fresh tensors
(which page-fault in), check the chunk checksums, and ``load_state_dict`` copies again into the model and
optimizer. Here the destination of an entry is the caller's own tensor when one fits (found as
:func:`lazyckpt.load_into` finds its targets: by the flattened key of a state with live tensors at its leaves),
so the bytes land where they are used and ``load_state_dict`` of the result copies nothing; an entry without a
fitting target gets a fresh tensor. Each 1 MiB chunk is copied and checked by
:func:`lazyckpt.format.checksum.copy_checksum`: each word is mixed into the chunk's checksum as it is copied, so the
snapshot's bytes are read from memory once. With more than one torch thread the chunks are spread over that many
threads (the copy-and-check loop releases the GIL).

Example:
    >>> dests = Destinations(job.entries, tensor_targets({"model": model.state_dict()}), "snapshot")  # doctest: +SKIP
    >>> copy_and_check(transfers, job.entries, job.checksums, "snapshot", threads=2)               # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from lazyckpt.errors import CheckpointCorruptError, CheckpointMismatchError
from lazyckpt.format.checksum import CHUNK_BYTES, copy_checksum, tensor_bytes
from lazyckpt.format.header import TensorEntry, torch_dtype
from lazyckpt.read.reshard import target_block
from lazyckpt.read.tensor_io import check_chunk

TASK_BYTES = 8 * CHUNK_BYTES
"""One unit of work handed to a thread: large enough that handing it over costs nothing next to its bytes."""
PARALLEL_MIN_BYTES = 32 * CHUNK_BYTES
"""Below this a snapshot is copied on the calling thread: starting threads (1-20 ms on a loaded 2-core machine)
would cost about what they save."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """``source`` (bytes of entry ``index`` from ``start``, a chunk boundary) goes to ``dest`` and is checked."""

    index: int
    start: int
    source: np.ndarray
    dest: np.ndarray


class Destinations:
    """Where each entry's bytes land: the target tensor of the same key when it fits, else a fresh tensor."""

    def __init__(self, entries: list[TensorEntry], targets: dict[str, torch.Tensor], where: str) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        """Per key, what the decoded state holds: the target itself, or a fresh tensor."""
        self.raw: list[np.ndarray] = []
        for entry in entries:
            target = _fitting(entry, targets.get(entry.key), where)
            if target is not None:
                self.raw.append(tensor_bytes(target))
                self.tensors[entry.key] = target
            else:
                fresh = torch.empty(entry.nbytes, dtype=torch.uint8)
                self.raw.append(fresh.numpy())  # a numpy slice assignment is a plain memcpy
                dtype = torch_dtype(entry.dtype, f"{where}: tensor {entry.key!r}")
                self.tensors[entry.key] = fresh.view(dtype).reshape(entry.shape)

    def alias_targets(self, entries: list[TensorEntry], targets: dict[str, torch.Tensor], aliases: dict[str, str],
                      where: str) -> dict[str, torch.Tensor]:
        """The targets at alias keys (docs/FORMAT.md rule 22) that the stored tensor's values can be copied into,
        as into a target of its own key: the others are left alone, and the alias gets the stored tensor."""
        by_key = {entry.key: entry for entry in entries}
        fitting = {}
        for alias, key in aliases.items():
            entry = by_key.get(key)
            target = None if entry is None else _fitting(entry, targets.get(alias), where)
            if target is not None:
                fitting[alias] = target
        return fitting


def _fitting(entry: TensorEntry, target: torch.Tensor | None, where: str) -> torch.Tensor | None:
    """``target`` when the entry's bytes can be copied straight into it (a contiguous CPU tensor of the same
    dtype and shape), else None: the entry then gets a fresh tensor, which ``load_state_dict`` converts."""
    if target is None:
        return None
    try:
        local, _ = target_block(entry.key, target, list(entry.shape))
    except CheckpointMismatchError:
        return None
    dtype = torch_dtype(entry.dtype, f"{where}: tensor {entry.key!r}")
    if local is not target or target.device.type != "cpu" or target.dtype != dtype or not target.is_contiguous():
        return None
    return target


def copy_and_check(transfers: list[Transfer], entries: list[TensorEntry], checksums: dict[str, list[str]],
                   where: str, threads: int) -> None:
    """Copy every transfer and check each chunk right after its copy, on ``threads`` threads.

    Raises:
        CheckpointCorruptError: a chunk does not match its recorded checksum (the destinations before it may
            already hold the snapshot's bytes), or the transfers miss a recorded chunk.
    """
    tasks = list(_tasks(transfers))
    if threads <= 1 or sum(t.source.size for t in transfers) < PARALLEL_MIN_BYTES:
        for task in tasks:
            _run(task, entries, checksums, where)
    else:
        # The workers run numpy only (no torch op, so no OpenMP team to limit) and live for this call.
        with ThreadPoolExecutor(threads, thread_name_prefix="lazyckpt-restore") as pool:
            for _ in pool.map(lambda task: _run(task, entries, checksums, where), tasks):
                pass
    copied = sum(-(-t.source.size // CHUNK_BYTES) for t in transfers)
    recorded = sum(len(sums) for sums in checksums.values())
    if copied != recorded:  # every recorded chunk must have been copied out and checked
        raise CheckpointCorruptError(f"{where} is incomplete: {copied} of its {recorded} chunks are held in memory")


def _tasks(transfers: list[Transfer]) -> Iterator[list[Transfer]]:
    """Transfers grouped into about TASK_BYTES each (a transfer is never split across tasks)."""
    task: list[Transfer] = []
    size = 0
    for transfer in transfers:
        task.append(transfer)
        size += transfer.source.size
        if size >= TASK_BYTES:
            yield task
            task, size = [], 0
    if task:
        yield task


def _run(task: list[Transfer], entries: list[TensorEntry], checksums: dict[str, list[str]], where: str) -> None:
    for transfer in task:
        key = entries[transfer.index].key
        for offset in range(0, transfer.source.size, CHUNK_BYTES):
            end = min(offset + CHUNK_BYTES, transfer.source.size)
            actual = copy_checksum(transfer.dest[offset:end], transfer.source[offset:end])
            chunk = (transfer.start + offset) // CHUNK_BYTES
            check_chunk(actual, checksums[key][chunk], where, key, chunk, transfer.start + end)
