"""Decode a manifest tree back into the saved structure. Builds plain data only; never imports or calls code."""

from __future__ import annotations

import argparse
import base64
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lazyckpt.errors import CheckpointFormatError

_TORCH_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_FLOATS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild the saved state from its tree and the loaded tensors (keyed as in the safetensors file)."""
    return _Decoder(tensors).decode(tree)


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.tags: dict[str, Callable[[Any], Any]] = {
            "$dict": self._dict, "$tuple": lambda v: tuple(self.decode(x) for x in self._list(v)),
            "$float": self._float, "$tensor": self._tensor, "$inline": decode_inline_tensor,
            "$ndarray": lambda v: self.decode(v).numpy(), "$np_scalar": self._np_scalar,
            "$torch_dtype": self._torch_dtype, "$torch_device": lambda v: torch.device(self._str(v)),
            "$path": lambda v: pathlib.Path(self._str(v)), "$namespace": lambda v: argparse.Namespace(**self.decode(v)),
            "$dataclass": lambda v: self.decode(v["fields"]), "$enum": lambda v: self.decode(v["value"]),
            "$bytes": lambda v: base64.b64decode(self._str(v), validate=True),
            "$set": lambda v: {self.decode(x) for x in self._list(v)},
            "$complex": lambda v: complex(*(self.decode(x) for x in self._list(v))),
        }

    def decode(self, node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.decode(v) for v in node]
        if isinstance(node, dict) and len(node) == 1:
            (tag, value), = node.items()
            handler = self.tags.get(tag)
            if handler is not None:
                try:
                    return handler(value)
                except CheckpointFormatError:
                    raise
                except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RuntimeError,
                        IndexError) as e:
                    raise CheckpointFormatError(f"manifest tree: malformed {tag} node {str(value)[:80]!r}: {e}") from e
        raise CheckpointFormatError(f"manifest tree: unknown node {str(node)[:80]!r}")

    def _dict(self, items: Any) -> dict:
        out = {}
        for pair in self._list(items):
            key, value = self._list(pair)
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise CheckpointFormatError(f"manifest tree: dict key {key!r} is not a str or int")
            out[key] = self.decode(value)
        return out

    def _tensor(self, key: Any) -> torch.Tensor:
        if key not in self.tensors:
            raise CheckpointFormatError(f"manifest tree refers to tensor {key!r}, which the tensor file lacks")
        return self.tensors[key]

    @staticmethod
    def _float(value: Any) -> float:
        if value not in _FLOATS:
            raise CheckpointFormatError(f"manifest tree: {value!r} is not nan, inf or -inf")
        return _FLOATS[value]

    def _np_scalar(self, value: Any) -> Any:
        dtype = np.dtype(self._str(value["dtype"]))
        if dtype.kind not in "biuf":
            raise CheckpointFormatError(f"manifest tree: numpy scalar dtype {dtype} is not allowed")
        return dtype.type(self.decode(value["value"]))

    @staticmethod
    def _torch_dtype(value: Any) -> torch.dtype:
        # A fixed table: getattr(torch, name) could import lazy submodules named by the file.
        if not isinstance(value, str) or value not in _TORCH_DTYPE_NAMES:
            raise CheckpointFormatError(f"manifest tree: {value!r} is not a torch dtype")
        return _TORCH_DTYPE_NAMES[value]

    @staticmethod
    def _list(value: Any) -> list:
        if not isinstance(value, list):
            raise CheckpointFormatError(f"manifest tree: expected a list, got {type(value).__name__}")
        return value

    @staticmethod
    def _str(value: Any) -> str:
        if not isinstance(value, str):
            raise CheckpointFormatError(f"manifest tree: expected a string, got {type(value).__name__}")
        return value


def decode_inline_tensor(value: dict[str, Any]) -> torch.Tensor:
    from lazyckpt.format import check_shape, numel_of, torch_dtype

    dtype = torch_dtype(value["dtype"])
    shape = check_shape(value["shape"], "manifest tree: inline tensor")
    raw = bytearray(base64.b64decode(value["data"], validate=True))
    expected = numel_of(shape) * torch.empty(0, dtype=dtype).element_size()
    if len(raw) != expected:
        raise CheckpointFormatError(f"inline tensor holds {len(raw)} bytes; dtype and shape need {expected}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
