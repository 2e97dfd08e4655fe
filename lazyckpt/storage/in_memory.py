"""An in-memory :class:`~lazyckpt.storage.Storage`: a directory tree of byte arrays behind one lock.

It proves the seam is closed (a checkpointer on it touches no file) and makes fault injection cheap. Its
semantics follow :class:`~lazyckpt.storage.LocalStorage` on POSIX: links are followed in every component but the
last one of ``stat``/``read_link``/``remove_file``; a lock is exclusive within the process and creates its file.

Example:
    >>> from lazyckpt.storage.in_memory import MemoryStorage
    >>> storage = MemoryStorage()
    >>> storage.make_dir("/runs/a")
    >>> storage.write_atomic("/runs/a/x.json", b"{}", sync=True)
    >>> sorted(storage.list_dir("/runs/a")), storage.read_bytes("/runs/a/x.json", max_bytes=10)
    (['x.json'], b'{}')
"""

from __future__ import annotations

import errno
import posixpath
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from lazyckpt.storage.base import Buffer, FileInfo, FileKind

_MAX_LINK_HOPS = 40
"""Like Linux: more links than this on one path is a loop (``ELOOP``)."""


@dataclass(eq=False)
class _File:
    data: bytearray = field(default_factory=bytearray)
    mtime: float = field(default_factory=time.time)


@dataclass(eq=False)
class _Dir:
    entries: dict[str, _Node] = field(default_factory=dict)
    mtime: float = field(default_factory=time.time)


@dataclass(eq=False)
class _Link:
    target: str
    mtime: float = field(default_factory=time.time)


_Node = _File | _Dir | _Link


class _WriteHandle:
    def __init__(self, node: _File, path: str) -> None:
        self.node, self.path, self.closed = node, path, False


class MemoryStorage:
    """Files, directories, links and locks kept in this process's memory; thread-safe.

    Args:
        capacity_bytes: what :meth:`free_bytes` counts down from (file bytes stored); None means 1 EiB.
    """

    def __init__(self, *, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes if capacity_bytes is not None else 1 << 60
        self._root = _Dir()
        self._mutex = threading.RLock()
        self._locks: set[str] = set()

    # --- tensor files ---------------------------------------------------------------------------------------

    def open_write(self, path: str) -> _WriteHandle:
        with self._mutex:
            node = _File()
            self._put(path, node, replace_file=True)
            return _WriteHandle(node, path)

    def write(self, handle: _WriteHandle, offset: int, buffers: Sequence[Buffer]) -> None:
        with self._mutex:
            if handle.closed:
                raise ValueError(f"{handle.path} is closed")
            data = handle.node.data
            for buf in buffers:
                raw = memoryview(buf).cast("B")
                if len(data) < offset:
                    data.extend(bytes(offset - len(data)))
                data[offset : offset + len(raw)] = raw
                offset += len(raw)
            handle.node.mtime = time.time()

    def close(self, handle: _WriteHandle, *, sync: bool) -> None:
        handle.closed = True

    # --- small files and the namespace ---------------------------------------------------------------------

    def write_atomic(self, path: str, data: bytes, *, sync: bool) -> None:
        with self._mutex:
            self._put(path, _File(bytearray(data)), replace_file=True)

    def make_dir(self, path: str) -> None:
        with self._mutex:
            node, parts = self._root, _parts(path)
            for i, name in enumerate(parts):
                child = node.entries.get(name)
                if isinstance(child, _Link):
                    child = self._lookup(posixpath.join("/", *parts[: i + 1]), follow_last=True)
                if child is None:
                    child = node.entries[name] = _Dir()
                elif not isinstance(child, _Dir):
                    raise FileExistsError(errno.EEXIST, "File exists", posixpath.join("/", *parts[: i + 1]))
                node = child

    def rename(self, src: str, dst: str, *, sync: bool) -> None:
        with self._mutex:
            src_dir, src_name = self._parent(src)
            moving = src_dir.entries.get(src_name)
            if moving is None:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", src)
            dst_dir, dst_name = self._parent(dst)
            there = dst_dir.entries.get(dst_name)
            if there is moving:
                return
            if isinstance(moving, _Dir) and _contains(moving, dst_dir):
                raise OSError(errno.EINVAL, "Invalid argument: a directory cannot move into itself", dst)
            _check_replace(moving, there, dst)
            del src_dir.entries[src_name]
            dst_dir.entries[dst_name] = moving

    def remove_file(self, path: str) -> None:
        with self._mutex:
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if node is None:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
            if isinstance(node, _Dir):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
            del parent.entries[name]

    def remove_tree(self, path: str) -> None:
        with self._mutex:
            try:
                parent, name = self._parent(path)
            except OSError:
                return
            if isinstance(parent.entries.get(name), _Dir):
                del parent.entries[name]

    def sync_dir(self, path: str) -> None:
        with self._mutex:
            self._dir(path)

    def link(self, target: str, path: str) -> None:
        with self._mutex:
            self._put(path, _Link(target), replace_file=True)

    def read_link(self, path: str) -> str:
        with self._mutex:
            node = self._lookup(path, follow_last=False)
            if node is None:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
            if not isinstance(node, _Link):
                raise OSError(errno.EINVAL, "Invalid argument: not a link", path)
            return node.target

    def lock(self, path: str) -> _MemoryLock:
        with self._mutex:
            key = self.resolve(path)
            if key in self._locks:
                raise BlockingIOError(errno.EWOULDBLOCK, "Resource temporarily unavailable", path)
            if self._lookup(path, follow_last=True) is None:
                self._put(path, _File(), replace_file=False)
            self._locks.add(key)
            return _MemoryLock(self, key)

    def free_bytes(self, path: str) -> int:
        with self._mutex:
            if self._lookup(path, follow_last=True) is None:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
            return max(0, self.capacity_bytes - _used(self._root))

    # --- reading ------------------------------------------------------------------------------------------

    def stat(self, path: str) -> FileInfo | None:
        with self._mutex:
            try:
                node = self._lookup(path, follow_last=False)
            except OSError:
                return None
            if node is None:
                return None
            if isinstance(node, _File):
                return FileInfo(kind=FileKind.FILE, size=len(node.data), mtime=node.mtime)
            if isinstance(node, _Dir):
                return FileInfo(kind=FileKind.DIR, size=0, mtime=node.mtime)
            return FileInfo(kind=FileKind.LINK, size=len(node.target), mtime=node.mtime)

    def list_dir(self, path: str) -> list[str]:
        with self._mutex:
            return list(self._dir(path).entries)

    def resolve(self, path: str) -> str:
        with self._mutex:
            return self._resolve(path, hops=0)

    def open_read(self, path: str) -> _ReadHandle:
        with self._mutex:
            return _ReadHandle(self._file(path))

    def read_bytes(self, path: str, *, max_bytes: int) -> bytes:
        with self._mutex:
            node = self._file(path)
            if len(node.data) > max_bytes:
                raise ValueError(f"{path} holds {len(node.data)} bytes, more than the limit of {max_bytes}")
            return bytes(node.data)

    # --- the tree -----------------------------------------------------------------------------------------

    def _resolve(self, path: str, hops: int) -> str:
        """The path with every link followed; missing components are kept as they are (like ``realpath``)."""
        done = "/"
        parts = _parts(path)
        for i, name in enumerate(parts):
            node = self._lookup(posixpath.join(done, name), follow_last=False, hops=hops)
            here = posixpath.join(done, name)
            if isinstance(node, _Link):
                hops += 1
                if hops > _MAX_LINK_HOPS:
                    raise OSError(errno.ELOOP, "Too many levels of symbolic links", path)
                here = self._resolve(posixpath.join(done, node.target), hops)
            done = here
            if node is None:
                return posixpath.join(done, *parts[i + 1 :])
        return done

    def _lookup(self, path: str, *, follow_last: bool, hops: int = 0) -> _Node | None:
        """The node at ``path`` (None when missing); raises NotADirectoryError when a component is a file."""
        node: _Node = self._root
        parts = _parts(path)
        for i, name in enumerate(parts):
            if not isinstance(node, _Dir):
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
            child = node.entries.get(name)
            if child is None:
                return None
            if isinstance(child, _Link) and (follow_last or i < len(parts) - 1):
                if hops >= _MAX_LINK_HOPS:
                    raise OSError(errno.ELOOP, "Too many levels of symbolic links", path)
                base = posixpath.join("/", *parts[:i])
                child = self._lookup(posixpath.join(base, child.target), follow_last=True, hops=hops + 1)
                if child is None:
                    return None
            node = child
        return node

    def _parent(self, path: str) -> tuple[_Dir, str]:
        parts = _parts(path)
        if not parts:
            raise OSError(errno.EBUSY, "The root cannot be replaced or removed", path)
        parent = self._lookup(posixpath.join("/", *parts[:-1]), follow_last=True)
        if parent is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if not isinstance(parent, _Dir):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        return parent, parts[-1]

    def _dir(self, path: str) -> _Dir:
        node = self._lookup(path, follow_last=True)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if not isinstance(node, _Dir):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        return node

    def _file(self, path: str) -> _File:
        node = self._lookup(path, follow_last=True)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if isinstance(node, _Dir):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        return node

    def _put(self, path: str, node: _Node, *, replace_file: bool) -> None:
        parent, name = self._parent(path)
        there = parent.entries.get(name)
        if isinstance(there, _Dir):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        if there is not None and not replace_file:
            raise FileExistsError(errno.EEXIST, "File exists", path)
        parent.entries[name] = node


class _ReadHandle:
    def __init__(self, node: _File) -> None:
        self._node = node
        self.size = len(node.data)

    def read_into(self, offset: int, buffer: Buffer) -> int:
        view = memoryview(buffer).cast("B")
        chunk = self._node.data[offset : offset + len(view)]
        view[: len(chunk)] = chunk
        return len(chunk)

    def close(self) -> None:
        pass

    def __enter__(self) -> _ReadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _MemoryLock:
    def __init__(self, storage: MemoryStorage, key: str) -> None:
        self._storage, self._key = storage, key

    def release(self) -> None:
        with self._storage._mutex:
            self._storage._locks.discard(self._key)


def _parts(path: str) -> list[str]:
    return [p for p in posixpath.normpath(posixpath.join("/", path)).split("/") if p]


def _contains(tree: _Dir, node: _Dir) -> bool:
    return tree is node or any(isinstance(c, _Dir) and _contains(c, node) for c in tree.entries.values())


def _check_replace(moving: _Node, there: _Node | None, dst: str) -> None:
    """What ``rename(2)`` refuses when ``dst`` exists."""
    if there is None:
        return
    if isinstance(there, _Dir) and not isinstance(moving, _Dir):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", dst)
    if isinstance(moving, _Dir) and not isinstance(there, _Dir):
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", dst)
    if isinstance(there, _Dir) and there.entries:
        raise OSError(errno.ENOTEMPTY, "Directory not empty", dst)


def _used(node: _Node) -> int:
    if isinstance(node, _File):
        return len(node.data)
    if isinstance(node, _Dir):
        return sum(_used(c) for c in node.entries.values())
    return 0
