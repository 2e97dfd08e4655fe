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

from lazyckpt.format.catalog import committed_steps
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

