"""The owned fuzz suite of issue 29 (items 5 and 6): 600 distinct, seeded mutations of a real 2-rank FSDP2
checkpoint's manifests (``manifest.json`` and both rank manifests), resealed as docs/FORMAT.md says, each read by
every reader: ``load`` of rank 0 and of rank 1, ``load_into``, DCP's ``torch.distributed.checkpoint.load`` through
lazyckpt's StorageReader, ``verify`` and ``lazyckpt verify``.

Every outcome is the same data the untouched checkpoint gives that reader, or a refusal by lazyckpt's own error:
never other data, a foreign exception or a hang (each read runs under a watchdog). And verify and load refuse the
same inputs: ``verify`` refuses iff ``load`` of some rank refuses, ``lazyckpt verify`` iff ``verify``, and the
partial readers (``load_into``, DCP: one rank's tree) refuse nothing ``verify`` accepts
(:func:`helpers.fuzz_readers.disagreement`). A long run: ``python tests/helpers/fuzz_readers.py --cases 20000``.
"""

from __future__ import annotations

import json
import os

import pytest

import lazyckpt
from helpers.distributed import run_ranks
from helpers.fuzz_readers import READERS, Fuzz, save_fsdp2
from helpers.mutations import TOP, draw, every_mutation

CASES, SEED = 600, 1


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    dirpath = str(tmp_path_factory.mktemp("fsdp2") / "ckpt")
    run_ranks(save_fsdp2, 2, dirpath)
    return Fuzz(lazyckpt.latest(dirpath))


def test_the_checkpoint_is_sharded_replicated_and_per_rank(fuzz):
    view = fuzz.docs[TOP]["tensors"]
    shard0 = view["model/0.weight"]["boxes"]
    assert [(b["rank"], b["offsets"], b["lengths"]) for b in shard0] == [(0, [0, 0], [3, 4]), (1, [3, 0], [3, 4])]
    assert [b["lengths"] for b in view["model/3.bias"]["boxes"]] == [[1], [0]], "an empty shard"
    assert len(view["table"]["boxes"]) == 1 and view["table"]["boxes"][0]["lengths"] == [10], "replicated, once"
    assert view["optim/state/0.weight/step"]["shape"] == [], "a replicated 0-dim tensor"
    for rank in (0, 1):
        assert fuzz.docs[f"rank-0000{rank}.json"]["tensors"]["rank/rng"]["box"] is None, "a PerRank tensor"
        assert "rank/rng" not in view


def test_the_mutations_are_distinct_seeded_and_cover_every_family_and_manifest(fuzz):
    drawn = draw(fuzz.docs, CASES, SEED)
    assert len(drawn) == CASES
    assert [m.what for m, _ in drawn] == [m.what for m, _ in draw(fuzz.docs, CASES, SEED)], "reproducible"
    assert len({json.dumps(docs, default=str) + str(m.reseal_header) for m, docs in drawn}) == CASES  # in order
    assert sum(m.family == "order" for m, _ in drawn) == 3, "the order of entries of each manifest"
    families = {m.family for m in every_mutation(fuzz.docs)}
    assert {m.family for m, _ in drawn} == families and len(families) >= 12
    assert {m.file for m, _ in drawn} == set(fuzz.docs), "manifest.json and both rank manifests"


def test_every_reader_gives_the_same_data_or_refuses_and_verify_agrees_with_load(fuzz, tmp_path):
    counts, violations = fuzz.run(CASES, SEED, str(tmp_path))
    assert not violations, f"{len(violations)} of {CASES} cases break the rules:\n" + "\n".join(violations[:40])
    assert counts["cases"] == CASES
    for reader in READERS:  # both outcomes happen for every reader
        assert counts[f"{reader}: same"] > 0 and sum(n for k, n in counts.items()
                                                     if k.startswith(f"{reader}: refused")) > 0, reader
    for family in ("harmless", "order"):
        assert counts[f"{family}: verify refused"] == 0 and counts[f"{family}: verify same"] > 0, family
    print(json.dumps(counts, indent=1))
