"""A :class:`~lazyckpt.storage.Storage` over fsspec: object stores (``s3://``, ``gs://``), ``file://``, ``memory://``.

Paths are full URLs. fsspec and the backend (s3fs, gcsfs, ...) are imported only when such a storage is built.

Example:
    >>> storage = FsspecStorage("memory://doc")
    >>> storage.write_atomic("memory://doc/run/x.json", b"{}", sync=True)
    >>> storage.list_dir("memory://doc/run"), storage.read_bytes("memory://doc/run/x.json", max_bytes=10)
    (['x.json'], b'{}')
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

from lazyckpt.storage._direct import fsync_dir, fsync_path, pwrite_all
from lazyckpt.storage.base import Buffer, FileInfo, FileKind

PART_BYTES = 64 << 20
"""Size of one multipart piece (S3 needs at least 5 MiB per part; larger parts mean fewer requests: measured
against a local S3 server, 32 MiB parts reached 0.92x the throughput of a plain s3fs ``put_file``, 64 MiB 1.0x)."""
MAX_CONCURRENCY = 4
"""Parts of one file in flight at once: an upload holds at most ``PART_BYTES * MAX_CONCURRENCY`` bytes in memory."""

_held_locks: set[str] = set()
_held_locks_guard = threading.Lock()


def import_fsspec() -> Any:
    try:
        import fsspec
    except ImportError as e:
        raise ImportError("lazyckpt needs fsspec for URLs (and s3fs for s3://): pip install 'lazyckpt[remote]'") from e
    return fsspec


class FsspecStorage:
    """Every operation of the storage seam through one fsspec file system.

    Object stores have no rename, links or directory sync: a single ``PUT`` is atomic, so :meth:`write_atomic`
    is one ``pipe``, and a checkpoint is committed by writing its ``manifest.json`` last. A tensor file written
    through :meth:`open_write` (pieces in any order) is spooled to a local temporary file and sent as one
    multipart upload by :meth:`close`. Listings and ``stat`` bypass fsspec's listing cache, so another process's
    commit is seen at once. There are no symbolic links (:attr:`has_links` is False), and :meth:`lock` is
    exclusive within this process only. On S3 an empty directory is an empty ``prefix/`` marker object.

    Args:
        url: any URL of the file system (only its scheme and options matter).
        storage_options: passed to fsspec (for s3fs e.g. ``endpoint_url``, ``key``, ``secret``).
    """

    has_links = False

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        fsspec = import_fsspec()
        self.fs, _ = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.protocol = url.split("://", 1)[0]
        self._is_s3 = self.protocol in ("s3", "s3a")
        self._local_files = self.protocol in ("file", "local")
        """``file://``: this machine's files (a shared mount, or the host level's ``dirpath``), synced like
        :class:`~lazyckpt.storage.LocalStorage`'s."""

    def _path(self, url: str) -> str:
        return self.fs._strip_protocol(url)

    # --- tensor files ---------------------------------------------------------------------------------------

    def open_write(self, path: str) -> _SpooledObject:
        return _SpooledObject(path)

    def write(self, handle: _SpooledObject, offset: int, buffers: Sequence[Buffer]) -> None:
        pwrite_all(handle.fd, [memoryview(b).cast("B") for b in buffers if len(b)], offset)

    def close(self, handle: _SpooledObject, *, sync: bool) -> None:
        try:
            self.upload_file(handle.spool, handle.path)  # durable once the multipart upload completes
        finally:
            handle.discard()

    # --- bulk transfers (uploads and fetches) ---------------------------------------------------------------------

    def upload_file(self, local_path: str, path: str) -> None:
        """Stream a local file to ``path`` in multipart pieces, never holding the whole file in memory."""
        kwargs = {"chunksize": PART_BYTES, "max_concurrency": MAX_CONCURRENCY} if self._is_s3 else {}
        self._make_parent(path)
        if not self._local_files:
            self.fs.put_file(local_path, self._path(path), **kwargs)
            return
        # A file system, not an object store: whole or absent (a torn commit object must not read as a commit),
        # and durable only once synced, its directory entry too.
        tmp = f"{self._path(path)}.{secrets.token_hex(6)}.tmp"
        self.fs.put_file(local_path, tmp)
        fsync_path(tmp)
        self.fs.mv(tmp, self._path(path))
        fsync_dir(self.fs._parent(self._path(path)))

    def download_file(self, path: str, local_path: str) -> None:
        """Stream the object ``path`` into the local file ``local_path``, durable when this returns (a fetched
        checkpoint is committed locally by a rename: its files must be on disk before it)."""
        self.fs.get_file(self._path(path), local_path)
        fsync_path(local_path)

    def _make_parent(self, path: str) -> None:
        if self.protocol in ("file", "local", "memory"):  # object stores have no directories to create
            self.fs.makedirs(self.fs._parent(self._path(path)), exist_ok=True)

    # --- small files and the namespace ---------------------------------------------------------------------

    def write_atomic(self, path: str, data: bytes, *, sync: bool) -> None:
        self._make_parent(path)
        if self.protocol == "file":  # a shared file system: readers could see a half-written file, so rename
            tmp = f"{self._path(path)}.{secrets.token_hex(6)}.tmp"  # a fresh name: nothing planted is written through
            self.fs.pipe_file(tmp, data)
            if sync:
                fsync_path(tmp)
            self.fs.mv(tmp, self._path(path))
            if sync:
                fsync_dir(self.fs._parent(self._path(path)))
        else:  # one PUT: readers see all of the object or none of it
            self.fs.pipe_file(self._path(path), data)

    def make_dir(self, path: str) -> None:
        info = self.stat(path)
        if info is not None and info.kind is not FileKind.DIR:
            raise FileExistsError(errno.EEXIST, "File exists", path)
        if self._is_s3:
            if info is None:
                self._put_directory_marker(path)
        else:
            self.fs.makedirs(self._path(path), exist_ok=True)

    def _put_directory_marker(self, path: str) -> None:
        """S3 has no directories, only key prefixes: an empty object named ``prefix/`` makes an empty directory
        exist (as the S3 console does), so ``stat``, ``list_dir`` and ``sync_dir`` see it."""
        bucket, _, key = self._path(path).partition("/")
        self.fs.makedirs(bucket, exist_ok=True)  # creates the bucket when missing
        if key:
            self.fs.call_s3("put_object", Bucket=bucket, Key=key.rstrip("/") + "/", Body=b"")

    def rename(self, src: str, dst: str, *, sync: bool) -> None:
        """A copy and a delete on object stores: not atomic there (the remote level never renames)."""
        moving = self.stat(src)
        if moving is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", src)
        there = self.stat(dst)
        if there is not None and there.kind is FileKind.DIR:
            if self.list_dir(dst):
                raise OSError(errno.ENOTEMPTY, "Directory not empty", dst)
            self.fs.rm(self._path(dst), recursive=True)  # rename(2) replaces an empty directory
        if self._is_s3 and moving.kind is FileKind.DIR:
            self._move_prefix(src, dst)
        else:
            self.fs.mv(self._path(src), self._path(dst), recursive=moving.kind is FileKind.DIR)
        self.fs.invalidate_cache()

    def _move_prefix(self, src: str, dst: str) -> None:
        """Copy every object below ``src`` (directory markers included) to ``dst``, then delete them."""
        bucket, _, old = self._path(src).rstrip("/").partition("/")
        new = self._path(dst).rstrip("/").partition("/")[2]
        listing = {"Bucket": bucket, "Prefix": old + "/"}
        while True:
            page = self.fs.call_s3("list_objects_v2", **listing)
            for item in page.get("Contents", []):
                self.fs.call_s3("copy_object", Bucket=bucket, Key=new + item["Key"][len(old):],
                                CopySource={"Bucket": bucket, "Key": item["Key"]})
            if not page.get("IsTruncated"):
                break
            listing["ContinuationToken"] = page["NextContinuationToken"]
        self.remove_tree(src)

    def remove_file(self, path: str) -> None:
        info = self.stat(path)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if info.kind is FileKind.DIR:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        self.fs.rm_file(self._path(path))

    def remove_tree(self, path: str) -> None:
        try:
            self.fs.rm(self._path(path), recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache()

    def sync_dir(self, path: str) -> None:
        """Only checks ``path``: an object (or a ``file://`` entry written through fsspec) is visible once written."""
        info = self.stat(path)
        if info is None or info.kind is not FileKind.DIR:
            raise FileNotFoundError(errno.ENOENT, "No such directory", path)

    def link(self, target: str, path: str) -> None:
        raise OSError(errno.ENOTSUP, f"{self.protocol}:// storage has no symbolic links", path)

    def read_link(self, path: str) -> str:
        raise OSError(errno.EINVAL, f"{self.protocol}:// storage has no symbolic links", path)

    def lock(self, path: str) -> _ProcessLock:
        """Object stores have no locks: this one is exclusive within this process only."""
        return _ProcessLock(path)

    def free_bytes(self, path: str) -> int:
        if self.protocol == "file":
            return shutil.disk_usage(self._path(path)).free
        return sys.maxsize  # object stores report no free space; a quota shows up as a failed write

    # --- reading ------------------------------------------------------------------------------------------

    def stat(self, path: str) -> FileInfo | None:
        self.fs.invalidate_cache()
        try:
            info = self.fs.info(self._path(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        kind = {"file": FileKind.FILE, "directory": FileKind.DIR}.get(info.get("type"), FileKind.OTHER)
        if info.get("islink"):
            kind = FileKind.LINK
        return FileInfo(kind=kind, size=int(info.get("size") or 0), mtime=_mtime(info))

    def list_dir(self, path: str) -> list[str]:
        self.fs.invalidate_cache()
        base = self._path(path).rstrip("/")
        entries = self.fs.ls(base, detail=True)
        if len(entries) == 1 and entries[0]["name"] == base and entries[0]["type"] == "file":  # "x/": a marker
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["name"].rstrip("/") != base]

    def list_tree(self, path: str, *, depth: int) -> dict[str, FileKind]:
        """What lies below ``path`` down to ``depth`` levels, by relative name (``step-0000040/manifest.json``); an
        entry deeper down makes its ancestors directories. On an object store this is one recursive listing (one
        request per 1,000 objects; s3fs's ``maxdepth`` would list each directory on its own), elsewhere a walk.
        A missing ``path`` holds nothing."""
        self.fs.invalidate_cache()
        base = self._path(path).rstrip("/")
        entries = self.fs.find(base, maxdepth=None if self._is_s3 else depth, withdirs=True, detail=True)
        found: dict[str, FileKind] = {}
        for name, info in entries.items():
            parts = name.removeprefix(base + "/").split("/") if name.startswith(base + "/") else [""]
            marker = parts[-1] == ""  # "x/": an S3 directory marker, or the listed path itself
            parts = parts[:-1] if marker else parts
            for above in range(1, min(len(parts), depth + 1)):
                found["/".join(parts[:above])] = FileKind.DIR
            if not parts or len(parts) > depth:
                continue
            kind = {"file": FileKind.FILE, "directory": FileKind.DIR}.get(info.get("type"), FileKind.OTHER)
            kind = FileKind.DIR if marker else FileKind.LINK if info.get("islink") else kind
            if found.get("/".join(parts)) is not FileKind.DIR:
                found["/".join(parts)] = kind
        return found

    def resolve(self, path: str) -> str:
        return path

    def _file_info(self, path: str) -> FileInfo:
        """``stat`` of a plain file or object; raises as opening a missing file or a directory would."""
        info = self.stat(path)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or object", path)
        if info.kind is not FileKind.FILE:
            raise IsADirectoryError(errno.EISDIR, "Not a regular file or object", path)
        return info

    def open_read(self, path: str) -> _ReadObject:
        self._file_info(path)
        return _ReadObject(self.fs.open(self._path(path), "rb", block_size=PART_BYTES))

    def read_bytes(self, path: str, *, max_bytes: int) -> bytes:
        info = self._file_info(path)
        if info.size > max_bytes:
            raise ValueError(f"{path} holds {info.size} bytes, more than the limit of {max_bytes}")
        return bytes(self.fs.cat_file(self._path(path)))


def _mtime(info: dict[str, Any]) -> float:
    value = info.get("mtime", info.get("LastModified", info.get("created", 0.0)))
    return value.timestamp() if hasattr(value, "timestamp") else float(value or 0.0)


class _SpooledObject:
    """A tensor file on its way to an object store: written at any offsets into a local temporary file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd, self.spool = tempfile.mkstemp(prefix="lazyckpt-object-")

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            os.unlink(self.spool)
            self.fd = -1


class _ReadObject:
    """Positional reads of one object (ranged GETs, read ahead by ``PART_BYTES``)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.size = int(handle.size)

    def read_into(self, offset: int, buffer: Buffer) -> int:
        self._handle.seek(offset)
        return self._handle.readinto(memoryview(buffer).cast("B"))

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> _ReadObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ProcessLock:
    def __init__(self, path: str) -> None:
        with _held_locks_guard:
            if path in _held_locks:
                raise BlockingIOError(errno.EWOULDBLOCK, "Resource temporarily unavailable (held in this process)",
                                      path)
            _held_locks.add(path)
        self._path: str | None = path

    def release(self) -> None:
        with _held_locks_guard:
            if self._path is not None:
                _held_locks.discard(self._path)
                self._path = None
