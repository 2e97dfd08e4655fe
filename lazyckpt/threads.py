"""Every background thread lazyckpt runs starts here, so none of them costs the training thread anything.

Two things are set on the new thread before its body runs, and only on that thread:

* **One torch thread.** With an OpenMP build of torch, a thread that runs one parallel op (a large ``copy_``,
  ``zero_``) becomes the master of its own OpenMP team, whose workers outlive the op. With more OpenMP threads
  than cores, libgomp stops spin-waiting, and the training thread's own parallel regions slow down too: measured
  16-47 % slower steps after the first checkpoint, with no checkpoint in flight. Background threads therefore
  run their torch ops on one thread. ``torch.set_num_threads`` cannot do this: it also rewrites the process-wide
  default that every thread which has not run a parallel op yet (possibly the training thread) picks up later.
  So the thread lets torch initialise its own count first, then lowers only its own OpenMP setting through
  ``threadpoolctl``.
* **A lower CPU priority** (a nice value; Linux threads have their own), so the training thread wins a core.

Example:
    >>> thread = start_background_thread(print, "hello", name="lazyckpt-example", nice=WRITER_NICE)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from threadpoolctl import threadpool_limits

COPIER_NICE = 4
WRITER_NICE = 4
UPLOAD_NICE = 10
"""Background threads yield the CPU to the training thread (nice 0). The writer used to run at nice 10, below
the copier, because it checksummed and copied into bounce buffers, and at equal priority the staging copy of
289 MiB stretched over a whole ~330 ms step. Now the copy checksums and the writer mostly waits in ``pwrite``
from the slots, so it runs at the copier's priority: on 2 cores with two training threads, time to durable fell
from 1.35-1.82x to 0.86-1.29x of the O_DIRECT floor in two A/B pairs, the stall unchanged (5.4-6.5 against
5.8-6.9 ms). Uploads to the remote level, which follow the local commit, stay lowest."""


def start_background_thread(target: Callable[..., Any], *args: Any, name: str, nice: int = WRITER_NICE) -> threading.Thread:
    """Start a daemon thread running ``target(*args)`` with one torch thread and the given nice value."""
    thread = threading.Thread(target=_run_quietly, args=(target, args, nice), name=name, daemon=True)
    thread.start()
    return thread


def _run_quietly(target: Callable[..., Any], args: tuple, nice: int) -> None:
    limit_torch_threads_here()
    lower_thread_priority(nice)
    target(*args)


def limit_torch_threads_here() -> None:
    """Make the calling thread run torch ops on one thread, without touching any other thread's count."""
    # torch sets a thread's OpenMP count lazily, on its first parallel op; trigger that now so it cannot later
    # overwrite the limit below. The limit only changes this thread's OpenMP setting (OpenMP keeps it per thread).
    torch.get_num_threads()
    threadpool_limits(limits=1, user_api="openmp")


def lower_thread_priority(nice: int = WRITER_NICE) -> None:
    """Give the calling thread a nice value (Linux threads have their own); a no-op where unsupported."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


def weakly(method: Callable[..., Any]) -> Callable[..., None]:
    """A function calling the bound ``method`` with its arguments while its object lives, else nothing: writer
    callbacks and global optimizer hooks that do not keep their owner alive (one dropped without ``close()`` is
    freed, and its directory lock released, at once)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)
    return call
