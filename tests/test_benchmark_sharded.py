"""benchmarks/sharded.py runs end to end on two gloo ranks and reports a row per mode (no timing assertions)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_distributed_benchmark_reports_each_mode_and_each_rank_writes_its_share(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sharded.py"), "--world-size", "2",
                           "--mb", "24", "--saves", "1", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line and not line.startswith(("#", "mode"))}
    assert set(rows) == {"ddp", "ddp-rank0", "fsdp2"}
    written = {mode: float(row[4]) for mode, row in rows.items()}
    assert written["ddp"] == pytest.approx(written["ddp-rank0"] / 2, rel=0.1)  # split, not all on rank 0
    assert written["fsdp2"] == pytest.approx(written["ddp"], rel=0.1)
