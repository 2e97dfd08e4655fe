"""DeepSpeed integration: ``LazyCheckpointEngine``, a DeepSpeed checkpoint engine that saves lazily, and
``use_lazy_checkpoints(engine)``, which plugs it into a ``DeepSpeedEngine``.

After ``use_lazy_checkpoints(engine)``, ``engine.save_checkpoint(save_dir)`` returns once every file DeepSpeed
hands its checkpoint engine is captured (ZeRO 1/2: the model states and each rank's fp32 partition and optimizer
state; ZeRO-3: each rank's parameter and optimizer partitions; no clone on the training thread): the bytes are
copied while the next forward and backward run, and written by lazyckpt's background writer (checksums, manifest
last, one commit across ranks). The base optimizer's step pre-hook is the barrier: an update waits only while a copy
still reads the weights. ``save_dir/<tag>`` links to the committed step directory, and ``save_dir/latest`` names
the tag only once the checkpoint is durable on every rank (:mod:`lazyckpt.integrations._deepspeed_files`).
``engine.load_checkpoint(save_dir)`` is unchanged: it reads lazyckpt checkpoints through this engine (checksums
verified) and DeepSpeed's own files through ``torch.load``.

Why DeepSpeed's "decoupled" commit is not used to write ``latest``: DeepSpeed calls it at a step boundary on every
rank, and a rank can learn of the global commit a step before another; ``latest`` is written by rank 0 when it sees
the commit instead (at the next step boundary, save or load), and :func:`repair_latest` catches up after a crash.

Example (docs/deepspeed.md has the whole loop):
    >>> engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)     # doctest: +SKIP
    >>> use_lazy_checkpoints(engine, keep_last_k=3)                                      # doctest: +SKIP
    >>> engine.load_checkpoint("ckpts")         # resumes from ckpts/latest, if there is one  # doctest: +SKIP
    >>> engine.save_checkpoint("ckpts")         # returns at once; ckpts/latest follows the commit  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from lazyckpt.integrations._deepspeed_files import (STEP_TAG, TagFolder, close_folders, decode_objects,
                                                    encode_objects, ensure_markers, repair_latest, step_of_tag)
from lazyckpt.config import normalize_dirpath
from lazyckpt.interop.deepspeed_format import consolidate
from lazyckpt.pending import PendingCheckpoint
from lazyckpt.policy import CheckpointSession, SessionOptions
from lazyckpt.ranks.group import rank_and_size
from lazyckpt.read.load import load
from lazyckpt.read.reader import CheckpointReader
from lazyckpt.format.files import MANIFEST
from lazyckpt.storage import FileKind, LocalStorage, kind_of
from lazyckpt.threads import weakly


class LazyCheckpointEngine(CheckpointEngine):
    """DeepSpeed's ``CheckpointEngine`` with lazy checkpoints (see the module docstring); made and installed by
    :func:`use_lazy_checkpoints`.

    Args:
        engine: the ``DeepSpeedEngine`` whose checkpoints this engine writes (its ``global_steps`` is each
            checkpoint's step; its optimizers and module are what the copies read lazily).
        dirpath: where the step directories go (default: each ``save_dir``); ``save_dir`` keeps the tag links and
            ``latest`` either way.
        keep_last_k: keep the newest k checkpoints (with their tags) of each directory; None keeps every one.
        **options: :class:`~lazyckpt.LazyCheckpointer` options (``host_buffer_bytes``, ``copy_backend``, ...).
    """

    def __init__(self, engine: Any, *, dirpath: str | os.PathLike[str] | None = None, keep_last_k: int | None = None,
                 **options: Any) -> None:
        super().__init__(None)
        self.name = "LazyCheckpointEngine"
        self.options, _ = SessionOptions.from_keywords(options, owner="LazyCheckpointEngine", source="DeepSpeed",
                                                       keep_last_k=keep_last_k)
        self._engine = weakref.ref(engine)
        self._steps_dir = None if dirpath is None else normalize_dirpath(dirpath)
        self._torch = TorchCheckpointEngine()
        self._folder: TagFolder | None = None
        self._session: CheckpointSession | None = None
        """The current directory's session, or the last one's once closed (its stalls and stats stay readable)."""
        self._info: CheckpointCommitInfo | None = None
        self._files: dict[str, Any] | None = None
        self._loaded: dict[tuple[str, int], dict[str, Any]] = {}
        self._rank, self._world_size = rank_and_size()
        self._capturing = False
        self.hooks: list[Any] = []
        """The barrier's step pre-hooks on the torch optimizers."""
        self._at_exit = weakref.finalize(self, close_folders, [None])

    # --- DeepSpeed's calls ----------------------------------------------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        self.submit()  # a save_checkpoint this engine was not told the end of (use_lazy_checkpoints tells it)
        self._info, self._files = info, {}

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """``save_dir`` is made; ``save_dir/<tag>`` is not: it becomes a link to the step once committed. While
        :meth:`capture` runs nothing is."""
        info = self._info
        if self._capturing or (info is not None and
                               os.path.abspath(path) == os.path.abspath(os.path.join(info.save_dir, info.tag))):
            return
        LocalStorage().make_dir(os.path.abspath(path))

    def save(self, state_dict: Any, path: str) -> None:
        if self._files is None or self._info is None:
            raise RuntimeError("LazyCheckpointEngine.save() outside engine.save_checkpoint(): DeepSpeed calls "
                               "create() first; save through engine.save_checkpoint(save_dir)")
        tag_dir = os.path.abspath(os.path.join(self._info.save_dir, self._info.tag))
        if os.path.dirname(os.path.abspath(path)) != tag_dir and not self._capturing:
            # Not a tag's file: ``engine.save_16bit_model(dir)`` writes a plain model file into ``dir`` (and
            # commits it at once). It is written as DeepSpeed's own engine writes it, and is no lazy checkpoint.
            self._torch.save(state_dict, path)
            self._info = self._files = None
            return
        self._files[os.path.basename(path)] = encode_objects(state_dict)

    def load(self, path: str, map_location: Any = None) -> Any:
        tag_dir, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
        step_dir = step_of_tag(LocalStorage(), tag_dir)
        if step_dir is None:
            return self._torch.load(path, map_location=map_location)  # a checkpoint DeepSpeed wrote itself
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        for rank in dict.fromkeys((self._rank, 0, *range(self._world_size))):
            files = self._files_of(step_dir, rank, device)
            if files is not None and name in files:
                return decode_objects(files[name])  # new containers each time: DeepSpeed may change what it gets
        raise FileNotFoundError(f"LazyCheckpointEngine.load({path!r}): the lazyckpt checkpoint {step_dir} has no "
                                f"DeepSpeed file {name!r}; was it saved with another parallel layout?")

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Only ``save_16bit_model`` calls it (synchronously, its file written already by :meth:`save`):
        checkpoints are committed by lazyckpt, and ``get_commit_info()`` is None (see the module docstring)."""
        return True

    def is_decoupled(self) -> bool:
        return True  # DeepSpeed then leaves ``latest`` to this engine

    def get_commit_info(self) -> None:
        """Called at every step boundary: publish what is committed since (tag links, ``latest``)."""
        self.submit()
        if self._folder is not None:
            self._folder.poll()
        return None

    def preserves_storage_sharing(self) -> bool:
        return False  # True would make DeepSpeed clone every tensor first, on the training thread

    def cleanup(self) -> None:
        self.close()

    # --- the rest -------------------------------------------------------------------------------------------

    def capture(self, save_dir: str, client_state: dict[str, Any]) -> dict[str, Any]:
        """The files ``engine.save_checkpoint(save_dir, tag="checkpoint", client_state=...)`` hands over, by name,
        without requesting a checkpoint of them: for an integration whose own session saves them with the rest of
        its state (``{"tag": "checkpoint", "files": <this, per rank>}``; its tensors are copied lazily with
        :func:`lazy_parts`). Every rank calls it (DeepSpeed meets the ranks inside); nothing is written but
        DeepSpeed's ``zero_to_fp32.py`` into ``save_dir``."""
        self.submit()
        self._capturing = True
        try:
            self._engine().save_checkpoint(save_dir, tag=STEP_TAG, client_state=client_state)
            files = self._files
        finally:
            self._capturing = False
            self._info = self._files = None
        return files

    def submit(self) -> PendingCheckpoint | None:
        """Request the checkpoint of the files DeepSpeed handed over since ``create()`` (once)."""
        info, files = self._info, self._files
        if info is None or files is None or self._capturing:
            return None
        self._info = self._files = None
        engine = self._engine()
        step = int(engine.global_steps)
        folder = self._folder_for(info.save_dir)
        return folder.save(step, info, files, *lazy_parts(engine))

    def barrier(self) -> None:
        """Before an update: wait while a copy still reads the weights (the base optimizer's step pre-hook)."""
        if self._folder is not None:
            self._folder.session.barrier()

    def before_load(self, load_dir: str, tag: str | None = None) -> None:
        """Before ``engine.load_checkpoint(load_dir[, tag])``: finish this directory's saves, and on rank 0 bring
        ``latest`` up to the newest committed step that asked to be latest (all ranks then read the same
        ``latest``). Not for a ``tag`` given, nor with ``dirpath=`` (its steps may be other directories')."""
        self.submit()
        if self._folder is not None:
            self._folder.finish()
        self._commit_host_step(normalize_dirpath(load_dir))
        if self._rank == 0:
            load_dir = normalize_dirpath(load_dir)
            marked = ensure_markers(load_dir, LocalStorage())  # a step directory itself
            if not marked and tag is None and self._steps_dir in (None, load_dir):
                repair_latest(LocalStorage(), load_dir, load_dir)
        if self._world_size > 1:
            torch.distributed.barrier()

    def _commit_host_step(self, load_dir: str) -> None:
        """With ``keep_in_memory="host"`` (every rank): a step a crash kept in the host folder only is committed in
        its steps directory first, where the repair of ``latest`` and DeepSpeed's loader look (and the host folder
        is freed). Not for a step directory loaded itself, nor a directory whose session is open (it did so)."""
        steps_dir = self._steps_dir or load_dir
        open_here = self._folder is not None and self._folder.session.dirpath == steps_dir
        if open_here or kind_of(LocalStorage(), os.path.join(load_dir, MANIFEST)) is FileKind.FILE:
            return
        CheckpointSession.commit_host_leftovers(steps_dir, self.options, rank=self._rank, world_size=self._world_size)

    def after_load(self) -> None:
        self._loaded.clear()

    def discard(self) -> None:
        """``engine.save_checkpoint`` raised: what it handed over so far is not a checkpoint."""
        self._info = self._files = None

    def wait(self) -> None:
        """Block until every requested checkpoint is committed and ``latest`` names the newest, on every rank
        (re-raises a failure). Every rank calls it."""
        self.submit()
        if self._folder is not None:
            self._folder.finish()
        if self._world_size > 1:
            torch.distributed.barrier()  # rank 0 writes latest: the others return once it is there

    def close(self) -> None:
        """Finish every checkpoint in flight, put ``latest`` in place, release the directory. Idempotent."""
        self.submit()
        folder, self._folder = self._folder, None
        close_folders([folder])

    @property
    def in_flight(self) -> PendingCheckpoint | None:
        """The newest checkpoint requested (``.wait()`` returns once it is committed), or None."""
        return None if self._folder is None else self._folder.session.last_request

    @property
    def stalls(self) -> dict[int, float]:
        """Training-thread seconds each checkpoint cost, by step (capture, request and the first barrier), of the
        current directory (or the last one, once closed)."""
        return {} if self._session is None else self._session.stalls

    @property
    def stats(self) -> list[Any]:
        """:class:`~lazyckpt.write.stats.CheckpointStats` of each committed checkpoint, as :attr:`stalls`."""
        return [] if self._session is None else list(self._session.engine.stats)

    def _files_of(self, step_dir: str, rank: int, device: torch.device | None) -> dict[str, Any] | None:
        key = (step_dir, rank)
        if key not in self._loaded:
            if rank >= CheckpointReader(step_dir, LocalStorage()).world_size:
                return None  # saved by fewer ranks
            verify = self.options.engine.get("verify_on_load", True)
            self._loaded[key] = load(step_dir, map_location=device, verify=verify, rank=rank)["files"]
        return self._loaded[key]

    def _folder_for(self, save_dir: str) -> TagFolder:
        """The folder of ``save_dir``; saving into another one first finishes and closes the current one."""
        save_dir = normalize_dirpath(save_dir)
        folder = self._folder
        if folder is None or folder.save_dir != save_dir:
            close_folders([folder])
            self._folder = None
            steps_dir = self._steps_dir or save_dir
            session = CheckpointSession(steps_dir, self.options, rank=self._rank, world_size=self._world_size,
                                        engine_retention=False)
            folder = self._folder = TagFolder(session, save_dir)
            self._session = session
            self._at_exit.detach()
            self._at_exit = weakref.finalize(self, close_folders, [folder])
        return folder


def lazy_parts(engine: Any) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """What stays unchanged until the base optimizer's next step, so its tensors are copied lazily: ``(optimizers,
    immutable)`` for :meth:`~lazyckpt.LazyCheckpointer.save`. ZeRO-3 empties the base optimizer's parameter groups
    between steps, so its fp32 partitions are named here too (they change only inside the base step)."""
    flat = list(getattr(engine.optimizer, "fp32_partitioned_groups_flat", None) or [])
    return _optimizers(engine), [engine.module, *flat]


def _optimizers(engine: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside DeepSpeed's (ZeRO's base optimizer, or the client optimizer itself)."""
    found, optimizer = [], getattr(engine, "optimizer", None)
    for _ in range(4):  # ZeRO wraps the client optimizer once; the fp16/bf16 wrappers once more at most
        if optimizer is None:
            break
        if isinstance(optimizer, torch.optim.Optimizer):
            found.append(optimizer)
            break
        optimizer = getattr(optimizer, "optimizer", None)
    return found


def use_lazy_checkpoints(engine: Any, dirpath: str | os.PathLike[str] | None = None, **options: Any
                         ) -> LazyCheckpointEngine:
    """Make ``engine.save_checkpoint`` / ``engine.load_checkpoint`` use lazy checkpoints (module docstring).

    Args:
        engine: a ``DeepSpeedEngine`` from ``deepspeed.initialize``.
        dirpath: where the step directories go (default: each ``save_dir``).
        **options: ``keep_last_k`` and :class:`~lazyckpt.LazyCheckpointer` options.

    Returns:
        the installed :class:`LazyCheckpointEngine` (``.wait()``, ``.close()``, ``.stalls``); calling this again on
        the same engine returns it.

    Raises:
        TypeError: ``engine`` is not a ``DeepSpeedEngine``.
        ValueError: a DeepSpeed feature lazyckpt does not checkpoint (named, with the reason).
    """
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(f"use_lazy_checkpoints(engine=...) needs the DeepSpeedEngine deepspeed.initialize returns; "
                        f"got {type(engine).__name__}")
    if isinstance(engine.checkpoint_engine, LazyCheckpointEngine):
        return engine.checkpoint_engine
    _refuse_unsupported(engine)
    if getattr(engine, "optimizer", None) is not None and not _optimizers(engine):
        raise ValueError(f"use_lazy_checkpoints: found no torch optimizer inside DeepSpeed's "
                         f"{type(engine.optimizer).__name__}, so no barrier could hold the next update while a copy "
                         "reads the weights; pass a torch.optim optimizer to deepspeed.initialize")
    lazy = LazyCheckpointEngine(engine, dirpath=dirpath, **options)
    engine.checkpoint_engine = lazy
    _wrap(engine, "save_checkpoint", before=None, after=lazy.submit, failed=lazy.discard)
    _wrap(engine, "load_checkpoint", before=lazy.before_load, after=lazy.after_load, failed=lazy.after_load)
    # destroy() frees the optimizer's buffers before it calls cleanup(): the copies in flight end first
    _wrap(engine, "destroy", before=lambda *_: lazy.close(), after=lambda: None, failed=lambda: None)
    barrier = weakly(lazy.barrier)
    lazy.hooks = [opt.register_step_pre_hook(lambda *_: barrier()) for opt in _optimizers(engine)]
    return lazy


def _refuse_unsupported(engine: Any) -> None:
    """What DeepSpeed saves outside its checkpoint engine, or in a layout not tested with lazyckpt."""
    reasons = {"zero_nvme_offload_optimizer": "ZeRO-Infinity's NVMe-offloaded optimizer state is copied into the "
                                              "checkpoint by DeepSpeed itself, not through its checkpoint engine",
               "has_moe_layers": "mixture-of-experts checkpoints (per-expert files) are not tested with lazyckpt",
               "is_pipe_parallel": "pipeline-parallel checkpoints (per-layer files) are not tested with lazyckpt"}
    for attribute, reason in reasons.items():
        value = getattr(engine, attribute, False)
        if (value() if callable(value) else value):
            raise ValueError(f"use_lazy_checkpoints: this engine has {attribute}; {reason}. Keep DeepSpeed's own "
                             "checkpoint engine for it")


def _wrap(engine: Any, method: str, *, before: Any, after: Any, failed: Any) -> None:
    """``engine.<method>`` calls ``before(its directory argument)`` first, then ``after()`` or, if it raised, ``failed()``
    (the engine holds the checkpoint engine only weakly through these)."""
    original = getattr(engine, method)
    before, after, failed = (f if f is None or not hasattr(f, "__self__") else weakly(f)
                             for f in (before, after, failed))

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if before is not None:  # load_checkpoint(load_dir, tag=None, ...)
            before(args[0] if args else kwargs.get("load_dir"), args[1] if len(args) > 1 else kwargs.get("tag"))
        try:
            result = original(*args, **kwargs)
        except BaseException:
            failed()
            raise
        after()
        return result
    setattr(engine, method, call)


def consolidated_state(path: str | os.PathLike[str], *, verify: bool = True) -> dict[str, Any]:
    """A DeepSpeed checkpoint's whole tensors in one process, at any world size (``save_dir/<tag>`` or its step
    directory): ``{"module": fp32 weights and buffers, "optimizer": {name: per-parameter state}, "tag",
    "global_steps"}``; see :func:`lazyckpt.interop.deepspeed_format.consolidate`."""
    return consolidate(path, verify=verify)


__all__ = ["LazyCheckpointEngine", "consolidated_state", "use_lazy_checkpoints"]
