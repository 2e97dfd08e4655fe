"""The soak: save, load and verify in a loop, sampling the resources a long run must not accumulate.

RSS alone cannot tell a leak from the C allocator keeping freed memory: glibc raises its mmap threshold once a
large block allocated with mmap is freed, and from then on blocks of that size come from its heaps, where freed
memory stays mapped (measured here: RSS settles about 40 MiB higher within a few hundred checkpoints, then stays
flat; ``malloc_trim(0)`` hands it back). So each sample also records what the allocator reports in use and free
(``mallinfo2``, on glibc), and the live Python objects by type: a structure that grows per checkpoint shows up
there, whatever the allocator does.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import gc
from typing import Any

import psutil
import torch

import lazyckpt


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _glibc() -> Any:
    """The C library when it is glibc 2.33+ (``mallinfo2`` and ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


def live_objects() -> collections.Counter:
    """Live garbage-collected Python objects by type name, after a collection."""
    gc.collect()
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def per_checkpoint_growth(before: collections.Counter, after: collections.Counter, checkpoints: int,
                          stats_growth: int) -> dict[str, int]:
    """Object types that grew by at least one per two ``checkpoints`` between two counts. ``stats_growth``
    records entered the checkpointer's bounded stats window meanwhile and are expected."""
    growth = collections.Counter(after)
    growth.subtract(before)
    growth["CheckpointStats"] -= stats_growth
    return {name: count for name, count in growth.items() if count * 2 >= checkpoints}


def soak(dirpath: str, checkpoints: int, warmup: int = 50, sample_every: int = 100) -> dict[str, Any]:
    """Save (keeping the last 2), load and verify ``checkpoints`` times; sample resources after ``warmup`` and
    every ``sample_every`` checkpoints. ``violations`` lists what grew per checkpoint after the warmup: file
    descriptors, threads, or live objects of a type (beyond the stats window). The figures are taken after a
    garbage collection."""
    process, libc = psutil.Process(), _glibc()
    state = {"w": torch.randn(250_000), "step": 0}
    warmup = min(warmup, checkpoints)

    def sample(step: int) -> dict[str, float]:
        gc.collect()
        row = {"step": step, "rss_mib": round(process.memory_info().rss / 2**20, 1), "fds": process.num_fds(),
               "threads": process.num_threads()}
        if libc is not None:
            info = libc.mallinfo2()
            row["heap_in_use_mib"] = round((info.uordblks + info.hblkhd) / 2**20, 1)
            row["heap_free_mib"] = round(info.fordblks / 2**20, 1)
        return row

    samples = []
    with lazyckpt.LazyCheckpointer(dirpath, keep_last_k=2) as ckpt:
        for step in range(1, checkpoints + 1):
            state["step"] = step
            path = ckpt.save(state, step=step).wait()
            assert lazyckpt.load(path)["step"] == step
            if step == warmup:
                objects, stats = live_objects(), len(ckpt.stats)
            if step == warmup or step % sample_every == 0 or step == checkpoints:
                samples.append(sample(step))
        grown = per_checkpoint_growth(objects, live_objects(), checkpoints - warmup, len(ckpt.stats) - stats)
    first, last = next(s for s in samples if s["step"] == warmup), samples[-1]
    # A thread or descriptor may be passing (a pool being joined); one leaked per checkpoint adds hundreds.
    violations = [f"{key} {first[key]} -> {last[key]}" for key in ("fds", "threads") if last[key] > first[key] + 2]
    violations += [f"{count} more live {name} objects" for name, count in grown.items()]
    result = {"checkpoints": checkpoints, "samples": samples, "violations": violations}
    if libc is not None:
        libc.malloc_trim(0)
        result["rss_mib_after_malloc_trim"] = round(process.memory_info().rss / 2**20, 1)
    return result
