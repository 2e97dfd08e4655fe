"""The remote level through the integrations: resume on a fresh node whose local directory is empty."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers.remote import moto_endpoint, s3_remote  # noqa: F401 - fixtures
from conftest import assert_tree_equal
from test_accelerate_hook import (STEPS_PER_EPOCH, build, final_state, fresh_accelerate_state,  # noqa: F401
                                  reset_accelerate, train)

import lazyckpt
from lazyckpt import LazyCheckpointHook


def test_accelerate_resumes_from_the_remote_when_the_local_directory_is_empty(tmp_path, s3_remote):
    url, options = s3_remote
    reference = build()
    train(reference, range(2))
    expected = final_state(reference)
    reset_accelerate()

    first = build()
    hook = LazyCheckpointHook(tmp_path / "node-a", every_n_steps=STEPS_PER_EPOCH, remote=url,
                              storage_options=options).register(first[0])
    train(first, range(1))
    hook.close()
    shutil.rmtree(tmp_path / "node-a")
    reset_accelerate()

    second = build()
    hook = LazyCheckpointHook(tmp_path / "node-b", every_n_steps=STEPS_PER_EPOCH, remote=url,
                              storage_options=options).register(second[0])
    assert hook.resume() == STEPS_PER_EPOCH
    train(second, range(1, 2))
    hook.close()
    assert_tree_equal(final_state(second), expected)


def test_accelerate_with_a_url_dirpath_resumes_from_it(tmp_path, s3_remote):
    url, options = s3_remote
    first = build()
    hook = LazyCheckpointHook(url, every_n_steps=STEPS_PER_EPOCH, spool_dir=str(tmp_path / "spool-a"),
                              storage_options=options).register(first[0])
    train(first, range(1))
    hook.close()
    expected = final_state(first)
    reset_accelerate()
    second = build()
    hook = LazyCheckpointHook(url, every_n_steps=STEPS_PER_EPOCH, spool_dir=str(tmp_path / "spool-b"),
                              storage_options=options).register(second[0])
    assert hook.resume() == STEPS_PER_EPOCH
    hook.close()
    assert_tree_equal(final_state(second)["model"], expected["model"])



def test_lightning_resumes_last_from_the_remote_on_an_empty_node_bit_exact(tmp_path, s3_remote):
    import torch
    from helpers.lightning_run import run

    url, options = s3_remote
    _, reference, _ = run(str(tmp_path / "reference"), max_epochs=3)
    remote = {"save_top_k": -1, "remote": url, "storage_options": options}
    run(str(tmp_path / "node-a"), max_epochs=2, callback_kwargs=remote)
    shutil.rmtree(tmp_path / "node-a")
    newest = lazyckpt.latest(url, storage_options=options)
    assert newest is not None
    trainer, resumed, _ = run(str(tmp_path / "node-b"), max_epochs=3, resume="last", callback_kwargs=remote)
    fetched = tmp_path / "node-b" / newest.rsplit("/", 1)[-1]
    assert trainer.ckpt_path == str(fetched), "resumed from the copy fetched from the remote level"
    for key, value in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_lightning_never_resumes_from_a_corrupt_remote_step_nor_keeps_its_copy(tmp_path, s3_remote):
    from helpers.lightning_run import run
    from lazyckpt.storage.fsspec import FsspecStorage

    url, options = s3_remote
    remote = {"save_top_k": -1, "remote": url, "storage_options": options}
    run(str(tmp_path / "node-a"), max_epochs=2, callback_kwargs=remote)
    newest = lazyckpt.latest(url, storage_options=options)
    damaged = f"{newest}/rank-00000-of-00001.safetensors"
    fs = FsspecStorage(url, options).fs
    for step_url in lazyckpt.format.catalog.committed_steps(url, FsspecStorage(url, options)).values():
        tensor_file = f"{step_url}/rank-00000-of-00001.safetensors"  # every step: none to fall back to
        data = bytearray(fs.cat_file(tensor_file))
        data[-1] ^= 0x01  # the last byte of the last tensor: only its chunk checksum can tell
        fs.pipe_file(tensor_file, bytes(data))
    with pytest.raises(lazyckpt.CheckpointCorruptError, match=rf"{re.escape(damaged)}: tensor .* checksum"):
        run(str(tmp_path / "node-b"), max_epochs=3, resume="last", callback_kwargs=remote)
    left = [name for name in os.listdir(tmp_path / "node-b") if name.startswith("step-")]
    assert left == [], "no committed local copy of the damaged step, and no partial one"
    assert lazyckpt.latest(str(tmp_path / "node-b")) is None


@pytest.mark.slow
def test_lightning_model_parallel_resumes_last_from_the_remote_on_an_empty_node_bit_exact(tmp_path, s3_remote):
    import torch

    url, options = s3_remote
    remote = ("--remote", url, "--storage-options", json.dumps(options), "--strategy", "model_parallel",
              "--devices", 2)  # FSDP2 over 2 gloo ranks; 4 steps an epoch
    _helper(tmp_path / "node-a", *remote, "--max-epochs", 1, "--out", tmp_path / "saved.pt")
    shutil.rmtree(tmp_path / "node-a")
    assert lazyckpt.latest(url, storage_options=options) == f"{url}/step-0000004"
    _helper(tmp_path / "node-b", *remote, "--max-epochs", 2, "--resume", "last",
            "--out-at-start", tmp_path / "restored.pt")
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    restored = torch.load(tmp_path / "restored.pt", weights_only=False)
    assert restored["global_step"] == 4, "fetched from the remote level, then resumed"
    for key, tensor in saved["model"].items():
        assert torch.equal(restored["model"][key], tensor), key
    assert_tree_equal(restored["optimizers"], saved["optimizers"])


def _helper(dirpath, *args) -> None:
    helper = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "lightning_run.py")
    cmd = [sys.executable, helper, "--dirpath", str(dirpath), *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


def test_lightning_with_a_url_dirpath_uploads_every_checkpoint_and_resumes_from_it_on_an_empty_node(
        tmp_path, s3_remote, monkeypatch):
    import torch
    from helpers.lightning_run import run

    from lazyckpt.levels.remote.contents import remote_steps
    from lazyckpt.storage.fsspec import FsspecStorage

    url, options = s3_remote
    _, reference, _ = run(str(tmp_path / "reference"), max_epochs=3)
    cwd, temp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    temp.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr("tempfile.tempdir", str(temp))  # the default spool directory of node A
    _, _, first = run(url, max_epochs=2, callback_kwargs={"save_top_k": -1, "storage_options": options})
    assert first.dirpath.startswith(str(temp)) and list(cwd.iterdir()) == []
    saved = sorted(step for step, _ in (lazyckpt.format.catalog.committed_steps(first.dirpath).items()))
    assert sorted(remote_steps(FsspecStorage(url, options), url)[0]) == saved and len(saved) == 2
    assert os.path.realpath(first.best_model_path).startswith(first.dirpath), "names live in the spool"

    spool_b = tmp_path / "node-b-spool"
    trainer, resumed, second = run(url, max_epochs=3, resume="last", callback_kwargs={
        "save_top_k": -1, "storage_options": options, "engine_options": {"spool_dir": str(spool_b)}})
    assert second.dirpath == str(spool_b)
    assert trainer.ckpt_path == str(spool_b / f"step-{saved[-1]:07d}"), "fetched from the remote level"
    for key, value in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    assert lazyckpt.latest(url, storage_options=options) == f"{url}/step-{trainer.global_step:07d}"
