"""``LazyCheckpointHook.rollback()``: translates an Accelerate loop's state into the policy layer's
:class:`~lazyckpt.policy.RollbackPolicy` (which decides), and its outcome back into the prepared objects.

The bad step is the update the current iteration makes (``UpdateLoop.bad_step``): ``hook.step + 1`` when
``rollback()`` is called before ``optimizer.step()`` (the cheap place: right after the loss is computed),
``hook.step`` when the update already happened (its request, not issued yet, is dropped). The target is the
newest snapshot strictly before it. With several processes every process must call ``rollback()`` for the same
iteration; process 0 reads the target and broadcasts it (it alone holds the replicated state, as in Accelerate's
own ``save_state``).
"""

from __future__ import annotations

from typing import Any

from lazyckpt.errors import NothingToRollBackTo
from lazyckpt.policy import CheckpointSession, Restored, RollbackPolicy

from ._accelerate_state import PreparedRun


class AccelerateRollback:
    """The rollback side of one registered ``LazyCheckpointHook``."""

    def __init__(self, session: CheckpointSession, run: PreparedRun) -> None:
        accelerator = run.accelerator
        self.run = run
        self.keep_start = session.engine.config.in_process_memory
        self.policy = RollbackPolicy.of_session(session, is_source=accelerator.process_index == 0,
                                                share=_broadcast if accelerator.num_processes > 1 else None)

    def remember_start(self, step: int) -> None:
        """The state now is the target before the first snapshot (kept only with ``keep_in_memory=True``: a
        private copy of the whole state costs host memory the user asked for with that option)."""
        if self.keep_start:
            self.policy.remember_start(step, self.run.replicated())

    def on_step(self) -> None:
        self.policy.drop_start_once_committed()

    def roll_back(self, bad_step: int) -> int | None:
        """Restore the newest state before ``bad_step``; its step, or None when there is none."""
        if self.run.sharded:  # process 0 finds the state and broadcasts it whole: replicated state only
            raise NotImplementedError("hook.rollback() is not supported under FSDP version 2 yet; resume from the "
                                      "newest checkpoint with hook.resume() in a new run instead")
        try:
            restored = self.policy.restore(bad_step, live=self.run.replicated(), load=self.run.restore_replicated,
                                           optimizers=self.run.optimizers)
        except NothingToRollBackTo:
            return None
        return restored.step


def _broadcast(restored: Restored | None) -> Restored | None:
    from accelerate.utils import broadcast_object_list

    box: list[Any] = [restored]
    broadcast_object_list(box, from_process=0)
    return box[0]
