"""Turn a loaded state into what ``torch.load(..., weights_only=True)`` accepts, for files other tools read.

``lazyckpt.load`` restores a ``Namespace``, numpy values, paths and OmegaConf configs as their own types;
``torch.load``'s safe unpickler refuses most of them. Each such value becomes the plain data it stands for,
unless ``torch.serialization.add_safe_globals`` allows its type, in which case it stays as it is.

Example:
    >>> torch.save(weights_only_safe(lazyckpt.load(path)), "model.ckpt")     # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import io
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from lazyckpt.errors import CheckpointFormatError

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


def check_weights_only(value: Any, where: str) -> None:
    """Refuse, with a :class:`~lazyckpt.CheckpointFormatError` naming ``where`` and the key path, a ``value`` that
    ``torch.load(weights_only=True)`` would not read back once saved: an export never writes such a file. Its
    non-tensor part is saved and loaded once, each tensor standing in as an empty one of its dtype (cheap)."""
    skeleton = _skeleton(value)
    problem = _refusal(skeleton)
    if problem is None:
        return
    path, leaf = next(((p, leaf) for p, leaf in _leaves(skeleton, "state") if _refusal([leaf])), ("", None))
    named = f" {path} = {str(leaf)[:80]!r}" if path else ""
    raise CheckpointFormatError(f"{where}:{named} would make torch.load(weights_only=True) refuse the exported file "
                                f"({problem}); nothing was written")


def _skeleton(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty(0, dtype=value.dtype)
    if isinstance(value, dict):
        return {k: _skeleton(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_skeleton(v) for v in value)
    return value


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield f"{path}[{key!r}]", key
            yield from _leaves(item, f"{path}[{key!r}]")
    elif type(value) in (list, tuple):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def _refusal(value: Any) -> str | None:
    """Why ``torch.load(weights_only=True)`` refuses ``value`` saved by ``torch.save``; None when it reads it."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch's safe unpickler refuses with, it is the answer
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None
