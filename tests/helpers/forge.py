"""Edit a committed checkpoint the way a forger would: change a manifest or a header, then recompute every
seal, so that a test reaches the structural check behind the checksums (and a fuzzer explores it)."""

from __future__ import annotations

import json
import os
import struct

from lazyckpt.format.checksum import sha256_hex
from lazyckpt.format.files import MANIFEST
from lazyckpt.format.manifest import encode_manifest, seal_manifest

FILE = "rank-00000-of-00001.safetensors"
RANK0 = "rank-00000.json"


def read_json(path):
    with open(path, "rb") as f:
        return json.loads(f.read())


def write_manifest(path, doc, *, seal=True):
    with open(path, "wb") as f:
        f.write(encode_manifest(seal_manifest(doc)) if seal else json.dumps(doc).encode())


def edit_manifest(path, mutate, *, seal=True):
    """Apply ``mutate`` to the manifest at ``path`` and write it back, sealed (by default)."""
    doc = read_json(path)
    mutate(doc)
    write_manifest(path, doc, seal=seal)


def split_tensor_file(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_tensor_file(path, header, data, *, pad_to=None):
    body = json.dumps(header).encode()
    if pad_to is not None and len(body) <= pad_to:
        body = body.ljust(pad_to, b" ")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + data)


def edit_header(checkpoint, mutate, *, file=FILE, manifest=RANK0, mirror=False):
    """Apply ``mutate`` to a tensor file's header (and, with ``mirror``, to the manifest's matching entries),
    then reseal the checkpoint so only the structural checks can object."""
    path = os.path.join(checkpoint, file)
    header, data = split_tensor_file(path)
    (n,) = struct.unpack("<Q", open(path, "rb").read(8))
    mutate(header)
    write_tensor_file(path, header, data, pad_to=n)
    if mirror:
        edit_manifest(os.path.join(checkpoint, manifest), lambda d: _mirror(d, header))
    reseal(checkpoint)


def _mirror(doc, header):
    for key, info in header.items():
        if key in doc["tensors"]:
            doc["tensors"][key].update(dtype=info["dtype"], shape=info["shape"], offsets=info["data_offsets"])


def reseal(checkpoint):
    """Recompute every header_sha256 and manifest_sha256 of a checkpoint (version 2)."""
    top_path = os.path.join(checkpoint, MANIFEST)
    top = read_json(top_path)
    for name in top["ranks"]:
        path = os.path.join(checkpoint, name)
        doc = read_json(path)
        with open(os.path.join(checkpoint, doc["file"]), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            f.seek(0)
            doc["header_sha256"] = sha256_hex(f.read(8 + n))
        write_manifest(path, doc)
    write_manifest(top_path, top)


def downgrade(checkpoint, version):
    """Rewrite a single-rank checkpoint (without aliases) as format ``version`` wrote it (1: no seals and no
    sharding; 2: sealed, no sharding; 3: sharding, no aliases)."""
    for name in [MANIFEST, *read_json(os.path.join(checkpoint, MANIFEST))["ranks"]]:
        path = os.path.join(checkpoint, name)
        doc = read_json(path)
        doc.pop("manifest_sha256", None)
        assert not doc.pop("aliases", {}), "a checkpoint with aliases has no earlier format"
        if version == 1:
            doc.pop("header_sha256", None)
        if version <= 2:
            doc.pop("tensors", None) if name == MANIFEST else [t.pop("box") for t in doc["tensors"].values()]
        doc["format_version"] = version
        if version >= 2:
            write_manifest(path, doc)
            continue
        with open(path, "wb") as f:
            f.write(encode_manifest(doc))
