"""Turn a loaded state into what ``torch.load(..., weights_only=True)`` accepts, for files other tools read.

``lazyckpt.load`` restores a ``Namespace``, numpy values, paths and OmegaConf configs as their own types;
``torch.load``'s safe unpickler refuses most of them. Each such value becomes the plain data it stands for,
unless ``torch.serialization.add_safe_globals`` allows its type, in which case it stays as it is.

Example:
    >>> torch.save(weights_only_safe(lazyckpt.load(path)), "model.ckpt")     # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

import numpy as np
import torch

_KEPT = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype, torch.device, torch.Size)


def weights_only_safe(value: Any) -> Any:
    """``value`` with every type ``torch.load(weights_only=True)`` refuses replaced by plain data."""
    if isinstance(value, _KEPT) or type(value) in _allowed_types():
        return value
    if isinstance(value, dict):  # OrderedDict and defaultdict become dicts; Lightning's AttributeDict too
        return {weights_only_safe(k): weights_only_safe(v) for k, v in value.items()}
    for container in (list, tuple, set, frozenset):  # a namedtuple becomes a plain tuple
        if isinstance(value, container):
            return container(weights_only_safe(v) for v in value)
    if isinstance(value, argparse.Namespace):
        return weights_only_safe(vars(value))
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, pathlib.PurePath):
        return str(value)
    return _omegaconf_plain(value)


def _omegaconf_plain(value: Any) -> Any:
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is not None and isinstance(value, (omegaconf.DictConfig, omegaconf.ListConfig)):
        return weights_only_safe(omegaconf.OmegaConf.to_container(value, resolve=False))
    if omegaconf is not None and (value is omegaconf.DictConfig or value is omegaconf.ListConfig):
        return value.__name__  # Lightning reads a str hparams_type as "make it an AttributeDict"
    raise TypeError(f"{type(value).__module__}.{type(value).__qualname__} has no weights_only-safe form")


def _allowed_types() -> set[Any]:
    return {entry[0] if isinstance(entry, tuple) else entry for entry in torch.serialization.get_safe_globals()}
