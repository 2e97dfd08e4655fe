"""A bounded pool of host staging slots, allocated once and reused across checkpoints."""

from __future__ import annotations

import queue

import torch

from lazyckpt.storage import PAGE_BYTES
from lazyckpt.write.plan import PIECE_BYTES


class HostBufferPool:
    """``num_slots`` slots of ``slot_bytes`` bytes each in one allocation (pinned when asked).

    The copier acquires a slot per piece and the writer releases it after the bytes are written, so host
    memory stays at the budget however large the checkpoint is.
    """

    def __init__(self, num_slots: int, *, slot_bytes: int = PIECE_BYTES, pin: bool = False) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots!r} must be at least 1")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.pinned = pin
        self._memory = _page_aligned(num_slots * slot_bytes, pin=pin)
        # Touch every page now (on the copier thread) so page faults never land inside a training step.
        self._memory.zero_()
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(num_slots):
            self._free.put(index)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def acquire(self, block: bool = True) -> int | None:
        """A free slot's index; blocks until the writer frees one, or returns None when ``block`` is False."""
        try:
            return self._free.get(block=block)
        except queue.Empty:
            return None

    def drain(self) -> None:
        """Block until every slot is back (the writer has written all it was handed), taking them all."""
        for _ in range(self.num_slots):
            self._free.get()

    def release(self, index: int) -> None:
        self._free.put(index)

    def slot(self, index: int) -> torch.Tensor:
        start = index * self.slot_bytes
        return self._memory[start : start + self.slot_bytes]


def _page_aligned(nbytes: int, *, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory starting on a 4 KiB boundary: the writer sends aligned slots to the disk with
    ``O_DIRECT`` straight from the pool, without a bounce copy."""
    if pin:  # page-locked memory is page-aligned; asking for one page more would double a power-of-two pool
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE_BYTES
    return raw[skip : skip + nbytes]


def slots_for(budget_bytes: int | None, lazy_bytes: int, slot_bytes: int = PIECE_BYTES) -> int:
    """How many slots a pool needs: one checkpoint's lazy bytes, capped by the budget, at least one."""
    wanted = -(-lazy_bytes // slot_bytes)
    if budget_bytes is not None:
        wanted = min(wanted, budget_bytes // slot_bytes)
    return max(1, wanted)
