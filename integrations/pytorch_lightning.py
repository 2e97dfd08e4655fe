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

from ._lightning_bindings import bind
from ._lightning_io import export_checkpoint, load_from_checkpoint, load_weights, to_lightning_checkpoint

LazyCheckpoint, LazyCheckpointIO, _LazyBarrier = bind("pytorch_lightning", "lightning_fabric", __name__)

__all__ = ["LazyCheckpoint", "LazyCheckpointIO", "export_checkpoint", "load_from_checkpoint", "load_weights",
           "to_lightning_checkpoint"]
