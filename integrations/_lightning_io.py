"""The Lightning checkpoint dict and lazyckpt: loading weights into a module, the per-rank RNG states, the lazy
request of a step, the CheckpointIO that resume goes through, and where the callback reports (console, loggers).
Reading a lazyckpt checkpoint as a Lightning checkpoint dict and exporting it to a plain ``.ckpt`` file are
:mod:`lazyckpt.interop.lightning_format` and :mod:`lazyckpt.interop.export` (the CLI uses them too); this module's names for them
are the public ones.

Nothing here imports ``lightning`` or ``pytorch_lightning``; the two bindings add their base classes.

Example:
    >>> from lazyckpt.integrations.lightning import export_checkpoint, load_weights
    >>> load_weights(model, "runs/ckpt/last.ckpt")                                 # doctest: +SKIP
    >>> export_checkpoint("runs/ckpt/step-0000120", "model.ckpt")                  # doctest: +SKIP
    >>> MyModule.load_from_checkpoint("model.ckpt")                                # doctest: +SKIP
"""

from __future__ import annotations

import functools
import importlib
import io
import logging
import os
import weakref
from typing import Any

import torch

from lazyckpt._version import __version__
from lazyckpt.format.files import MANIFEST
from lazyckpt.interop.export import export_lightning as export_checkpoint
from lazyckpt.interop.lightning_format import EXTRA_KEY, lightning_checkpoint_bytes, to_lightning_checkpoint
from lazyckpt.pending import PendingCheckpoint
from lazyckpt.policy import Reporter, ResumedRng, RunLayout, capture_rng, check_fits, find_generators, restore_sharded
from lazyckpt.read.load import check_committed
from lazyckpt.storage import FileKind, LocalStorage, kind_of
from lazyckpt.storage.urls import is_url

from . import _compat

logger = logging.getLogger(__name__)

URL_PREFIX = "lazyckpt://"
"""``lazyckpt://<path>`` names a checkpoint for Lightning's fsspec-based loading (see ``integrations/url.py``)."""


# ------------------------------------------------------------------------------------------ reading
DCP_METADATA = ".metadata"
"""The file ``torch.distributed.checkpoint`` writes last into a checkpoint directory (a sharded ModelCheckpoint's)."""


def is_lazyckpt_path(path: str | os.PathLike[str]) -> bool:
    """True for a directory (or an alias symlink to one): lazyckpt checkpoints are directories. Not for the DCP
    directory of a sharded ``ModelCheckpoint`` save (its ``.metadata`` file and no lazyckpt manifest), which the
    strategy's own loader reads."""
    storage, name = LocalStorage(), os.fspath(path)
    if kind_of(storage, name) is not FileKind.DIR:
        return False
    dcp = storage.stat(os.path.join(name, DCP_METADATA)) is not None
    return not dcp or storage.stat(os.path.join(name, MANIFEST)) is not None


def local_path(url: str | os.PathLike[str]) -> str:
    """The checkpoint path a ``lazyckpt://`` URL names (a plain path is returned as it is).

    Raises:
        ValueError: the URL wraps another URL (``lazyckpt://s3://...``): ``lazyckpt://`` names local checkpoints,
            and nothing is sent to the host it names.
    """
    text = os.fspath(url)
    if not text.startswith(URL_PREFIX):
        return text
    inner = text[len(URL_PREFIX):]
    if is_url(inner):
        raise ValueError(f"{text!r}: {URL_PREFIX} names a local lazyckpt checkpoint, not {inner!r}; load a remote "
                         "checkpoint with lazyckpt.load(url, storage_options=...), or fetch it to a local directory")
    return inner


def load_weights(module: torch.nn.Module, path: str | os.PathLike[str], *, strict: bool = True,
                 map_location: Any = None) -> Any:
    """Load the weights of a lazyckpt checkpoint into ``module`` (a LightningModule or any ``nn.Module`` whose
    ``state_dict`` keys match); returns ``load_state_dict``'s result (missing and unexpected keys)."""
    checkpoint = to_lightning_checkpoint(path, map_location=map_location)
    return module.load_state_dict(checkpoint["state_dict"], strict=strict)


def load_from_checkpoint(cls: type, path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint`` for a lazyckpt checkpoint (hyper-parameters included); ``kwargs`` go to it."""
    return cls.load_from_checkpoint(io.BytesIO(lightning_checkpoint_bytes(path)), **kwargs)


# ------------------------------------------------------------------------------------------ the run's own state
def per_rank_extra(trainer: Any) -> dict[str, Any]:
    """lazyckpt's additions to this rank's Lightning checkpoint: RNG states (train loaders' generators included)."""
    generators = find_generators(_compat.train_loaders(trainer), "train")
    return {"rng": capture_rng(generators), "rank": trainer.global_rank, "world_size": trainer.world_size,
            "version": __version__}


def restore_train_rng(trainer: Any, rng: ResumedRng) -> None:
    """Restore the RNG states a loaded checkpoint captured (if any), at the start of training.

    Lightning created the train iterator (drawing from the RNGs) before ``on_train_start``; after the restore the
    iterator is created again so its draws match the uninterrupted run. A stateful loader already got its own state
    from Lightning: re-creating its iterator would lose it.
    """
    loaders = _compat.train_loaders(trainer)
    if rng.restore(lambda: find_generators(loaders, "train")) and not any(
            callable(getattr(dl, "load_state_dict", None)) for dl in loaders):
        _compat.restart_train_iterator(trainer)


_ROUTED: weakref.WeakSet[Any] = weakref.WeakSet()
"""Strategies whose ``load_checkpoint`` :func:`route_sharded_loads` replaced already."""


def route_sharded_loads(strategy: Any) -> None:
    """Make ``strategy.load_checkpoint`` restore lazyckpt checkpoints, resharded, when the strategy loads them
    itself instead of through its CheckpointIO (ModelParallelStrategy); other paths keep its own loader."""
    if not _compat.loads_checkpoints_itself(strategy) or strategy in _ROUTED:
        return
    own = strategy.load_checkpoint

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = local_path(strategy.broadcast(checkpoint_path))
        if not is_lazyckpt_path(path):  # e.g. ModelCheckpoint's DCP directory: a switching callback adopts its state
            return adopt_callback_states(own(checkpoint_path, weights_only=weights_only), _state_keys(strategy))
        return restore_sharded(check_committed(path), strategy.model, strategy.optimizers,
                               model_key="state_dict", optimizers_key="optimizer_states", run_keys=(EXTRA_KEY,),
                               rank=strategy.global_rank, world_size=strategy.world_size)

    strategy.load_checkpoint = load_checkpoint
    _ROUTED.add(strategy)


def _state_keys(strategy: Any) -> set[str] | None:
    """The state keys of the callbacks of the trainer ``strategy`` runs (None: no trainer yet)."""
    trainer = getattr(strategy.lightning_module, "_trainer", None)
    return None if trainer is None else {cb.state_key for cb in trainer.callbacks}


def request_snapshot(callback: Any, step: int) -> PendingCheckpoint | None:
    """Request the checkpoint ``trainer.save_checkpoint`` would write for ``callback`` (a ``LazyCheckpoint``: its
    session, trainer and ``save_weights_only``), lazily (None: the step exists already)."""
    trainer = callback.trainer
    checkpoint = _compat.dump_checkpoint(trainer, callback.save_weights_only)
    frozen = [p for p in trainer.lightning_module.parameters() if not p.requires_grad]
    # DDP replicates the model and optimizer; every rank has its own RNG states
    return callback.session.save(step, replicated=checkpoint, per_rank={EXTRA_KEY: checkpoint.get(EXTRA_KEY)},
                                 optimizers=trainer.optimizers, immutable=frozen, if_committed="warn")


# ------------------------------------------------------------------------------------------ CheckpointIO
_STATE_KEY_CLASSES = ("ModelCheckpoint{", "LazyCheckpoint{")
"""Lightning keeps a callback's state under a key that starts with its class name (``Callback._generate_state_key``):
``ModelCheckpoint{'monitor': 'val_loss', ...}`` and ``LazyCheckpoint{'monitor': 'val_loss', ...}``."""


def adopt_callback_states(checkpoint: dict[str, Any], state_keys: set[str] | None) -> dict[str, Any]:
    """Switching between ``ModelCheckpoint`` and ``LazyCheckpoint``: give each checkpoint callback of the resuming
    trainer (``state_keys``; None: a trainer without ``LazyCheckpoint``) the state the other class saved with the
    same options (monitor, mode, triggers) when the checkpoint holds none under its own key. A state no callback of
    the trainer reads under its old key is moved, so Lightning does not ask for the callback that saved it."""
    states = checkpoint.get("callbacks")
    if not isinstance(states, dict):
        return checkpoint
    plain, lazy = _STATE_KEY_CLASSES
    for key in [k for k in states if isinstance(k, str) and k.startswith(_STATE_KEY_CLASSES)]:
        other = lazy + key[len(plain):] if key.startswith(plain) else plain + key[len(lazy):]
        if other in states or not (other in state_keys if state_keys is not None else key.startswith(lazy)):
            continue
        states[other] = states[key] if state_keys is not None and key in state_keys else states.pop(key)
    return checkpoint


class LazyCheckpointIOMixin:
    """Loads lazyckpt checkpoints (directories, names linking to them, ``lazyckpt://`` URLs) for
    ``fit/validate/test/predict(ckpt_path=...)``; everything else (plain ``.ckpt`` files, direct
    ``trainer.save_checkpoint`` calls, SLURM ``hpc`` saves) goes to the wrapped CheckpointIO, so those saves stay
    blocking and produce ordinary Lightning files.

    ``LazyCheckpoint`` installs one itself. Without that callback, pass one as a plugin:
    ``Trainer(plugins=[lazyckpt.LazyCheckpointIO()])``.

    Args:
        base: the CheckpointIO for everything that is not a lazyckpt checkpoint (default: Lightning's
            ``TorchCheckpointIO``).
    """

    _default_base: Any = None

    def __init__(self, base: Any = None, owner: Any = None) -> None:
        super().__init__()
        self.base = base if base is not None else self._default_base()
        self._owner = weakref.ref(owner) if owner is not None else (lambda: None)

    @classmethod
    def install(cls, trainer: Any, owner: Any) -> None:
        """Wrap the strategy's CheckpointIO (or adopt an instance given in ``Trainer(plugins=...)``)."""
        io = trainer.strategy.checkpoint_io
        if isinstance(io, cls):
            io._owner = weakref.ref(owner)
        else:
            trainer.strategy.checkpoint_io = cls(io, owner=owner)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.base.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict:
        owner = self._owner()
        trainer = owner.trainer if owner is not None else None
        path = local_path(path)
        keys = None if trainer is None else {cb.state_key for cb in trainer.callbacks}
        if not is_lazyckpt_path(path):
            if kind_of(LocalStorage(), os.fspath(path)) is None:
                check_committed(os.fspath(path))  # raises with the partial / newest-committed hint
            return adopt_callback_states(
                self.base.load_checkpoint(path, map_location=map_location, weights_only=weights_only), keys)
        rank = trainer.global_rank if trainer is not None else 0
        checkpoint = to_lightning_checkpoint(path, rank=rank, map_location=map_location)
        adopt_callback_states(checkpoint, keys)
        module = trainer.lightning_module if trainer is not None else None
        if module is not None:  # Lightning's load_state_dict converts dtypes, so only keys and shapes must match
            name = f"model ({type(module).__name__})"
            check_fits(os.fspath(path), RunLayout(models={name: checkpoint.get("state_dict", {})}),
                       RunLayout(models={name: module.state_dict()}), dtypes=False,
                       strict=getattr(module, "strict_loading", True))
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        storage, name = LocalStorage(), os.fspath(path)
        info = storage.stat(name)
        if info is not None and info.kind is FileKind.LINK:  # a name of a step directory: the step stays
            storage.remove_file(name)
        else:
            self.base.remove_checkpoint(path)

    def teardown(self) -> None:
        self.base.teardown()


def rank_zero_info(namespace: str, message: str) -> None:
    """Print like ModelCheckpoint(verbose=True) does (Lightning's console logger)."""
    importlib.import_module(f"{namespace}.utilities.rank_zero").rank_zero_info(message)


def trainer_reporter(callback: Any, namespace: str) -> Reporter:
    """Where a ``LazyCheckpoint`` reports: the console of Lightning's ``namespace``; its trainer's loggers get the
    metrics (with ``log_stats``) and hear of each saved checkpoint (``after_save_checkpoint``)."""

    def log_metrics(values: dict[str, float], step: int) -> None:
        for lg in callback.trainer.loggers:
            lg.log_metrics(values, step=step)

    def after_save(step: int) -> None:
        for lg in callback.trainer.loggers:
            lg.after_save_checkpoint(weakref.proxy(callback))

    return Reporter(info=functools.partial(rank_zero_info, namespace), each=after_save,
                    metrics=log_metrics if callback.log_stats else None)
