"""Every exception lazyckpt defines; each subclasses the builtin it refines. Those a user can meet are exported from
``lazyckpt``; :class:`IllegalTransitionError` only ever means a bug in lazyckpt."""

from __future__ import annotations


class CheckpointFormatError(ValueError):
    """A checkpoint on disk breaks a rule of docs/FORMAT.md (bad header, offsets, manifest, paths)."""


class CheckpointCorruptError(CheckpointFormatError):
    """Stored bytes do not match their recorded checksum (or the file is truncated)."""


class CheckpointNotFoundError(FileNotFoundError):
    """The path is not a committed lazyckpt checkpoint (missing, partial or uncommitted)."""


class StepAlreadyCommittedError(FileExistsError):
    """A checkpoint for this step is already committed; lazyckpt never overwrites one."""


class StepOrderError(ValueError):
    """The step is lower than the newest committed one, which ``latest()`` would keep returning."""


class SnapshotConsistencyError(RuntimeError):
    """A lazily captured tensor changed in place inside the immutability window (torn snapshot)."""


class RanksDisagreeError(RuntimeError):
    """At restart, the ranks hold no step in common on any level (a node's copies were all lost), while some hold
    steps: resuming would put ranks at different steps."""


class DirectoryLockedError(RuntimeError):
    """Another live checkpointer of this process or another one writes the same directory and rank."""


class UnsupportedValueError(TypeError):
    """A value in the state has no safe encoding; the message names its key path."""


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the run resuming from it; the message lists every difference."""


class CheckpointDiscardedError(RuntimeError):
    """The checkpoint was discarded on request (``LazyCheckpointer.discard``) before it committed."""


class RollbackLimitError(RuntimeError):
    """The loss stayed non-finite through more rollbacks in a row than ``max_rollbacks`` allows."""


class NothingToRollBackTo(LookupError):
    """There is no state before the bad step: no snapshot, and the start of training was not remembered."""


class CommitAbandoned(RuntimeError):
    """Another rank failed this attempt (its reason is in the message); this rank's files are discarded too."""


class RemoteUnreachableError(OSError):
    """The remote level cannot be listed or written (wrong URL, credentials, endpoint, or network)."""


class IllegalTransitionError(RuntimeError):
    """A job was asked to move to a state its current one does not lead to (a bug in lazyckpt)."""
