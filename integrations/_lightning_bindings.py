"""Builds the Lightning classes for one namespace: ``lightning`` and ``pytorch_lightning`` have separate class
trees, so each gets its own ``LazyCheckpoint``, ``LazyCheckpointIO`` and barrier callback, all made of the same
mixins (``_lightning_core``, ``_lightning_io``, ``_lightning_barrier``)."""

from __future__ import annotations

import importlib

from ._lightning_barrier import LazyBarrierMixin
from ._lightning_core import LazyCheckpointMixin
from ._lightning_io import LazyCheckpointIOMixin


def bind(namespace: str, fabric: str, module: str) -> tuple[type, type, type]:
    """``(LazyCheckpoint, LazyCheckpointIO, barrier callback)`` for ``namespace`` (e.g. ``"lightning.pytorch"``),
    whose CheckpointIO lives in ``fabric``; the classes are named as attributes of ``module`` (so they pickle)."""
    callbacks = importlib.import_module(f"{namespace}.callbacks")
    checkpoint_io = importlib.import_module(f"{fabric}.plugins.io.checkpoint_io")

    def make(name: str, mixin: type, base: type, **attrs: object) -> type:
        return type(name, (mixin, base), {"__module__": module, "__qualname__": name, "__doc__": mixin.__doc__,
                                          **attrs})

    io_class = make("LazyCheckpointIO", LazyCheckpointIOMixin, checkpoint_io.CheckpointIO)
    barrier_class = make("_LazyBarrier", LazyBarrierMixin, callbacks.Callback)
    callback = make("LazyCheckpoint", LazyCheckpointMixin, callbacks.ModelCheckpoint, _namespace=namespace,
                    _io_class=io_class, _barrier_class=barrier_class)
    return callback, io_class, barrier_class
