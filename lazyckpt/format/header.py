"""The safetensors header of a rank's tensor file (docs/FORMAT.md): dtypes, the entry of each stored tensor, the
header written at the start of the file and its strict checks when read."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from lazyckpt.errors import CheckpointFormatError, UnsupportedValueError
from lazyckpt.storage import PAGE_BYTES

HEADER_ALIGN = PAGE_BYTES
"""The data section starts on a 4 KiB boundary (header padded with spaces), ready for direct I/O."""
MAX_HEADER_BYTES = 100 << 20
"""safetensors' own cap on the JSON header."""

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
_ITEMSIZE = {name: torch.empty(0, dtype=dtype).element_size() for dtype, name in _DTYPES.items()}


def dtype_name(dtype: torch.dtype, where: str = "a tensor") -> str:
    """The safetensors name of a torch dtype, or a clear error naming ``where`` (a key path) for one the format
    cannot hold."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise UnsupportedValueError(f"{where} has dtype {dtype}, which safetensors cannot store; supported: "
                                    f"{sorted(map(str, _DTYPES))}") from None


def torch_dtype(name: Any, where: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name read from ``where`` (a file and tensor, for the message)."""
    if not isinstance(name, str) or name not in _TORCH_DTYPES:
        raise CheckpointFormatError(f"{where}: unknown dtype {name!r}; the format knows {sorted(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[name]


def itemsize(name: str) -> int:
    return _ITEMSIZE[name]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of one rank's file: where its bytes go and how they are captured."""

    key: str
    dtype: str
    """The safetensors dtype string (``F32``, ``BF16``, ``BOOL``...)."""
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0
    """Byte offset of the tensor inside the file's data section."""
    lazy: bool = False


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


