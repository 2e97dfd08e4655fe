"""examples/transformers_finetune.py: the demo trains with the Trainer's own save and with LazyCheckpointCallback,
crashes a run with ``os._exit``, resumes it with ``resume_from_checkpoint=True`` and ends bit for bit where the
uninterrupted run ended; it prints both medians of the stall per save."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                       "transformers_finetune.py")


@pytest.mark.slow
def test_the_demo_trains_crashes_resumes_and_matches(tmp_path):
    cmd = [sys.executable, EXAMPLE, "--demo", "--output-dir", str(tmp_path), "--layers", "2", "--width", "32",
           "--seq", "16", "--batch-size", "4", "--train-size", "32", "--max-steps", "12", "--save-steps", "3",
           "--crash-at", "8", "--log-every", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "crashing after step 8 (os._exit)" in proc.stdout
    # step 6's write starts at step 7's barrier: the crash may come before or after its commit
    resumed = re.search(r"^resuming from (.*)$", proc.stdout, re.M).group(1)
    assert resumed in (str(tmp_path / "crashed" / "checkpoint-3"), str(tmp_path / "crashed" / "checkpoint-6"))
    assert f"after the crash the newest checkpoint was {os.path.basename(resumed)}" in proc.stdout
    assert "step 12/12" in proc.stdout  # the progress lines
    assert "median stall per save: lazyckpt" in proc.stdout and "vs the Trainer's own save" in proc.stdout
    assert "resumed run matches the uninterrupted run bit for bit: yes" in proc.stdout
    assert sorted(os.listdir(tmp_path / "crashed")) == ["checkpoint-12", "checkpoint-9", "lazyckpt"]
