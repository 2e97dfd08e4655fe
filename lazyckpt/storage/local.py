"""Local (or POSIX-mounted) files: the default :class:`~lazyckpt.storage.Storage`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import stat as stat_mod
from collections.abc import Sequence

from lazyckpt.storage._direct import CLOEXEC, DirectFile, fsync_dir, pwrite_all
from lazyckpt.storage.base import Buffer, FileInfo, FileKind

_TMP_SUFFIX = ".tmp"


class LocalStorage:
    """Local files: direct I/O (aligned buffers in place, the rest through two aligned bounce buffers, one written
    while the other fills), ``fsync``, cache drop, ``flock`` locks.

    Args:
        direct_io: write tensor files with ``O_DIRECT`` where the file system allows it. Measured here, a 296 MiB
            write + fsync took 0.4 s instead of 1.5 s and slowed a concurrent compute loop less, because the bytes
            skip the page cache and its write-back burst. File systems without ``O_DIRECT`` (tmpfs) fall back to
            buffered writes.
    """

    def __init__(self, *, direct_io: bool = True) -> None:
        self.direct_io = direct_io

    # --- tensor files ---------------------------------------------------------------------------------------

    def open_write(self, path: str) -> DirectFile:
        return DirectFile(path, direct_io=self.direct_io)

    def write(self, handle: DirectFile, offset: int, buffers: Sequence[Buffer]) -> None:
        handle.write(offset, [memoryview(b).cast("B") for b in buffers if len(b)])

    def close(self, handle: DirectFile, *, sync: bool) -> None:
        handle.close(sync=sync)

    # --- small files and the namespace ---------------------------------------------------------------------

    def write_atomic(self, path: str, data: bytes, *, sync: bool) -> None:
        # A fresh name, created exclusively and never through a link: a file or link planted where the temp file
        # goes (``out.tmp`` next to an export) is never written through.
        tmp = f"{path}.{secrets.token_hex(6)}{_TMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | CLOEXEC, 0o644)
        try:
            try:
                pwrite_all(fd, [memoryview(data)], 0)
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if sync:
            self.sync_dir(os.path.dirname(path))

    def make_dir(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rename(self, src: str, dst: str, *, sync: bool) -> None:
        os.rename(src, dst)
        if sync:
            self.sync_dir(os.path.dirname(dst))

    def remove_file(self, path: str) -> None:
        os.unlink(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def sync_dir(self, path: str) -> None:
        fsync_dir(path)

    def link(self, target: str, path: str) -> None:
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{_TMP_SUFFIX}")
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, path)

    def read_link(self, path: str) -> str:
        return os.readlink(path)

    def lock(self, path: str) -> _FileLock:
        return _FileLock(path)

    def free_bytes(self, path: str) -> int:
        return shutil.disk_usage(path).free

    # --- reading ------------------------------------------------------------------------------------------

    def stat(self, path: str) -> FileInfo | None:
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return FileInfo(kind=_kind(st.st_mode), size=st.st_size, mtime=st.st_mtime)

    def list_dir(self, path: str) -> list[str]:
        return os.listdir(path)

    def resolve(self, path: str) -> str:
        return os.path.realpath(path)

    def open_read(self, path: str) -> _ReadFile:
        return _ReadFile(path)

    def read_bytes(self, path: str, *, max_bytes: int) -> bytes:
        with _ReadFile(path) as f:
            if f.size > max_bytes:
                raise ValueError(f"{path} holds {f.size} bytes, more than the limit of {max_bytes}")
            data = bytearray(f.size)
            got = f.read_into(0, memoryview(data))
        return bytes(data[:got])


def _kind(mode: int) -> FileKind:
    if stat_mod.S_ISREG(mode):
        return FileKind.FILE
    if stat_mod.S_ISDIR(mode):
        return FileKind.DIR
    if stat_mod.S_ISLNK(mode):
        return FileKind.LINK
    return FileKind.OTHER


class _ReadFile:
    """A regular file opened for positional reads. ``O_NONBLOCK`` makes opening a FIFO return at once, and the
    ``fstat`` check then refuses it, so a hostile directory cannot hang the reader."""

    parallel_reads = True
    """``preadv`` keeps no file position: threads may read at once."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | CLOEXEC)
        st = os.fstat(self.fd)
        if not stat_mod.S_ISREG(st.st_mode):
            os.close(self.fd)
            raise OSError(f"{path} is not a regular file")
        self.size = st.st_size

    def read_into(self, offset: int, buffer: Buffer) -> int:
        view, total = memoryview(buffer).cast("B"), 0
        while total < len(view):
            got = os.preadv(self.fd, [view[total:]], offset + total)
            if got == 0:
                break
            total += got
        return total

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> _ReadFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _FileLock:
    """An exclusive ``flock`` on a file; the kernel drops it if the process dies."""

    def __init__(self, path: str) -> None:
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | CLOEXEC, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def process_identity(pid: int) -> str | None:
    """Who process ``pid`` is on this machine, beyond its number: the boot and the process's start time (Linux
    ``/proc``), so a number reused by a later process does not pass for the one that wrote it; None when it does
    not run, or where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
        return f"{boot.decode()}:{int(fields[19])}"  # field 22 of the whole line: start time since boot
    except (OSError, IndexError, ValueError):
        return None
