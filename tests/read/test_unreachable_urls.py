"""A URL that cannot be reached, read through any public reading function or CLI command, is one
RemoteUnreachableError naming the argument, the URL and the storage options (secrets masked) — it was botocore's own
EndpointConnectionError (a traceback in the CLI) everywhere but export."""

from __future__ import annotations

import json

import pytest

import lazyckpt
from helpers.remote import free_port, s3_options
from lazyckpt.cli import main

RUN = "s3://bucket/run"
STEP = f"{RUN}/step-0000001"

READERS = {
    "latest": ("dirpath", RUN, lambda options: lazyckpt.latest(RUN, storage_options=options)),
    "checkpoint_step": ("path", STEP, lambda options: lazyckpt.checkpoint_step(STEP, storage_options=options)),
    "load": ("path", STEP, lambda options: lazyckpt.load(STEP, storage_options=options)),
    "load_into": ("path", STEP, lambda options: lazyckpt.load_into(STEP, {}, storage_options=options)),
    "verify": ("path", STEP, lambda options: lazyckpt.verify(STEP, storage_options=options)),
}


@pytest.fixture(scope="module")
def nowhere() -> dict:
    return s3_options(f"http://127.0.0.1:{free_port()}")  # nothing listens there


@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reading_function_names_the_unreachable_url(reader, nowhere):
    name, url, read = READERS[reader]
    with pytest.raises(lazyckpt.RemoteUnreachableError) as refused:
        read(nowhere)
    message = str(refused.value)
    assert f"{name}={url!r} is not reachable" in message and "EndpointConnectionError" in message, message
    assert "'secret': '***'" in message and "testing" not in message, "no credentials in a message"


def test_an_option_the_file_system_does_not_take_is_named_too():
    with pytest.raises(lazyckpt.RemoteUnreachableError, match=r"storage_options=\{'no_such_option': 1\}.*TypeError"):
        lazyckpt.load(STEP, storage_options={"no_such_option": 1})


@pytest.mark.parametrize("command", [["ls", RUN], ["show", STEP], ["verify", STEP]])
def test_every_cli_command_says_it_in_one_line_and_exits_1(command, nowhere, capsys):
    assert main([*command, "--storage-options", json.dumps(nowhere)]) == 1
    err = capsys.readouterr().err
    assert "is not reachable" in err and command[1] in err and "EndpointConnectionError" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_local_path_keeps_its_own_error(tmp_path):
    """Only URLs are translated: a missing local checkpoint still says it is not a checkpoint."""
    with pytest.raises(lazyckpt.CheckpointNotFoundError):
        lazyckpt.load(tmp_path / "step-0000001")
