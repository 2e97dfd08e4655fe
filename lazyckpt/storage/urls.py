"""Telling URLs from local paths, so that ``s3://bucket/run`` never becomes a local folder named ``s3:``."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import tempfile
from typing import Any, Callable, Iterator, TypeVar

from lazyckpt.errors import RemoteUnreachableError
from lazyckpt.storage.base import Storage

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def is_url(path: object) -> bool:
    """True for ``scheme://...`` strings (``s3://``, ``gs://``, ``file://``, ``memory://``, ...)."""
    return isinstance(path, str) and _SCHEME.match(path) is not None


def check_url(name: str, url: object) -> str:
    """``url`` without a trailing slash, or a ``ValueError`` naming the argument and the fix."""
    if not is_url(url):
        raise ValueError(f"{name}={url!r} must be an fsspec URL such as 's3://bucket/run' or "
                         "'file:///shared/fs/run' (a scheme followed by '://')")
    stripped = url.rstrip("/")
    if stripped.endswith(":/") or stripped.endswith(":"):
        raise ValueError(f"{name}={url!r} names no bucket or directory; add one, e.g. 's3://bucket/run'")
    return stripped


_SECRET = re.compile(r"key|secret|token|password|credential|sas|signature", re.IGNORECASE)


def unreachable(name: str, url: str, storage_options: dict[str, Any] | None,
                error: BaseException) -> RemoteUnreachableError:
    """The error for a remote that could not be reached or read: ``name=url``, the storage options (secrets
    masked), what the file system said, and what to check."""
    shown = None if storage_options is None else {
        k: "***" if _SECRET.search(str(k)) and not isinstance(v, dict) else v for k, v in storage_options.items()}
    return RemoteUnreachableError(
        f"{name}={url!r} is not reachable with storage_options={shown!r}: {type(error).__name__}: {error}. Check the "
        "URL, the credentials and storage_options (for S3: endpoint_url, key, secret; an option the file system "
        "does not know is refused), and that the bucket or directory exists")


_OWN_ERRORS = (ValueError, OSError)
"""Errors that already say what is wrong, which pass :func:`reaching` as they are: bad arguments and lazyckpt's
format errors (ValueErrors), and the file system's own answers (a missing object, access denied; lazyckpt's
CheckpointNotFoundError and RemoteUnreachableError are OSErrors too)."""


@contextlib.contextmanager
def reaching(name: str, path: str | os.PathLike[str], storage_options: dict[str, Any] | None, *,
             storage: Storage | None = None) -> Iterator[None]:
    """Inside: when ``path`` is a URL read through a storage made from it and ``storage_options`` (no ``storage``
    given: a caller's own storage reports its own errors), a failure of the file system behind it (botocore's
    connection errors, an option the file system does not take) becomes :func:`unreachable`'s one error naming
    ``name=path``; local paths and lazyckpt's own errors are left as they are."""
    try:
        yield
    except Exception as e:
        if storage is not None or not is_url(os.fspath(path)) or isinstance(e, _OWN_ERRORS):
            raise
        raise unreachable(name, os.fspath(path), storage_options, e) from e


Reader = TypeVar("Reader", bound=Callable[..., Any])


def reads_url(name: str) -> Callable[[Reader], Reader]:
    """A reading function ``fn(path, ..., storage=None, storage_options=None)`` run under :func:`reaching`
    (``name``: what its first argument is called, for the message)."""
    def decorate(fn: Reader) -> Reader:
        @functools.wraps(fn)
        def read(path: Any, *args: Any, **kwargs: Any) -> Any:
            with reaching(name, path, kwargs.get("storage_options"), storage=kwargs.get("storage")):
                return fn(path, *args, **kwargs)
        return read  # type: ignore[return-value]
    return decorate


def options_for(path: object, storage_options: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run's fsspec ``storage_options`` when ``path`` is a URL; None for a local path (which takes none)."""
    return storage_options if is_url(path) else None


def join(url: str, *names: str) -> str:
    """``url/name/...`` (URLs always use ``/``, whatever the local separator)."""
    return "/".join([url.rstrip("/"), *names])


def default_spool_dir(url: str) -> str:
    """The private node-local directory used when ``dirpath`` is a URL: under the system temp directory (never
    the working directory), one per URL so ranks of one node share it and two runs do not."""
    digest = hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "lazyckpt-spool", digest)


DEFAULT_HOST_ROOT = "/dev/shm/lazyckpt"
"""Where ``keep_in_memory="host"`` keeps its copies when ``host_memory_dir`` is not given: the tmpfs every Linux
machine mounts, which outlives a process (not a reboot)."""


def host_dir(dirpath: str, root: str | os.PathLike[str] | None) -> str:
    """The host level's folder for the local ``dirpath`` under ``root`` (None: :data:`DEFAULT_HOST_ROOT`): one per
    directory, so the ranks of one node share it, a restarted job finds its predecessor's, and two runs never
    meet."""
    digest = hashlib.sha256(os.path.abspath(dirpath).encode("utf-8")).hexdigest()[:16]
    return os.path.join(host_root(root), digest)


def host_root(root: str | os.PathLike[str] | None) -> str:
    """The directory the host folders live under: ``root`` made absolute, or :data:`DEFAULT_HOST_ROOT`."""
    return os.path.abspath(os.fspath(root)) if root is not None else DEFAULT_HOST_ROOT


def storage_for(path: str | os.PathLike[str], storage: Storage | None,
                storage_options: dict[str, Any] | None) -> tuple[str, Storage | None]:
    """``(path, storage)`` to read ``path`` through: the caller's ``storage`` when given (it receives the path as
    it is, URL or not), else an fsspec storage for a URL, else ``None`` (local files)."""
    if storage is None and is_url(path):
        from lazyckpt.storage.fsspec import FsspecStorage

        url = check_url("path", path)
        return url, FsspecStorage(url, storage_options)
    if storage_options is not None:
        raise ValueError(f"storage_options={storage_options!r} applies to URLs read through fsspec, and {path!r} is "
                         "not one (or storage= was given); drop storage_options or pass an fsspec URL")
    return os.fspath(path), storage
