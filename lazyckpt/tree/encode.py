"""Flatten a nested training state into a JSON-safe tree plus a list of tensors, and back.

Every container is tagged, so decoding gives back exactly the structure that was saved: a tuple stays a
tuple, int dict keys stay ints, ``nan``/``inf`` survive. Common non-JSON values get typed encodings; decoding
only ever builds plain data (it never imports a module or calls a constructor named by the file), so a dataclass
comes back as a dict and an Enum member as its value. OmegaConf configs, numpy string arrays, tuple keys and
sparse tensors have encodings of their own (:mod:`lazyckpt.tree.values`). Anything else is refused at ``save()`` with
its key path; :func:`lazyckpt.check_storable` finds such values before training starts.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import enum
import math
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lazyckpt.errors import UnsupportedValueError
from lazyckpt.format.header import dtype_name
from lazyckpt.tree import values
from lazyckpt.tree.paths import Path, path_str, tensor_key

MAX_DEPTH = 100
"""Containers nest at most this deep in a state (docs/FORMAT.md): decoding stays far from Python's recursion limit
even when ``load()`` is called deep in a program's stack, so whatever saves loads."""
MAX_NODE_DEPTH = 5 * MAX_DEPTH + 8
"""The JSON nesting a tree may reach: five levels for a dataclass field (its tag, the class and fields object, the
fields' dict tag, its list of pairs, a pair), three for a dict entry, with room for the tags of one value."""
_WORST_LEVEL = 7
"""JSON levels one container level can take at most (a dataclass field holding an Enum): a state whose containers
nest less than ``MAX_NODE_DEPTH / _WORST_LEVEL`` deep is within the limit without measuring its tree."""
MAX_INLINE_TENSOR_BYTES = 16 << 20
"""Tensors produced by ``Deferred`` leaves are stored inline in the manifest; keep them small."""


class Deferred:
    """A leaf of ``state`` whose value is ``fn()`` evaluated at the next barrier, not at ``save()``.

    Use it for state that legitimately changes between ``optimizer.step()`` and the next update, such as an LR
    scheduler stepped after the checkpoint request or the optimizer's ``param_groups``. Tensors in the result
    are stored inline in the manifest (at most 16 MiB each).

    Example:
        >>> ckpt.save({"model": model.state_dict(), "sched": Deferred(scheduler.state_dict)}, step=10)  # doctest: +SKIP
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"Deferred(fn) needs a callable; got {type(fn).__name__}")
        self.fn = fn


class PerRank:
    """A leaf of ``state`` that belongs to this rank alone (RNG states, data loader positions).

    Without it, every tensor that is not a ``DTensor`` is taken to be replicated (identical on every rank) and is
    written once in total. A ``PerRank`` value is written by its rank and comes back to the same rank.

    Example:
        >>> ckpt.save({"model": msd, "rng": PerRank(lazyckpt.capture_rng_state())}, step=10)  # doctest: +SKIP
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        if isinstance(value, PerRank):
            raise TypeError("PerRank(PerRank(...)) is redundant; wrap the value once")
        self.value = value


class _Flattener:
    def __init__(self, inline_tensors: bool) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.deferred: list[tuple[Path, Deferred]] = []
        self.inline_tensors = inline_tensors
        self.per_rank: set[str] = set()
        """Keys of the tensors under a PerRank leaf: written by this rank for this rank."""
        self._in_per_rank = False
        self.deepest = 0
        """The longest key path of a container seen: only a deep state needs its tree measured."""
        self.aliases: dict[str, str] = {}
        """Key of a tensor leaf that is an earlier leaf (same memory, dtype, shape and strides: a tied weight) ->
        the earlier leaf's key; such a leaf is stored once, under the earlier key (docs/FORMAT.md rule 22)."""
        self._seen: dict[tuple, tuple[str, bool]] = {}

    def encode(self, value: Any, path: Path) -> Any:
        if isinstance(value, torch.Tensor):  # first: most leaves of a training state are tensors
            return self._leaf_tensor(value, path)
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int) and not isinstance(value, enum.Enum):
            return int(value)
        if isinstance(value, float):
            return value if math.isfinite(value) else {"$float": repr(value)}
        if isinstance(value, (dict, list, tuple)) and len(path) >= self.deepest:
            self.deepest = len(path)
            if self.deepest >= MAX_DEPTH:
                raise UnsupportedValueError(f"{path_str(path[:6])}... nests containers deeper than {MAX_DEPTH} levels, "
                                            "which no reader may have to decode; flatten it (e.g. a list of rows)")
        if isinstance(value, dict):
            # a str key is stored as it is: skipping the call saved a fifth of flatten() for a state dict of tensors
            return {"$dict": [[k if type(k) is str else self._key(k, path), self.encode(v, (*path, k))]
                              for k, v in value.items()]}
        if isinstance(value, list):
            return [self.encode(v, (*path, i)) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return {"$tuple": [self.encode(v, (*path, i)) for i, v in enumerate(value)]}
        if isinstance(value, PerRank):
            return self._per_rank(value, path)
        if isinstance(value, Deferred):
            if self.inline_tensors:
                raise UnsupportedValueError(f"{path_str(path)}: a Deferred must not return another Deferred")
            self.deferred.append((path, value))
            return {"$deferred": len(self.deferred) - 1}
        return self._typed(value, path)

    def _per_rank(self, value: PerRank, path: Path) -> Any:
        if self._in_per_rank:
            raise UnsupportedValueError(f"{path_str(path)}: a PerRank inside another PerRank is redundant")
        self._in_per_rank = True
        try:
            return {"$per_rank": self.encode(value.value, path)}
        finally:
            self._in_per_rank = False

    def _key(self, key: Any, path: Path) -> Any:
        return values.encode_key(key, path, self.encode)

    def _leaf_tensor(self, tensor: torch.Tensor, path: Path) -> Any:
        """A tensor leaf; one that is an earlier leaf's tensor (a tied weight) becomes an alias of it. Only plain
        tensors and parameters count (a DTensor, or any other subclass, is stored as it is), not negative or
        conjugate views, and only within the same PerRank-ness; a leaf merely equal in value to another is a
        tensor of its own."""
        if self.inline_tensors or type(tensor) not in _ALIASABLE or tensor.layout != torch.strided \
                or tensor.device.type == "meta" or tensor.numel() == 0 or tensor.is_neg() or tensor.is_conj():
            return self._tensor(tensor, path)  # a negative or conjugate view reads other values from one memory
        identity = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.dtype,
                    tuple(tensor.shape), tensor.stride())
        first = self._seen.get(identity)
        if first is None or first[1] != self._in_per_rank:
            encoded = self._tensor(tensor, path)
            self._seen.setdefault(identity, (encoded["$tensor"], self._in_per_rank))
            return encoded
        key = tensor_key(path)
        self.aliases[key] = first[0]
        return {"$tensor": key}

    def _tensor(self, tensor: torch.Tensor, path: Path) -> Any:
        if tensor.layout != torch.strided:
            return values.encode_sparse(tensor, path, self._tensor)
        if self.inline_tensors:
            return {"$inline": encode_inline_tensor(tensor, path)}
        key = tensor_key(path)
        self.tensors.append((key, tensor))
        if self._in_per_rank:
            self.per_rank.add(key)
        return {"$tensor": key}

    def _typed(self, value: Any, path: Path) -> Any:
        if isinstance(value, enum.Enum):
            return {"$enum": {"class": type(value).__qualname__, "value": self.encode(value.value, path)}}
        encoded = values.encode_value(value, path, self.encode)
        if encoded is not values.UNHANDLED:
            return encoded
        if isinstance(value, np.ndarray):
            if value.dtype.kind not in "biuf":
                raise UnsupportedValueError(f"{path_str(path)} is a numpy array of dtype {value.dtype}; only "
                                            "bool, int, uint, float and string arrays are stored")
            encoded = self._tensor(torch.from_numpy(np.ascontiguousarray(value).astype(value.dtype.newbyteorder("="))), path)
            return {"$ndarray": encoded}
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return {"$np_scalar": {"dtype": value.dtype.str, "value": self.encode(value.item(), path)}}
        if isinstance(value, torch.dtype):
            return {"$torch_dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"$torch_device": str(value)}
        if isinstance(value, pathlib.PurePath):
            return {"$path": str(value)}
        if isinstance(value, argparse.Namespace):
            return {"$namespace": self.encode(vars(value), path)}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            return {"$dataclass": {"class": type(value).__qualname__, "fields": self.encode(fields, path)}}
        if isinstance(value, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
        if isinstance(value, (set, frozenset)):
            return {"$set": [self.encode(v, (*path, i)) for i, v in enumerate(value)]}
        if isinstance(value, complex):
            return {"$complex": [self.encode(value.real, path), self.encode(value.imag, path)]}
        if isinstance(value, tuple):  # namedtuple: stored as a plain tuple
            return {"$tuple": [self.encode(v, (*path, i)) for i, v in enumerate(value)]}
        raise UnsupportedValueError(
            f"{path_str(path)} is a {type(value).__module__}.{type(value).__qualname__}, which lazyckpt cannot "
            "store without pickle; convert it to tensors, numbers, strings, lists or dicts (e.g. its state_dict())"
        )


_ALIASABLE = (torch.Tensor, torch.nn.Parameter)


@dataclasses.dataclass(frozen=True, slots=True)
class Flat:
    """A state split by :func:`flatten`."""

    tree: Any
    """The JSON tree: every tensor leaf a ``$tensor`` node naming its key."""
    tensors: list[tuple[str, torch.Tensor]]
    """The tensors to store, by key, in the state's order (an alias's tensor is stored under its first key)."""
    deferred: list[tuple[Path, Deferred]]
    per_rank: set[str]
    """Keys of the tensors under a PerRank leaf."""
    aliases: dict[str, str]
    """Key of a leaf that is an earlier leaf's tensor -> that leaf's key (its tensor is in ``tensors``)."""


def flatten(state: Any) -> Flat:
    """Split ``state`` into its tree, tensors, ``Deferred`` leaves, PerRank keys and aliases."""
    flattener = _Flattener(inline_tensors=False)
    tree = flattener.encode(state, ())
    _check_nesting(tree, flattener.deepest, start=1)
    return Flat(tree, flattener.tensors, flattener.deferred, flattener.per_rank, flattener.aliases)


def encode_resolved(value: Any, path: Path) -> Any:
    """Encode a Deferred's result; its tensors are stored inline."""
    flattener = _Flattener(inline_tensors=True)
    encoded = flattener.encode(value, path)
    _check_nesting(encoded, flattener.deepest, start=_WORST_LEVEL * len(path) + 1)  # where it lands, at worst
    return encoded


def node_depth(tree: Any, start: int = 1) -> int:
    """The JSON nesting of ``tree`` (``start`` for its root), measured without recursion."""
    deepest, stack = start, [(tree, start)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        children = node if isinstance(node, list) else node.values() if isinstance(node, dict) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (list, dict)))
    return deepest


def _check_nesting(tree: Any, deepest_path: int, *, start: int) -> None:
    """Refuse an encoding nested deeper than :data:`MAX_NODE_DEPTH` (typed values wrapping containers: dataclasses,
    namespaces, enums), measured only when its containers nest deep enough for that to be possible."""
    if _WORST_LEVEL * (deepest_path + 1) + start <= MAX_NODE_DEPTH:
        return
    depth = node_depth(tree, start)
    if depth > MAX_NODE_DEPTH:
        raise UnsupportedValueError(f"the state's encoding nests {depth} levels deep, more than the {MAX_NODE_DEPTH} "
                                    "any reader may have to decode (containers inside dataclasses, namespaces or "
                                    "enums count their wrappers too); flatten it")


def fill_deferred(tree: Any, resolved: list[Any]) -> Any:
    """Replace ``{"$deferred": i}`` placeholders by ``resolved[i]`` (already encoded)."""
    if isinstance(tree, list):
        return [fill_deferred(v, resolved) for v in tree]
    if isinstance(tree, dict):
        if set(tree) == {"$deferred"}:
            return resolved[tree["$deferred"]]
        return {k: fill_deferred(v, resolved) for k, v in tree.items()}
    return tree


def encode_inline_tensor(tensor: torch.Tensor, path: Path) -> dict[str, Any]:
    data = tensor.detach().to("cpu").contiguous()
    nbytes = data.numel() * data.element_size()
    if nbytes > MAX_INLINE_TENSOR_BYTES:
        raise UnsupportedValueError(f"{path_str(path)}: a Deferred produced a tensor of {nbytes} bytes; at most "
                                    f"{MAX_INLINE_TENSOR_BYTES} are stored inline — put it in the state directly")
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if nbytes else b""
    return {"dtype": dtype_name(data.dtype, path_str(path)), "shape": list(data.shape),
            "data": base64.b64encode(raw).decode("ascii")}
