"""The storage seam: the one place lazyckpt touches files or objects.

| module | owns |
|---|---|
| ``base`` | the :class:`Storage` Protocol every backend implements (reads, writes, listings, stat, rename, removal, links, locks), :func:`kind_of`, :func:`wait_for_lock`, ``PAGE_BYTES`` |
| ``local`` | :class:`LocalStorage`: local files with direct I/O, fsync and ``flock`` locks |
| ``_direct`` | the ``O_DIRECT`` tensor file writer behind ``LocalStorage`` (aligned buffers in place, two bounce buffers) |
| ``fsspec`` | :class:`~lazyckpt.storage.fsspec.FsspecStorage`: object stores and other fsspec file systems, by URL |
| ``in_memory`` | :class:`~lazyckpt.storage.in_memory.MemoryStorage`: a file system in memory, for tests and fault injection |
| ``metered`` | :class:`~lazyckpt.storage.metered.MeteredReads`: a storage whose reads report their bytes (export's progress bar) |
| ``urls`` | telling URLs from paths, and the storage to read a path or URL through |
"""

from lazyckpt.storage.base import (PAGE_BYTES, Buffer, FileInfo, FileKind, ReadHandle, Storage, StorageLock, kind_of,
                                   wait_for_lock)
from lazyckpt.storage.local import LocalStorage

__all__ = ["PAGE_BYTES", "Buffer", "FileInfo", "FileKind", "LocalStorage", "ReadHandle", "Storage", "StorageLock",
           "kind_of", "wait_for_lock"]
