"""What ``LazyCheckpointCallback`` reads from and restores into a Hugging Face ``Trainer``'s objects, the Trainer's
own files it adds to each committed step directory, and the Trainer's retention rule.

The model's own ``state_dict()`` keys sit at the root of the checkpoint's tree, so each rank's tensor file holds
them under the names ``model.load_state_dict`` expects: with ``model.safetensors.index.json`` and
``trainer_state.json`` next to the manifest, the Trainer's loader accepts a lazyckpt step directory as a checkpoint
of its own (``trainer.train(resume_from_checkpoint=...)``, ``load_best_model_at_end``). What the Trainer's loader
cannot read (optimizer, scheduler, scaler, RNG) is under ``lazyckpt.trainer`` and ``lazyckpt.rank``, restored by
the callback.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from lazyckpt.format.catalog import committed_steps
from lazyckpt.format.files import rank_file, step_dirname
from lazyckpt.levels.aliases import aliased_steps, link_alias
from lazyckpt.policy import capture_rng
from lazyckpt.storage import Storage
from lazyckpt.tree.encode import Deferred

from ._compat import inner_optimizer

FORMAT = "lazyckpt.transformers/1"
TRAINER = "lazyckpt.trainer"
"""The tree's key of what the Trainer's own loader does not read (replicated)."""
RANK = "lazyckpt.rank"
"""The tree's key of this process's own values (RNG states)."""
INDEX = "model.safetensors.index.json"
TRAINER_STATE = "trainer_state.json"
PREFIX = "checkpoint"


@dataclasses.dataclass
class AtSave:
    """What the Trainer's own save would read at the end of a step's log, evaluation and save decisions: its
    ``TrainerState`` and this process's RNG states (an evaluation draws from the global RNG)."""

    trainer_state: str
    rng: dict[str, Any]


def capture_at_save(state: Any, best_model_checkpoint: str | None) -> AtSave:
    saved = dataclasses.replace(state, best_model_checkpoint=best_model_checkpoint)
    saved.stateful_callbacks = state.stateful_callbacks
    # what TrainerState.save_to_json writes
    return AtSave(trainer_state=json.dumps(dataclasses.asdict(saved), indent=2, sort_keys=True) + "\n",
                  rng=capture_rng({}))


def replicated_state(model: torch.nn.Module, optimizer: Any, scheduler: Any, scaler: Any, *, model_only: bool,
                     at_save: Callable[[], AtSave]) -> dict[str, Any]:
    """The tree of one checkpoint as every rank passes it: the model's keys at the root (the Trainer reads them),
    the rest under :data:`TRAINER`. The ``TrainerState`` is read at the next barrier (after the step's logging
    and evaluation)."""
    model_state = model.state_dict()
    if TRAINER in model_state or RANK in model_state:
        raise ValueError(f"the model has a state_dict key named {TRAINER!r} or {RANK!r}, which "
                         "LazyCheckpointCallback keeps for itself; rename that submodule")
    trainer: dict[str, Any] = {"format": FORMAT, "model_keys": sorted(model_state), "model_only": model_only,
                               "trainer_state": Deferred(lambda: at_save().trainer_state)}
    if not model_only:
        trainer["optimizer"] = inner_optimizer(optimizer).state_dict()
        trainer["scheduler"] = None if scheduler is None else scheduler.state_dict()
        trainer["scaler"] = None if scaler is None else scaler.state_dict()
    return {**model_state, TRAINER: trainer}


def per_rank_state(process_index: int, at_save: Callable[[], AtSave]) -> dict[str, Any]:
    return {RANK: {"process_index": process_index, "rng": Deferred(lambda: at_save().rng)}}


def restore(tree: dict[str, Any], own: dict[str, Any], *, model: torch.nn.Module, optimizer: Any,
            scheduler: Any, scaler: Any) -> dict[str, Any] | None:
    """Restore what the Trainer's loader did not (the model too: every byte checked against its checksum);
    returns the RNG states to restore at the first step (None: the checkpoint holds only the model)."""
    trainer = tree[TRAINER]
    model.load_state_dict({key: tree[key] for key in trainer["model_keys"]})
    if trainer["model_only"]:
        return None
    inner_optimizer(optimizer).load_state_dict(trainer["optimizer"])
    if scheduler is not None and trainer["scheduler"] is not None:
        scheduler.load_state_dict(trainer["scheduler"])
    if scaler is not None and trainer["scaler"] is not None:
        scaler.load_state_dict(trainer["scaler"])
    return own[RANK]["rng"]


def write_trainer_files(storage: Storage, step_dir: str, *, trainer_state: str, model_keys: list[str],
                        config_json: str | None) -> None:
    """The files that make a committed step directory a checkpoint the Trainer's own loader accepts; written by
    rank 0 after the commit, before the step's name (``checkpoint-N``) exists. The format ignores them."""
    manifest = json.loads(storage.read_bytes(os.path.join(step_dir, "manifest.json"), max_bytes=1 << 30))
    world_size = int(manifest["world_size"])
    tensors = manifest.get("tensors", {})
    rank0 = json.loads(storage.read_bytes(os.path.join(step_dir, manifest["ranks"][0]), max_bytes=1 << 30))
    stored_as = {key: rank0.get("aliases", {}).get(key, key) for key in model_keys}  # a tied weight: stored once
    weight_map = {key: rank_file(tensors[source]["boxes"][0]["rank"], world_size)
                  for key, source in stored_as.items() if source in tensors}
    index = {"metadata": {"format": FORMAT, "note": "the tensors are those of lazyckpt's rank files; the "
                          "optimizer, scheduler and RNG states are restored by LazyCheckpointCallback"},
             "weight_map": weight_map}
    storage.write_atomic(os.path.join(step_dir, INDEX), json.dumps(index, indent=1).encode(), sync=True)
    storage.write_atomic(os.path.join(step_dir, TRAINER_STATE), trainer_state.encode(), sync=True)
    if config_json is not None:
        storage.write_atomic(os.path.join(step_dir, "config.json"), config_json.encode(), sync=True)


def steps_to_keep(steps: list[int], *, limit: int | None, best: int | None) -> set[int]:
    """The Trainer's ``save_total_limit`` rule (``rotate_checkpoints``): the newest and the best are always kept;
    the oldest others go until ``max(limit, len(protected))`` remain."""
    ordered = sorted(set(steps))
    if limit is None or limit <= 0 or len(ordered) <= limit:
        return set(ordered)
    protected = {ordered[-1]} | ({best} & set(ordered) if best is not None else set())
    keep, remaining = set(ordered), len(ordered)
    for step in ordered:
        if remaining <= max(limit, len(protected)):
            break
        if step not in protected:
            keep.discard(step)
            remaining -= 1
    return keep



def name_unnamed_commits(storage: Storage, dirpath: str, names_dir: str, load: Callable[[str], Any]) -> list[int]:
    """Give the Trainer's files and name to the steps a crashed run committed but had not named yet (the names
    follow commits at the next step event), so that ``resume_from_checkpoint=True`` finds the newest; returns
    those steps. Rank 0, before ``train()`` looks for checkpoints."""
    if storage.stat(dirpath) is None:
        return []
    named = aliased_steps(storage, names_dir, into=dirpath)
    newest_named = max(named, default=-1)
    repaired = []
    for step in committed_steps(dirpath, storage):
        if step <= newest_named:
            continue
        step_dir = os.path.join(dirpath, step_dirname(step))
        trainer = load(step_dir).get(TRAINER)
        if not isinstance(trainer, dict) or trainer.get("format") != FORMAT:
            continue
        write_trainer_files(storage, step_dir, trainer_state=trainer["trainer_state"],
                            model_keys=list(trainer["model_keys"]), config_json=None)
        link_alias(storage, os.path.join(names_dir, f"{PREFIX}-{step}"), step_dir)
        repaired.append(step)
    return repaired
