"""The options of an integration (``LazyCheckpoint``, ``LazyCheckpointHook``), validated once at construction.

To give both integrations a new option, add a field to :class:`SessionOptions`: each adapter passes the keywords
named like its fields here (see :meth:`SessionOptions.from_keywords`), so nothing else changes. Options of the engine
itself (``CheckpointConfig`` fields, ``storage``, ``backend``) travel in ``engine``.

A URL ``dirpath`` (:func:`url_dirpath_levels`) is split the engine's own way
(:func:`lazyckpt.levels.remote.spool.split_levels`) before the framework sees the directory: a framework that
keeps its file names as links next to the checkpoints (Lightning's ``last.ckpt``) gets the private node-local spool
directory, where the names and the local level live, and the URL becomes the remote level every checkpoint is
uploaded to. ``keep_last_k`` applies on the remote; the spool keeps the newest checkpoint, the ones a name points
at, and any still uploading.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, TypedDict

from lazyckpt.config import CheckpointConfig, check_option_names, normalize_dirpath
from lazyckpt.levels.remote.spool import split_levels
from lazyckpt.read.load import latest
from lazyckpt.storage import FileKind, LocalStorage, kind_of
from lazyckpt.storage.urls import is_url

ENGINE_OBJECTS = ("storage", "backend")
"""``LazyCheckpointer`` arguments that are objects, not ``CheckpointConfig`` fields."""
SET_BY_THE_RUN = ("rank", "world_size", "keep_last_k")
"""Engine arguments an integration sets itself: rank and world size from the framework, keep_last_k from its own
argument (so that retention can also protect named checkpoints)."""


class EngineOptions(TypedDict, total=False):
    """Further :class:`~lazyckpt.LazyCheckpointer` arguments an integration passes through unchanged; each has the
    meaning of the :class:`~lazyckpt.CheckpointConfig` field of that name (``storage``: a ``Storage`` object,
    ``backend``: a copy backend object)."""

    verify_on_load: bool
    commit_timeout_s: float
    peer_timeout_s: float
    min_free_bytes: int
    fsync: bool
    max_in_flight: int
    on_older_step: Literal["error", "move_aside"]
    spool_dir: str
    storage: Any
    backend: Any


@dataclass(kw_only=True)
class SessionOptions:
    """What one integration was asked to do; raises ``ValueError`` naming the option at construction."""

    owner: str
    """The integration's class name, for error messages (``"LazyCheckpointHook"``)."""
    source: str
    """Where rank and world size come from, for error messages (``"the trainer"``)."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Further :class:`~lazyckpt.LazyCheckpointer` arguments (``host_buffer_bytes``, ``copy_backend``, ...)."""
    keep_last_k: int | None = None
    """Keep the newest k committed checkpoints (also when nothing else names them); None keeps all."""
    remote: str | None = None
    """An fsspec URL: the remote level behind the local directory (docs/remote.md)."""
    remote_every_n: int = 1
    """Upload the checkpoints whose step is a multiple of this."""
    remote_keep_last_k: int | None = None
    """Keep only the newest k checkpoints on the remote level (None keeps all)."""
    storage_options: dict[str, Any] | None = None
    """Passed to fsspec for ``remote`` or a URL directory (for s3fs e.g. ``endpoint_url``, ``key``, ``secret``)."""
    max_rollbacks: int = 3
    """Rollbacks on a non-finite loss allowed in a row without a newer good checkpoint; one more raises
    :class:`~lazyckpt.RollbackLimitError` (see :class:`~lazyckpt.policy.RollbackPolicy`)."""

    _config: CheckpointConfig = field(init=False, repr=False)

    _NOT_USER_OPTIONS: ClassVar[tuple[str, ...]] = ("owner", "source", "engine")
    _REMOTE_OPTIONS: ClassVar[tuple[str, ...]] = ("remote", "remote_every_n", "remote_keep_last_k", "storage_options")
    """Options the engine applies as they are (its ``CheckpointConfig`` fields of the same names)."""

    def __post_init__(self) -> None:
        if isinstance(self.keep_last_k, bool):
            raise ValueError(f"keep_last_k={self.keep_last_k!r} must be a positive int or None (keep all)")
        check_max_rollbacks(self.max_rollbacks)
        taken = [k for k in SET_BY_THE_RUN if k in self.engine]
        if taken:
            spelled = ", ".join(f"{k}=..." for k in taken)
            raise ValueError(f"{self.owner}({spelled}) is not accepted: rank and world_size come from {self.source}, "
                             "and keep_last_k is an argument of its own")
        self.engine = {**self.engine, **{k: getattr(self, k) for k in self._REMOTE_OPTIONS
                                         if getattr(self, k) != type(self).__dataclass_fields__[k].default}}
        own = {f.name for f in fields(self) if f.init and f.name not in self._NOT_USER_OPTIONS}
        misplaced = sorted(set(self.engine) & own - {f.name for f in fields(CheckpointConfig)})
        if misplaced:
            raise TypeError(f"{self.owner}: {misplaced[0]!r} is an argument of {self.owner} itself, not an engine "
                            f"option: pass {self.owner}(..., {misplaced[0]}=...)")
        check_option_names(self.engine, owner=self.owner, extra=ENGINE_OBJECTS, left_out=SET_BY_THE_RUN)
        config = {k: v for k, v in self.engine.items() if k not in ENGINE_OBJECTS}
        self._config = CheckpointConfig(keep_last_k=self.keep_last_k, **config)  # every check, now

    @classmethod
    def from_keywords(cls, keywords: dict[str, Any], *, owner: str, source: str, keep_last_k: int | None,
                      engine: dict[str, Any] | None = None) -> tuple[SessionOptions, dict[str, Any]]:
        """The options named like this class's fields, taken out of an adapter's ``**keywords``, and the keywords
        left. Without ``engine`` the others are the engine's options and none is left; with it they are left for
        the framework (``ModelCheckpoint``'s own arguments).

        Raises:
            ValueError: an invalid option (the message names it).
        """
        names = {f.name for f in fields(cls) if f.init} - {*cls._NOT_USER_OPTIONS, "keep_last_k"}
        ours = {k: v for k, v in keywords.items() if k in names}
        rest = {k: v for k, v in keywords.items() if k not in names}
        options = cls(owner=owner, source=source, keep_last_k=keep_last_k,
                      engine=rest if engine is None else engine, **ours)
        return options, {} if engine is None else rest

    def newest_on_this_node(self, dirpath: str) -> str | None:
        """The newest committed checkpoint in ``dirpath`` or on the remote level, as a local directory (a newer
        remote one is fetched into ``dirpath`` first, e.g. on a fresh node); None when there is none."""
        if self._config.remote is None:
            return latest(dirpath) if kind_of(LocalStorage(), dirpath) is FileKind.DIR else None
        from lazyckpt.levels.remote.fetch import newest_on_this_node

        return newest_on_this_node(dirpath, self._config.remote, self._config.storage_options)

    def engine_arguments(self, *, rank: int, world_size: int, retention: bool) -> dict[str, Any]:
        """``LazyCheckpointer`` keyword arguments; ``retention``: the engine applies ``keep_last_k`` itself."""
        return {**self.engine, "rank": rank, "world_size": world_size,
                "keep_last_k": self.keep_last_k if retention else None}


def check_max_rollbacks(value: Any) -> None:
    """Raise ``ValueError`` unless ``max_rollbacks`` is a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"max_rollbacks={value!r} must be a non-negative int (0 stops at the first non-finite loss)")


def project_defaults(dirpath: str | os.PathLike[str] | None, options: SessionOptions, *, project_dir: str | None,
                     total_limit: int | None, missing: str, subdir: str = "lazyckpt") -> tuple[str, SessionOptions]:
    """``dirpath`` and ``keep_last_k`` from a framework's project settings where the integration was given none:
    ``project_dir/subdir`` (a folder of its own: the framework may prune its own checkpoint folder by name) and
    ``total_limit``.

    Raises:
        ValueError: no ``dirpath`` and no ``project_dir``; ``missing`` says how to give one.
    """
    if dirpath is None:
        if project_dir is None:
            raise ValueError(f"{options.owner}(dirpath=None) has no directory to write to: {missing}")
        dirpath = os.path.join(project_dir, subdir)
    if options.keep_last_k is None and total_limit is not None:
        options = dataclasses.replace(options, keep_last_k=total_limit)
    return normalize_dirpath(dirpath), options


def url_dirpath_levels(dirpath: str | os.PathLike[str] | None,
                       options: SessionOptions) -> tuple[str | os.PathLike[str] | None, SessionOptions]:
    """``(local directory, options)`` for ``dirpath``: for a URL, the spool directory and ``options`` whose remote
    level is that URL; anything else is returned unchanged. With ``keep_in_memory="host"`` too: the names stay in
    ``dirpath``, next to the steps the host level copies there (the engine keeps its host folder to itself).

    Raises:
        ValueError: ``remote=`` names another URL, or ``remote_every_n`` is not 1 (every checkpoint goes remote).
    """
    if not is_url(dirpath):
        return dirpath, options
    spool, config = split_levels(normalize_dirpath(dirpath), options._config)
    return spool, dataclasses.replace(options, remote=config.remote, remote_keep_last_k=config.remote_keep_last_k,
                                      keep_last_k=config.keep_last_k)
