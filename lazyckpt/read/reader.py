"""The strict reader of one checkpoint directory. ``load`` and ``verify`` both run it, so whatever one refuses
the other refuses: they differ only in where tensor bytes land (the caller's tensors, or a reused buffer).

Every file access goes through a :class:`~lazyckpt.storage.Storage`. Before a file is opened its kind is checked
without following links: only regular files inside the checkpoint directory are read (a FIFO would block
``open``, a link could lead outside), and manifests are size-capped before a byte is read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lazyckpt.errors import CheckpointFormatError, CheckpointNotFoundError
from lazyckpt.format.checksum import sha256_hex
from lazyckpt.format.files import MANIFEST, PARTIAL_SUFFIX
from lazyckpt.format.header import header_length, parse_header, torch_dtype
from lazyckpt.format.manifest import MAX_MANIFEST_BYTES, SEAL_FIELD
from lazyckpt.format.schema import (GlobalView, check_against_global_view, check_aliases, check_member_name,
                                    parse_manifest)
from lazyckpt.read.fresh_memory import empty_cpu
from lazyckpt.read.tensor_io import read_exact, read_tensor_bytes
from lazyckpt.storage import FileInfo, FileKind, LocalStorage, ReadHandle, Storage
from lazyckpt.storage.urls import is_url
from lazyckpt.tree.decode import check_references, unflatten, with_aliases

Progress = Callable[[int], None]
"""Called with the number of tensor bytes just read and checked."""


@dataclass
class RankFile:
    """A rank's checked manifest and its open tensor file, header checked against the manifest."""

    manifest: str
    doc: dict[str, Any]
    file: str
    handle: ReadHandle
    data_start: int

    def close(self) -> None:
        self.handle.close()


class CheckpointReader:
    """One committed checkpoint directory, opened strictly.

    Raises:
        CheckpointNotFoundError: ``path`` is not a committed checkpoint directory.
        CheckpointFormatError: a file breaks a rule of docs/FORMAT.md; the message names the file and the tensor,
            field or key path.
    """

    def __init__(self, path: str, storage: Storage | None = None) -> None:
        self.storage = storage if storage is not None else LocalStorage()
        self.path = self._checkpoint_dir(path)
        top = os.path.join(self.path, MANIFEST)
        if self.storage.stat(top) is None:
            raise CheckpointNotFoundError(f"{path} is not a committed lazyckpt checkpoint (no {MANIFEST}); pass a "
                                          "step-NNNNNNN directory, e.g. lazyckpt.latest(dirpath)")
        self.top = self._manifest(MANIFEST, "top", "the checkpoint directory")
        self.view = GlobalView(self.top.get("tensors", {}))
        self._trees_checked: set[tuple[int, str]] = set()
        """(rank, manifest seal) of the rank manifests whose trees passed :func:`check_references`."""

    @property
    def world_size(self) -> int:
        return self.top["world_size"]

    def _checkpoint_dir(self, path: str) -> str:
        path = _normalized(path)
        info = self.storage.stat(path)
        if info is not None and info.kind is FileKind.LINK:  # e.g. a "last" alias: the link itself is the user's
            path = self.storage.resolve(path)
            info = self.storage.stat(path)
        if path.rstrip("/").endswith(PARTIAL_SUFFIX) or info is None or info.kind is not FileKind.DIR:
            raise CheckpointNotFoundError(f"{path} is not a committed lazyckpt checkpoint directory (missing, "
                                          "partial or not a directory); pass a step-NNNNNNN directory")
        return path

    def member(self, name: Any, named_by: str) -> tuple[str, FileInfo]:
        """A regular file of the checkpoint directory, named by ``named_by`` (a file, for messages)."""
        check_member_name(name, named_by)
        full = os.path.join(self.path, name)
        info = self.storage.stat(full)
        if info is None:
            raise CheckpointFormatError(f"{full} is missing (named by {named_by})")
        if info.kind is not FileKind.FILE:
            what = "a symbolic link" if info.kind is FileKind.LINK else f"not a regular file ({info.kind.value})"
            raise CheckpointFormatError(f"{full} is {what}; lazyckpt reads only regular files inside the "
                                        "checkpoint directory")
        return full, info

    def _manifest(self, name: Any, kind: str, named_by: str) -> dict[str, Any]:
        full, info = self.member(name, named_by)
        if info.size > MAX_MANIFEST_BYTES:
            raise CheckpointFormatError(f"{full} holds {info.size} bytes, more than the {MAX_MANIFEST_BYTES}-byte "
                                        "limit for a manifest; it is not a lazyckpt manifest")
        try:
            raw = self.storage.read_bytes(full, max_bytes=MAX_MANIFEST_BYTES)
        except ValueError as e:  # grew past the limit since the stat
            raise CheckpointFormatError(f"{full}: {e}") from None
        except OSError as e:
            raise OSError(e.errno, f"{full}: reading the manifest failed: {e.strerror or e}") from e
        return parse_manifest(raw, full, kind)

    def open_rank(self, rank: int) -> RankFile:
        """Read and check rank ``rank``'s manifest and tensor file header (no tensor bytes yet)."""
        name = self.top["ranks"][rank]
        doc = self._manifest(name, "rank", os.path.join(self.path, MANIFEST))
        where = os.path.join(self.path, name)
        _match_top(where, self.top, doc, rank)
        file, _ = self.member(doc["file"], where)
        handle = _open(self.storage, file)
        try:
            data_start = _check_header(handle, file, doc, where)
            check_against_global_view(doc, self.view, rank, where)  # before any tensor byte is read
            check_aliases(doc, self.view, where)
            self._check_tree(doc, rank, where)
        except BaseException:
            handle.close()
            raise
        return RankFile(where, doc, file, handle, data_start)

    def _check_tree(self, doc: dict[str, Any], rank: int, where: str) -> None:
        """The tree's depth and references (rule 21), once per rank manifest this reader opens: ``load(rank=r)``
        and the DCP reader open the same manifest again, and a sealed manifest's seal names its bytes exactly."""
        seal = doc.get(SEAL_FIELD)
        if seal is not None and (rank, seal) in self._trees_checked:
            return
        check_references(doc["tree"], [*doc["tensors"], *doc.get("aliases", {})], where)
        if seal is not None:
            self._trees_checked.add((rank, seal))

    def read_whole(self, opened: RankFile, *, verify: bool, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The whole tensors of ``opened``'s file (its rank's own, and boxes that cover their global tensor), read
        into fresh tensors on ``device`` (default CPU); the global view's other tensors are assembled from every
        rank's file (:class:`~lazyckpt.read.shard_files.ShardFiles`)."""
        entries = {k: e for k, e in opened.doc["tensors"].items() if _is_whole(e)}
        tensors = _allocate(opened, entries, device if device is not None else torch.device("cpu"))
        read_tensor_bytes(opened.handle, opened.file, opened.data_start, entries, tensors, verify=verify)
        return tensors

    def check_rank(self, rank: int, progress: Progress | None = None) -> None:
        """Every check of loading ``rank`` (its files, tree and chunk checksums), keeping no tensor. The global
        view's tensors in other ranks' files are placeholders here: those files' own checks cover their bytes."""
        opened = self.open_rank(rank)
        try:
            read_tensor_bytes(opened.handle, opened.file, opened.data_start, opened.doc["tensors"], None,
                              verify=True, progress=progress)
            unflatten(opened.doc["tree"], self.all_placeholders(opened), opened.manifest, depth_checked=True)
        finally:
            opened.close()

    def all_placeholders(self, opened: RankFile) -> dict[str, torch.Tensor]:
        """A placeholder under every key ``opened``'s tree may name: its own tensors, the global view's and its
        aliases."""
        tensors = placeholders(opened)
        tensors.update(self._placeholders(list(self.top.get("tensors", {}))))
        return with_aliases(tensors, opened.doc.get("aliases", {}), opened.manifest)

    def _placeholders(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Stand-ins for global tensors held in other ranks' files (whose own checks cover their bytes)."""
        index = self.top.get("tensors", {})
        return {k: torch.zeros((), dtype=torch_dtype(index[k]["dtype"], f"{self.path}: tensor {k!r}"))
                .expand(index[k]["shape"]) for k in keys}

    def aliases(self, rank: int) -> dict[str, str]:
        """``rank``'s aliases (docs/FORMAT.md rule 22): the key of each tensor leaf stored under another key -> that
        key; its manifest is opened and checked for it."""
        opened = self.open_rank(rank)
        opened.close()
        return opened.doc.get("aliases", {})

    def outline(self, rank: int) -> Any:
        """The decoded state of ``rank`` with every tensor a placeholder of the right dtype and shape (no tensor
        bytes are read); the checks are those of :meth:`read_rank` except the chunk checksums."""
        opened = self.open_rank(rank)
        try:
            return unflatten(opened.doc["tree"], self.all_placeholders(opened), opened.manifest, depth_checked=True)
        finally:
            opened.close()


def _normalized(path: str) -> str:
    """``path`` without ``.`` and ``..`` parts or a trailing slash, so ``step-N.partial/.`` is seen as the partial
    directory it is. A URL loses only trailing ``/`` and ``/.`` parts (``//`` and ``::`` mean something there)."""
    if not is_url(path):
        return os.path.normpath(path)
    while path.endswith(("/.", "/")) and not path.endswith("://"):
        path = path[:-2] if path.endswith("/.") else path[:-1]
    return path


def placeholders(opened: RankFile) -> dict[str, torch.Tensor]:
    """Stand-ins with each tensor's dtype and shape and no memory behind them: the decoder checks structure only,
    so it refuses the same trees with these as with the real tensors."""
    return {k: torch.zeros((), dtype=_dtype(opened, k, e)).expand(e["shape"])
            for k, e in opened.doc["tensors"].items()}


def _is_whole(entry: dict[str, Any]) -> bool:
    """A stored tensor that is a whole tensor: its rank's own (no box; every tensor before format version 3), or
    a box that covers its global tensor."""
    box = entry.get("box")
    return box is None or (box["global_shape"] == entry["shape"] and not any(box["offsets"]))


def _allocate(opened: RankFile, entries: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    tensors = {}
    for key, entry in entries.items():
        try:
            dtype = _dtype(opened, key, entry)
            tensors[key] = (empty_cpu(entry["shape"], dtype) if device.type == "cpu"
                            else torch.empty(entry["shape"], dtype=dtype, device=device))
        except (RuntimeError, MemoryError, OSError) as e:  # e.g. a huge tensor in a sparse file
            raise MemoryError(f"{opened.file}: cannot allocate tensor {key!r} {entry['shape']} on {device}: "
                              f"{e}") from None
    return tensors


def _dtype(opened: RankFile, key: str, entry: dict[str, Any]) -> torch.dtype:
    return torch_dtype(entry["dtype"], f"{opened.manifest}: tensor {key!r}")


def _open(storage: Storage, file: str) -> ReadHandle:
    try:
        return storage.open_read(file)
    except OSError as e:  # replaced by a non-regular file since the stat
        raise CheckpointFormatError(f"{file} cannot be opened as a regular file: {e}") from None


def _read_exact(handle: ReadHandle, offset: int, nbytes: int, file: str, what: str) -> bytes:
    buffer = bytearray(nbytes)
    read_exact(handle, offset, buffer, file, what)
    return bytes(buffer)


def _check_header(handle: ReadHandle, file: str, doc: dict[str, Any], where: str) -> int:
    """Check the tensor file's header against its checksum and the manifest; returns the data section's start."""
    prefix = _read_exact(handle, 0, min(8, handle.size), file, "the header length")
    length = header_length(prefix, handle.size, file)
    raw = _read_exact(handle, 8, length, file, "the header")
    if "header_sha256" in doc and sha256_hex(prefix + raw) != doc["header_sha256"]:
        raise CheckpointFormatError(f"{file}: header is corrupt: its bytes hash to {sha256_hex(prefix + raw)}, "
                                    f"{where} records {doc['header_sha256']} (header_sha256)")
    header = parse_header(raw, handle.size - 8 - length, file)
    _match_manifest(where, file, doc["tensors"], header)
    return 8 + length


def _match_top(where: str, top: dict[str, Any], doc: dict[str, Any], rank: int) -> None:
    mine = (doc["format_version"], doc["step"], doc["world_size"], doc["rank"])
    expected = (top["format_version"], top["step"], top["world_size"], rank)
    if mine != expected:
        raise CheckpointFormatError(f"{where} says format_version/step/world_size/rank {mine}; the checkpoint's "
                                    f"{MANIFEST} expects {expected}")


def _match_manifest(where: str, file: str, tensors: dict[str, Any], header: dict[str, Any]) -> None:
    if set(tensors) != set(header):
        missing, extra = sorted(set(tensors) - set(header)), sorted(set(header) - set(tensors))
        raise CheckpointFormatError(f"{where} and {file} disagree: manifest-only tensors {missing[:5]}, "
                                    f"file-only tensors {extra[:5]}")
    for key, info in tensors.items():
        h = header[key]
        if [info["dtype"], info["shape"], info["offsets"]] != [h["dtype"], h["shape"], h["data_offsets"]]:
            raise CheckpointFormatError(f"{where} and {file} disagree about tensor {key!r}: manifest "
                                        f"{info['dtype']}{info['shape']}@{info['offsets']}, file "
                                        f"{h['dtype']}{h['shape']}@{h['data_offsets']}")
