"""Decode a manifest tree back into the saved structure. Builds plain data only; never imports or calls code."""

from __future__ import annotations

import argparse
import base64
import functools
import pathlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from lazyckpt.errors import CheckpointFormatError, CheckpointMismatchError
from lazyckpt.format.header import check_shape, numel_of, torch_dtype
from lazyckpt.tree import values
from lazyckpt.tree.encode import MAX_DEPTH, MAX_NODE_DEPTH, node_depth
from lazyckpt.tree.paths import legacy_int_parts, tensor_key

_TORCH_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_SCALARS = frozenset({type(None), bool, int, float, str})
_FLOATS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def unflatten(tree: Any, tensors: dict[str, torch.Tensor], where: str = "manifest", *,
              depth_checked: bool = False) -> Any:
    """Rebuild the saved state from its tree and the loaded tensors (keyed as in the safetensors file).

    Errors name ``where`` (the manifest file) and the key path of the bad node, e.g. ``state['model'][0]``.
    ``depth_checked``: :func:`check_references` (which measures the depth too) already passed this tree.
    """
    if not depth_checked:
        check_depth(tree, where)
    return _Decoder(tensors, where).decode(tree, "state")


def check_depth(tree: Any, where: str) -> None:
    """Refuse a tree nested deeper than any save writes, before anything recursive reads it (no ``RecursionError``
    from a hostile or damaged manifest)."""
    depth = node_depth(tree)
    if depth > MAX_NODE_DEPTH:
        raise CheckpointFormatError(f"{where}: the tree nests {depth} levels deep, more than the {MAX_NODE_DEPTH} any "
                                    f"save writes ({MAX_DEPTH} nested containers)")


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        self.tensors = tensors
        self.where = where
        self.parts: list[Any] = []
        """The key path of the node being decoded (dict keys, list and tuple indices), as the encoder saw it."""
        self.legacy: dict[tuple[str, str, Any], Any] = {}
        """Int parts of older writers' keys seen so far: (text, parent) → int and (int, parent) → text."""
        self.tags: dict[str, Callable[[Any, str], Any]] = {
            "$dict": self._dict, "$tuple": lambda v, p: tuple(self._items(v, p)),
            "$float": self._float, "$tensor": self._tensor, "$inline": lambda v, p: decode_inline_tensor(v),
            "$ndarray": lambda v, p: self.decode(v, p).cpu().numpy(), "$np_scalar": self._np_scalar,
            "$torch_dtype": self._torch_dtype, "$torch_device": self._torch_device,
            "$path": lambda v, p: pathlib.Path(self._str(v, p)),
            "$namespace": lambda v, p: argparse.Namespace(**self.decode(v, p)),
            "$dataclass": lambda v, p: self.decode(v["fields"], p), "$enum": lambda v, p: self.decode(v["value"], p),
            "$bytes": lambda v, p: base64.b64decode(self._str(v, p), validate=True),
            "$set": lambda v, p: set(self._items(v, p)),
            "$complex": lambda v, p: complex(*(self._number(self.decode(x, p), p) for x in self._list(v, p))),
            **{tag: functools.partial(fn, decoder=self) for tag, fn in values.DECODERS.items()},
            "$per_rank": self.decode,
        }

    def fail(self, path: str, problem: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.where}: tree at {path}: {problem}")

    def decode(self, node: Any, path: str) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return self._items(node, path)
        if isinstance(node, dict) and len(node) == 1:
            (tag, value), = node.items()
            handler = self.tags.get(tag)
            if handler is not None:
                try:
                    return handler(value, path)
                except CheckpointFormatError:
                    raise
                except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RuntimeError,
                        IndexError) as e:
                    raise self.fail(path, f"malformed {tag} node {str(value)[:80]!r}: {e}") from None
        raise self.fail(path, f"unknown node {str(node)[:80]!r}")

    def child(self, node: Any, path: str, part: Any) -> Any:
        """Decode ``node``, the member ``part`` (a dict key, an index, a sparse tensor's part) of the node at the
        current key path; ``path`` names it in messages."""
        self.parts.append(part)
        try:
            return self.decode(node, path)
        finally:
            self.parts.pop()

    def _items(self, value: Any, path: str) -> list:
        # a JSON scalar stands for itself: no key path to track, no message path to format (a list of ints)
        return [x if type(x) in _SCALARS else self.child(x, f"{path}[{i}]", i)
                for i, x in enumerate(self._list(value, path))]

    def _dict(self, items: Any, path: str) -> dict:
        out = {}
        for pair in self._list(items, path):
            key, value = self._list(pair, path)
            if isinstance(key, dict):
                key = values.decode_key(key, path, self)
            if isinstance(key, bool) or not isinstance(key, (str, int, tuple)):
                raise self.fail(path, f"dict key {str(key)[:80]!r} is not a str, int or tuple")
            if key in out:  # a saved dict holds each key once; a later pair would hide the first (a tensor, say)
                raise self.fail(path, f"dict key {str(key)[:80]!r} is repeated; the tree was changed after it was "
                                      "written (use another checkpoint)")
            out[key] = value if type(value) in _SCALARS else self.child(value, f"{path}[{key!r}]", key)
        return out

    def _tensor(self, key: Any, path: str) -> torch.Tensor:
        if not isinstance(key, str) or key not in self.tensors:
            raise self.fail(path, f"refers to tensor {str(key)[:80]!r}, which the tensor file lacks")
        own = tensor_key(tuple(self.parts))
        if key != own and not self._legacy(key):  # a key is its key path (FORMAT.md rule 9): else other values
            raise self.fail(path, f"refers to tensor {key[:80]!r}, but the tensor saved at this key path is named "
                                  f"{own[:80]!r}; the tree was changed after it was written (use another checkpoint)")
        return self.tensors[key]

    def _legacy(self, key: str) -> bool:
        """An older writer's key for this path (int parts written as an int subclass's text, FORMAT.md rule 21),
        with each text standing for one int under its parent, and each int under a parent written one way: a
        reference swapped or copied to a sibling's tensor still fails."""
        parts = tuple(self.parts)
        legacy = legacy_int_parts(key, parts)
        if legacy is None:
            return False
        for i, text in legacy:
            parent = tensor_key(parts[:i])
            if self.legacy.setdefault(("text", parent, text), parts[i]) != parts[i] \
                    or self.legacy.setdefault(("int", parent, parts[i]), text) != text:
                return False
        return True

    def _float(self, value: Any, path: str) -> float:
        if not isinstance(value, str) or value not in _FLOATS:
            raise self.fail(path, f"{str(value)[:80]!r} is not nan, inf or -inf")
        return _FLOATS[value]

    def _np_scalar(self, value: Any, path: str) -> Any:
        dtype = np.dtype(self._str(value["dtype"], path))
        if dtype.kind not in "biuf":
            raise self.fail(path, f"numpy scalar dtype {dtype} is not allowed")
        return dtype.type(self._number(self.decode(value["value"], path), path))

    def _number(self, value: Any, path: str) -> bool | int | float:
        # Never a tensor: a value read from tensor bytes would make decoding depend on data, not structure.
        if not isinstance(value, (bool, int, float)):
            raise self.fail(path, f"expected a number, got {type(value).__name__}")
        return value

    def _torch_dtype(self, value: Any, path: str) -> torch.dtype:
        # A fixed table: getattr(torch, name) could import lazy submodules named by the file.
        if not isinstance(value, str) or value not in _TORCH_DTYPE_NAMES:
            raise self.fail(path, f"{str(value)[:80]!r} is not a torch dtype")
        return _TORCH_DTYPE_NAMES[value]

    def _torch_device(self, value: Any, path: str) -> torch.device:
        # torch.device parses more than it keeps: "cuda:128" wraps to index -128, which torch.load(weights_only=True)
        # then refuses, and "cuda:256" to "cuda:0". A save writes str(device), whose index reads back as written.
        # Only the index is compared: a backend may be renamed in the reader ("privateuseone:0" reads as "npu:0").
        text = self._str(value, path)
        device = torch.device(text)
        _, colon, index = text.partition(":")
        if device.index != (int(index) if colon and index.isdigit() else None) or (colon and not index.isdigit()):
            raise self.fail(path, f"device {text[:80]!r} does not read back as written (torch makes it "
                                  f"{str(device)!r}); a save writes str(device)")
        return device

    def _list(self, value: Any, path: str) -> list:
        if not isinstance(value, list):
            raise self.fail(path, f"expected a list, got {type(value).__name__}")
        return value

    def _str(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected a string, got {type(value).__name__}")
        return value


def decode_inline_tensor(value: dict[str, Any]) -> torch.Tensor:
    dtype = torch_dtype(value["dtype"], "inline tensor")
    shape = check_shape(value["shape"], "inline tensor")
    raw = bytearray(base64.b64decode(value["data"], validate=True))
    expected = numel_of(shape) * torch.empty(0, dtype=dtype).element_size()
    if len(raw) != expected:
        raise CheckpointFormatError(f"inline tensor holds {len(raw)} bytes; dtype and shape need {expected}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)


def with_aliases(tensors: dict[str, torch.Tensor], aliases: dict[str, str], where: str,
                 targets: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``tensors`` plus a tensor under each alias key (docs/FORMAT.md rule 22): the very tensor of the key it
    aliases, so the loaded state shares it as the saved one did. A tensor of ``targets`` at an alias key that is
    another tensor (a state whose weights are not tied) gets a copy of its values and stands there instead.

    Raises:
        CheckpointFormatError: an alias names a key that is not among ``tensors``.
        CheckpointMismatchError: such a target's dtype or shape differs from the stored tensor's.
    """
    out = dict(tensors)
    for alias, key in aliases.items():
        if alias in out:
            continue
        source, target = out.get(key), (targets or {}).get(alias)
        if source is None:
            raise CheckpointFormatError(f"{where}: tensor {alias!r} is an alias of {key!r}, which is not among the "
                                        "tensors this rank can load (rule 22: an alias names an earlier leaf of the "
                                        "same tree)")
        if target is not None and target is not source:
            if target.dtype != source.dtype or target.shape != source.shape:
                raise CheckpointMismatchError(f"tensor {alias!r} (stored as {key!r}) is {source.dtype}"
                                              f"{list(source.shape)} in the checkpoint, the target {target.dtype}"
                                              f"{list(target.shape)}")
            with torch.no_grad():
                target.copy_(source)
            source = target
        out[alias] = source
    return out


def aliases_in(tree: Any, aliases: dict[str, str]) -> dict[str, str]:
    """The aliases a tree refers to (e.g. a tree whose ``PerRank`` values were dropped refers to fewer)."""
    keys = tensor_keys(tree)
    return {alias: key for alias, key in aliases.items() if alias in keys}


# --- walks over an encoded tree ------------------------------------------------------------------------------

def drop_per_rank(tree: Any) -> Any:
    """The tree with every ``PerRank`` value replaced by None (for a rank the checkpoint has no part for); a copy,
    made without recursion (a tree of any depth, from any depth of the caller's stack)."""
    root = [tree]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, at = stack.pop()
        node = parent[at]
        if type(node) is dict and set(node) == {"$per_rank"}:
            parent[at] = None
            continue
        if type(node) is list:
            node = parent[at] = list(node)
            members = enumerate(node)
        elif type(node) is dict:
            node = parent[at] = dict(node)
            members = iter(node.items())
        else:
            continue
        stack.extend((node, k) for k, v in members if type(v) is list or type(v) is dict)
    return root[0]


def check_references(tree: Any, stored: Iterable[str], where: str) -> None:
    """Every tensor of a rank's file is part of its state: the rank's tree refers to it (docs/FORMAT.md rule 21;
    a writer stores only the tensors of its state). Else the tree lost a tensor, or a reference was moved. Also
    refuses a tree nested deeper than any save writes (:func:`check_depth`), in the same walk; the walk itself
    never recurses, so a tree of any depth is measured from any depth of the caller's stack."""
    depth, keys = _walk(tree)
    if depth > MAX_NODE_DEPTH:
        check_depth(tree, where)
    unused = sorted(set(stored) - keys)
    if unused:
        raise CheckpointFormatError(f"{where}: the tree refers to none of the stored tensors {unused[:5]} "
                                    f"({len(unused)} in all); a writer stores only tensors of the state, so the "
                                    "tree was changed after it was written (use another checkpoint)")


def tensor_keys(tree: Any) -> set[str]:
    """Every ``$tensor`` key a tree refers to (walked without recursion)."""
    return _walk(tree)[1]


def _walk(tree: Any) -> tuple[int, set[str]]:
    """The JSON nesting of ``tree`` and every ``$tensor`` key it refers to, in one walk with an explicit stack
    into one set (scalars are never pushed: a list of 500,000 ints costs one filter)."""
    keys: set[str] = set()
    deepest, stack = 1, [(tree, 1)] if type(tree) is list or type(tree) is dict else []
    pop, push, add = stack.pop, stack.extend, keys.add
    while stack:
        node, depth = pop()
        if depth > deepest:
            deepest = depth
        if type(node) is dict:
            if len(node) == 1 and "$tensor" in node and type(node["$tensor"]) is str:
                add(node["$tensor"])
                continue
            node = node.values()
        push([(v, depth + 1) for v in node if type(v) is list or type(v) is dict])
    return deepest, keys
