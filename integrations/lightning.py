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

from ._lightning_bindings import bind
from ._lightning_io import export_checkpoint, load_from_checkpoint, load_weights, to_lightning_checkpoint

LazyCheckpoint, LazyCheckpointIO, _LazyBarrier = bind("lightning.pytorch", "lightning.fabric", __name__)

__all__ = ["LazyCheckpoint", "LazyCheckpointIO", "export_checkpoint", "load_from_checkpoint", "load_weights",
           "to_lightning_checkpoint"]
