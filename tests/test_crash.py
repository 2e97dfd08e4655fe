"""SIGKILL in the middle of a flush leaves the previous committed checkpoint as latest, loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import torch

import lazyckpt

CHILD = textwrap.dedent("""
    import os, sys, threading, torch, lazyckpt
    from lazyckpt.storage import LocalStorage

    class StallingStorage(LocalStorage):
        # After the first checkpoint, announce the first write of the next one and then hang inside it.
        armed = False
        def write(self, handle, offset, buffers):
            if self.armed:
                print("IN_FLUSH", flush=True)
                threading.Event().wait()
            super().write(handle, offset, buffers)

    torch.manual_seed(0)
    storage = StallingStorage()
    ckpt = lazyckpt.LazyCheckpointer(sys.argv[1], storage=storage)
    state = {"w": torch.randn(300_000), "step": 1}
    ckpt.save(state, step=1).wait()
    storage.armed = True
    ckpt.save({"w": torch.zeros(300_000), "step": 2}, step=2)
    threading.Event().wait()
""")


def test_sigkill_during_a_flush_leaves_latest_on_the_previous_commit(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "IN_FLUSH"  # synchronise on the child's own signal
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert os.path.isdir(tmp_path / "step-0000002.partial"), "the kill must land mid-flush"
    latest = lazyckpt.latest(tmp_path)
    assert latest == str(tmp_path / "step-0000001")
    torch.manual_seed(0)
    state = lazyckpt.load(latest)
    assert state["step"] == 1 and torch.equal(state["w"], torch.randn(300_000))
    # A new checkpointer takes over the directory (the dead process's lock is gone) and removes the debris.
    lazyckpt.LazyCheckpointer(tmp_path).close()
    assert not os.path.exists(tmp_path / "step-0000002.partial")
