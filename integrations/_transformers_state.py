"""What ``LazyCheckpointCallback`` reads from and restores into a Hugging Face ``Trainer``'s objects, the Trainer's
own files it adds to each committed step directory, and the Trainer's retention rule.

The model's own ``state_dict()`` keys sit at the root of the checkpoint's tree, so each rank's tensor file holds
them under the names ``model.load_state_dict`` expects: with ``model.safetensors.index.json`` and
``trainer_state.json`` next to the manifest, the Trainer's loader accepts a lazyckpt step directory as a checkpoint
of its own (``trainer.train(resume_from_checkpoint=...)``, ``load_best_model_at_end``). What the Trainer's loader
cannot read (optimizer, scheduler, scaler, RNG) is under ``lazyckpt.trainer`` and ``lazyckpt.rank``, restored by
the callback; ``lazyckpt export --format transformers`` turns them into the Trainer's own files
(``lazyckpt.interop.transformers_format``, which owns these keys).

A PEFT model (``PeftModel``, e.g. TRL's ``SFTTrainer(peft_config=LoraConfig(...))``) keeps its whole
``state_dict()`` at the root as any model does (the frozen base too), and each step directory also gets what the
Trainer's own save writes for it and what its loader reads back (``model.load_adapter``): ``adapter_config.json``
and ``adapter_model.safetensors`` of the active adapter, the latter from the step's own committed bytes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import safetensors.torch
import torch

from lazyckpt.format.catalog import committed_steps
from lazyckpt.format.files import rank_file, step_dirname
from lazyckpt.interop.transformers_format import FORMAT, RANK, TRAINER
from lazyckpt.levels.aliases import aliased_steps, link_alias
from lazyckpt.policy import capture_rng
from lazyckpt.read.reader import CheckpointReader
from lazyckpt.read.shard_files import ShardFiles
from lazyckpt.storage import Storage
from lazyckpt.tree.encode import Deferred

from ._compat import inner_optimizer

INDEX = "model.safetensors.index.json"
TRAINER_STATE = "trainer_state.json"
PREFIX = "checkpoint"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


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


def adapter_layout(model: torch.nn.Module) -> dict[str, Any] | None:
    """What the Trainer's own save (``PeftModel.save_pretrained``) writes of a PEFT model's active adapter: its
    ``adapter_config.json`` text and, for each name in ``adapter_model.safetensors``, the key of the model's
    ``state_dict()`` whose tensor it holds (``get_peft_model_state_dict``'s selection and names: ``lora_A.weight``
    for ``lora_A.default.weight``). None for a model without adapters."""
    peft = sys.modules.get("peft")  # a PeftModel has imported it
    if peft is None or not isinstance(model, peft.PeftModel):
        return None
    name = model.active_adapters[0]  # the one the Trainer's loader loads the files into
    state = model.state_dict()
    keys = {id(tensor): key for key, tensor in state.items()}
    selected = peft.get_peft_model_state_dict(model, state_dict=state, adapter_name=name)
    made = sorted(file_key for file_key, tensor in selected.items() if id(tensor) not in keys)
    if made:
        raise ValueError(f"the PEFT adapter {name!r} saves tensors that are not the model's own state_dict() "
                         f"entries ({made[:4]}), which LazyCheckpointCallback cannot take from the checkpoint; "
                         "train this adapter without the callback for now")
    return {"adapter": name, "config": _adapter_config(model, name),
            "weights": sorted([file_key, keys[id(tensor)]] for file_key, tensor in selected.items())}


def _adapter_config(model: Any, name: str) -> str:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it (without changing the live config)."""
    config = copy.deepcopy(model.peft_config[name])
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = getattr(model.get_base_model(), "name_or_path", None) or None
    config.inference_mode = True
    saved = {key: sorted(value) if isinstance(value, set) else value for key, value in config.to_dict().items()}
    if config.task_type is None:
        base = type(model.get_base_model())
        saved["auto_mapping"] = {"base_model_class": base.__name__, "parent_library": base.__module__}
    return json.dumps(saved, indent=2, sort_keys=True)


def replicated_state(model: torch.nn.Module, optimizer: Any, scheduler: Any, scaler: Any, *, model_only: bool,
                     at_save: Callable[[], AtSave], adapter: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tree of one checkpoint as every rank passes it: the model's keys at the root (the Trainer reads them),
    the rest under :data:`TRAINER` (with a PEFT model's :func:`adapter_layout`). The ``TrainerState`` is read at
    the next barrier (after the step's logging and evaluation)."""
    model_state = model.state_dict()
    if TRAINER in model_state or RANK in model_state:
        raise ValueError(f"the model has a state_dict key named {TRAINER!r} or {RANK!r}, which "
                         "LazyCheckpointCallback keeps for itself; rename that submodule")
    trainer: dict[str, Any] = {"format": FORMAT, "model_keys": sorted(model_state), "model_only": model_only,
                               "trainer_state": Deferred(lambda: at_save().trainer_state), "adapter": adapter}
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
    if scaler is not None and trainer["scaler"]:  # a disabled scaler saves {}, which an enabled one refuses
        scaler.load_state_dict(trainer["scaler"])
    return own[RANK]["rng"]


def write_trainer_files(storage: Storage, step_dir: str, *, trainer_state: str, model_keys: list[str],
                        config_json: str | None, adapter: dict[str, Any] | None = None) -> None:
    """The files that make a committed step directory a checkpoint the Trainer's own loader accepts (a PEFT
    model's adapter files too); written by rank 0 after the commit, before the step's name (``checkpoint-N``)
    exists. The format ignores them."""
    reader = CheckpointReader(step_dir, storage)
    tensors, aliases = reader.top.get("tensors", {}), reader.aliases(0)
    stored_as = {key: aliases.get(key, key) for key in model_keys}  # a tied weight: stored once
    weight_map = {key: rank_file(tensors[source]["boxes"][0]["rank"], reader.world_size)
                  for key, source in stored_as.items() if source in tensors}
    index = {"metadata": {"format": FORMAT, "note": "the tensors are those of lazyckpt's rank files; the "
                          "optimizer, scheduler and RNG states are restored by LazyCheckpointCallback"},
             "weight_map": weight_map}
    storage.write_atomic(os.path.join(step_dir, INDEX), json.dumps(index, indent=1).encode(), sync=True)
    storage.write_atomic(os.path.join(step_dir, TRAINER_STATE), trainer_state.encode(), sync=True)
    if config_json is not None:
        storage.write_atomic(os.path.join(step_dir, "config.json"), config_json.encode(), sync=True)
    if adapter is not None:
        write_adapter_files(reader, adapter)


def write_adapter_files(reader: CheckpointReader, adapter: dict[str, Any]) -> None:
    """``adapter_model.safetensors`` and ``adapter_config.json`` of :func:`adapter_layout`, the weights read from
    the committed step's own files (their checksums checked): the live parameters have moved on since the save
    was requested."""
    pairs = [(str(file_key), str(key)) for file_key, key in adapter["weights"]]
    with ShardFiles(reader, verify=True) as files:
        stored = files.consolidate([key for _, key in pairs])
    weights = safetensors.torch.save({file_key: stored[key] for file_key, key in pairs}, metadata={"format": "pt"})
    reader.storage.write_atomic(os.path.join(reader.path, ADAPTER_WEIGHTS), weights, sync=True)
    reader.storage.write_atomic(os.path.join(reader.path, ADAPTER_CONFIG), str(adapter["config"]).encode(), sync=True)


def config_json(model: Any) -> str | None:
    """The model's ``config.json`` as ``save_pretrained`` writes it, which records the model's dtype and class
    (``architectures``) in the config first; here on a copy, the live config stays as it is. None: no config."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_json_string"):
        return None
    saved = copy.copy(config)
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        saved.dtype = str(dtype).split(".")[1]
    saved.architectures = [type(model).__name__.removeprefix("FSDP")]
    return saved.to_json_string()


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



def name_unnamed_commits(storage: Storage, dirpath: str, names_dir: str, load: Callable[[str], Any], *,
                         config_json: str | None = None) -> list[int]:
    """Give the Trainer's files and name to the steps a crashed run committed but had not named yet (the names
    follow commits at the next step event), so that ``resume_from_checkpoint=True`` finds the newest; returns
    those steps. Rank 0, before ``train()`` looks for checkpoints; ``config_json`` is the new run's model's."""
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
                            model_keys=list(trainer["model_keys"]), config_json=config_json,
                            adapter=trainer.get("adapter"))
        link_alias(storage, os.path.join(names_dir, f"{PREFIX}-{step}"), step_dir)
        repaired.append(step)
    return repaired
