"""The on-disk format (docs/FORMAT.md): names, the safetensors header, the manifests, and their strict checks."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from typing import Any

import torch

from lazyckpt.checksum import ALGORITHM, CHUNK_BYTES
from lazyckpt.errors import CheckpointFormatError, UnsupportedValueError
from lazyckpt.storage import PAGE_BYTES
from lazyckpt.plan import TensorEntry

FORMAT_NAME = "lazyckpt"
FORMAT_VERSION = 3
"""Version 2 added the SHA-256 of every manifest and of every tensor file's header. Version 3 adds sharding: each
stored tensor's box in its global tensor (rank manifests) and the global view of which rank holds which box
(``manifest.json``); a version-2 reader would take a shard for the whole tensor, so it must refuse version 3.
Versions 1 and 2 stay readable."""
READABLE_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
HEADER_ALIGN = PAGE_BYTES
"""The data section starts on a 4 KiB boundary (header padded with spaces), ready for direct I/O."""
MAX_HEADER_BYTES = 100 << 20
"""safetensors' own cap on the JSON header."""
MAX_MANIFEST_BYTES = 256 << 20
"""Largest manifest a reader accepts (checked before reading): room for a million tensors' checksums plus
inline tensors, small enough that a hostile file cannot exhaust memory."""
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


def torch_dtype(name: Any, where: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name read from ``where`` (a file and tensor, for the message)."""
    if not isinstance(name, str) or name not in _TORCH_DTYPES:
        raise CheckpointFormatError(f"{where}: unknown dtype {name!r}; the format knows {sorted(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[name]


def itemsize(name: str) -> int:
    return _ITEMSIZE[name]


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


def dcp_sharding_metadata(entries: list[TensorEntry],
                          offsets: dict[str, tuple[int, ...] | None] | None = None) -> dict[str, str]:
    """``__metadata__`` that ``torch.distributed.checkpoint.HuggingFaceStorageReader`` understands: where each
    stored tensor starts in its global tensor (per-rank and whole tensors start at the origin)."""
    offsets = offsets or {}
    info = {e.key: {"saved_offsets": list(offsets.get(e.key) or (0,) * len(e.shape))} for e in entries}
    return {"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"}


def header_length(prefix: bytes, file_size: int, where: str) -> int:
    """The JSON length N from a tensor file's first 8 bytes, checked against the cap and the file size."""
    if len(prefix) < 8:
        raise CheckpointFormatError(f"{where}: {file_size} bytes is too short for a safetensors header")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise CheckpointFormatError(f"{where}: header length {length} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if 8 + length > file_size:
        raise CheckpointFormatError(f"{where}: header length {length} runs past the end of the file "
                                    f"({file_size} bytes)")
    return length


def parse_header(raw: bytes, data_bytes: int, where: str) -> dict[str, Any]:
    """Check a header's JSON (without the 8-byte prefix); returns its tensor entries by key."""
    header = parse_json(raw, f"{where}: header")
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{where}: header must be a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointFormatError(f"{where}: __metadata__ must map strings to strings")
    _check_ranges(where, header, data_bytes)
    return header


def parse_json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON syntax, huge int literals
        raise CheckpointFormatError(f"{where} is not valid UTF-8 JSON: {e}") from None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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


def _check_ranges(where: str, header: dict[str, Any], data_bytes: int) -> None:
    spans = []
    for key, info in header.items():
        at = f"{where}: tensor {key!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointFormatError(f"{at} must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        torch_dtype(dtype, at)
        check_shape(shape, at)
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise CheckpointFormatError(f"{at} has bad data_offsets {offsets!r}")
        start, end = offsets
        if not 0 <= start <= end or end - start != numel_of(shape) * _ITEMSIZE[dtype]:
            raise CheckpointFormatError(f"{at}: offsets {offsets} do not match {dtype}{shape}")
        spans.append((start, end, key))
    cursor = 0
    for start, end, key in sorted(spans):
        if start != cursor:
            kind = "overlaps the previous tensor" if start < cursor else f"leaves a hole at byte {cursor}"
            raise CheckpointFormatError(f"{where}: tensor {key!r} {kind} (data_offsets start {start})")
        cursor = end
    if cursor != data_bytes:
        state = "truncated" if cursor > data_bytes else "has trailing bytes"
        raise CheckpointFormatError(f"{where}: file {state}: tensors need {cursor} data bytes, file holds {data_bytes}")


# --- manifests (written here, checked in lazyckpt.manifest) -----------------------------------------------

SEAL_FIELD = "manifest_sha256"
"""The last member of every manifest: SHA-256 of the file without that member (the bytes before
``,"manifest_sha256"`` followed by ``}``), so any changed byte of a manifest is detected."""


def encode_manifest(doc: dict[str, Any]) -> bytes:
    """The exact bytes of a manifest file (compact JSON, ASCII). A sealed doc keeps its seal valid."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


def seal_manifest(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` plus its seal as the last member (any earlier seal is replaced)."""
    doc = {k: v for k, v in doc.items() if k != SEAL_FIELD}
    body = encode_manifest(doc)
    if len(body) > MAX_MANIFEST_BYTES:
        raise UnsupportedValueError(f"the manifest of step {doc['step']} would take {len(body)} bytes, more than "
                                    f"the {MAX_MANIFEST_BYTES}-byte limit readers accept; keep large values in "
                                    "tensors rather than Deferred leaves or plain lists")
    return {**doc, SEAL_FIELD: sha256_hex(body)}


def rank_manifest_doc(*, step: int, rank: int, world_size: int, file: str, tree: Any, header: bytes,
                      entries: list[TensorEntry], checksums: dict[str, list[str]],
                      boxes: dict[str, Any]) -> dict[str, Any]:
    """A rank's manifest; ``header`` is the tensor file's header exactly as written (prefix, JSON, padding);
    ``boxes`` maps each key to its :class:`~lazyckpt.sharding.Box` (None: a tensor of this rank alone)."""
    tensors = tensor_table_doc(entries, checksums, boxes)
    return seal_manifest({"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": step, "rank": rank,
                    "world_size": world_size, "file": file,
                    "checksum": {"algorithm": ALGORITHM, "chunk_bytes": CHUNK_BYTES},
                    "header_sha256": sha256_hex(header), "tensors": tensors, "tree": tree})


def tensor_table_doc(entries: list[TensorEntry], checksums: dict[str, list[str]],
                     boxes: dict[str, Any]) -> dict[str, Any]:
    """A rank manifest's ``tensors`` table: per stored tensor its dtype, shape, byte range, chunk checksums,
    capture mode and box."""
    return {e.key: {"dtype": e.dtype, "shape": list(e.shape), "offsets": [e.offset, e.offset + e.nbytes],
                    "checksums": checksums[e.key], "capture": "lazy" if e.lazy else "eager",
                    "box": _box_doc(boxes.get(e.key))} for e in entries}


def _box_doc(box: Any) -> dict[str, list[int]] | None:
    return None if box is None else {"global_shape": list(box.global_shape), "offsets": list(box.offsets)}


def top_manifest_doc(*, step: int, world_size: int, library_version: str,
                     tensors: dict[str, Any]) -> dict[str, Any]:
    """``manifest.json``; ``tensors`` is the global view (see :func:`global_index`)."""
    return seal_manifest({"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "library_version": library_version,
                    "step": step, "world_size": world_size,
                    "ranks": [rank_manifest(r) for r in range(world_size)], "tensors": tensors})


def tensor_summary(tensors: dict[str, Any]) -> dict[str, Any]:
    """What a rank tells the others about its manifest's tensors: dtype, stored shape and box."""
    return {key: {"dtype": info["dtype"], "shape": info["shape"], "box": info["box"]} for key, info in tensors.items()}


def global_index(summaries: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The global view from every rank's :func:`tensor_summary`: per global tensor, its dtype, global shape and
    which rank holds which box. Tensors of one rank alone (no box) are not part of it. A block written by several
    ranks (a DTensor on a sub-mesh, replicated over the ranks outside it) is listed once, from its lowest rank."""
    index: dict[str, Any] = {}
    for rank in sorted(summaries):
        for key, info in summaries[rank].items():
            box = info["box"]
            if box is None:
                continue
            entry = index.setdefault(key, {"dtype": info["dtype"], "shape": box["global_shape"], "boxes": []})
            if not any(b["offsets"] == box["offsets"] and b["lengths"] == info["shape"] for b in entry["boxes"]):
                entry["boxes"].append({"rank": rank, "offsets": box["offsets"], "lengths": info["shape"]})
    return index
