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
import re
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
    ``torch.load(weights_only=True)`` would not read back once saved: an export never writes such a file.

    Only the leaves the safe unpickler could refuse are tried: plain scalars (exact ``None``, ``bool``, ``int``,
    ``float``, ``complex``, ``str``, ``bytes``) always load, and one empty tensor stands in for all of a dtype; the
    rest are saved and loaded once, and a refusal is narrowed down to its leaf by halving (a few more tries)."""
    leaves, dtypes = [], set()
    for path, leaf in _suspects(value, "state"):
        if isinstance(leaf, torch.Tensor):  # one tensor per dtype tells all the others
            if leaf.dtype in dtypes:
                continue
            dtypes.add(leaf.dtype)
        leaves.append((path, leaf))
    problem = _refusal([_stand_in(leaf) for _, leaf in leaves])
    if problem is None:
        return
    while len(leaves) > 1:
        half = leaves[:len(leaves) // 2]
        leaves = half if _refusal([_stand_in(leaf) for _, leaf in half]) else leaves[len(leaves) // 2:]
    path, leaf = leaves[0]
    shown = object.__repr__(leaf) if isinstance(leaf, (list, tuple, set, frozenset, dict)) else repr(leaf)[:80]
    raise CheckpointFormatError(
        f"{where}: {path} = {shown[:80]} would make torch.load(weights_only=True) refuse the exported file ({problem}); "
        "nothing was written. Save that value as plain data (dicts, lists, strings, numbers, tensors), or allow its "
        "type with torch.serialization.add_safe_globals([...]) before exporting")


def _stand_in(leaf: Any) -> Any:
    return torch.empty(0, dtype=leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf


_PLAIN = (type(None), bool, int, float, complex, str, bytes)
"""Exact types the safe unpickler always reads (a subclass, such as an IntEnum, may be refused)."""


def _suspects(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """``(key path, leaf)`` of every leaf (dict keys included) the safe unpickler might refuse, tensors included.
    Dicts and exact lists and tuples are walked (what ``weights_only_safe`` leaves)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            if type(key) not in _PLAIN:
                yield f"{path} key {object.__repr__(key)}", key
            yield from _suspects(item, f"{path}[{key!r}]")
    elif type(value) in (list, tuple):
        for i, item in enumerate(value):
            yield from _suspects(item, f"{path}[{i}]")
    elif type(value) not in _PLAIN:
        yield path, value


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _refusal(value: Any) -> str | None:
    """Why ``torch.load(weights_only=True)`` refuses ``value`` saved by ``torch.save``; None when it reads it. The
    reason is torch's own line naming what it refused (``Unsupported global: GLOBAL builtins.frozenset ...``)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch's safe unpickler refuses with, it is the answer
        lines = [line.strip() for line in _ANSI.sub("", str(e)).splitlines() if line.strip()]
        reason = next((line for line in lines if "Unsupported" in line or "WeightsUnpickler error" in line),
                      lines[0] if lines else "")
        return f"{type(e).__name__}: {reason[:300]}"
    return None
