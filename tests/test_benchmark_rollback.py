"""benchmarks/rollback.py runs end to end on a tiny model and every path restores the checkpointed state."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import rollback  # noqa: E402


def test_rollback_benchmark_restores_the_checkpointed_state_on_every_path(tmp_path, capsys):
    out = tmp_path / "runs.json"
    rollback.main(["--params-m", "0.3", "--repeats", "1", "--checkpoints", "1", "--json", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert [r["source"] for r in runs["memory"]] == ["memory"] and [r["source"] for r in runs["disk"]] == ["disk"]
    assert all(r["verified"] for r in runs["memory"] + runs["disk"])
    assert len(runs["restart"]) == 1
    assert "restart" in capsys.readouterr().out
