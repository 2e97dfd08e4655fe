"""``LazyCheckpoint`` for ``pytorch_lightning`` (whose classes are separate from ``lightning``'s).

Example:
    >>> from pytorch_lightning import Trainer
    >>> from lazyckpt.integrations.pytorch_lightning import LazyCheckpoint
    >>> callback = LazyCheckpoint("runs/ckpt", every_n_train_steps=100, save_last=True)     # doctest: +SKIP
    >>> Trainer(callbacks=[callback]).fit(model, ckpt_path="last")                           # doctest: +SKIP

``lightning`` users import it from :mod:`lazyckpt.integrations.lightning` (or ``from lazyckpt import LazyCheckpoint``).
See docs/lightning.md for the hooks, the options, DDP and resume guarantees.
"""

from __future__ import annotations

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

from ._lightning_barrier import LazyBarrierMixin
from ._lightning_core import LazyCheckpointMixin
from ._lightning_io import (
    LazyCheckpointIOMixin,
    export_checkpoint,
    load_from_checkpoint,
    load_weights,
    to_lightning_checkpoint,
)


class LazyCheckpointIO(LazyCheckpointIOMixin, CheckpointIO):
    __doc__ = LazyCheckpointIOMixin.__doc__


class _LazyBarrier(LazyBarrierMixin, Callback):
    __doc__ = LazyBarrierMixin.__doc__


class LazyCheckpoint(LazyCheckpointMixin, ModelCheckpoint):
    __doc__ = LazyCheckpointMixin.__doc__
    _namespace = "pytorch_lightning"
    _io_class = LazyCheckpointIO
    _barrier_class = _LazyBarrier


__all__ = ["LazyCheckpoint", "LazyCheckpointIO", "export_checkpoint", "load_from_checkpoint", "load_weights",
           "to_lightning_checkpoint"]
