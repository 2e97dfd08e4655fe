"""The reliability suite at CI size (fixed seeds); ``tests/helpers/reliability.py`` runs the same engines for long."""

from __future__ import annotations

import pytest

import lazyckpt
from helpers.soak import soak
from helpers.rank_kills import run as kill_ranks
from helpers.reliability import corrupt_every_file, fuzz, kill_at_random, make_template


def test_fuzzed_headers_and_manifests_are_refused_cleanly_and_identically_by_load_and_verify(tmp_path):
    counts = fuzz(300, seed=1, workdir=str(tmp_path))
    assert counts["cases"] == 300 and counts["refused"] > 250, counts


def test_a_changed_byte_in_any_file_of_a_checkpoint_is_detected_by_load_and_verify(tmp_path):
    path = make_template(str(tmp_path))
    counts = corrupt_every_file(path, per_file=48)
    assert counts["files"] == 5 and counts["flips"] >= 5 * 48, counts


@pytest.mark.slow
def test_sigkill_at_random_points_always_leaves_a_loadable_latest_checkpoint(tmp_path):
    counts = kill_at_random(str(tmp_path), kills=4, seed=1)
    assert counts["kills"] == 4 and counts["latest_step"] >= 1, counts


def test_sigkill_of_one_rank_at_random_moments_never_hangs_the_other_nor_breaks_a_committed_step(tmp_path):
    result = kill_ranks(3, seed=1, peer_s=1.0, root=str(tmp_path))  # raises on a slow call (a hang) or a broken committed step
    assert result["committed_steps_checked"] > 0


def test_nothing_accumulates_per_checkpoint_over_a_soak(tmp_path):
    result = soak(str(tmp_path), checkpoints=80, warmup=20, sample_every=20)
    assert result["violations"] == [] and len(result["samples"]) == 4, result


def test_the_soak_reports_a_structure_that_grows_per_checkpoint(tmp_path, monkeypatch):
    held, load = [], lazyckpt.load
    monkeypatch.setattr(lazyckpt, "load", lambda path: held.append([path]) or load(path))
    result = soak(str(tmp_path), checkpoints=40, warmup=10, sample_every=10)
    # the 30 planted lists, give or take a few the test process frees or holds meanwhile (and thread-pool weakrefs
    # the interpreter has not collected yet may be reported beside them)
    lists = [v for v in result["violations"] if v.endswith(" more live list objects")]
    assert len(lists) == 1 and int(lists[0].split(" ", 1)[0]) >= 25, result
