"""Configuration: one keyword-only dataclass, validated once at construction."""

from __future__ import annotations

import difflib
import enum
import os
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from lazyckpt.storage.urls import check_url, is_url


class CopyBackendName(str, enum.Enum):
    """How bytes move from the live tensors into host staging buffers."""

    AUTO = "auto"
    """``cuda`` when any tensor is on a GPU and CUDA is available, else ``cpu``."""
    CPU = "cpu"
    """A background thread copies piece by piece (torch ``copy_`` releases the GIL)."""
    CUDA = "cuda"
    """``copy_(non_blocking=True)`` on a dedicated stream ordered after the compute stream by an event."""
    TRITON = "triton"
    """Triton multi-tensor chunked copy kernels with fused checksums (``lazyckpt.triton_kernels``)."""


class OnBusy(str, enum.Enum):
    """What ``save()`` does while earlier checkpoints are still in flight."""

    WAIT = "wait"
    """Block until the oldest uncommitted checkpoint is committed (fewer than ``max_in_flight`` remain), then take
    the new one."""
    SKIP = "skip"
    """Drop the new request with a warning instead of blocking (``max_in_flight`` uncommitted, or the newest one
    still being copied); its handle's ``wait()`` returns ``None``."""


class OnOlderStep(str, enum.Enum):
    """What ``save()`` does with a step lower than the newest committed one (e.g. after resuming from an older
    checkpoint), whose newer checkpoints ``latest()`` would otherwise keep returning."""

    ERROR = "error"
    """Refuse it with :class:`~lazyckpt.errors.StepOrderError` naming the newer steps."""
    MOVE_ASIDE = "move_aside"
    """Rename every newer checkpoint to ``step-N.superseded`` (kept, never read by ``latest()``) and save."""


def _parse_enum(enum_cls: type[enum.Enum], name: str, value: object) -> enum.Enum:
    try:
        return enum_cls(value)
    except ValueError as e:
        values = [m.value for m in enum_cls]
        raise ValueError(f"{name}={value!r} is not valid{did_you_mean(str(value), values)}; choose one of "
                         f"{', '.join(map(repr, values))}") from e


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a mistyped ``name``, or ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_option_names(options: Iterable[str], *, owner: str, extra: Iterable[str] = (),
                       left_out: Iterable[str] = ()) -> None:
    """Refuse an option that is no :class:`CheckpointConfig` field (nor one of ``extra``; ``left_out`` ones are not
    offered), naming the closest valid one: a typo must not read as Python's bare ``unexpected keyword argument``."""
    valid = sorted(({f.name for f in fields(CheckpointConfig)} | set(extra)) - set(left_out))
    unknown = [name for name in options if name not in valid]
    if unknown:
        name = unknown[0]
        raise TypeError(f"{owner} got an unknown option {name!r}{did_you_mean(name, valid)}; valid options: "
                        f"{', '.join(valid)}")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Settings of a :class:`~lazyckpt.LazyCheckpointer` (its keyword arguments)."""

    keep_last_k: int | None = None
    """Keep only the newest k committed checkpoints (None keeps all). Older ones are removed only after a newer
    one is committed, so the only committed checkpoint is never removed."""
    host_buffer_bytes: int | None = None
    """Budget of the host staging pool. None sizes it to one checkpoint (rounded up to whole 8 MiB slots). A budget
    is filled up to ``max_in_flight`` checkpoints, so the next copy need not wait for the writer. A smaller budget
    works: pieces cycle through the pool's slots as the writer frees them, and the barrier waits longer."""
    copy_backend: CopyBackendName | str = CopyBackendName.AUTO
    """One of ``"auto"``, ``"cpu"``, ``"cuda"``, ``"triton"`` (see :class:`CopyBackendName`)."""
    on_busy: OnBusy | str = OnBusy.WAIT
    """``"wait"`` or ``"skip"`` (see :class:`OnBusy`): what a ``save()`` does while ``max_in_flight`` checkpoints
    are uncommitted (or, for ``"skip"``, while the newest is still being copied)."""
    max_in_flight: int = 1
    """How many checkpoints may be requested and not yet committed at once. 1: ``save()`` first waits until the
    previous checkpoint is committed, so a crash after ``save()`` returned leaves the previous one committed. 2: the
    next checkpoint is captured and copied while the previous one is still written and committed (commits stay in
    step order), so checkpointing more often than the writer keeps up with costs the slower of copy and write
    instead of their sum; a crash may then lose both. Both share the host pool (``host_buffer_bytes``): the next
    copy takes slots as the writer frees them, so memory stays at the budget; a budget of two checkpoints lets that
    copy never wait for the writer."""
    rank: int = 0
    """This process's rank; each rank writes its own tensor file."""
    world_size: int = 1
    """How many ranks write each checkpoint; it is committed only when all of their files are durable."""
    verify_on_load: bool = True
    """Default of ``verify`` for loads made through this checkpointer."""
    commit_timeout_s: float = 600.0
    """How long rank 0 waits for the other ranks' files before failing the checkpoint."""
    peer_timeout_s: float = 10.0
    """With a store: a rank waiting for a peer gives the checkpoint up once that peer's heartbeat stood still this
    long (it died or hangs), instead of waiting ``commit_timeout_s``. A live peer beats from a thread of its own, so
    a slow peer (a long step) is never taken as dead."""
    min_free_bytes: int = 0
    """Extra free space to keep on the file system beyond the checkpoint's own bytes."""
    fsync: bool = True
    """Make every file durable before commit. Turn off only for throwaway runs (tests of speed, tmpfs)."""
    on_older_step: OnOlderStep | str = OnOlderStep.ERROR
    """``"error"`` or ``"move_aside"`` (see :class:`OnOlderStep`)."""
    remote: str | None = None
    """An fsspec URL (``s3://bucket/run``, ``file:///shared/run``, ...): the remote level behind ``dirpath``
    (see docs/remote.md). Needs ``pip install 'lazyckpt[remote]'``."""
    remote_every_n: int = 1
    """Upload the checkpoints whose step is a multiple of this."""
    remote_keep_last_k: int | None = None
    """Keep only the newest k checkpoints on the remote level (None keeps all)."""
    remote_timeout_s: float = 600.0
    """How long the ranks wait for each other's uploads of one checkpoint (rank 0 for every rank's files, the
    others for rank 0's commit) before that upload fails."""
    storage_options: dict[str, Any] | None = None
    """Passed to fsspec for ``remote`` or a URL ``dirpath`` (for s3fs e.g. ``endpoint_url``, ``key``, ``secret``)."""
    spool_dir: str | None = None
    """The node-local directory used when ``dirpath`` is a URL (default: a private one under the system temp
    directory)."""
    keep_in_memory: bool | str = False
    """``True``: keep the newest committed snapshot in the host staging pool (the memory level, for a rollback
    without the disk; see ``LazyCheckpointer.memory_snapshot``). The pool then holds two checkpoints: the newest and
    the one being written, so ``host_buffer_bytes`` (None sizes it automatically) must have room for both.
    ``"host"``: the host level (docs/memory.md): checkpoints commit first in shared memory that outlives the
    training process (``host_memory_dir``), then are copied to ``dirpath`` in the background; a restart after a
    crash commits a newer host snapshot to ``dirpath`` before anything else."""
    host_memory_dir: str | None = None
    """With ``keep_in_memory="host"``: the shared-memory directory (a tmpfs) the host level lives under; None is
    ``/dev/shm/lazyckpt``. One folder per ``dirpath`` below it."""
    keep_on_close: bool = False
    """With ``keep_in_memory="host"``: a clean ``close()`` leaves the host copy in shared memory (default: frees it,
    once every checkpoint is committed in ``dirpath``)."""
    memory_peers: int = 0
    """With ``keep_in_memory="host"`` in a ``torch.distributed`` job over several nodes: ``1`` sends each rank's
    newest host snapshot, in the background, to the host memory of a rank on the next node (and keeps the previous
    node's), so a lost node's ranks restore from their peer's copy (docs/memory.md, "Peer copy"). ``0``: none."""

    @property
    def host_level(self) -> bool:
        """``keep_in_memory="host"``: the shared-memory level that outlives the process."""
        return self.keep_in_memory == "host"

    @property
    def in_process_memory(self) -> bool:
        """``keep_in_memory=True``: the in-process memory level (a rollback from the staging pool)."""
        return self.keep_in_memory is True

    def __post_init__(self) -> None:
        self.copy_backend = _parse_enum(CopyBackendName, "copy_backend", self.copy_backend)
        self.on_busy = _parse_enum(OnBusy, "on_busy", self.on_busy)
        self.on_older_step = _parse_enum(OnOlderStep, "on_older_step", self.on_older_step)
        if self.keep_last_k is not None and (not isinstance(self.keep_last_k, int) or self.keep_last_k < 1):
            raise ValueError(f"keep_last_k={self.keep_last_k!r} must be a positive int or None (keep all)")
        if isinstance(self.max_in_flight, bool) or not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(f"max_in_flight={self.max_in_flight!r} must be a positive int (1: one checkpoint at a "
                             "time; 2: the next one is copied while the previous one is written)")
        if self.host_buffer_bytes is not None and self.host_buffer_bytes < (8 << 20):
            raise ValueError(f"host_buffer_bytes={self.host_buffer_bytes!r} must be at least 8 MiB (one staging "
                             "slot) or None (one checkpoint)")
        _check_memory_options(self)
        if self.keep_in_memory is True and self.host_buffer_bytes is not None and self.host_buffer_bytes < (16 << 20):
            raise ValueError(f"keep_in_memory=True needs host_buffer_bytes of at least 16 MiB (two staging slots, "
                             f"one per checkpoint held); got {self.host_buffer_bytes!r}. Raise it or pass None")
        if self.on_busy is OnBusy.SKIP and self.world_size > 1:
            raise ValueError("on_busy='skip' needs world_size=1: ranks could skip different steps and the "
                             "checkpoint would never commit; use on_busy='wait' with several ranks")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank!r} must be in [0, world_size={self.world_size!r})")
        for name in ("commit_timeout_s", "peer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive number of seconds")
        if self.min_free_bytes < 0:
            raise ValueError(f"min_free_bytes={self.min_free_bytes!r} must be >= 0")
        _check_remote_options(self)


def _check_memory_options(config: CheckpointConfig) -> None:
    """Raise ``ValueError`` naming the option, the value and the fix."""
    if not (config.keep_in_memory is False or config.keep_in_memory is True or config.keep_in_memory == "host"):
        raise ValueError(f"keep_in_memory={config.keep_in_memory!r} must be False, True (the in-process memory "
                         "level) or 'host' (shared memory that outlives the process, docs/memory.md)")
    if isinstance(config.memory_peers, bool) or config.memory_peers not in (0, 1):
        raise ValueError(f"memory_peers={config.memory_peers!r} must be 0 (no peer copy) or 1 (a copy of each "
                         "rank's host snapshot on one rank of another node)")
    for name in ("host_memory_dir", "keep_on_close", "memory_peers"):
        if getattr(config, name) not in (None, False, 0) and not config.host_level:
            raise ValueError(f"{name}={getattr(config, name)!r} applies to keep_in_memory='host' only; got "
                             f"keep_in_memory={config.keep_in_memory!r}")
    root = config.host_memory_dir
    if root is not None and (not isinstance(root, (str, os.PathLike)) or is_url(root)):
        raise ValueError(f"host_memory_dir={config.host_memory_dir!r} must be a local directory (a tmpfs such as "
                         "/dev/shm/...), not a URL")


def _check_remote_options(config: CheckpointConfig) -> None:
    """Raise ``ValueError`` naming the option, the value and the fix."""
    if config.remote is not None:
        config.remote = check_url("remote", config.remote)
    every_n = config.remote_every_n
    if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
        raise ValueError(f"remote_every_n={every_n!r} must be a positive int (1 uploads every checkpoint)")
    keep = config.remote_keep_last_k
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"remote_keep_last_k={keep!r} must be a positive int or None (keep all)")
    timeout = config.remote_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"remote_timeout_s={timeout!r} must be a positive number of seconds")
    if config.storage_options is not None and not isinstance(config.storage_options, dict):
        raise ValueError(f"storage_options={config.storage_options!r} must be a dict of fsspec options or None")
    if config.spool_dir is not None and is_url(config.spool_dir):
        raise ValueError(f"spool_dir={config.spool_dir!r} must be a local directory, not a URL")


def normalize_dirpath(dirpath: str | os.PathLike[str]) -> str:
    """An absolute path string for ``dirpath`` (a URL stays a URL), with a clear error for an unusable value."""
    if not isinstance(dirpath, (str, os.PathLike)) or not os.fspath(dirpath):
        raise ValueError(f"dirpath={dirpath!r} must be a non-empty path to a directory")
    if is_url(dirpath):
        return check_url("dirpath", dirpath)
    return os.path.abspath(os.fspath(dirpath))


