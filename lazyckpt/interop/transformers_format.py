"""The Hugging Face ``Trainer``'s own checkpoint folder, made from a checkpoint ``LazyCheckpointCallback`` wrote:
what ``Trainer._save_checkpoint`` would have written at that step (transformers 5), so that a plain ``Trainer``
resumes from it with ``train(resume_from_checkpoint=...)`` and ``from_pretrained`` loads the model, with no
lazyckpt installed. Imports no transformers: the files are JSON, safetensors and ``torch.save`` bytes.

What the callback stores where (``integrations/_transformers_state.py``): the model's ``state_dict()`` keys at the
tree's root, :data:`TRAINER` (replicated: the ``TrainerState`` JSON, optimizer, scheduler and scaler states) and
:data:`RANK` (each process's RNG states, in that rank's file).

Example:
    >>> checkpoint = trainer_checkpoint("hf-run/checkpoint-6")            # doctest: +SKIP
    >>> sorted(checkpoint.files)     # besides model.safetensors           # doctest: +SKIP
    ['config.json', 'optimizer.pt', 'rng_state.pth', 'scheduler.pt', 'trainer_state.json']
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lazyckpt.errors import CheckpointFormatError
from lazyckpt.interop.lightning_format import LIGHTNING_KEYS
from lazyckpt.interop.weights_only import check_weights_only, weights_only_safe
from lazyckpt.read.load import load
from lazyckpt.read.reader import CheckpointReader
from lazyckpt.storage import FileKind, Storage
from lazyckpt.storage.urls import is_url, join

FORMAT = "lazyckpt.transformers/1"
"""``lazyckpt.trainer``'s ``format``: the layout below."""
TRAINER = "lazyckpt.trainer"
"""The tree's key of what the Trainer's own loader does not read (replicated)."""
RANK = "lazyckpt.rank"
"""The tree's key of this process's own values (RNG states)."""
CONFIG = "config.json"
CONFIG_MAX_BYTES = 16 << 20
TRAINER_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt", "scaler.pt")
"""The Trainer's names (``TRAINER_STATE_NAME``, ``OPTIMIZER_NAME``, ``SCHEDULER_NAME``, ``SCALER_NAME``)."""


@dataclass
class TrainerCheckpoint:
    """The Trainer's checkpoint folder of one lazyckpt checkpoint: the model's weights (in the order of its
    ``state_dict()``, for ``model.safetensors``) and every other file's bytes, by name."""

    weights: dict[str, torch.Tensor]
    files: dict[str, bytes]


def trainer_checkpoint(path: str, *, verify: bool = True, storage: Storage | None = None) -> TrainerCheckpoint:
    """Read the committed checkpoint at ``path`` (a step directory, a ``checkpoint-N`` name, or a URL read through
    ``storage``) and make the Trainer's files of it.

    Raises:
        CheckpointFormatError: ``path`` was not written by ``LazyCheckpointCallback`` (the message names the
            export formats that fit it), or its model is sharded across ranks (FSDP).
    """
    reader = CheckpointReader(path, storage)
    state = load(path, verify=verify, storage=storage)
    trainer = _trainer_record(path, state)
    _refuse_sharded(path, reader, trainer)
    model_keys = set(trainer["model_keys"])
    weights = {key: value for key, value in state.items() if key in model_keys}
    files = {"trainer_state.json": str(trainer["trainer_state"]).encode()}
    config = _config_json(reader)
    if config is not None:
        files[CONFIG] = config
    if trainer["model_only"]:  # save_only_model: the Trainer writes neither optimizer, scheduler nor RNG states
        return TrainerCheckpoint(weights, files)
    for name, key in zip(TRAINER_FILES[1:], ("optimizer", "scheduler", "scaler")):
        if trainer.get(key) is not None:
            files[name] = _weights_only_bytes(trainer[key], f"{path}: {TRAINER}/{key}")
    world_size = reader.world_size
    for rank in range(world_size):
        own = state if rank == 0 else load(path, rank=rank, verify=verify, storage=storage)
        name = "rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth"
        files[name] = _torch_bytes(trainer_rng(own[RANK]["rng"], distributed=world_size > 1))
    return TrainerCheckpoint(weights, files)


def _trainer_record(path: str, state: Any) -> dict[str, Any]:
    trainer = state.get(TRAINER) if isinstance(state, dict) else None
    if not isinstance(trainer, dict):
        lightning = isinstance(state, dict) and all(k in state for k in LIGHTNING_KEYS)
        fits = ("it is a Lightning checkpoint (LazyCheckpoint): export it with --format lightning (a .ckpt) or "
                "--format safetensors (its weights)" if lightning else
                "export its model weights with --format safetensors (--key names where they are), or read it "
                "with lazyckpt.load()")
        raise CheckpointFormatError(f"{path} was not written by LazyCheckpointCallback (it has no {TRAINER!r} "
                                    f"entry), so it holds no Trainer state to export as a Trainer checkpoint; {fits}")
    if trainer.get("format") != FORMAT:
        raise CheckpointFormatError(f"{path}: {TRAINER}/format is {trainer.get('format')!r}, not {FORMAT!r}: "
                                    "written by another version of lazyckpt; export it with that version, or "
                                    "use --format safetensors for its weights")
    return trainer


def _refuse_sharded(path: str, reader: CheckpointReader, trainer: dict[str, Any]) -> None:
    """The Trainer's files hold whole tensors; a model or optimizer sharded across ranks (FSDP) has the Trainer
    layout of its own (``pytorch_model_fsdp_0/``, ``optimizer_0/``), which this export does not write. Replicated
    tensors (DDP) are whole blocks, wherever they are stored."""
    prefix = f"{TRAINER}/optimizer/"
    model_keys = set(trainer["model_keys"])
    for key, entry in reader.top.get("tensors", {}).items():
        boxes = entry.get("boxes", [])
        whole = len(boxes) == 1 and list(boxes[0]["lengths"]) == list(entry["shape"])
        if not whole and (key in model_keys or key.startswith(prefix)):
            raise CheckpointFormatError(
                f"{path}: {key!r} is sharded across {reader.world_size} ranks (FSDP); the Trainer's own layout for "
                "a sharded model is not written by this export. Export the consolidated weights with --format "
                "safetensors, or resume the run with LazyCheckpointCallback")


def _config_json(reader: CheckpointReader) -> bytes | None:
    """The model's ``config.json`` the callback wrote next to the manifest (a model without a config, or a step
    named after a crash, has none: the Trainer's own save of such a model writes none either)."""
    config = join(reader.path, CONFIG) if is_url(reader.path) else os.path.join(reader.path, CONFIG)
    info = reader.storage.stat(config)
    if info is None or info.kind is not FileKind.FILE:
        return None
    data = reader.storage.read_bytes(config, max_bytes=CONFIG_MAX_BYTES)
    json.loads(data)  # a damaged one fails here, not in from_pretrained
    return data


def trainer_rng(rng: dict[str, Any], *, distributed: bool) -> dict[str, Any]:
    """lazyckpt's RNG record (``lazyckpt.policy.randomness.capture_rng``) as the dict ``Trainer._save_rng_state``
    writes: ``python``, ``numpy`` (its key array as ``uint32``), ``cpu``, and ``cuda`` where CUDA was in use (every
    device's state in a distributed run, as ``get_rng_state_all``; the first device's otherwise, as
    ``get_rng_state`` on the current device)."""
    version, internal, gauss = rng["python"]
    name, keys, pos, has_gauss, cached = rng["numpy"]
    out: dict[str, Any] = {
        "python": (int(version), tuple(int(x) for x in internal), gauss),
        "numpy": (str(name), np.asarray(keys, dtype=np.int64).astype(np.uint32), int(pos), int(has_gauss),
                  float(cached)),
        "cpu": rng["torch"].clone(),
    }
    if rng.get("cuda"):
        states = [state.clone() for state in rng["cuda"]]
        out["cuda"] = states if distributed else states[0]
    return out


def _weights_only_bytes(value: Any, where: str) -> bytes:
    """``torch.save`` bytes that ``torch.load(weights_only=True)`` reads back, as the Trainer loads them."""
    value = weights_only_safe(value)
    check_weights_only(value, where)
    return _torch_bytes(value)


def _torch_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
