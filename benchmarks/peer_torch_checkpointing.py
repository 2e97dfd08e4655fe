"""torch-checkpointing (PyPI ``torch-checkpointing``, import ``torch_checkpointing``) as a method (see ``methods``).

``CheckpointManager.save(path, state)`` takes the manager's staging lock for writing, copies the state on a
background thread into reused shared-memory buffers and hands them to a writer process the manager spawned (a
temporary directory, a store barrier across ranks, then a rename). ``with manager.lock(): optimizer.step()`` waits
only while a copy is running: that is its barrier, taken right before the step.

Configured as its documentation says for CPU: no pinned memory, no non-blocking copies. Two changes, both needed
here: its default ``O_DIRECT`` write stream fails at close on ext4 (``OSError: [Errno 22]``), so writes are
buffered; and it never fsyncs, so its own ``pre_finalize_callback`` (in the writer process, after the files are
written, before the rename) fsyncs this rank's files and the directory, and its ``finalize_callback`` fsyncs the
parent after rank 0's rename. Both run inside its write, so their time is in its time to durable and in the wait
of the next save, as Lightning's and Accelerate's added fsyncs are in theirs. The writer process's private memory
counts in the method's peak RSS (``child_processes``). A first save waits for that process to finish starting.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from methods import Method, Run, empty_state_like
from workload import fsync_path


def fsync_written(args: Any, rank: int) -> None:
    """``pre_finalize_callback``: fsync the files this rank wrote into the temporary directory (its layout names
    them ``<item>_<rank>.pt``; rank 0 also writes the metadata), then the directory."""
    for base, _, names in os.walk(args.path):
        for name in names:
            if name.endswith(f"_{rank}.pt") or (rank == 0 and not name.endswith(".pt")):
                fsync_path(os.path.join(base, name))
        fsync_path(base)


def fsync_committed(args: Any, rank: int) -> None:
    """``finalize_callback``: rank 0 renamed the temporary directory onto ``args.path``; fsync its parent."""
    if rank == 0:
        fsync_path(os.path.dirname(os.path.normpath(args.path)) or ".")


def manager_config(*, rank: int, saving: bool = True) -> Any:
    """The ``CheckpointManager.Config`` of every run: async saves with the CPU staging options, buffered writes and
    the added fsyncs; a manager that only loads (``saving=False``) saves synchronously, so it starts no writer
    process."""
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    staging = CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False)
    save = AsyncCheckpointSaverConfig(staging_config=staging) if saving else SyncCheckpointSaverConfig()
    return CheckpointManager.Config(save=save, storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
                                    pre_finalize_callback=functools.partial(fsync_written, rank=rank),
                                    finalize_callback=functools.partial(fsync_committed, rank=rank))


class TorchCheckpointing(Method):
    """``fut = manager.save(path, {"model", "opt"})`` after the step, ``manager.lock()`` before the next one."""

    key, label = "torch_checkpointing", "torch-checkpointing CheckpointManager (lock before step)"
    modules = ("torch_checkpointing",)
    child_processes = True

    def rank(self) -> int:
        return 0

    def setup(self, run: Run) -> None:
        super().setup(run)
        from torch_checkpointing import CheckpointManager

        # Built before training, as a trainer builds it: its writer process starts spawning here.
        self.manager = CheckpointManager(manager_config(rank=self.rank()))
        self.write = None

    def request(self, step: int) -> None:
        self.write = self.manager.save(self.path_for(step), self.state())
        self.write.add_done_callback(lambda _f, s=step: self.durable_at.__setitem__(s, time.monotonic()))

    def before_step(self) -> None:
        # Holding the read lock across optimizer.step() would change nothing: only this thread starts a capture,
        # and not before the step's end, so once the lock is acquired the step cannot overlap one.
        with self.manager.lock():
            pass

    def drain(self) -> None:
        if self.write is not None:
            self.write.result()

    def finish(self) -> None:
        self.drain()
        self.manager.close()

    def path_for(self, step: int) -> str:
        return os.path.join(self.run.dirpath, f"step-{step}")

    def prepare_load(self) -> None:
        from torch_checkpointing import CheckpointManager

        self.reader = CheckpointManager(manager_config(rank=self.rank(), saving=False))
        self.template = empty_state_like(self.run.model, self.run.optimizer)

    def load(self, path: str) -> Any:
        try:
            return self.reader.load(path, into=self.template)  # filled in place, as a resume would
        finally:
            self.reader.close()
