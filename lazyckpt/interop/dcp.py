"""``torch.distributed.checkpoint`` reads lazyckpt checkpoints through :class:`StorageReader`.

DCP's planner decides which stored block fills which part of each target (resharding to any mesh and world size);
this reader only describes the checkpoint (the global view in ``manifest.json``) and serves the blocks through
:class:`~lazyckpt.read.shard_files.ShardFiles`, so every manifest and header check of ``load`` applies and the checksums of
what is read are verified. Plain values (ints, lists, ``param_groups``) are served the way DCP stores them, as
``torch.save`` bytes; they come from rank 0's part of the checkpoint.

Example:
    >>> import torch.distributed.checkpoint as dcp                                            # doctest: +SKIP
    >>> state = {"model": msd, "optim": osd}    # e.g. from get_state_dict on the fresh model  # doctest: +SKIP
    >>> from lazyckpt.interop.dcp import StorageReader                                        # doctest: +SKIP
    >>> dcp.load(state, storage_reader=StorageReader(lazyckpt.latest("runs/ckpt")))          # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import io
import os
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from lazyckpt.errors import CheckpointFormatError, CheckpointMismatchError, CheckpointNotFoundError
from lazyckpt.format.files import MANIFEST
from lazyckpt.format.header import torch_dtype
from lazyckpt.read.reader import CheckpointReader
from lazyckpt.read.shard_files import ShardFiles
from lazyckpt.storage import FileKind, LocalStorage, Storage, kind_of
from lazyckpt.tree.paths import tensor_key

REFUSALS = (CheckpointFormatError, CheckpointNotFoundError, CheckpointMismatchError, OSError)
"""What the strict reader raises for a checkpoint it cannot read (or this reader cannot serve)."""


class RefusedMetadata(Metadata):
    """What :meth:`StorageReader.read_metadata` returns for a checkpoint it refuses: reading what it describes
    (``state_dict_metadata``, ``storage_data``) raises the refusal, so a direct caller never takes it for an empty
    checkpoint."""

    def __init__(self, refusal: BaseException) -> None:  # no Metadata.__init__: it would assign the fields
        self.refusal = refusal

    @property
    def state_dict_metadata(self) -> Any:
        raise self.refusal

    @property
    def storage_data(self) -> Any:
        raise self.refusal

    def __repr__(self) -> str:
        return f"RefusedMetadata({self.refusal!r})"


class StorageReader(dcp.StorageReader):
    """Serves a committed lazyckpt checkpoint to ``torch.distributed.checkpoint.load``.

    Args:
        path: a committed ``step-NNNNNNN`` directory holding every rank's files.
        verify: check the checksum of every chunk read (on by default).
        storage: where the files live (default: local files).
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True, storage: Storage | None = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.verify = verify
        self.storage = storage
        self._where: dict[tuple[str, tuple[int, ...]], Any] = {}
        self._refusal: BaseException | None = None
        self._reader: CheckpointReader | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._reader = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        if not isinstance(checkpoint_id, (str, os.PathLike)):
            return False
        return kind_of(LocalStorage(), os.path.join(os.fspath(checkpoint_id), MANIFEST)) is FileKind.FILE

    def read_metadata(self) -> Metadata:
        """Every global tensor with its blocks, and every plain value of rank 0's tree, under DCP's names. Each
        rank's manifest is checked against the global view here, before DCP's planner compares the targets with
        the shapes it describes (else a global view that lies about a shape gave DCP's own size-mismatch error).

        A checkpoint the strict reader refuses gives a :class:`RefusedMetadata` here, whose fields raise the
        refusal when read, and :meth:`set_up_storage_reader`, which DCP calls next, raises it: DCP turns an
        exception of ``read_metadata`` into an ``AssertionError`` that keeps only its text ("metadata is None;
        global metadata read failed: ...")."""
        self._refusal = None
        try:
            return self._describe()
        except REFUSALS as e:
            self._refusal = e
            return RefusedMetadata(e)

    def _describe(self) -> Metadata:
        reader = self._reader = CheckpointReader(self.path, self.storage)
        index = reader.top.get("tensors", {})
        outline = reader.outline(0)
        aliases = reader.aliases(0)  # a tied weight is described (and served) as the tensor it is stored as
        for rank in range(1, reader.world_size) if index else ():  # DCP plans with the global view's shapes:
            reader.open_rank(rank).close()  # each rank's manifest agrees with it first (FORMAT.md rule 20)
        flat, paths = flatten_state_dict(outline)
        described: dict[str, Any] = {}
        storage_data: dict[MetadataIndex, Any] = {}
        for fqn, value in flat.items():
            key = tensor_key(_saved_path(outline, paths[fqn]))
            key = aliases.get(key, key)
            if isinstance(value, torch.Tensor) and key in index:
                info = index[key]
                chunks = [ChunkStorageMetadata(torch.Size(b["offsets"]), torch.Size(b["lengths"])) for b in info["boxes"]]
                dtype = torch_dtype(info["dtype"], f"{reader.path}: tensor {key!r}")
                described[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(info["shape"]), chunks)
                for box in info["boxes"]:
                    storage_data[MetadataIndex(fqn, box["offsets"])] = (key, box["rank"], box["lengths"])
            elif not isinstance(value, torch.Tensor):
                described[fqn] = BytesStorageMetadata()
                refusal = _tensor_inside(value, fqn, reader.path)
                storage_data[MetadataIndex(fqn)] = ("value", value) if refusal is None else ("refused", refusal)
        return Metadata(state_dict_metadata=described, storage_data=storage_data)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._refusal is not None:
            raise self._refusal
        self._where = {(index.fqn, tuple(index.offset or ())): where for index, where in metadata.storage_data.items()}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy every requested block into the planner's targets, checksums of the bytes read verified."""
        reader = self._reader if self._reader is not None else CheckpointReader(self.path, self.storage)
        for item in plan.items:  # before any target is written
            where = self._where[item.storage_index.fqn, tuple(item.storage_index.offset or ())]
            if where[0] == "refused":
                raise where[1]
        with ShardFiles(reader, verify=self.verify) as files:  # the reader of read_metadata: its trees checked
            for item in plan.items:
                where = self._where[item.storage_index.fqn, tuple(item.storage_index.offset or ())]
                if item.type == LoadItemType.BYTE_IO:
                    buffer = io.BytesIO()
                    torch.save(where[1], buffer)
                    buffer.seek(0)
                    planner.load_bytes(item, buffer)
                    continue
                key, rank, _ = where
                stored = files.read_whole(rank, key)
                block = stored[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))]
                target = planner.resolve_tensor(item).detach()
                target.copy_(block)
                planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _tensor_inside(value: Any, fqn: str, where: str) -> CheckpointMismatchError | None:
    """DCP serves a value that is not a tensor (a tuple, a numpy array, a Namespace) as bytes of rank 0's outline,
    whose tensors are placeholders: a tensor inside it would come back as zeros. The refusal :meth:`read_data`
    raises when a target asks for such a value (``lazyckpt.load`` and ``load_into`` read them), else None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor) or (isinstance(item, np.ndarray) and item.dtype.kind in "biuf"):
            what = (f"is a {type(value).__name__}" if item is value
                    else f"holds a {type(item).__name__} inside a {type(value).__name__}")
            return CheckpointMismatchError(
                f"{where}: {fqn!r} {what}, which torch.distributed.checkpoint loads as one opaque value; this "
                "reader serves tensors only as leaves of dicts and lists: use lazyckpt.load or lazyckpt.load_into "
                "for this value")
        if isinstance(item, argparse.Namespace):  # a saved Namespace decodes as one (DCP: an opaque value)
            stack.extend(vars(item).values())
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
    return None


def _saved_path(state: Any, path: tuple) -> tuple:
    """The key path ``path`` of DCP's flattening stands for in ``state``: DCP names a dict key by its ``str()``, so
    ``"7"`` may stand for the int key ``7`` and ``"(1, 'x')"`` for a tuple key."""
    node, saved = state, []
    for part in path:
        if isinstance(node, dict) and part not in node:
            if isinstance(part, str) and part.lstrip("-").isdigit() and int(part) in node:
                part = int(part)
            else:
                part = next((k for k in node if str(k) == part), part)
        saved.append(part)
        node = node[part]
    return tuple(saved)
