"""The manifests of a checkpoint (docs/FORMAT.md), built and sealed: each rank's, and ``manifest.json`` with the
global view of every sharded or replicated tensor. Their strict checks are :mod:`lazyckpt.format.schema`'s."""

from __future__ import annotations

import json
from typing import Any

from lazyckpt.errors import UnsupportedValueError
from lazyckpt.format.checksum import ALGORITHM, CHUNK_BYTES, sha256_hex
from lazyckpt.format.files import FORMAT_NAME, FORMAT_VERSION, rank_manifest
from lazyckpt.format.header import TensorEntry

MAX_MANIFEST_BYTES = 256 << 20
"""Largest manifest a reader accepts (checked before reading): room for a million tensors' checksums plus
inline tensors, small enough that a hostile file cannot exhaust memory."""

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
                      boxes: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """A rank's manifest; ``header`` is the tensor file's header exactly as written (prefix, JSON, padding);
    ``boxes`` maps each key to its :class:`~lazyckpt.ranks.sharding.Box` (None: a tensor of this rank alone);
    ``aliases`` maps the key of each tensor leaf stored under another key (a tied weight) to that key."""
    tensors = tensor_table_doc(entries, checksums, boxes)
    return seal_manifest({"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": step, "rank": rank,
                    "world_size": world_size, "file": file,
                    "checksum": {"algorithm": ALGORITHM, "chunk_bytes": CHUNK_BYTES},
                    "header_sha256": sha256_hex(header), "tensors": tensors, "aliases": aliases, "tree": tree})


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
