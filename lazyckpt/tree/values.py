"""Typed encodings for values users keep next to their weights: OmegaConf/Hydra configs, numpy string arrays,
tuple dict keys and sparse tensors.

Each kind is stored as plain data under its own tag. Decoding gives back the same type where that needs no
code named by the file: an OmegaConf ``DictConfig``/``ListConfig`` comes back as one when ``omegaconf`` is
importable (interpolations such as ``${model.dim}`` stay unresolved) and as a plain dict/list otherwise; the
only module decoding ever imports is ``omegaconf`` itself, by that fixed name.

Example:
    >>> cfg = OmegaConf.create({"dim": 8, "hidden": "${dim}"})              # doctest: +SKIP
    >>> ckpt.save({"cfg": cfg, "names": np.array(["a", "b"])}, step=1)       # doctest: +SKIP
    >>> lazyckpt.load(path)["cfg"]._get_node("hidden")._value()            # doctest: +SKIP
    '${dim}'
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from lazyckpt.errors import CheckpointFormatError, UnsupportedValueError
from lazyckpt.format.header import check_shape
from lazyckpt.tree.paths import path_str

UNHANDLED = object()
"""Returned by :func:`encode_value` for a value that is none of the kinds here."""

_OMEGACONF_KINDS = ("DictConfig", "ListConfig")
_KEY_SCALARS = (str, int, float, bool, type(None))
_COMPRESSED = {torch.sparse_csr: "csr", torch.sparse_csc: "csc", torch.sparse_bsr: "bsr", torch.sparse_bsc: "bsc"}
_LAYOUTS = {name: layout for layout, name in _COMPRESSED.items()}

Encode = Callable[[Any, tuple], Any]
Store = Callable[[torch.Tensor, tuple], Any]


# ------------------------------------------------------------------------------------------ encoding
def encode_value(value: Any, path: tuple, encode: Encode) -> Any:
    """The tagged encoding of ``value`` when it is one of this module's kinds, else :data:`UNHANDLED`."""
    omegaconf = sys.modules.get("omegaconf")  # an OmegaConf value means omegaconf is imported already
    if omegaconf is not None:
        if isinstance(value, (omegaconf.DictConfig, omegaconf.ListConfig)):
            return _encode_omegaconf(omegaconf, value, path, encode)
        if value is omegaconf.DictConfig or value is omegaconf.ListConfig:  # Lightning stores type(hparams)
            return {"$omegaconf_type": value.__name__}
    if isinstance(value, np.ndarray) and value.dtype.kind in "US":
        return _encode_strings(value)
    return UNHANDLED


def _encode_omegaconf(omegaconf: Any, cfg: Any, path: tuple, encode: Encode) -> dict[str, Any]:
    # resolve=False keeps "${...}" interpolations as written; "???" (missing) stays a string OmegaConf re-reads.
    data = omegaconf.OmegaConf.to_container(cfg, resolve=False, enum_to_str=False,
                                            structured_config_mode=omegaconf.SCMode.DICT)
    flags = {"struct": bool(omegaconf.OmegaConf.is_struct(cfg)),
             "readonly": bool(omegaconf.OmegaConf.is_readonly(cfg))}
    return {"$omegaconf": {"kind": type(cfg).__name__, "value": encode(data, path), "flags": flags}}


def _encode_strings(array: np.ndarray) -> dict[str, Any]:
    flat = array.ravel().tolist()
    items = flat if array.dtype.kind == "U" else [base64.b64encode(b).decode("ascii") for b in flat]
    return {"$np_strings": {"dtype": array.dtype.str, "shape": list(array.shape), "items": items}}


def encode_sparse(tensor: torch.Tensor, path: tuple, store: Store) -> dict[str, Any]:
    """A sparse COO/CSR/CSC/BSR/BSC tensor as its index and value tensors (each stored like any tensor)."""
    t = tensor.detach()
    if t.layout == torch.sparse_coo:
        parts = {"layout": "coo", "coalesced": t.is_coalesced(), "indices": t._indices(), "values": t._values()}
    elif t.layout in _COMPRESSED:
        row_major = t.layout in (torch.sparse_csr, torch.sparse_bsr)
        compressed, plain = (t.crow_indices(), t.col_indices()) if row_major else (t.ccol_indices(), t.row_indices())
        parts = {"layout": _COMPRESSED[t.layout], "compressed_indices": compressed, "plain_indices": plain,
                 "values": t.values()}
    else:
        raise UnsupportedValueError(f"{path_str(path)} is a {t.layout} tensor; call .to_dense() first")
    # The parts hang below the tensor's own path: it is a leaf, so no saved key can collide with them.
    encoded = {k: store(v, (*path, f"${k}")) if isinstance(v, torch.Tensor) else v for k, v in parts.items()}
    return {"$sparse": {**encoded, "size": list(t.shape)}}


def encode_key(key: Any, path: tuple, encode: Encode) -> Any:
    """A dict key: str and int as they are, a tuple of plain scalars (or of such tuples) tagged."""
    if isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool)):
        return key
    if isinstance(key, tuple) and _plain_key(key):
        return encode(key, path)
    raise UnsupportedValueError(
        f"{path_str(path)} has a key {key!r} of type {type(key).__name__}; str, int and tuples of str/int/float/"
        "bool/None keys are stored (convert the key, e.g. str(key))")


def _plain_key(key: Any) -> bool:
    if isinstance(key, tuple):
        return all(_plain_key(k) for k in key)
    return isinstance(key, _KEY_SCALARS) and type(key).__module__ == "builtins"


# ------------------------------------------------------------------------------------------ decoding
class Decoder(Protocol):
    """What the tree decoder offers these decoders: ``decode`` a node at the same key path, ``child`` a node one
    key below it, ``fail`` naming the key path."""

    where: str

    def decode(self, node: Any, path: str) -> Any: ...

    def child(self, node: Any, path: str, part: Any) -> Any: ...

    def fail(self, path: str, problem: str) -> CheckpointFormatError: ...


def decode_key(node: Any, path: str, decoder: Decoder) -> Any:
    """The dict key a tagged key node stands for; only tuples of plain scalars are keys."""
    if not (isinstance(node, dict) and set(node) == {"$tuple"}):
        raise decoder.fail(path, f"dict key {str(node)[:80]!r} is not a str, int or tuple")
    key = decoder.decode(node, path)
    if not _plain_key(key):
        raise decoder.fail(path, f"tuple key {key!r} holds a value that is not a plain scalar")
    return key


def _decode_omegaconf(value: Any, path: str, decoder: Decoder) -> Any:
    kind, data, flags = value["kind"], decoder.decode(value["value"], path), value["flags"]
    expected = {"DictConfig": dict, "ListConfig": list}.get(kind)
    if expected is None or not isinstance(data, expected) or not isinstance(flags, dict):
        raise decoder.fail(path, f"malformed OmegaConf node of kind {str(kind)[:40]!r}")
    omegaconf = _import_omegaconf()
    if omegaconf is None:
        return data
    try:
        cfg = omegaconf.OmegaConf.create(data)
    except omegaconf.errors.OmegaConfBaseException as e:
        raise decoder.fail(path, f"OmegaConf refuses the stored {kind}: {e}") from None
    omegaconf.OmegaConf.set_struct(cfg, bool(flags.get("struct")))
    omegaconf.OmegaConf.set_readonly(cfg, bool(flags.get("readonly")))
    return cfg


def _decode_omegaconf_type(value: Any, path: str, decoder: Decoder) -> Any:
    if value not in _OMEGACONF_KINDS:
        raise decoder.fail(path, f"{str(value)[:80]!r} is not an OmegaConf container type")
    omegaconf = _import_omegaconf()
    return getattr(omegaconf, value) if omegaconf is not None else value


def _import_omegaconf() -> Any:
    try:
        import omegaconf
    except ImportError:
        return None
    return omegaconf


def _decode_strings(value: Any, path: str, decoder: Decoder) -> np.ndarray:

    dtype = np.dtype(value["dtype"])
    items = value["items"]
    if dtype.kind not in "US" or not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise decoder.fail(path, f"malformed numpy string array of dtype {dtype}")
    shape = check_shape(value["shape"], f"{decoder.where}: tree at {path}: numpy string array")
    if dtype.kind == "S":
        items = [base64.b64decode(s, validate=True) for s in items]
    return np.array(items, dtype=dtype).reshape(shape)


def _decode_sparse(value: Any, path: str, decoder: Decoder) -> torch.Tensor:
    parts = {k: decoder.child(v, f"{path}.{k}", f"${k}") for k, v in value.items()
             if k not in ("layout", "size", "coalesced")}
    if not all(isinstance(t, torch.Tensor) for t in parts.values()):
        raise decoder.fail(path, "a sparse tensor's parts must be tensors")
    size, layout = value["size"], value["layout"]
    # check_invariants: index tensors from a file are checked before any kernel indexes memory with them.
    if layout == "coo":
        return torch.sparse_coo_tensor(parts["indices"], parts["values"], size,
                                       is_coalesced=bool(value["coalesced"]), check_invariants=True)
    if layout not in _LAYOUTS:
        raise decoder.fail(path, f"unknown sparse layout {str(layout)[:40]!r}")
    return torch.sparse_compressed_tensor(parts["compressed_indices"], parts["plain_indices"], parts["values"],
                                          size, layout=_LAYOUTS[layout], check_invariants=True)


DECODERS: dict[str, Callable[[Any, str, Decoder], Any]] = {
    "$omegaconf": _decode_omegaconf, "$omegaconf_type": _decode_omegaconf_type,
    "$np_strings": _decode_strings, "$sparse": _decode_sparse,
}
"""Tag → decoder(value, path, decoder) for the kinds above; the tree decoder dispatches here."""
