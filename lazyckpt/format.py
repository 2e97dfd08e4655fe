"""The on-disk format (docs/FORMAT.md): names, the safetensors header, the manifests, and their strict checks."""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Any

import torch

from lazyckpt.checksum import ALGORITHM, CHUNK_BYTES, num_chunks
from lazyckpt.errors import CheckpointFormatError, UnsupportedValueError
from lazyckpt.plan import TensorEntry

FORMAT_NAME = "lazyckpt"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
HEADER_ALIGN = 4096
"""The data section starts on a 4 KiB boundary (header padded with spaces), ready for direct I/O."""
MAX_HEADER_BYTES = 100 << 20
"""safetensors' own cap on the JSON header."""
STEP_DIR = re.compile(r"step-([0-9]{7,})")
"""Use with ``fullmatch``: ``match`` would accept a trailing newline."""

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
_ITEMSIZE = {name: torch.empty(0, dtype=dtype).element_size() for dtype, name in _DTYPES.items()}


def dtype_name(dtype: torch.dtype, path: Any = ()) -> str:
    """The safetensors name of a torch dtype, or a clear error for one the format cannot hold."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise UnsupportedValueError(f"state{''.join(f'[{p!r}]' for p in path)} has dtype {dtype}, which "
                                    f"safetensors cannot store; supported: {sorted(map(str, _DTYPES))}") from None


def torch_dtype(name: Any) -> torch.dtype:
    if not isinstance(name, str) or name not in _TORCH_DTYPES:
        raise CheckpointFormatError(f"unknown dtype {name!r}; the format knows {sorted(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[name]


def step_dirname(step: int) -> str:
    return f"step-{step:07d}"


def rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def rank_manifest(rank: int) -> str:
    return f"rank-{rank:05d}.json"


# --- the safetensors header -------------------------------------------------------------------------------

def build_header(entries: list[TensorEntry], metadata: dict[str, str]) -> bytes:
    """The 8-byte length prefix plus the JSON header, padded with spaces so data starts 4 KiB-aligned."""
    header: dict[str, Any] = {"__metadata__": metadata}
    for e in entries:
        header[e.key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.offset, e.offset + e.nbytes]}
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    padded = len(body) + (-(8 + len(body)) % HEADER_ALIGN)
    return struct.pack("<Q", padded) + body.ljust(padded, b" ")


def dcp_sharding_metadata(entries: list[TensorEntry]) -> dict[str, str]:
    """``__metadata__`` that ``torch.distributed.checkpoint.HuggingFaceStorageReader`` understands."""
    info = {e.key: {"saved_offsets": [0] * len(e.shape)} for e in entries}
    return {"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"}


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """Parse and check a tensor file's header; returns (tensor entries by key, start of the data section)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointFormatError(f"{path}: {size} bytes is too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise CheckpointFormatError(f"{path}: header length {length} exceeds the {MAX_HEADER_BYTES}-byte cap")
        if 8 + length > size:
            raise CheckpointFormatError(f"{path}: header length {length} runs past the end of the file ({size} bytes)")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointFormatError(f"{path}: header is not valid UTF-8 JSON: {e!r}") from e
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: header must be a JSON object")
    header.pop("__metadata__", None)
    _check_ranges(path, header, size - 8 - length)
    return header, 8 + length


_MAX_DIM = 1 << 62


def check_shape(shape: Any, where: str) -> list[int]:
    """A shape is a list of non-negative ints whose non-zero product stays far from overflow."""
    if not (isinstance(shape, list) and all(type(s) is int and 0 <= s < _MAX_DIM for s in shape)):
        raise CheckpointFormatError(f"{where} has a bad shape {shape!r}")
    product = 1
    for s in shape:
        product *= max(s, 1)
    if product >= _MAX_DIM:
        raise CheckpointFormatError(f"{where} has an impossibly large shape {shape!r}")
    return shape


def numel_of(shape: list[int]) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel


def _check_ranges(path: str, header: dict[str, Any], data_bytes: int) -> None:
    spans = []
    for key, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointFormatError(f"{path}: tensor {key!r} must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        torch_dtype(dtype)
        check_shape(shape, f"{path}: tensor {key!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise CheckpointFormatError(f"{path}: tensor {key!r} has bad data_offsets {offsets!r}")
        start, end = offsets
        if not 0 <= start <= end or end - start != numel_of(shape) * _ITEMSIZE[dtype]:
            raise CheckpointFormatError(f"{path}: tensor {key!r} offsets {offsets} do not match {dtype}{shape}")
        spans.append((start, end, key))
    cursor = 0
    for start, end, key in sorted(spans):
        if start != cursor:
            kind = "overlaps the previous tensor" if start < cursor else f"leaves a hole at byte {cursor}"
            raise CheckpointFormatError(f"{path}: tensor {key!r} {kind} (data_offsets start {start})")
        cursor = end
    if cursor != data_bytes:
        state = "truncated" if cursor > data_bytes else "has trailing bytes"
        raise CheckpointFormatError(f"{path}: file {state}: tensors need {cursor} data bytes, file holds {data_bytes}")


# --- manifests --------------------------------------------------------------------------------------------

def rank_manifest_doc(*, step: int, rank: int, world_size: int, file: str, tree: Any,
                      entries: list[TensorEntry], checksums: dict[str, list[str]]) -> dict[str, Any]:
    tensors = {e.key: {"dtype": e.dtype, "shape": list(e.shape), "offsets": [e.offset, e.offset + e.nbytes],
                       "checksums": checksums[e.key], "capture": "lazy" if e.lazy else "eager"} for e in entries}
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": step, "rank": rank,
            "world_size": world_size, "file": file, "checksum": {"algorithm": ALGORITHM, "chunk_bytes": CHUNK_BYTES},
            "tensors": tensors, "tree": tree}


def top_manifest_doc(*, step: int, world_size: int, library_version: str) -> dict[str, Any]:
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "library_version": library_version,
            "step": step, "world_size": world_size, "ranks": [rank_manifest(r) for r in range(world_size)]}


def check_top_manifest(doc: Any, where: str) -> dict[str, Any]:
    _check_common(doc, where)
    ranks = doc.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != doc["world_size"]:
        raise CheckpointFormatError(f"{where}: 'ranks' must list one manifest per rank (world_size={doc['world_size']})")
    for name in ranks:
        check_member_name(name, where)
    return doc


def check_rank_manifest(doc: Any, where: str) -> dict[str, Any]:
    _check_common(doc, where)
    check_member_name(doc.get("file"), where)
    checksum = doc.get("checksum")
    if checksum != {"algorithm": ALGORITHM, "chunk_bytes": CHUNK_BYTES}:
        raise CheckpointFormatError(f"{where}: unsupported checksum {checksum!r}; this reader knows {ALGORITHM}")
    if type(doc.get("rank")) is not int or not 0 <= doc["rank"] < doc["world_size"]:
        raise CheckpointFormatError(f"{where}: 'rank' must be an int in [0, world_size), got {doc.get('rank')!r}")
    if "tree" not in doc:
        raise CheckpointFormatError(f"{where}: the manifest has no 'tree'")
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict):
        raise CheckpointFormatError(f"{where}: 'tensors' must be an object")
    for key, info in tensors.items():
        _check_tensor_entry(info, f"{where}: tensor {key!r}")
    return doc


_TENSOR_FIELDS = {"dtype", "shape", "offsets", "checksums", "capture"}


def _check_tensor_entry(info: Any, where: str) -> None:
    if not isinstance(info, dict) or set(info) != _TENSOR_FIELDS:
        raise CheckpointFormatError(f"{where} must have exactly the fields {sorted(_TENSOR_FIELDS)}")
    torch_dtype(info["dtype"])
    check_shape(info["shape"], where)
    offsets = info["offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise CheckpointFormatError(f"{where} has bad offsets {offsets!r}")
    sums = info["checksums"]
    if not isinstance(sums, list) or len(sums) != num_chunks(offsets[1] - offsets[0]) \
            or not all(isinstance(c, str) for c in sums):
        raise CheckpointFormatError(f"{where} must list one checksum string per {CHUNK_BYTES}-byte chunk")


def _check_common(doc: Any, where: str) -> None:
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{where}: a manifest must be a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise CheckpointFormatError(f"{where}: 'format' is {doc.get('format')!r}, not {FORMAT_NAME!r}")
    if doc.get("format_version") != FORMAT_VERSION:
        raise CheckpointFormatError(f"{where}: format_version {doc.get('format_version')!r} is not supported "
                                    f"(this reader knows {FORMAT_VERSION}); upgrade lazyckpt")
    for field in ("step", "world_size"):
        if type(doc.get(field)) is not int or doc[field] < 0:
            raise CheckpointFormatError(f"{where}: '{field}' must be a non-negative int, got {doc.get(field)!r}")
    if doc["world_size"] < 1:
        raise CheckpointFormatError(f"{where}: 'world_size' must be at least 1")


def check_member_name(name: Any, where: str) -> str:
    """A file named by a manifest must be a plain name inside the checkpoint directory."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or os.path.isabs(name) or "\x00" in name:
        raise CheckpointFormatError(f"{where}: file reference {name!r} must be a plain file name inside the "
                                    "checkpoint directory (no absolute paths, separators or '..')")
    return name
