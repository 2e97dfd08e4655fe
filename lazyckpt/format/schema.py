"""Strict checks of manifest files: the seal over their bytes, then a table of fields per kind and version.

The tables are the schema of docs/FORMAT.md (rules 10-14): a field the table does not list is refused, so a new
field is added by adding one row (and, for a field old readers must not ignore, a new format version).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from lazyckpt.errors import CheckpointFormatError
from lazyckpt.format.checksum import ALGORITHM, CHUNK_BYTES, num_chunks, sha256_hex
from lazyckpt.format.files import FORMAT_NAME, MANIFEST, READABLE_VERSIONS
from lazyckpt.format.header import check_shape, numel_of, parse_json, torch_dtype
from lazyckpt.format.manifest import SEAL_FIELD

Check = Callable[[Any, str, dict[str, Any]], None]
"""A field check: (value, where (file and field, for the message), the whole document)."""

_SEAL = re.compile(rb',"' + SEAL_FIELD.encode() + rb'":"([0-9a-f]{64})"\}\Z')
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _fail(where: str, problem: str) -> None:
    raise CheckpointFormatError(f"{where} {problem}")


def _int_at_least(low: int) -> Check:
    def check(value: Any, where: str, doc: dict[str, Any]) -> None:
        if type(value) is not int or value < low:
            _fail(where, f"must be an int >= {low}, got {value!r}")
    return check


def _equals(expected: Any) -> Check:
    def check(value: Any, where: str, doc: dict[str, Any]) -> None:
        if value != expected:
            _fail(where, f"is {value!r}; this reader knows {expected!r}")
    return check


def _string(value: Any, where: str, doc: dict[str, Any]) -> None:
    if not isinstance(value, str):
        _fail(where, f"must be a string, got {type(value).__name__}")


def _sha256(value: Any, where: str, doc: dict[str, Any]) -> None:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        _fail(where, "must be 64 lowercase hex digits")


def _rank(value: Any, where: str, doc: dict[str, Any]) -> None:
    if type(value) is not int or not 0 <= value < doc["world_size"]:
        _fail(where, f"must be an int in [0, world_size={doc['world_size']}), got {value!r}")


def _member(value: Any, where: str, doc: dict[str, Any]) -> None:
    check_member_name(value, where)


def _ranks(value: Any, where: str, doc: dict[str, Any]) -> None:
    if not isinstance(value, list) or len(value) != doc["world_size"]:
        _fail(where, f"must list one rank manifest per rank (world_size={doc['world_size']})")
    for name in value:
        check_member_name(name, where)


def _anything(value: Any, where: str, doc: dict[str, Any]) -> None:
    """The tree is checked by decoding it (lazyckpt.tree.decode), which load and verify both do."""


def _aliases(value: Any, where: str, doc: dict[str, Any]) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        _fail(where, "must map tensor keys to tensor keys")
    stored = sorted(set(value) & set(doc["tensors"]))
    if stored:
        _fail(where, f"names stored tensors as aliases: {stored[:5]}")


def _tensor_table(schema: dict[str, Check]) -> Check:
    def check(value: Any, where: str, doc: dict[str, Any]) -> None:
        if not isinstance(value, dict):
            _fail(where, "must be an object")
        for key, info in value.items():
            check_fields(info, schema, f"{where} tensor {key!r}")
            sums, (start, end) = info["checksums"], info["offsets"]
            if not isinstance(sums, list) or len(sums) != num_chunks(end - start) \
                    or not all(isinstance(c, str) and _HEX16.fullmatch(c) for c in sums):
                _fail(f"{where} tensor {key!r}", f"must list one 16-hex-digit checksum per {CHUNK_BYTES}-byte chunk")
    return check


def _box(value: Any, where: str, info: dict[str, Any]) -> None:
    """A stored tensor's place in its global tensor (null: the tensor belongs to its rank alone)."""
    if value is None:
        return
    check_fields(value, {"global_shape": _shape, "offsets": _shape}, where)
    if not _inside(value["offsets"], info["shape"], value["global_shape"]):
        _fail(where, f"places shape {info['shape']} at {value['offsets']}, outside the global shape "
                     f"{value['global_shape']}")


def _inside(offsets: list[int], lengths: list[int], shape: list[int]) -> bool:
    return len(offsets) == len(lengths) == len(shape) and all(o + n <= g for o, n, g in zip(offsets, lengths, shape))


def _global_tensors(value: Any, where: str, doc: dict[str, Any]) -> None:
    """The global view: every box inside its tensor's shape, held by an existing rank, no overlaps, full cover."""
    if not isinstance(value, dict):
        _fail(where, "must be an object")
    for key, info in value.items():
        at = f"{where} tensor {key!r}"
        check_fields(info, {"dtype": _dtype, "shape": _shape, "boxes": _anything}, at)
        if not isinstance(info["boxes"], list):
            _fail(at, "field 'boxes' must be a list")
        if len(info["boxes"]) > doc["world_size"]:  # each rank writes at most one box of a tensor
            _fail(at, f"lists {len(info['boxes'])} boxes, more than world_size={doc['world_size']}")
        for box in info["boxes"]:
            check_fields(box, {"rank": _int_at_least(0), "offsets": _shape, "lengths": _shape}, f"{at} box")
            if box["rank"] >= doc["world_size"]:
                _fail(f"{at} box", f"names rank {box['rank']}, but world_size is {doc['world_size']}")
            if not _inside(box["offsets"], box["lengths"], info["shape"]):
                _fail(f"{at} box of rank {box['rank']}", f"(offsets {box['offsets']}, lengths {box['lengths']}) is "
                                                         f"not inside the global shape {info['shape']}")
        _check_tiling(at, info["shape"], info["boxes"])


class GlobalView:
    """``manifest.json``'s global view indexed once per reader: each tensor's blocks, and the blocks of each rank."""

    def __init__(self, index: dict[str, Any]) -> None:
        self.index = index
        self.blocks = {key: {(tuple(b["offsets"]), tuple(b["lengths"])) for b in info["boxes"]}
                       for key, info in index.items()}
        self.of_rank: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        for key, info in index.items():
            for box in info["boxes"]:
                self.of_rank.setdefault(box["rank"], []).append((key, box))


def check_against_global_view(doc: dict[str, Any], view: GlobalView, rank: int, where: str) -> None:
    """A rank manifest and ``manifest.json``'s global view must say the same (rule 20): every boxed tensor of the
    rank is a block the global view lists, every block the global view gives this rank is in its file, and a tensor
    of the rank alone is not in the global view. Every reader runs this when it opens a rank, so none takes a shard
    for a whole tensor, or another rank's block for this one's. Costs the rank's own tensors and blocks."""
    for key, entry in doc["tensors"].items():
        box, info = entry.get("box"), view.index.get(key)
        if box is None:
            if info is not None:
                _disagree(where, key, "is this rank's own (box null), the global view lists it")
            continue
        if info is None or info["dtype"] != entry["dtype"] or info["shape"] != box["global_shape"]:
            _disagree(where, key, f"is a block of {entry['dtype']}{box['global_shape']}, the global view says "
                                  f"{None if info is None else info['dtype'] + str(info['shape'])}")
        if (tuple(box["offsets"]), tuple(entry["shape"])) not in view.blocks[key]:
            _disagree(where, key, f"holds the block at {box['offsets']} of lengths {entry['shape']}, which the "
                                  "global view does not list")
    for key, block in view.of_rank.get(rank, ()):
        entry = doc["tensors"].get(key)
        info = view.index[key]
        if entry is None or entry.get("box") != {"global_shape": info["shape"], "offsets": block["offsets"]} \
                or entry["shape"] != block["lengths"]:
            _disagree(where, key, f"lacks the block at {block['offsets']} that the global view places in this "
                                  "rank's file")


def check_aliases(doc: dict[str, Any], view: GlobalView, where: str) -> None:
    """Every alias (rule 22) names a tensor stored under another key: one of this rank's file, or of the global
    view; an alias itself is stored nowhere."""
    for alias, key in doc.get("aliases", {}).items():
        if alias in view.index:
            _fail(where, f"field 'aliases' names {alias!r}, a tensor of the global view, as an alias")
        if key not in doc["tensors"] and key not in view.index:
            _fail(where, f"field 'aliases': {alias!r} is an alias of {key!r}, which neither this rank's file nor "
                         "the global view holds")


def _disagree(where: str, key: str, problem: str) -> None:
    raise CheckpointFormatError(f"{where} and the global view of {MANIFEST} disagree about tensor {key!r}: it "
                                f"{problem}")


def check_global_tensors(index: dict[str, Any], world_size: int, where: str) -> None:
    """The checks a reader runs on ``manifest.json``'s global view, for a writer about to commit one."""
    _global_tensors(index, where, {"world_size": world_size})


def _check_tiling(where: str, shape: list[int], boxes: list[dict[str, Any]]) -> None:
    """The boxes tile the tensor: they cover as many elements as it holds, and no two overlap. Overlaps are found
    by a sweep along the dimension the boxes are split most along, sorted by where they start there: a box is
    compared only with those still open at its start (one for a split along one dimension, a row of a grid), not
    with every other box."""
    solid = [box for box in boxes if numel_of(box["lengths"])]
    dim = max(range(len(shape)), key=lambda d: len({b["offsets"][d] for b in solid}), default=None)
    start = (lambda b: b["offsets"][dim]) if dim is not None else (lambda b: 0)
    end = (lambda b: b["offsets"][dim] + b["lengths"][dim]) if dim is not None else (lambda b: 1)
    open_boxes: list[dict[str, Any]] = []
    for box in sorted(solid, key=start):
        open_boxes = [other for other in open_boxes if end(other) > start(box)]
        for other in open_boxes:
            if _overlap(box, other):
                _fail(where, f"has overlapping boxes on ranks {other['rank']} and {box['rank']}")
        open_boxes.append(box)
    covered = sum(numel_of(box["lengths"]) for box in boxes)
    if covered != numel_of(shape):
        _fail(where, f"boxes cover {covered} of the {numel_of(shape)} elements of {shape}")


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(ao < bo + bl and bo < ao + al
               for ao, al, bo, bl in zip(a["offsets"], a["lengths"], b["offsets"], b["lengths"]))


def _dtype(value: Any, where: str, doc: dict[str, Any]) -> None:
    torch_dtype(value, where)


def _shape(value: Any, where: str, doc: dict[str, Any]) -> None:
    check_shape(value, where)


def _offsets(value: Any, where: str, doc: dict[str, Any]) -> None:
    if not (isinstance(value, list) and len(value) == 2 and all(type(o) is int for o in value)
            and 0 <= value[0] <= value[1]):
        _fail(where, f"must be [start, end] with 0 <= start <= end, got {value!r}")


_TENSOR: dict[str, Check] = {
    "dtype": _dtype, "shape": _shape, "offsets": _offsets, "checksums": _anything,
    "capture": lambda v, where, doc: None if v in ("lazy", "eager") else _fail(where, "must be 'lazy' or 'eager'"),
}
_COMMON: dict[str, Check] = {
    "format": _equals(FORMAT_NAME), "format_version": _anything, "step": _int_at_least(0),
    "world_size": _int_at_least(1),
}
_TOP_V1 = {**_COMMON, "library_version": _string, "ranks": _ranks}
_RANK_V1 = {**_COMMON, "rank": _rank, "file": _member,
            "checksum": _equals({"algorithm": ALGORITHM, "chunk_bytes": CHUNK_BYTES}),
            "tensors": _tensor_table(_TENSOR), "tree": _anything}
_RANK_V2 = {**_RANK_V1, "header_sha256": _sha256}
_RANK_V3 = {**_RANK_V2, "tensors": _tensor_table({**_TENSOR, "box": _box})}
SCHEMAS: dict[tuple[str, int], dict[str, Check]] = {
    ("top", 1): _TOP_V1,
    ("rank", 1): _RANK_V1,
    ("top", 2): {**_TOP_V1, SEAL_FIELD: _sha256},
    ("rank", 2): {**_RANK_V2, SEAL_FIELD: _sha256},
    ("top", 3): {**_TOP_V1, "tensors": _global_tensors, SEAL_FIELD: _sha256},
    ("rank", 3): {**_RANK_V3, SEAL_FIELD: _sha256},
    ("top", 4): {**_TOP_V1, "tensors": _global_tensors, SEAL_FIELD: _sha256},
    ("rank", 4): {**_RANK_V3, "aliases": _aliases, SEAL_FIELD: _sha256},
}
"""Fields by (manifest kind, format version); checked in this order (``rank`` after ``world_size``)."""


def parse_manifest(raw: bytes, where: str, kind: str) -> dict[str, Any]:
    """Parse and check the bytes of a manifest (``kind`` "top" for manifest.json, "rank" for rank-NNNNN.json)."""
    doc = parse_json(raw, where)
    if not isinstance(doc, dict):
        _fail(where, "must hold a JSON object")
    version = doc.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        _fail(where, f"has format version {version!r}, which this reader cannot read (it reads versions "
                     f"{list(READABLE_VERSIONS)}); upgrade lazyckpt")
    if version >= 2:
        _check_seal(raw, doc, where)
    check_fields(doc, SCHEMAS[kind, version], where)
    return doc


def check_fields(doc: Any, schema: dict[str, Check], where: str) -> None:
    if not isinstance(doc, dict):
        _fail(where, "must be a JSON object")
    missing, unknown = [f for f in schema if f not in doc], sorted(set(doc) - set(schema))
    if missing or unknown:
        _fail(where, f"must have exactly the fields {list(schema)}: missing {missing}, unknown {unknown}")
    for field, check in schema.items():
        check(doc[field], f"{where} field {field!r}", doc)


def _check_seal(raw: bytes, doc: dict[str, Any], where: str) -> None:
    found = _SEAL.search(raw)
    if found is None:
        _fail(where, f'does not end with its "{SEAL_FIELD}" member; the file was changed or cut short')
    actual = sha256_hex(raw[: found.start()] + b"}")
    if actual != found.group(1).decode() or doc.get(SEAL_FIELD) != actual:
        raise CheckpointFormatError(f"{where} is corrupt: its bytes hash to {actual}, the file records "
                                    f"{found.group(1).decode()} ({SEAL_FIELD})")


def check_member_name(name: Any, where: str) -> str:
    """A file named by a manifest must be a plain name inside the checkpoint directory."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\x00" in name:
        raise CheckpointFormatError(f"{where}: file reference {name!r} must be a plain file name inside the "
                                    "checkpoint directory (no absolute paths, separators or '..')")
    return name
