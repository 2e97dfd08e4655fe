"""SIGKILL with one or two checkpoints in flight leaves the previous committed checkpoint as latest, loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import lazyckpt

CHILD = textwrap.dedent("""
    import sys, threading, torch, lazyckpt
    from lazyckpt.storage import LocalStorage

    last = int(sys.argv[2])

    class StallingStorage(LocalStorage):
        # Once armed every write hangs; opening the last step's file says that every step after 1 is in flight.
        armed = False
        def write(self, handle, offset, buffers):
            if self.armed:
                threading.Event().wait()
            super().write(handle, offset, buffers)
        def open_write(self, path):
            handle = super().open_write(path)
            if f"step-{last:07d}.partial" in path:
                print("IN_FLIGHT", flush=True)
            return handle

    torch.manual_seed(0)
    storage = StallingStorage()
    ckpt = lazyckpt.LazyCheckpointer(sys.argv[1], storage=storage, host_buffer_bytes=16 << 20,
                                     max_in_flight=last - 1)
    ckpt.save({"w": torch.randn(300_000), "step": 1}, step=1).wait()
    storage.armed = True
    for step in range(2, last + 1):
        ckpt.save({"w": torch.full((300_000,), float(step)), "step": step}, step=step)
    threading.Event().wait()
""")


@pytest.mark.parametrize("in_flight", [1, 2])
def test_sigkill_with_checkpoints_in_flight_leaves_latest_on_the_previous_commit(tmp_path, in_flight):
    last = 1 + in_flight
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(last)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "IN_FLIGHT"  # synchronise on the child's own signal
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
        child.stdout.close()
    for step in range(2, last + 1):
        assert os.path.isdir(tmp_path / f"step-{step:07d}.partial"), "the kill must land with the step in flight"
    latest = lazyckpt.latest(tmp_path)
    assert latest == str(tmp_path / "step-0000001")
    torch.manual_seed(0)
    state = lazyckpt.load(latest)
    assert state["step"] == 1 and torch.equal(state["w"], torch.randn(300_000))
    # A new checkpointer takes over the directory (the dead process's lock is gone) and removes the debris.
    lazyckpt.LazyCheckpointer(tmp_path).close()
    assert sorted(os.listdir(tmp_path)) == [".lock-rank00000", "step-0000001"]
