"""A storage whose reads report how many bytes they brought in, for a progress bar over work that reads through
the public reading functions (``lazyckpt export``); everything else passes through to the storage it wraps.

Example:
    >>> storage = MeteredReads(LocalStorage(), on_bytes=bar.advance)            # doctest: +SKIP
    >>> export(path, "model.ckpt", storage=storage)                             # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lazyckpt.storage.base import Buffer, ReadHandle, Storage


class MeteredReads:
    """``inner``, with ``on_bytes(n)`` called after every read of ``n`` bytes (on the reading thread, which may
    be one of the reader's workers: ``on_bytes`` must be thread-safe, as rich's ``Progress.advance`` is)."""

    def __init__(self, inner: Storage, on_bytes: Callable[[int], Any]) -> None:
        self.inner, self.on_bytes = inner, on_bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open_read(self, path: str) -> ReadHandle:
        return _MeteredHandle(self.inner.open_read(path), self.on_bytes)


class _MeteredHandle:
    def __init__(self, inner: ReadHandle, on_bytes: Callable[[int], Any]) -> None:
        self.inner, self.on_bytes, self.size = inner, on_bytes, inner.size

    def read_into(self, offset: int, buffer: Buffer) -> int:
        got = self.inner.read_into(offset, buffer)
        self.on_bytes(got)
        return got

    def close(self) -> None:
        self.inner.close()
