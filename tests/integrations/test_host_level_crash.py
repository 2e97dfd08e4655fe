"""The host level (``keep_in_memory="host"``) through the integrations: a training process dies after a checkpoint
is committed in the host folder and before its copy to ``dirpath`` began (:mod:`helpers.host_faults`); the next
process resumes from that step, bit-exact with an uninterrupted run, and the step ends up committed in ``dirpath``.

Every host folder is under ``tmp_path`` (never the machine's ``/dev/shm``).
"""

from __future__ import annotations

import os

import pytest
from test_accelerate_crash import (BATCH, CRASH_EXIT_CODE, EPOCHS, SAMPLES, assert_same_training_state, check,
                                   final, run_script)

from lazyckpt.format.catalog import committed_steps, is_committed
from lazyckpt.storage import LocalStorage
from lazyckpt.storage.urls import host_dir

pytestmark = pytest.mark.slow


def _steps(dirpath) -> list[int]:
    return sorted(committed_steps(str(dirpath))) if os.path.isdir(dirpath) else []


def test_accelerate_resumes_the_step_only_the_host_folder_holds_bit_exact_and_commits_it_in_dirpath(tmp_path):
    per_epoch = SAMPLES // BATCH
    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    host = ("--dirpath", str(ckpt), "--host-memory-dir", str(shm))
    check(run_script(tmp_path, "reference"))
    check(run_script(tmp_path, "crashed", *host, "--stall-copy-of", str(2 * per_epoch),
                     "--crash-at", str(2 * per_epoch + 3)), CRASH_EXIT_CODE)
    assert _steps(ckpt) == [per_epoch], "the crash came before step 16 was copied to dirpath"
    assert 2 * per_epoch in _steps(host_dir(str(ckpt), str(shm)))

    check(run_script(tmp_path, "resumed", *host))
    resumed = final(tmp_path, "resumed")
    assert resumed["resumed_from"] == 2 * per_epoch, "resumed from the host folder's step, not dirpath's older one"
    assert_same_training_state(resumed, final(tmp_path, "reference"))
    assert _steps(ckpt) == [per_epoch * e for e in range(1, EPOCHS + 1)]
    assert not os.path.exists(host_dir(str(ckpt), str(shm))), "a clean close frees the host folder"



def test_lightning_resumes_last_from_the_host_folder_bit_exact_and_its_names_live_in_dirpath(tmp_path):
    import torch
    from helpers.lightning_run import final_state, run
    from test_lightning_resume import _assert_identical, _train

    trainer, model, _ = run(str(tmp_path / "full"), callback_kwargs={"save_top_k": -1, "save_last": True})
    torch.save(final_state(model, trainer), tmp_path / "full.pt")  # uninterrupted, in this process
    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    host = ("--host-memory-dir", shm)
    _train(ckpt, *host, "--stall-copy-of", 16, "--crash-at", 18, expect_rc=17)
    assert _steps(ckpt) == [8], "the crash came before step 16 was copied to dirpath"
    assert 16 in _steps(host_dir(str(ckpt), str(shm)))

    _train(ckpt, *host, "--resume", "last", out=tmp_path / "resumed.pt")
    _assert_identical(tmp_path / "full.pt", tmp_path / "resumed.pt", steps_resumed=8)  # from step 16
    seen = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert seen["ckpt_path"] == str(ckpt / "step-0000016"), "trainer.ckpt_path names the step in dirpath"
    assert is_committed(LocalStorage(), seen["ckpt_path"]), "and it outlives the host folder"
    assert os.path.dirname(os.path.realpath(seen["best_model_path"])) == str(ckpt)
    assert _steps(ckpt) == [8, 16, 24]
    assert os.path.realpath(ckpt / "last.ckpt") == str(ckpt / "step-0000024"), "ModelCheckpoint's names in dirpath"
    assert os.readlink(ckpt / "epoch=1-step=16.ckpt") == "step-0000016", "the names its save planned, put in place"
    assert not os.path.exists(host_dir(str(ckpt), str(shm))), "a clean close frees the host folder"


def test_lightning_top_k_and_names_act_on_dirpath_and_the_host_folder_holds_two_steps_at_most(tmp_path, monkeypatch):
    from helpers.lightning_run import run

    from lazyckpt.levels.host import HostLevel

    held = []
    before_save = HostLevel.before_save
    monkeypatch.setattr(HostLevel, "before_save", lambda self, job: (
        held.append(len(committed_steps(self.folder))), before_save(self, job))[-1])
    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    _, _, callback = run(str(ckpt), max_epochs=5, callback_kwargs={
        "monitor": "val_loss", "save_top_k": 1, "save_last": True, "keep_in_memory": "host",
        "engine_options": {"host_memory_dir": str(shm)}})
    assert len(held) == 5 and max(held) <= 2, held
    best = os.path.realpath(callback.best_model_path)
    assert os.path.dirname(best) == str(ckpt), "names live in dirpath, next to the steps copied there"
    assert os.path.realpath(callback.last_model_path) == str(ckpt / "step-0000040")
    assert {f"step-{s:07d}" for s in _steps(ckpt)} == {os.path.basename(best), "step-0000040"}, "top-k retention"
    assert not os.path.exists(host_dir(str(ckpt), str(shm)))


def test_the_trainer_resumes_the_step_only_the_host_folder_holds_bit_exact_under_its_name(tmp_path):
    pytest.importorskip("transformers")
    from helpers.trainer_run import assert_same_weights, run_worker

    out, shm = tmp_path / "out", tmp_path / "shm"
    ckpt, host = out / "lazyckpt", ("--epochs", "1", "--host-memory-dir", str(shm))  # 12 steps, one every 3
    run_worker(tmp_path / "full", tmp_path / "full.st", *host[:2])
    run_worker(out, tmp_path / "crashed.st", *host, "--stall-copy-of", "6", "--crash-at", "8", expect=3)
    assert _steps(ckpt) == [3] and 6 in _steps(host_dir(str(ckpt), str(shm)))
    assert not (out / "checkpoint-6").exists()

    run_worker(out, tmp_path / "resumed.st", *host, "--resume", "true")
    assert_same_weights(tmp_path / "full.st", tmp_path / "resumed.st")
    assert os.path.realpath(out / "checkpoint-6") == str(ckpt / "step-0000006"), "committed, named, resumed from"
    assert (out / "checkpoint-6" / "trainer_state.json").is_file()
    assert _steps(ckpt) == [3, 6, 9, 12]
    assert not os.path.exists(host_dir(str(ckpt), str(shm)))


def test_fabric_resumes_the_step_only_the_host_folder_holds_bit_exact_and_commits_it_in_dirpath(tmp_path):
    import subprocess
    import sys

    import torch
    from helpers import fabric_run

    def train(name, *args, expect=0):
        command = [sys.executable, fabric_run.__file__, "--out", str(tmp_path / f"{name}.pt"), *map(str, args)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
        assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
        return torch.load(tmp_path / f"{name}.pt", weights_only=False) if expect == 0 else None

    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    reference = train("reference", "--dirpath", tmp_path / "plain")
    train("crashed", "--dirpath", ckpt, "--host-memory-dir", shm, "--stall-copy-of", 4,
          expect=fabric_run.CRASH_EXIT_CODE)
    assert max(_steps(ckpt)) == 3 and 4 in _steps(host_dir(str(ckpt), str(shm))), "step 4 in the host folder only"

    resumed = train("resumed", "--dirpath", ckpt, "--host-memory-dir", shm, "--resume")
    assert resumed["resumed_from"] == 4, "fabric.load(dirpath) found the host folder's step, not dirpath's older one"
    for key, tensor in reference["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), key
    steps = _steps(ckpt)
    assert 4 in steps and 5 not in steps and steps[-1] == 6, "step 4 committed in dirpath, the steps count on after it"
    assert os.readlink(ckpt / "last.ckpt") == "step-0000006"
    assert not os.path.exists(host_dir(str(ckpt), str(shm))), "a clean close frees the host folder"
