"""The barrier callback ``LazyCheckpoint`` places first in ``trainer.callbacks``.

Lightning moves checkpoint callbacks to the end of the list, so ``LazyCheckpoint``'s own hooks run after every
other callback's. Parameters must not change while a snapshot still reads them, so the barrier (``wait_staged``)
has to come *before* any callback that updates or overwrites weights in the same hook.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class LazyBarrierMixin:
    """Placed first in ``trainer.callbacks`` by ``LazyCheckpoint.setup``: passes the snapshot barrier before any
    other callback's hook can update or overwrite parameters (optimizer step, weight averaging swaps)."""

    def __init__(self, owner: Any) -> None:
        super().__init__()
        self.owner = owner

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.owner.wait_staged()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.owner.wait_staged()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.owner.wait_at_epoch_start:  # StochasticWeightAveraging writes weights here
            self.owner.wait_staged()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.owner.wait_staged()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            self.owner.wait_staged()
        except BaseException:  # the run is failing already; keep its exception, log this one
            logger.exception("lazyckpt: the in-flight checkpoint failed")
