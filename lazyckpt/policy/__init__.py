"""The checkpoint policy of a training run, shared by every integration (framework-neutral: imports no framework).

One :class:`CheckpointSession` per process and training run owns the engine and the decisions around it; the
Lightning and Accelerate adapters only translate framework events into calls on it (docs/design.md,
"Integration policy layer").

| module | owns |
|---|---|
| ``options`` | :class:`SessionOptions`: the integrations' options, validated once at construction; defaults from a project's settings; a URL ``dirpath`` as a spool directory plus the remote level |
| ``session`` | :class:`CheckpointSession`: the engine, which rank writes what, the barrier and stalls, retention |
| ``steps`` | :class:`StepCounter`: steps from optimizer updates, when a checkpoint is due; :class:`StepRequests` |
| ``loop`` | :class:`UpdateLoop`: capture, request and barrier around the updates of a loop driven by optimizer hooks, the rollback's start, close |
| ``names`` | :class:`CheckpointNames`: names that follow commits; named steps are protected from retention; :data:`NO_NAMES` outside a fit |
| ``randomness`` | RNG states (``lazyckpt.capture_rng_state``) and the generators behind data loaders; :class:`ResumedRng`: a loaded state until its restore; :class:`ContinuedEpoch`: a mid-epoch resume's extra draw undone |
| ``rollback`` | :class:`RollbackPolicy`: the target of a rollback on a non-finite loss, and how many in a row |
| ``fit`` | :func:`check_fits`: does a checkpoint fit this run (:class:`~lazyckpt.CheckpointMismatchError`) |
| ``feedback`` | :class:`RunFeedback`: the summary at the end of a run, a warning when the write cannot keep up, "saved" once committed; :class:`Reporter`: where they go |
| ``sharded`` | :func:`restore_sharded`: a sharded model and its optimizers filled from a checkpoint, resharded; :func:`per_rank_source` when the number of ranks changed |
| ``resume`` | :func:`resume_target`: "last" among both levels and another tool's files; :func:`committed_copy`: a host step's path in ``dirpath`` |
"""

from __future__ import annotations

from lazyckpt.policy.feedback import (Reporter, RunFeedback, checkpoint_metrics, falling_behind, run_summary,
                                      summary_line)
from lazyckpt.policy.fit import RunLayout, check_fits, differences
from lazyckpt.policy.loop import UpdateLoop
from lazyckpt.policy.names import NO_NAMES, CheckpointNames, Committed
from lazyckpt.policy.options import (EngineOptions, SessionOptions, check_max_rollbacks, project_defaults,
                                     url_dirpath_levels)
from lazyckpt.policy.randomness import ContinuedEpoch, ResumedRng, capture_rng, find_generators, restore_rng
from lazyckpt.policy.resume import committed_copy, newest_checkpoint, resume_target, run_directory
from lazyckpt.policy.rollback import Restored, RollbackPolicy, StepVote, is_nonfinite
from lazyckpt.policy.session import CheckpointSession, open_directories
from lazyckpt.policy.sharded import per_rank_source, restore_sharded
from lazyckpt.policy.steps import StepCounter, StepRequests

__all__ = ["NO_NAMES", "CheckpointNames", "CheckpointSession", "Committed", "EngineOptions",
           "ContinuedEpoch", "Reporter", "Restored", "ResumedRng", "RollbackPolicy", "RunFeedback", "RunLayout", "SessionOptions",
           "StepCounter", "StepRequests", "StepVote", "UpdateLoop", "capture_rng", "check_fits",
           "check_max_rollbacks", "checkpoint_metrics", "differences", "falling_behind", "find_generators",
           "committed_copy", "is_nonfinite", "newest_checkpoint", "open_directories", "per_rank_source", "project_defaults", "restore_rng", "restore_sharded",
           "resume_target", "run_directory", "run_summary", "summary_line", "url_dirpath_levels"]
