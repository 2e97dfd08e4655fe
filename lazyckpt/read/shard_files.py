"""The rank files of one checkpoint, with verified reads of byte ranges of its tensors: how a reader assembles a
global tensor (or the part of it a target needs) from the boxes every rank's file holds.

``manifest.json`` says, for every global tensor, which rank's file holds which box. For each box a target meets,
only the byte range from its first to its last needed element is read (widened to whole checksum chunks so that
what is read is verified), and the block is copied out of it in place. Files are opened through
:class:`~lazyckpt.read.reader.CheckpointReader`, so every manifest and header check of ``load`` applies here too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from lazyckpt.errors import CheckpointFormatError, CheckpointMismatchError
from lazyckpt.format.checksum import CHUNK_BYTES
from lazyckpt.format.header import torch_dtype
from lazyckpt.read.reader import CheckpointReader, RankFile
from lazyckpt.read.tensor_io import check_chunks, read_exact


class ShardFiles:
    """The rank files of one checkpoint, opened on first use, with verified reads of byte ranges of a tensor.

    Use as a context manager (closes the files).
    """

    def __init__(self, reader: CheckpointReader, *, verify: bool) -> None:
        self.reader = reader
        self.index: dict[str, Any] = reader.top.get("tensors", {})
        """The global view (empty before format version 3: every tensor belonged to its rank)."""
        self.verify = verify
        self._open: dict[int, RankFile] = {}

    def __enter__(self) -> ShardFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for opened in self._open.values():
            opened.close()
        self._open.clear()

    def rank(self, rank: int) -> RankFile:
        if rank not in self._open:
            self._open[rank] = self.reader.open_rank(rank)
        return self._open[rank]

    def read(self, rank: int, key: str, start: int, end: int) -> np.ndarray:
        """Bytes ``[start, end)`` of tensor ``key`` in ``rank``'s file, the chunks they touch verified."""
        opened = self.rank(rank)
        info = opened.doc["tensors"].get(key)
        if info is None:
            raise CheckpointFormatError(f"{opened.manifest}: the global view places tensor {key!r} in this rank's "
                                        "file, which does not hold it")
        t_start, t_end = info["offsets"]
        lo, hi = start, end
        if self.verify:
            lo, hi = start // CHUNK_BYTES * CHUNK_BYTES, min(-(-end // CHUNK_BYTES) * CHUNK_BYTES, t_end - t_start)
        buffer = np.empty(hi - lo, dtype=np.uint8)
        read_exact(opened.handle, opened.data_start + t_start + lo, buffer, opened.file, f"tensor {key!r}")
        if self.verify:
            check_chunks(buffer, lo, info["checksums"][lo // CHUNK_BYTES :], opened.file, key)
        return buffer[start - lo : end - lo]

    def read_whole(self, rank: int, key: str) -> torch.Tensor:
        """A whole stored tensor of ``rank``'s file, in its own memory."""
        opened = self.rank(rank)
        info = opened.doc["tensors"].get(key)
        if info is None:
            raise CheckpointFormatError(f"{opened.manifest}: the tree refers to tensor {key!r}, which neither this "
                                        "rank's file nor the global view holds")
        data = self.read(rank, key, 0, info["offsets"][1] - info["offsets"][0])
        dtype = torch_dtype(info["dtype"], f"{self.rank(rank).manifest}: tensor {key!r}")
        return torch.from_numpy(data.copy()).view(dtype).reshape(info["shape"])

    def fill(self, key: str, target: torch.Tensor, offsets: tuple[int, ...]) -> None:
        """Copy into ``target`` (the block at ``offsets`` of global tensor ``key``) every stored part it meets."""
        info = self.index[key]
        dtype = torch_dtype(info["dtype"], f"{self.reader.path}: tensor {key!r}")
        if target.dtype != dtype:
            raise CheckpointMismatchError(f"tensor {key!r} is {dtype} in {self.reader.path}, the target is "
                                          f"{target.dtype}")
        for box in info["boxes"]:
            lo = [max(a, b) for a, b in zip(offsets, box["offsets"])]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, target.shape, box["offsets"], box["lengths"])]
            if any(h <= low for low, h in zip(lo, hi)) or target.numel() == 0:
                continue
            strides = _contiguous_strides(box["lengths"])
            first = sum((low - o) * s for low, o, s in zip(lo, box["offsets"], strides))
            last = sum((h - 1 - o) * s for h, o, s in zip(hi, box["offsets"], strides))
            raw = self.read(box["rank"], key, first * target.element_size(), (last + 1) * target.element_size())
            flat = torch.from_numpy(raw).view(dtype)
            block = flat.as_strided([h - low for low, h in zip(lo, hi)], strides) if target.dim() else flat.reshape(())
            region = target[tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets))]
            with torch.no_grad():
                region.copy_(block)

    def consolidate(self, keys: Iterable[str], device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Full tensors of the global view, assembled from every box."""
        out = {}
        for key in keys:
            info = self.index[key]
            dtype = torch_dtype(info["dtype"], f"{self.reader.path}: {key!r}")
            try:
                full = torch.empty(info["shape"], dtype=dtype)
            except (RuntimeError, MemoryError) as e:  # e.g. a huge global shape
                raise MemoryError(f"{self.reader.path}: cannot allocate global tensor {key!r} {info['shape']}: "
                                  f"{e}") from None
            self.fill(key, full, (0,) * full.dim())
            out[key] = full if device is None else full.to(device)
        return out


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]
