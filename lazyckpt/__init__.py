"""lazyckpt: lazy asynchronous multi-level checkpointing for PyTorch, Lightning and Accelerate.

Example:
    >>> import lazyckpt
    >>> with lazyckpt.LazyCheckpointer("runs/ckpt", keep_last_k=2) as ckpt:     # doctest: +SKIP
    ...     pending = ckpt.save({"model": model.state_dict()}, step=1, optimizers=[opt])
    ...     ckpt.wait_staged()        # right before the next optimizer.step()
    >>> state = lazyckpt.load(lazyckpt.latest("runs/ckpt"))                   # doctest: +SKIP

The file tree is the pipeline (docs/design.md). Each package imports only from the ones below it:

| layer | package or module | owns |
|---|---|---|
| 0 | ``errors``, ``threads``, ``_version`` | every exception; how background threads start (and calls that do not keep their owner alive); the version |
| 1 | ``storage/`` | the one seam to files and objects |
| 2 | ``config``, ``format/`` | the checkpointer's settings; the on-disk format in code |
| 3 | ``tree/``, ``triton_kernels/`` | the state codec; the Triton copy kernels |
| 4 | ``ranks/`` | who writes what, and how ranks agree |
| 5 | ``write/``, ``read/`` | the write path and its mirror (never importing each other) |
| 6 | ``levels/``, ``interop/`` | memory, local and remote levels; other tools' formats |
| 7 | ``pending``, ``engine`` | the handle ``save()`` returns; ``LazyCheckpointer``, the wiring of it all |
| 8 | ``policy/`` | one training run's checkpoint policy, shared by the integrations |
| 9 | ``integrations/``, ``cli`` | the framework adapters; the ``lazyckpt`` command line |
"""

from __future__ import annotations

from typing import Any

from lazyckpt._version import __version__
from lazyckpt.config import CheckpointConfig, CopyBackendName, OnBusy, OnOlderStep
from lazyckpt.engine import LazyCheckpointer
from lazyckpt.errors import (CheckpointCorruptError, CheckpointDiscardedError, CheckpointFormatError,
                             CheckpointMismatchError, CheckpointNotFoundError, CommitAbandoned, DirectoryLockedError,
                             RanksDisagreeError,
                             NothingToRollBackTo, RemoteUnreachableError, RollbackLimitError,
                             SnapshotConsistencyError, StepAlreadyCommittedError, StepOrderError,
                             UnsupportedValueError)
from lazyckpt.pending import PendingCheckpoint
from lazyckpt.policy.randomness import capture_rng_state, restore_rng_state
from lazyckpt.policy.rollback import RollbackPolicy, is_nonfinite
from lazyckpt.interop.export import export
from lazyckpt.read.load import checkpoint_step, latest, load, verify
from lazyckpt.read.reshard import load_into
from lazyckpt.tree.encode import Deferred, PerRank
from lazyckpt.tree.preflight import check_storable
from lazyckpt.write.stats import CheckpointStats

_INTEGRATIONS = {
    "LazyCheckpoint": "lazyckpt.integrations.lightning",
    "LazyCheckpointIO": "lazyckpt.integrations.lightning",
    "LazyCheckpointHook": "lazyckpt.integrations.accelerate",
    "LazyFabricIO": "lazyckpt.integrations.fabric",
    "LazyCheckpointCallback": "lazyckpt.integrations.transformers",
}


def __getattr__(name: str) -> Any:
    # The integrations import lightning / accelerate; load them only when asked for.
    if name in _INTEGRATIONS:
        import importlib

        return getattr(importlib.import_module(_INTEGRATIONS[name]), name)
    raise AttributeError(f"module 'lazyckpt' has no attribute {name!r}")


__all__ = sorted([
    "CheckpointConfig", "CheckpointCorruptError", "CheckpointDiscardedError", "CheckpointFormatError",
    "CheckpointMismatchError", "CheckpointNotFoundError", "CommitAbandoned", "NothingToRollBackTo",
    "RanksDisagreeError",
    "RemoteUnreachableError", "RollbackLimitError", "RollbackPolicy", "is_nonfinite",
    "CheckpointStats", "CopyBackendName", "Deferred", "DirectoryLockedError", "LazyCheckpoint",
    "LazyCheckpointCallback", "LazyCheckpointHook", "LazyCheckpointIO", "LazyCheckpointer", "LazyFabricIO", "OnBusy", "OnOlderStep", "PendingCheckpoint",
    "PerRank", "SnapshotConsistencyError", "StepAlreadyCommittedError", "StepOrderError", "UnsupportedValueError",
    "__version__", "capture_rng_state", "check_storable", "checkpoint_step",
    "export", "latest", "load", "load_into", "restore_rng_state", "verify",
])
