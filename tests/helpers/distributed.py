"""Run a function on several gloo ranks (forked processes, one per rank) and report how each ended."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, args: tuple, errors, meet_at_end: bool,
           backend: str) -> None:
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        if meet_at_end:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        errors.put((rank, traceback.format_exc()))
        os._exit(1)
    os._exit(0)


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 240.0, meet_at_end: bool = True,
              backend: str = "gloo") -> dict[int, int]:
    """Run ``fn(rank, world_size, *args)`` on every rank; raise the first rank failure; return exit codes.

    ``fn`` may end its own process (e.g. ``os.kill(os.getpid(), SIGKILL)``; pass ``meet_at_end=False`` so the
    survivors do not wait for it at a final barrier): its exit code is returned, and the other ranks still have to
    succeed. ``backend="nccl"``: one GPU per rank (processes are spawned: CUDA does not survive a fork).
    """
    context = multiprocessing.get_context("spawn" if backend == "nccl" else "fork")
    errors = context.SimpleQueue()
    port = free_port()
    procs = [context.Process(target=_entry, args=(fn, r, world_size, port, args, errors, meet_at_end, backend)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            for q in procs:
                q.kill()
            raise TimeoutError(f"rank {procs.index(p)} did not finish within {timeout}s")
    if not errors.empty():
        rank, trace = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{trace}")
    return {r: p.exitcode for r, p in enumerate(procs)}


def two_ranks_meeting(dirpath: str, store=None, timeout_s: float = 0.5):
    """``(rank 0, rank 1)`` :class:`~lazyckpt.ranks.rendezvous.Rendezvous` of one process, built on two threads (they
    meet at construction) through ``store`` (default: a fresh ``HashStore``)."""
    from lazyckpt.ranks.rendezvous import Rendezvous
    from lazyckpt.storage import LocalStorage

    store = torch.distributed.HashStore() if store is None else store
    built, errors = {}, []

    def build(rank):
        try:
            built[rank] = Rendezvous(store, rank=rank, world_size=2, dirpath=dirpath, storage=LocalStorage(),
                                     timeout_s=timeout_s, clear_dir=lambda: None)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return built[0], built[1]
