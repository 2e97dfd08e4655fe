"""The storage seam (:class:`Storage`) and its local-file implementation (:class:`LocalStorage`)."""

from lazyckpt.storage.base import Buffer, FileInfo, FileKind, ReadHandle, Storage, StorageLock
from lazyckpt.storage.local import LocalStorage

__all__ = ["Buffer", "FileInfo", "FileKind", "LocalStorage", "ReadHandle", "Storage", "StorageLock"]
