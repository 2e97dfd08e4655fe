"""``LazyCheckpoint`` for ``pytorch_lightning`` (whose classes are separate from ``lightning``'s).

Example:
    >>> from pytorch_lightning import Trainer
    >>> from lazyckpt.integrations.pytorch_lightning import LazyCheckpoint
    >>> callback = LazyCheckpoint("runs/ckpt", every_n_train_steps=100, save_last=True)     # doctest: +SKIP
    >>> Trainer(callbacks=[callback]).fit(model, ckpt_path="last")                           # doctest: +SKIP

The classes are derived from those of :mod:`lazyckpt.integrations.lightning` (read the code there): the same
mixin and class attributes on ``pytorch_lightning``'s base classes, so both read each other's checkpoints. Like the
``lightning`` binding it needs the ``lightning`` package (``pip install 'lazyckpt[lightning]'``). See
docs/lightning.md.
"""

from __future__ import annotations

from typing import Any

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

from . import lightning as _lightning
from ._lightning_io import export_checkpoint, load_from_checkpoint, load_weights, to_lightning_checkpoint


def _derive(cls: type, base: type, **attributes: Any) -> type:
    """``cls`` (mixin first, then a ``lightning`` base) with ``base`` in place of that base; named in this module
    so that instances pickle (``ddp_spawn``)."""
    body = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    body.update(__module__=__name__, __qualname__=cls.__name__, **attributes)
    return type(cls.__name__, (cls.__bases__[0], base), body)


LazyCheckpointIO = _derive(_lightning.LazyCheckpointIO, CheckpointIO, _default_base=TorchCheckpointIO)
LazyBarrier = _derive(_lightning.LazyBarrier, Callback)
LazyCheckpoint = _derive(_lightning.LazyCheckpoint, ModelCheckpoint, _namespace="pytorch_lightning",
                         _io_class=LazyCheckpointIO, _barrier_class=LazyBarrier)

__all__ = ["LazyCheckpoint", "LazyCheckpointIO", "export_checkpoint", "load_from_checkpoint", "load_weights",
           "to_lightning_checkpoint"]
