"""Fault injection for the host level (``keep_in_memory="host"``): a step committed in the host folder whose copy
to ``dirpath`` never starts, so that a crash of the training process lands, deterministically, between the two.

The copy of a step begins only once it is committed in the host folder (the uploader takes committed step
directories), so the moment :func:`stall_copy_to_disk`'s event is set, that step is in the host folder, complete,
and nothing of it is in ``dirpath`` yet.
"""

from __future__ import annotations

import os
import threading

from lazyckpt.format.files import step_of_dir
from lazyckpt.levels.remote.upload import RemoteLevel

STALL_TIMEOUT_S = 120.0
"""How long a crash waits for the stalled copy to begin before it gives up (a broken run, not a slow one)."""


def gate_copy_to_disk(step: int, release: threading.Event, patch=setattr) -> threading.Event:
    """Patch the uploader so that the copy of ``step`` to ``dirpath`` waits for ``release`` before its first byte;
    returns an event set when that copy would have begun. ``patch`` replaces the method (pytest's
    ``monkeypatch.setattr`` undoes it after the test; ``setattr`` keeps it for the rest of the process)."""
    reached = threading.Event()
    copy_step = RemoteLevel.upload_step

    def gated(self, step_url: str, local_dir: str, attempt: str) -> int:
        if step_of_dir(local_dir) == step:
            reached.set()
            release.wait()
        return copy_step(self, step_url, local_dir, attempt)

    patch(RemoteLevel, "upload_step", gated)
    return reached


def stall_copy_to_disk(step: int) -> threading.Event:
    """:func:`gate_copy_to_disk` never released: the process dies with that copy not begun."""
    return gate_copy_to_disk(step, threading.Event())


def crash_once_stalled(reached: threading.Event, exit_code: int, *, meet=lambda: None) -> None:
    """Hard-exit (no clean-up, no atexit) once the stalled copy would have begun; exit ``exit_code + 1`` if it
    never does (the step was never committed in the host folder). ``meet``: called first, once it has begun (the
    ranks of a job meet there: a rank that dies early takes the job's store with it, and its peers never learn of
    the commit)."""
    if not reached.wait(STALL_TIMEOUT_S):
        os._exit(exit_code + 1)
    meet()
    os._exit(exit_code)


def fail_copy_to_disk_once(step: int, patch=setattr) -> threading.Event:
    """Patch the uploader so that the first copy of ``step`` to ``dirpath`` fails (an ``OSError`` before its first
    byte, as a full or vanished disk gives) and later ones run; returns an event set once it failed."""
    failed = threading.Event()
    copy_step = RemoteLevel.upload_step

    def failing(self, step_url: str, local_dir: str, attempt: str, **kwargs) -> int:
        if step_of_dir(local_dir) == step and not failed.is_set():
            failed.set()
            raise OSError(f"injected: the copy of step {step} to dirpath fails")
        return copy_step(self, step_url, local_dir, attempt, **kwargs)

    patch(RemoteLevel, "upload_step", failing)
    return failed
