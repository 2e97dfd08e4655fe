"""The barrier callback ``LazyCheckpoint`` places first in ``trainer.callbacks``.

Lightning moves checkpoint callbacks to the end of the list, so ``LazyCheckpoint``'s own hooks run after every
other callback's. Parameters must not change while a snapshot still reads them, so the barrier (``wait_staged``)
has to come *before* any callback that updates or overwrites weights in the same hook.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from typing_extensions import override

logger = logging.getLogger(__name__)
_WEIGHT_WRITERS = ("StochasticWeightAveraging", "WeightAveraging")


class LazyBarrierMixin:
    """Placed first in ``trainer.callbacks`` by ``LazyCheckpoint.setup``: passes the snapshot barrier before any
    other callback's hook can update or overwrite parameters (optimizer step, weight averaging swaps)."""

    def __init__(self, owner: Any) -> None:
        super().__init__()
        self.owner = owner
        self._hooks: list[Any] = []
        self.at_epoch_start = False
        """A weight-averaging callback writes weights at epoch start: the barrier runs there too."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_hooks": []}  # hook handles are per-process, made in on_train_start()

    def release(self) -> None:
        """Remove the optimizer hooks of :meth:`on_train_start`."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def install(self, trainer: Any, namespace: str) -> None:
        """Put this callback first in ``trainer.callbacks``; notes whether a weight-averaging callback there writes
        weights at epoch start (:attr:`at_epoch_start`)."""
        if self not in trainer.callbacks:
            # A new list, not insert(): Lightning is iterating over the old one while it calls setup().
            trainer.callbacks = [self, *trainer.callbacks]
        callbacks = importlib.import_module(f"{namespace}.callbacks")
        writers = tuple(getattr(callbacks, n) for n in _WEIGHT_WRITERS if hasattr(callbacks, n))
        self.at_epoch_start = any(isinstance(cb, writers) for cb in trainer.callbacks)

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not pl_module.automatic_optimization:
            # Manual optimization calls step() after backward, so a torch pre-hook is a safe barrier there (it
            # also covers raw optimizers that bypass on_before_optimizer_step). Never in automatic mode: Lightning
            # runs forward/backward inside step(closure), after the pre-hook.
            for opt in trainer.optimizers:
                self._hooks.append(opt.register_step_pre_hook(lambda *_: self.owner.wait_staged()))

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.owner.wait_staged()

    @override
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.owner.wait_staged()

    @override
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.at_epoch_start:  # StochasticWeightAveraging writes weights here
            self.owner.wait_staged()

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.owner.wait_staged()

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            self.owner.wait_staged()
        except BaseException:  # the run is failing already; keep its exception, log this one
            logger.exception("lazyckpt: the in-flight checkpoint failed")
