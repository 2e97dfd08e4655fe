"""A real S3 API server (moto's server mode on a free local port) and remote URLs for each kind of remote level."""

from __future__ import annotations

import socket
import uuid

import pytest

from lazyckpt.storage.fsspec import FsspecStorage


class FlakyRemote(FsspecStorage):
    """The real remote, except that while ``fail`` is set an upload dies after the tensor file went up."""

    def __init__(self, url, options):
        super().__init__(url, options)
        self.fail = False

    def upload_file(self, local_path, path):
        if self.fail and path.endswith(".json"):
            raise ConnectionError(f"connection to the object store lost (injected) while writing {path}")
        super().upload_file(local_path, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_options(endpoint: str) -> dict:
    # Connection failures are not retried, so an unreachable endpoint fails at once.
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "eu-west-1"}, "config_kwargs": {"retries": {"max_attempts": 1}}}


_server_endpoint: list[str] = []


def shared_moto_endpoint() -> str:
    """The URL of one moto S3 server for the whole test session, started on first use (a daemon thread that
    ends with the process)."""
    if not _server_endpoint:
        from moto.server import ThreadedMotoServer

        port = free_port()
        ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False).start()
        _server_endpoint.append(f"http://127.0.0.1:{port}")
    return _server_endpoint[0]


def fresh_bucket(endpoint: str) -> tuple[str, dict]:
    """``(s3://new-bucket/run, storage_options)`` on the server at ``endpoint``; the bucket exists."""
    url, options = f"s3://lazyckpt-{uuid.uuid4().hex[:12]}/run", s3_options(endpoint)
    FsspecStorage(url, options).make_dir(url)
    return url, options


@pytest.fixture(scope="session")
def moto_endpoint():
    """The URL of a moto S3 server running for the whole test session."""
    return shared_moto_endpoint()


@pytest.fixture
def s3_remote(moto_endpoint):
    """A fresh bucket on the moto server: ``(url, storage_options)``."""
    return fresh_bucket(moto_endpoint)


@pytest.fixture(params=["s3", "file", "memory"])
def any_remote(request, tmp_path):
    """Each kind of remote level: S3 (moto server), a shared file system (file://), fsspec's memory store."""
    if request.param == "s3":
        return request.getfixturevalue("s3_remote")
    if request.param == "file":
        return f"file://{tmp_path}/shared/run", None
    return f"memory://lazyckpt-{uuid.uuid4().hex[:12]}/run", None
