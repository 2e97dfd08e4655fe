"""Exporting a checkpoint's model weights as a Hugging Face-style ``model.safetensors``: plain parameter names,
no lazyckpt metadata, loadable by ``safetensors.torch.load_file`` and ``from_pretrained`` next to the model's
config.

Example:
    >>> export_safetensors("runs/ckpt/step-0000120", "out/model.safetensors")     # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from lazyckpt.errors import CheckpointFormatError
from lazyckpt.loading import load
from lazyckpt.storage import LocalStorage, Storage

MODEL_KEYS = ("state_dict", "model")
"""Where the weights are looked for when no key is given: Lightning's layout, then the plain-PyTorch habit."""


def model_weights(state: Any, key: str | None = None, *, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The flat ``{parameter name: tensor}`` mapping of ``state[key]`` (default: the first of :data:`MODEL_KEYS`
    present, or the whole state when it is already such a mapping)."""
    if not isinstance(state, dict):
        raise CheckpointFormatError(f"{where} holds a {type(state).__name__}, not a dict of weights")
    if key is None:
        key = next((k for k in MODEL_KEYS if isinstance(state.get(k), dict)), None)
    if key is not None and not isinstance(state.get(key), dict):
        raise CheckpointFormatError(f"{where} has no dict under {key!r}; its top-level keys are "
                                    f"{sorted(map(str, state))[:10]}; pass --key with the one holding the weights")
    weights = state if key is None else state[key]
    bad = [name for name, value in weights.items() if not isinstance(name, str) or not isinstance(value, torch.Tensor)]
    if bad:
        raise CheckpointFormatError(f"{where}: {key or 'the state'} is not a flat dict of tensors (e.g. "
                                    f"{bad[:3]!r}); pass --key with the one holding the model's state_dict")
    return weights


def export_safetensors(path: str | os.PathLike[str], out_file: str | os.PathLike[str], *, key: str | None = None,
                       storage: Storage | None = None) -> str:
    """Write the model weights of a checkpoint (read and verified by :func:`lazyckpt.load`) to ``out_file``,
    atomically; returns ``out_file``."""
    storage = storage if storage is not None else LocalStorage()
    state = load(path, storage=storage)
    weights = model_weights(state, key, where=os.fspath(path))
    data = safetensors_bytes({name: t.contiguous() for name, t in weights.items()}, metadata={"format": "pt"})
    out_file = os.fspath(out_file)
    storage.make_dir(os.path.dirname(os.path.abspath(out_file)))
    storage.write_atomic(out_file, data, sync=True)
    return out_file
