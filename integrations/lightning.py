"""``LazyCheckpoint`` for ``lightning`` (``import lightning.pytorch``); also ``from lazyckpt import LazyCheckpoint``.

Example:
    >>> from lightning.pytorch import Trainer
    >>> from lazyckpt import LazyCheckpoint
    >>> callback = LazyCheckpoint("runs/ckpt", every_n_train_steps=100, save_last=True)     # doctest: +SKIP
    >>> Trainer(callbacks=[callback]).fit(model, ckpt_path="last")                           # doctest: +SKIP

``pytorch_lightning`` users import the same callback from :mod:`lazyckpt.integrations.pytorch_lightning`.
See docs/lightning.md for the hooks, the options, DDP and resume guarantees.
"""

from __future__ import annotations

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ._lightning_barrier import LazyBarrierMixin
from ._lightning_core import LazyCheckpointMixin
from ._lightning_io import (LazyCheckpointIOMixin, export_checkpoint, load_from_checkpoint, load_weights,
                            to_lightning_checkpoint)


class LazyCheckpointIO(LazyCheckpointIOMixin, CheckpointIO):
    __doc__ = LazyCheckpointIOMixin.__doc__
    _default_base = TorchCheckpointIO


class LazyBarrier(LazyBarrierMixin, Callback):
    __doc__ = LazyBarrierMixin.__doc__


class LazyCheckpoint(LazyCheckpointMixin, ModelCheckpoint):
    __doc__ = LazyCheckpointMixin.__doc__
    _namespace = "lightning.pytorch"
    _io_class = LazyCheckpointIO
    _barrier_class = LazyBarrier


__all__ = ["LazyCheckpoint", "LazyCheckpointIO", "export_checkpoint", "load_from_checkpoint", "load_weights",
           "to_lightning_checkpoint"]
