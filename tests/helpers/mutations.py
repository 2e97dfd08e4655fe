"""Seeded, structure-aware mutations of a multi-rank checkpoint's manifests (``manifest.json`` and every
``rank-*.json``), each written into a fresh directory and resealed as docs/FORMAT.md says a writer seals it (every
``header_sha256`` from the file the manifest names, then every ``manifest_sha256``), so that only the structural
checks behind the seals can object. The engine of ``tests/read/test_manifest_fuzz.py`` (the readers and the
outcomes: :mod:`helpers.fuzz_readers`).

A mutation edits one manifest: a field deleted, duplicated, given a wrong JSON type, a huge or negative int or a
NaN-ish value; a box made null, whole, shifted, swapped with another rank's, overlapping, out of range or of the
wrong shape; offsets, lengths, ranks, dtypes, shapes, global shapes, file names and checksums changed; tree
references pointed elsewhere, swapped, duplicated or dropped. Edits a valid checkpoint could also hold are not
drawn (a plain value of the tree; a rank's reference to a global tensor that only another rank stores, dropped:
a rank need not hold every global tensor, e.g. a DTensor on a sub-mesh), except as the harmless edits every reader
must read as before (``library_version``, ``capture``, the order of entries).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lazyckpt.format.checksum import sha256_hex

Docs = dict[str, Any]
"""Every manifest of a checkpoint by file name, parsed."""
TOP = "manifest.json"
NAN, INF = float("nan"), float("inf")
WRONG_TYPES: list[Any] = [None, True, "NaN", "Infinity", 1.5, NAN, -INF, [], {}, "", [[]]]
"""Values of the wrong JSON type for any field (NaN and Infinity as the literals Python's json writes and reads)."""
BIGNUM = "__bignum__"
"""Written as a 5,001-digit int literal: more digits than Python's int parser takes (its json cannot write one)."""
HUGE: list[Any] = [-1, -(2**63), 2**63, 2**64 + 1, 10**30, BIGNUM]
"""Negative and huge ints."""


@dataclass(frozen=True)
class Mutation:
    family: str
    """What kind of edit (``box``, ``global boxes``, ``tree refs``, ...): each family is drawn from."""
    file: str
    what: str
    """The edit in words: file, JSON path and new value."""
    edit: Callable[[Any], None]
    """Applies the edit to the parsed manifest ``file`` in place."""
    reseal_header: bool = True


# --- JSON paths -----------------------------------------------------------------------------------------------

def _at(doc: Any, path: tuple) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def _setter(path: tuple, value: Any) -> Callable[[Any], None]:
    def edit(doc: Any) -> None:
        _at(doc, path[:-1])[path[-1]] = copy.deepcopy(value)
    return edit


def _deleter(path: tuple) -> Callable[[Any], None]:
    def edit(doc: Any) -> None:
        del _at(doc, path[:-1])[path[-1]]
    return edit


def _duplicator(path: tuple, new_key: Any = None) -> Callable[[Any], None]:
    """A dict member copied under ``new_key``, or a list item inserted again after itself."""
    def edit(doc: Any) -> None:
        parent = _at(doc, path[:-1])
        if isinstance(parent, list):
            parent.insert(path[-1] + 1, copy.deepcopy(parent[path[-1]]))
        else:
            parent[new_key] = copy.deepcopy(parent[path[-1]])
    return edit


def _text(path: tuple) -> str:
    return "".join(f"[{p!r}]" for p in path)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} chars)"


# --- the mutation families --------------------------------------------------------------------------------------

def _values(file: str, family: str, path: tuple, values: list[Any]) -> Iterator[Mutation]:
    for value in values:
        yield Mutation(family, file, f"{file}{_text(path)} = {_shown(value)}", _setter(path, value))


def _int_lies(value: int) -> list[Any]:
    return [value + 1, value - 1, 0, 1, 2 * value + 2, float(value), str(value), [value], *HUGE, *WRONG_TYPES]


def _int_list_lies(value: list) -> list[Any]:
    lies = [value[:-1], [*value, 0], [*value, 1], value[::-1], [v + 1 for v in value], [-v - 1 for v in value],
            [2**63] * len(value), [float(v) for v in value], *WRONG_TYPES]
    return [lie for lie in lies if lie != value]


def _ints(file: str, family: str, path: tuple, value: list) -> Iterator[Mutation]:
    """A list of ints (a shape, offsets, lengths): the whole list, then each element."""
    yield from _values(file, family, path, _int_list_lies(value))
    for i, v in enumerate(value):
        yield from _values(file, family, (*path, i), _int_lies(v))


def _members(file: str, family: str, path: tuple, members: dict[str, Any]) -> Iterator[Mutation]:
    """Each member of an object deleted; an unknown member added; the object itself null or a list."""
    for name in members:
        yield Mutation(family, file, f"{file}{_text((*path, name))} deleted", _deleter((*path, name)))
    yield from _values(file, family, (*path, "extra"), [0])
    if path:
        yield from _values(file, family, path, [None, [], [members]])


DTYPES = ["F16", "F64", "BF16", "I32", "I64", "U8", "f32", "F128", "", None, 32]
FILE_LIES = ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors", "rank-00000.json", "manifest.json",
             "missing.safetensors", "../rank-00000-of-00002.safetensors", "/etc/passwd", ".", "..", "", "a\\b",
             "a\x00b", None, 0, ["rank-00000-of-00002.safetensors"]]


def _top_fields(top: dict[str, Any]) -> Iterator[Mutation]:
    yield from _members(TOP, "top fields", (), {k: v for k, v in top.items() if k != "manifest_sha256"})
    yield from _values(TOP, "top fields", ("format",), ["lazyckpt2", "", None])
    yield from _values(TOP, "top fields", ("format_version",), [1, 2, 3, 5, "4", 4.0, *HUGE[:3], None])
    yield from _values(TOP, "top fields", ("step",), _int_lies(top["step"]))
    yield from _values(TOP, "top fields", ("world_size",), _int_lies(top["world_size"]))
    ranks = top["ranks"]
    yield from _values(TOP, "ranks", ("ranks",), [ranks[::-1], ranks[:1], [*ranks, ranks[0]], [ranks[0]] * 2,
                                                  [ranks[0], "missing.json"], [ranks[0], TOP], *WRONG_TYPES])
    for i in range(len(ranks)):
        yield from _values(TOP, "ranks", ("ranks", i), FILE_LIES)


def _entry_edits(file: str, family: str, tensors: dict[str, Any], n: int) -> Iterator[Mutation]:
    """The edits of the ``n``-th entry of a ``tensors`` table as a whole: deleted, duplicated under another key,
    replaced by the next entry, its members deleted or added."""
    keys = list(tensors)
    key, other = keys[n], keys[(n + 1) % len(keys)]
    at = ("tensors", key)
    yield Mutation(family, file, f"{file}{_text(at)} deleted", _deleter(at))
    yield Mutation(family, file, f"{file}{_text(at)} duplicated as {key + '~'!r}", _duplicator(at, key + "~"))
    yield Mutation(family, file, f"{file}{_text(at)} replaced by {other!r}'s entry", _setter(at, tensors[other]))
    yield from _members(file, family, at, tensors[key])


def _global_view(top: dict[str, Any]) -> Iterator[Mutation]:
    tensors = top["tensors"]
    yield from _values(TOP, "global view", ("tensors",), [{}, None, [], {k: tensors[k] for k in list(tensors)[1:]}])
    for n, (key, info) in enumerate(tensors.items()):
        at = ("tensors", key)
        yield from _entry_edits(TOP, "global view", tensors, n)
        yield from _values(TOP, "dtypes", (*at, "dtype"), DTYPES)
        yield from _ints(TOP, "global shapes", (*at, "shape"), info["shape"])
        yield from _global_boxes(key, info)


def _global_boxes(key: str, info: dict[str, Any]) -> Iterator[Mutation]:
    boxes, at = info["boxes"], ("tensors", key, "boxes")
    family = "global boxes"
    swapped_ranks = [{**b, "rank": boxes[-1 - i]["rank"]} for i, b in enumerate(boxes)]
    swapped_offsets = [{**b, "offsets": boxes[-1 - i]["offsets"]} for i, b in enumerate(boxes)]
    one_rank = [{**b, "rank": boxes[0]["rank"]} for b in boxes]
    overlapping = [{**b, "offsets": boxes[0]["offsets"]} for b in boxes]
    whole = [{"rank": boxes[-1]["rank"], "offsets": [0] * len(info["shape"]), "lengths": info["shape"]}]
    yield from _values(TOP, family, at, [boxes[::-1], swapped_ranks, swapped_offsets, one_rank, overlapping, whole,
                                         boxes[:-1], [*boxes, boxes[-1]], [], *WRONG_TYPES[:4]])
    for i, box in enumerate(boxes):
        yield Mutation(family, TOP, f"{TOP}{_text((*at, i))} duplicated", _duplicator((*at, i)))
        yield from _members(TOP, family, (*at, i), box)
        yield from _values(TOP, family, (*at, i, "rank"), _int_lies(box["rank"]))
        yield from _ints(TOP, family, (*at, i, "offsets"), box["offsets"])
        yield from _ints(TOP, family, (*at, i, "lengths"), box["lengths"])


def _rank_fields(file: str, doc: dict[str, Any]) -> Iterator[Mutation]:
    family = "rank fields"
    yield from _members(file, family, (), {k: v for k, v in doc.items() if k != "manifest_sha256"})
    yield from _values(file, family, ("format_version",), [2, 3, 5, "4", None])
    for field in ("step", "rank", "world_size"):
        yield from _values(file, family, (field,), _int_lies(doc[field]))
    yield from _values(file, "file names", ("file",), [name for name in FILE_LIES if name != doc["file"]])
    yield from _values(file, family, ("checksum",), [{"algorithm": "crc32", "chunk_bytes": 1 << 20},
                                                     {"algorithm": "lzc64-v1", "chunk_bytes": 1 << 10}, None])
    sha = doc["header_sha256"]
    for value in [sha.upper(), sha[:-1] + ("0" if sha[-1] != "0" else "1"), sha[:32], None, 0]:
        yield Mutation("checksums", file, f"{file}['header_sha256'] = {_shown(value)} (header not resealed)",
                       _setter(("header_sha256",), value), reseal_header=False)


def _rank_entries(file: str, doc: dict[str, Any], others: dict[str, dict[str, Any]]) -> Iterator[Mutation]:
    for n, (key, entry) in enumerate(doc["tensors"].items()):
        at = ("tensors", key)
        yield from _entry_edits(file, "rank entries", doc["tensors"], n)
        yield from _values(file, "dtypes", (*at, "dtype"), DTYPES)
        yield from _ints(file, "shapes", (*at, "shape"), entry["shape"])
        yield from _ints(file, "byte offsets", (*at, "offsets"), entry["offsets"])
        yield from _checksums(file, at, entry["checksums"])
        yield from _values(file, "harmless", (*at, "capture"), ["eager" if entry["capture"] == "lazy" else "lazy"])
        yield from _values(file, "rank entries", (*at, "capture"), ["Lazy", None])
        yield from _box(file, key, entry, [d["tensors"][key] for d in others.values() if key in d["tensors"]])


def _checksums(file: str, at: tuple, sums: list[str]) -> Iterator[Mutation]:
    family, path = "checksums", (*at, "checksums")
    yield from _values(file, family, path, [[], [*sums, "0" * 16], sums * 2, ["0" * 16], None, "0" * 16])
    for i, value in enumerate(sums):
        flipped = value[:-1] + ("0" if value[-1] != "0" else "1")
        yield from _values(file, family, (*path, i), [flipped, value.upper(), value[:15], int(value, 16), None])


def _box(file: str, key: str, entry: dict[str, Any], twins: list[dict[str, Any]]) -> Iterator[Mutation]:
    """The box of one stored tensor: null, whole, shifted, swapped with another rank's, overlapping, out of range,
    of the wrong shape; a tensor of the rank alone given a box."""
    family, box, at = "boxes", entry["box"], ("tensors", key, "box")
    shape = entry["shape"]
    if box is None:
        claims = [{"global_shape": shape, "offsets": [0] * len(shape)}, {"global_shape": [2 * s for s in shape],
                                                                         "offsets": [0] * len(shape)}]
        yield from _values(file, family, at, claims + WRONG_TYPES[1:4])
        return
    gs, offsets = box["global_shape"], box["offsets"]
    lies = [None, {"global_shape": shape, "offsets": [0] * len(shape)}, {"global_shape": gs, "offsets": [0] * len(gs)},
            {"global_shape": gs, "offsets": gs}, {"global_shape": gs, "offsets": [*offsets, 0]},
            {"global_shape": [*gs, 1], "offsets": [*offsets, 0]}, {"global_shape": gs[:-1], "offsets": offsets[:-1]},
            {"offsets": offsets}, {"global_shape": gs}, {**box, "extra": 0}, *WRONG_TYPES[1:4]]
    lies += [{"global_shape": gs, "offsets": [o + d if i == 0 else o for i, o in enumerate(offsets)]}
             for d in (-1, 1, 2) if offsets]
    lies += [twin["box"] for twin in twins if twin["box"] != box]  # swapped / overlapping another rank's block
    yield from _values(file, family, at, [lie for lie in lies if lie != box])
    yield from _ints(file, "global shapes", (*at, "global_shape"), gs)
    yield from _ints(file, family, (*at, "offsets"), offsets)


def _tensor_refs(node: Any, path: tuple = ()) -> Iterator[tuple[tuple, str]]:
    """Every ``{"$tensor": key}`` node of a tree, with its JSON path."""
    if isinstance(node, dict):
        if set(node) == {"$tensor"}:
            yield path, node["$tensor"]
            return
        for name, child in node.items():
            yield from _tensor_refs(child, (*path, name))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from _tensor_refs(child, (*path, i))


def _tree(file: str, doc: dict[str, Any], global_keys: list[str]) -> Iterator[Mutation]:
    refs = list(_tensor_refs(doc["tree"], ("tree",)))
    keys = [key for _, key in refs]
    for n, (path, key) in enumerate(refs):
        ref = (*path, "$tensor")
        others = [keys[(n + 1) % len(keys)], keys[(n + 7) % len(keys)], "missing", key + "~", key.upper(),
                  "../" + key, *[k for k in global_keys if k not in keys][:1], 0, None, [key]]
        yield from _values(file, "tree refs", ref, [k for k in others if k != key])
        yield from _values(file, "tree refs", path, [{"$tensor": key, "extra": 0}, {"$inline": key}])
        in_pair = len(path) >= 3 and path[-3] == "$dict" and path[-1] == 1  # ["name", {"$tensor": key}]
        member = path[:-1] if in_pair else path  # the pair, a list or $tuple item, or a wrapper's value
        if in_pair or isinstance(path[-1], int):
            yield Mutation("tree refs", file, f"{file}{_text(member)} duplicated", _duplicator(member))
        for value in (None, 0) if in_pair else ():
            yield Mutation("tree refs", file, f"{file}{_text(member)} shadowed by a later pair of its key holding "
                                               f"{value!r}", _shadower(member, value))
        if key in doc["tensors"]:  # a rank may lack a global tensor another rank stores (a DTensor on a sub-mesh):
            # dropping the reference to one gives a valid checkpoint of another state, like a changed plain value
            yield from _values(file, "tree refs", path, [key])
            yield Mutation("tree refs", file, f"{file}{_text(member)} deleted", _deleter(member))
    for (a, ka), (b, kb) in zip(refs[::2], refs[1::2]):
        yield Mutation("tree refs", file, f"{file}: tree references {ka!r} and {kb!r} swapped",
                       _swapper((*a, "$tensor"), (*b, "$tensor")))


def _shadower(pair: tuple, value: Any) -> Callable[[Any], None]:
    """A ``[key, value]`` pair of a ``$dict`` followed by another pair of the same key."""
    def edit(doc: Any) -> None:
        pairs = _at(doc, pair[:-1])
        pairs.insert(pair[-1] + 1, [pairs[pair[-1]][0], value])
    return edit


def _swapper(a: tuple, b: tuple) -> Callable[[Any], None]:
    def edit(doc: Any) -> None:
        pa, pb = _at(doc, a[:-1]), _at(doc, b[:-1])
        pa[a[-1]], pb[b[-1]] = pb[b[-1]], pa[a[-1]]
    return edit


def _harmless(docs: Docs) -> Iterator[Mutation]:
    """Edits a valid checkpoint may hold: every reader must read the same data as before (families ``harmless``
    and ``order``)."""
    top = docs[TOP]
    yield from _values(TOP, "harmless", ("library_version",), ["9.9.9", ""])
    yield from _values(TOP, "order", ("tensors",), [dict(reversed(top["tensors"].items()))])
    for file in sorted(docs):  # a family of their own: each is drawn (dict equality is blind to them)
        if file != TOP:
            yield from _values(file, "order", ("tensors",), [dict(reversed(docs[file]["tensors"].items()))])


def every_mutation(docs: Docs) -> Iterator[Mutation]:
    """Every mutation the engine knows of ``docs`` (a checkpoint's manifests), in a fixed order."""
    top = docs[TOP]
    yield from _top_fields(top)
    yield from _global_view(top)
    yield from _harmless(docs)
    ranks = {name: docs[name] for name in top["ranks"]}
    for file, doc in ranks.items():
        others = {name: d for name, d in ranks.items() if name != file}
        yield from _rank_fields(file, doc)
        yield from _rank_entries(file, doc, others)
        yield from _tree(file, doc, list(top["tensors"]))



def encode(doc: Any) -> bytes:
    """The bytes of a manifest as a forger writes them: compact JSON, NaN and Infinity as Python's json writes
    them, :data:`BIGNUM` as a huge int literal."""
    raw = json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()
    return raw.replace(json.dumps(BIGNUM).encode(), b"1" + b"0" * 5000)


def sealed(doc: dict[str, Any]) -> bytes:
    """``doc`` resealed as docs/FORMAT.md rule 10a says: its last member the SHA-256 of the rest."""
    body = encode({k: v for k, v in doc.items() if k != "manifest_sha256"})
    return body[:-1] + b',"manifest_sha256":"' + sha256_hex(body).encode() + b'"}'


def draw(docs: Docs, count: int, seed: int) -> list[tuple[Mutation, Docs]]:
    """``count`` distinct mutations (no two give the same files, none gives the untouched ones), drawn in turn
    from each family in a seeded order; with each, the manifests it gives."""
    families: dict[str, list[Mutation]] = {}
    for mutation in every_mutation(docs):
        families.setdefault(mutation.family, []).append(mutation)
    rng = random.Random(seed)
    for name in sorted(families):
        rng.shuffle(families[name])
    untouched = {file: encode(doc) for file, doc in docs.items()}
    seen = {_digest(TOP, untouched[TOP], True)}
    drawn: list[tuple[Mutation, Docs]] = []
    while len(drawn) < count and any(families.values()):
        for name in sorted(families):
            while families[name] and len(drawn) < count:
                mutation = families[name].pop()
                doc = copy.deepcopy(docs[mutation.file])
                mutation.edit(doc)
                raw = encode(doc)
                digest = _digest(mutation.file, raw, mutation.reseal_header)
                if raw != untouched[mutation.file] and digest not in seen:  # not doc != ...: == is blind to order
                    seen.add(digest)
                    drawn.append((mutation, {**docs, mutation.file: doc}))
                    break
    return drawn


def _digest(file: str, raw: bytes, reseal_header: bool) -> str:
    return hashlib.sha256(f"{file}{reseal_header}".encode() + raw).hexdigest()


def read_docs(path: str) -> Docs:
    """The manifests of the checkpoint directory ``path``."""
    with open(os.path.join(path, TOP), "rb") as f:
        top = json.loads(f.read())
    docs = {TOP: top}
    for name in top["ranks"]:
        with open(os.path.join(path, name), "rb") as f:
            docs[name] = json.loads(f.read())
    return docs


def write_case(template: str, mutation: Mutation, docs: Docs, dest: str) -> None:
    """The checkpoint ``template`` with manifests ``docs`` (as ``mutation`` left them), resealed, at ``dest``."""
    os.makedirs(dest)
    for name in os.listdir(template):
        if not name.endswith(".json"):
            shutil.copyfile(os.path.join(template, name), os.path.join(dest, name))
    for name, doc in docs.items():
        if name != TOP and isinstance(doc, dict) and "header_sha256" in doc \
                and (mutation.reseal_header or name != mutation.file):
            doc = {**doc, "header_sha256": _header_sha256(dest, doc)}
        with open(os.path.join(dest, name), "wb") as f:
            f.write(sealed(doc) if isinstance(doc, dict) else encode(doc))


def _header_sha256(dest: str, doc: dict[str, Any]) -> Any:
    """The SHA-256 of the first 8 + N bytes of the file ``doc`` names, as a forger computes it; where that file
    is not there (or is no tensor file), the recorded value stays."""
    name = doc.get("file")
    path = os.path.join(dest, name) if isinstance(name, str) and name and "\x00" not in name else None
    if path is None or not os.path.isfile(path):
        return doc.get("header_sha256")
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little") if len(raw) >= 8 else None
    return sha256_hex(raw[: 8 + n]) if n is not None and 8 + n <= len(raw) else doc.get("header_sha256")
