"""Reading checkpoints back: ``load``, ``verify``, ``latest``. Strict, and never executes stored code.

Example:
    >>> path = latest("runs/ckpt")                      # doctest: +SKIP
    >>> state = load(path, map_location="cpu")          # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from lazyckpt.checksum import CHUNK_BYTES, checksum_bytes, format_checksum, tensor_bytes
from lazyckpt.errors import CheckpointCorruptError, CheckpointFormatError, CheckpointNotFoundError
from lazyckpt.format import (MANIFEST, PARTIAL_SUFFIX, check_member_name, check_rank_manifest,
                             check_top_manifest, read_header, torch_dtype)
from lazyckpt.retention import committed_steps
from lazyckpt.unflatten import unflatten


def latest(dirpath: str | os.PathLike[str]) -> str | None:
    """The newest committed checkpoint directory under ``dirpath``, or ``None`` when there is none."""
    steps = committed_steps(os.fspath(dirpath))
    return steps[max(steps)] if steps else None


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The step a committed checkpoint directory holds."""
    return _top_manifest(os.fspath(path))["step"]


def load(path: str | os.PathLike[str], *, map_location: str | torch.device | None = None, verify: bool = True,
         rank: int | None = None) -> Any:
    """Load the state saved in a committed checkpoint directory.

    Args:
        path: a ``step-NNNNNNN`` directory (see :func:`latest`).
        map_location: device to move every tensor to (default: CPU).
        verify: check every chunk's checksum (on by default).
        rank: whose state to load in a multi-rank checkpoint (default 0).

    Raises:
        CheckpointNotFoundError: ``path`` is not a committed checkpoint.
        CheckpointFormatError: the files break a format rule (the message says which).
        CheckpointCorruptError: a checksum does not match (the message names file and tensor).
    """
    path = os.fspath(path)
    top = _top_manifest(path)
    rank = 0 if rank is None else rank
    if not 0 <= rank < top["world_size"]:
        raise ValueError(f"rank={rank} is out of range: {path} was saved by {top['world_size']} rank(s)")
    doc, tensors = _load_rank(path, top["ranks"][rank], verify=verify)
    _match_top(path, top, doc, rank)
    if map_location is not None:
        tensors = {k: t.to(map_location) for k, t in tensors.items()}
    return unflatten(doc["tree"], tensors)


def verify(path: str | os.PathLike[str]) -> None:
    """Check every file, header, manifest rule and checksum of every rank; raises on the first problem."""
    path = os.fspath(path)
    top = _top_manifest(path)
    for rank, name in enumerate(top["ranks"]):
        doc, _ = _load_rank(path, name, verify=True)
        _match_top(path, top, doc, rank)


def _match_top(path: str, top: dict[str, Any], doc: dict[str, Any], rank: int) -> None:
    mine = (doc["step"], doc["world_size"], doc["rank"])
    if mine != (top["step"], top["world_size"], rank):
        raise CheckpointFormatError(f"{path}: rank manifest {top['ranks'][rank]!r} says step/world_size/rank "
                                    f"{mine}, the checkpoint's manifest expects {(top['step'], top['world_size'], rank)}")


def _top_manifest(path: str) -> dict[str, Any]:
    if path.rstrip("/").endswith(PARTIAL_SUFFIX) or not os.path.isfile(os.path.join(path, MANIFEST)):
        raise CheckpointNotFoundError(
            f"{path} is not a committed lazyckpt checkpoint (no {MANIFEST}); pass a step-NNNNNNN directory, "
            "e.g. lazyckpt.latest(dirpath)")
    return check_top_manifest(_read_json(os.path.join(path, MANIFEST)), os.path.join(path, MANIFEST))


def _read_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointFormatError(f"{path} is not valid UTF-8 JSON: {e!r}") from e


def _load_rank(path: str, manifest_name: str, *, verify: bool) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    where = _member(path, manifest_name)
    doc = check_rank_manifest(_read_json(where), where)
    file_path = _member(path, doc["file"])
    if not os.path.isfile(file_path):
        raise CheckpointFormatError(f"{where} names tensor file {doc['file']!r}, which is missing")
    header, data_start = read_header(file_path)
    _match_manifest(where, file_path, doc["tensors"], header)
    tensors = {}
    with open(file_path, "rb") as f:
        for key, info in doc["tensors"].items():
            tensor = _read_tensor(f, file_path, key, info, data_start)
            if verify:
                _verify_tensor(file_path, key, tensor, info["checksums"])
            tensors[key] = tensor
    return doc, tensors


def _member(path: str, name: Any) -> str:
    """A file of the checkpoint directory; a link may not lead the reader outside it."""
    full = os.path.join(path, check_member_name(name, path))
    if os.path.dirname(os.path.realpath(full)) != os.path.realpath(path):
        raise CheckpointFormatError(f"{full} resolves to {os.path.realpath(full)}, outside the checkpoint "
                                    "directory; lazyckpt reads only files inside it")
    return full


def _match_manifest(where: str, file_path: str, tensors: dict[str, Any], header: dict[str, Any]) -> None:
    if set(tensors) != set(header):
        missing, extra = sorted(set(tensors) - set(header)), sorted(set(header) - set(tensors))
        raise CheckpointFormatError(f"{where} and {file_path} disagree: manifest-only tensors {missing[:5]}, "
                                    f"file-only tensors {extra[:5]}")
    for key, info in tensors.items():
        h = header[key]
        if [info["dtype"], info["shape"], info["offsets"]] != [h["dtype"], h["shape"], h["data_offsets"]]:
            raise CheckpointFormatError(f"{where} and {file_path} disagree about tensor {key!r}: manifest "
                                        f"{info['dtype']}{info['shape']}@{info['offsets']}, file "
                                        f"{h['dtype']}{h['shape']}@{h['data_offsets']}")


def _read_tensor(f: Any, file_path: str, key: str, info: dict[str, Any], data_start: int) -> torch.Tensor:
    """Read one tensor into its own buffer (aligned, independently freeable; torch APIs dislike shared views)."""
    tensor = torch.empty(info["shape"], dtype=torch_dtype(info["dtype"]))
    start, end = info["offsets"]
    if end > start:
        f.seek(data_start + start)
        got = f.readinto(memoryview(tensor_bytes(tensor)))
        if got != end - start:
            raise CheckpointCorruptError(f"{file_path}: file is truncated inside tensor {key!r}")
    return tensor


def _verify_tensor(file_path: str, key: str, tensor: torch.Tensor, expected: list[str]) -> None:
    raw = tensor_bytes(tensor)
    for index, start in enumerate(range(0, raw.size, CHUNK_BYTES)):
        actual = format_checksum(checksum_bytes(raw[start : start + CHUNK_BYTES]))
        if actual != expected[index]:
            raise CheckpointCorruptError(
                f"{file_path}: tensor {key!r} is corrupt: chunk {index} (bytes {start}..{min(start + CHUNK_BYTES, raw.size)} "
                f"of the tensor) has checksum {actual}, the manifest recorded {expected[index]}")
