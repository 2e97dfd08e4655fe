"""The integration policy layer on its own, without a framework: options, steps, the fit check, RNG and loader
generators, which rank writes what, and retention with named steps."""

from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest
import torch

import lazyckpt
from lazyckpt.policy import (CheckpointNames, CheckpointSession, RunLayout, SessionOptions, StepCounter, capture_rng,
                             check_fits, find_generators, restore_rng)
from helpers.distributed import run_ranks
from lazyckpt.levels.retention import steps_to_purge
from lazyckpt.policy.sharded import PerRankSource, per_rank_source
from lazyckpt.storage import LocalStorage


def options(**kwargs) -> SessionOptions:
    return SessionOptions(owner="Adapter", source="the framework", **kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"engine": {"rank": 1}}, r"Adapter\(rank=...\) is not accepted: rank and world_size come from the framework"),
    ({"engine": {"keep_last_k": 2}}, r"Adapter\(keep_last_k=...\) is not accepted"),
    ({"keep_last_k": 0}, "keep_last_k=0 must be a positive int"),
    ({"keep_last_k": True}, "keep_last_k=True must be a positive int"),
    ({"engine": {"copy_backend": "gpu"}}, "copy_backend='gpu' is not valid"),
])
def test_invalid_options_are_refused_naming_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        options(**kwargs)


def test_engine_objects_pass_through_validation_untouched():
    storage = LocalStorage()
    opts = options(engine={"storage": storage, "fsync": False}, keep_last_k=2)
    arguments = opts.engine_arguments(rank=1, world_size=2, retention=False)
    assert arguments == {"storage": storage, "fsync": False, "rank": 1, "world_size": 2, "keep_last_k": None}
    assert opts.engine_arguments(rank=0, world_size=1, retention=True)["keep_last_k"] == 2


def test_from_keywords_takes_the_session_options_and_leaves_the_rest_to_the_framework_or_the_engine():
    keywords = {"max_rollbacks": 1, "monitor": "val_loss", "owner": "x"}
    options, rest = SessionOptions.from_keywords(keywords, owner="X", source="s", keep_last_k=3, engine={"fsync": False})
    assert (options.max_rollbacks, options.keep_last_k, options.owner) == (1, 3, "X")
    assert options.engine == {"fsync": False} and rest == {"monitor": "val_loss", "owner": "x"}
    options, rest = SessionOptions.from_keywords({"max_rollbacks": 1, "fsync": False}, owner="X", source="s",
                                                 keep_last_k=None)
    assert options.max_rollbacks == 1 and options.engine == {"fsync": False} and rest == {}


def test_a_step_completes_when_every_optimizer_has_updated():
    counter = StepCounter(every_n_steps=2)
    assert [counter.updated(i, optimizers=2) for i in (0, 0, 1, 1, 0, 1)] == [False, False, False, False, True, False]
    assert counter.step == 2
    counter.restart(7)
    assert counter.updated(0, optimizers=1) and not counter.updated(0, optimizers=1) and counter.step == 9
    assert not StepCounter(None).updated(0, optimizers=1)
    with pytest.raises(ValueError, match="every_n_steps=0"):
        StepCounter(0)


def test_the_fit_check_names_every_difference():
    here = RunLayout(world_size=2, kinds={"optimizers": ["AdamW"]}, dataloaders=1, param_groups=[[4]],
                     models={"model 0 (Net)": {"w": torch.zeros(2, 3), "b": torch.zeros(2), "new": torch.zeros(1)}})
    saved = RunLayout(world_size=1, kinds={"optimizers": ["SGD"]}, dataloaders=2, param_groups=[[3]],
                      models={"model 0 (Net)": {"w": torch.zeros(3, 3), "b": torch.zeros(2, dtype=torch.float16),
                                                "old": torch.zeros(1)}})
    with pytest.raises(lazyckpt.CheckpointMismatchError) as caught:
        check_fits("ckpt", saved, here, problems=["first"])
    lines = str(caught.value).splitlines()
    assert lines[0] == "ckpt does not match this run:"
    assert [line.strip("- ").split(":")[0] for line in lines[1:]] == [
        "first", "it was written by 1 process(es), this run has 2 (RNG and sampler states are per process; resume "
        "with the same number of processes)", "optimizers", "dataloaders", "model 0 (Net)", "model 0 (Net)",
        "model 0 (Net)", "model 0 (Net)", "optimizer 0"]
    assert "'w' is float32[3, 3] in the checkpoint and float32[2, 3] here" in str(caught.value)
    assert "'b' is float16[2]" in str(caught.value)


def test_the_fit_check_can_ignore_key_sets_and_dtypes():
    here = RunLayout(models={"m": {"w": torch.zeros(2), "new": torch.zeros(1)}})
    saved = RunLayout(models={"m": {"w": torch.zeros(2, dtype=torch.float64), "old": torch.zeros(1)}})
    check_fits("ckpt", saved, here, strict=False, dtypes=False)  # nothing to report
    saved.models["m"]["w"] = torch.zeros(3)
    with pytest.raises(lazyckpt.CheckpointMismatchError, match=r"'w' is float32\[3\] in the checkpoint"):
        check_fits("ckpt", saved, here, strict=False, dtypes=False)


def test_loader_generators_are_found_once_each_under_stable_names():
    gen, sampler_gen = torch.Generator(), torch.Generator()
    data = torch.utils.data.TensorDataset(torch.arange(8))
    sampler = torch.utils.data.RandomSampler(data, generator=sampler_gen)
    loaders = [torch.utils.data.DataLoader(data, sampler=sampler, generator=gen),
               torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, generator=gen)]
    found = find_generators(loaders, "train")
    assert found == {"train[0].loader": gen, "train[0].sampler": sampler_gen}


def test_rng_states_round_trip_bit_exact_and_in_a_weights_only_form(tmp_path):
    gen = torch.Generator().manual_seed(3)
    state = capture_rng({"g": gen})
    torch.save(state, tmp_path / "rng.pt")
    state = torch.load(tmp_path / "rng.pt", weights_only=True)
    expected = (random.random(), float(np.random.rand()), torch.rand(2), torch.rand(2, generator=gen))
    assert restore_rng(state, {"g": gen, "absent": torch.Generator()}) == ["g"]
    got = (random.random(), float(np.random.rand()), torch.rand(2), torch.rand(2, generator=gen))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])


def test_without_a_process_group_rank_zero_writes_replicated_values_and_every_rank_its_own(tmp_path):
    weight = torch.arange(4.0)
    built = []

    def replicated():
        built.append(True)
        return {"model": {"w": weight}}

    engine = {"fsync": False, "commit_timeout_s": 60}
    sessions = [CheckpointSession(tmp_path, options(engine=engine), rank=r, world_size=2) for r in (0, 1)]
    pending = [s.save(5, replicated=replicated, per_rank={"rank": s.rank}, immutable=[weight]) for s in sessions]
    for session in sessions:
        session.barrier()
    assert pending[0].wait() is not None and pending[1].wait() is not None
    for session in sessions:
        session.close()
    assert built == [True]  # only rank 0 built the replicated values
    assert torch.equal(lazyckpt.load(tmp_path / "step-0000005")["model"]["w"], weight)
    assert lazyckpt.load(tmp_path / "step-0000005", rank=1) == {"rank": 1}
    assert sorted(sessions[0].stalls) == sorted(sessions[1].stalls) == [5]


def _session_in_a_group(rank, world_size, dirpath):
    layers = {f"layer{i}": torch.full((256,), float(i)) for i in range(4)}  # the same on every rank (DDP)
    session = CheckpointSession(dirpath, options(engine={"fsync": False, "commit_timeout_s": 60}), rank=rank,
                                world_size=world_size)
    statistics = torch.full((8,), float(rank))  # a buffer nothing synchronizes (BatchNorm under FSDP2)
    pending = session.save(3, replicated=lambda: {"model": layers, "stats": statistics},
                           per_rank={"rng": torch.tensor([rank])},
                           immutable=list(layers.values()))
    session.barrier()
    assert pending.wait() is not None
    session.close()
    step_dir = os.path.join(dirpath, "step-0000003")
    with open(os.path.join(step_dir, f"rank-{rank:05d}.json")) as f:
        written = [key for key, t in json.load(f)["tensors"].items() if t["box"] is not None]
    assert len(written) == 4 // world_size  # written once in total, split across the ranks by bytes
    loaded = lazyckpt.load(step_dir, rank=rank)
    assert torch.equal(loaded["rng"], torch.tensor([rank]))  # per-rank values come back to their rank
    assert torch.equal(loaded["stats"], statistics)  # so do tensors outside the optimizers and immutable ones
    for name, tensor in layers.items():
        assert torch.equal(loaded["model"][name], tensor), name


def test_in_a_process_group_synchronized_tensors_are_split_across_ranks_and_the_rest_come_back_per_rank(tmp_path):
    run_ranks(_session_in_a_group, 2, str(tmp_path))


def test_retention_keeps_what_is_protected_kept_by_recency_or_just_committed():
    steps = [1, 2, 3, 4, 5]
    assert steps_to_purge(steps, None, just_committed=5, released={1, 3}, protected={3}) == [1]
    assert steps_to_purge(steps, 2, just_committed=5, protected={1}) == [3, 2]
    assert steps_to_purge(steps, 2, just_committed=5, released={4}) == [3, 2, 1]  # the newest k always stay


def test_a_dropped_name_releases_its_step_after_the_next_commit(tmp_path):
    session = CheckpointSession(tmp_path, options(engine={"fsync": False}), rank=0, world_size=1,
                                engine_retention=False)
    names = CheckpointNames(session, lambda s: session.save(s, replicated={}, per_rank={"step": s}))
    name = {step: str(tmp_path / f"best-{step}.ckpt") for step in (1, 2)}
    for step in (1, 2):
        names.plan(step, name[step])  # like ModelCheckpoint's top-1: save the new best, then drop the old one
        if step == 2:
            names.drop(name[1])
        committed = names.submit()
        session.barrier()
        committed += names.poll(block=True)
        assert [c.step for c in committed] == [step]
    session.close()
    assert name[2] in names and name[1] not in names and os.readlink(name[2]) == "step-0000002"
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(("step-", "best-"))) == [
        "best-2.ckpt", "step-0000002"]


def test_names_request_once_when_a_hook_returns_nothing_when_it_raises_and_report_the_summary_at_the_end(tmp_path):
    from lazyckpt.policy import NO_NAMES, Reporter, RunFeedback

    session = CheckpointSession(tmp_path, options(engine={"fsync": False}), rank=0, world_size=1,
                                engine_retention=False)
    lines, saved = [], []

    def save(step):
        saved.append(step)
        return session.save(step, replicated={}, per_rank={"step": step})

    names = CheckpointNames(session, save, feedback=RunFeedback(), reporter=Reporter(lines.append))
    with names.deciding():  # like ModelCheckpoint saving top-k, then last, in one hook
        names.plan(1, str(tmp_path / "best.ckpt"))
        names.plan(1, str(tmp_path / "last.ckpt"))
        assert saved == []
    assert saved == [1]
    with pytest.raises(KeyError), names.deciding():
        names.plan(2, str(tmp_path / "last.ckpt"))
        raise KeyError("the hook failed")
    session.barrier()
    assert saved == [1]
    assert names.finish(step=2)["lazyckpt/checkpoints"] == 2 and saved == [1, 2]  # what is planned goes at the end
    assert len(lines) == 1 and lines[0].startswith("lazyckpt: 2 checkpoints committed")
    names.close(raise_errors=True)
    with NO_NAMES.deciding():  # outside a fit: nothing is planned, requested or published
        pass
    assert saved == [1, 2] and NO_NAMES.poll(block=True) == [] and NO_NAMES.finish(step=2) == {}
    assert str(tmp_path / "last.ckpt") not in NO_NAMES


def test_no_names_is_checkpoint_names_that_answers_every_call_without_a_session(tmp_path, caplog):
    from lazyckpt.policy import NO_NAMES
    from lazyckpt.policy.names import _NoNames

    public = {n for n in dir(CheckpointNames) if not n.startswith("_")} | {"__contains__"}
    assert isinstance(NO_NAMES, CheckpointNames)
    assert public <= set(vars(_NoNames)), "an inherited method would reach the session NO_NAMES does not have"
    name = str(tmp_path / "epoch=0-step=3.ckpt")
    with caplog.at_level("WARNING", logger="lazyckpt.policy.names"):
        NO_NAMES.plan(3, name)  # a framework saving outside a fit: raising could mask an exception being handled
    assert re.search(r"no checkpoint of step 3 for .*epoch=0-step=3.ckpt.*only while fitting", caplog.text)
    NO_NAMES.copy(name, str(tmp_path / "last.ckpt"))
    NO_NAMES.drop(name)
    assert name not in NO_NAMES and NO_NAMES.submit() == [] and os.listdir(tmp_path) == []


def test_sessions_on_one_directory_share_one_engine_and_one_snapshot_per_step(tmp_path):
    first = CheckpointSession.shared(tmp_path, options(engine={"fsync": False}), rank=0, world_size=1,
                                     engine_retention=False)
    second = CheckpointSession.shared(tmp_path / ".", options(engine={"fsync": False}), rank=0, world_size=1,
                                      engine_retention=False)
    assert second is first
    handles = []

    def save(step):
        handles.append(first.save(step, replicated={}, per_rank={"step": step}))
        return handles[-1]

    best, every = CheckpointNames(first, save), CheckpointNames(second, save)

    best.plan(1, str(tmp_path / "best.ckpt"))
    every.plan(1, str(tmp_path / "every-1.ckpt"))
    best.submit()
    every.submit()
    assert handles[0] is handles[1], "the second request of a step gets the first one's snapshot"
    best.close(raise_errors=True)
    for step in (2, 3):  # the engine stays open for the other user; its drops never delete what best names
        every.plan(step, str(tmp_path / f"every-{step}.ckpt"))
        every.drop(str(tmp_path / f"every-{step - 1}.ckpt"))
        every.submit()
        first.barrier()
    every.close(raise_errors=True)
    assert os.readlink(tmp_path / "best.ckpt") == "step-0000001"
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(("step-", "every-"))) == [
        "every-3.ckpt", "step-0000001", "step-0000003"]
    assert CheckpointSession.shared(tmp_path, options(), rank=0, world_size=1) is not first, "closed: a new one"


def test_sessions_sharing_a_directory_must_agree_on_the_engine(tmp_path):
    session = CheckpointSession.shared(tmp_path, options(keep_last_k=2), rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"keep_last_k=2 .*same keep_last_k and engine options"):
        CheckpointSession.shared(tmp_path, options(keep_last_k=3), rank=0, world_size=1)
    session.close()


def test_the_run_summary_counts_stalls_time_to_durable_and_bytes():
    from lazyckpt.policy import run_summary, summary_line
    from lazyckpt.write.stats import CheckpointStats

    stats = [CheckpointStats(step=s, save_s=0.001 * s, wait_s=0.001, flush_s=0.5 * s, nbytes=10**9)
             for s in (1, 2, 3)]
    summary = run_summary(stats)
    assert summary == pytest.approx({"lazyckpt/checkpoints": 3, "lazyckpt/stall_median_ms": 3.0,
                                     "lazyckpt/stall_max_ms": 4.0, "lazyckpt/durable_median_s": 1.0,
                                     "lazyckpt/written_mb": 3000.0})
    assert summary_line(summary) == ("lazyckpt: 3 checkpoints committed, stall median 3.0 ms / max 4.0 ms, "
                                     "durable after 1.00 s (median), 3.00 GB written")
    assert run_summary([]) == {} and "no checkpoint" in summary_line({})


@pytest.mark.parametrize("stalls, warns", [((0.01, 0.02, 0.05), True), ((0.01, 0.015, 0.019), False),
                                          ((0.05, 0.02, 0.06), False), ((0.01, 0.04), False)])
def test_a_stall_that_keeps_growing_is_reported_with_what_to_change(stalls, warns):
    from lazyckpt.policy import falling_behind
    from lazyckpt.write.stats import CheckpointStats

    message = falling_behind([CheckpointStats(step=i, save_s=s, flush_s=1.0) for i, s in enumerate(stalls)])
    assert (message is not None) == warns
    if warns:
        assert "10.0 ms to 50.0 ms" in message and "host_buffer_bytes" in message and "interval" in message


@pytest.mark.parametrize("stalls", [(0.010, 0.015, 0.023), (0.002, 0.010, 0.049)])
def test_a_growing_stall_that_stays_short_in_absolute_terms_is_not_reported(stalls):
    from lazyckpt.policy import falling_behind
    from lazyckpt.policy.feedback import MIN_STALL_S
    from lazyckpt.write.stats import CheckpointStats

    def stats(values):
        return [CheckpointStats(step=i, save_s=s, flush_s=1.0) for i, s in enumerate(values)]

    assert falling_behind(stats(stalls)) is None  # it doubled, but a tiny run's milliseconds are noise
    assert falling_behind(stats((*stalls[:-1], MIN_STALL_S))) is not None


def test_run_feedback_warns_once_holds_messages_until_their_commit_and_follows_a_bounded_log():
    from lazyckpt.policy import Reporter, RunFeedback
    from lazyckpt.write.stats import CheckpointStats, StatsLog

    feedback = RunFeedback()
    feedback.announce(2, "saved 'last.ckpt'")
    assert feedback.committed(1, CheckpointStats(step=1, save_s=0.01, flush_s=1.0)) == []
    with pytest.warns(RuntimeWarning, match="falling behind"):
        for step, stall in ((2, 0.02), (3, 0.05)):
            announced = feedback.committed(step, CheckpointStats(step=step, save_s=stall, flush_s=1.0))
            assert announced == (["saved 'last.ckpt'"] if step == 2 else [])
    feedback.committed(4, CheckpointStats(step=4, save_s=0.2, flush_s=1.0))  # still growing: no second warning
    assert feedback.committed(2, None) == [] and len(feedback.stats) == 4

    log, follower = StatsLog(window=2), RunFeedback()
    for step in range(1, 6):
        log.append(CheckpointStats(step=step, save_s=0.001, flush_s=0.1))
        if step in (1, 5):  # between the calls the window dropped steps 2 and 3: they are not invented
            follower.follow(log)
    assert [s.step for s in follower.stats] == [1, 4, 5]
    lines = []
    assert follower.finish(Reporter(lines.append))["lazyckpt/checkpoints"] == 3 and lines[0].startswith("lazyckpt: 3 ")


def test_step_requests_issue_a_capture_once_drop_a_bad_one_and_restart_after_a_restore():
    from types import SimpleNamespace

    from lazyckpt.policy import StepRequests

    requests, saved = StepRequests(every_n_steps=2), []
    save = lambda captured: saved.append(captured.step) or f"handle {captured.step}"  # noqa: E731
    assert requests.issue(save) is None and saved == []
    requests.capture_unless_requested(3, lambda step: SimpleNamespace(step=step))
    assert requests.issue(save) == "handle 3" == requests.issue(save) and saved == [3]
    requests.capture_unless_requested(3, lambda step: SimpleNamespace(step=step))  # step 3 was requested
    requests.capture_unless_requested(4, lambda step: SimpleNamespace(step=step))
    requests.drop(4)
    assert requests.issue(save) == "handle 3" and saved == [3]
    requests.restart(7, committed=True)
    requests.capture_unless_requested(7, lambda step: SimpleNamespace(step=step))
    assert requests.issue(save) is None and saved == [3]
    completed = [requests.updated(i, optimizers=2, capture=lambda step: SimpleNamespace(step=step)) for i in (0, 1)]
    assert completed == [False, True] and requests.step == 8 and requests.waiting.step == 8  # 8 is due
    with pytest.warns(RuntimeWarning, match="too late") as late:
        assert requests.issue(save, late="too late") == "handle 8"
        requests.restart(8, committed=False)
        requests.capture_unless_requested(8, lambda step: SimpleNamespace(step=step))
        assert requests.issue(save, late="too late") == "handle 8" and saved == [3, 8, 8]
    assert len(late) == 1, "once per run"


def test_resume_target_is_none_without_a_directory_and_the_newest_of_both_kinds_otherwise(tmp_path):
    from lazyckpt.policy import resume_target

    opts = options()
    assert resume_target(os.fspath(tmp_path / "missing"), opts) is None
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        ckpt.save({"w": torch.ones(2)}, step=1).wait()
    other = tmp_path / "last.ckpt"
    other.write_bytes(b"a Lightning file")
    old = os.stat(tmp_path / "step-0000001" / "manifest.json").st_mtime
    os.utime(other, (old - 10, old - 10))
    assert resume_target(os.fspath(tmp_path), opts, [os.fspath(other)]).endswith("step-0000001")
    os.utime(other, (old + 10, old + 10))
    assert resume_target(os.fspath(tmp_path), opts, [os.fspath(other)]) == os.fspath(other)


def test_update_loop_requests_a_due_step_at_the_next_forward_and_a_rollback_undoes_the_update_just_made():
    from types import SimpleNamespace

    from lazyckpt.policy import UpdateLoop
    from lazyckpt.write.stats import StatsLog

    calls = []
    session = SimpleNamespace(engine=SimpleNamespace(stats=StatsLog()), barrier=lambda: calls.append("barrier"),
                              rank=0, close=lambda: calls.append("close"), resumed=lambda step, path: None)
    rollback = SimpleNamespace(remember_start=lambda step: calls.append(("start", step)),
                               on_step=lambda: calls.append("step"),
                               roll_back=lambda bad: calls.append(("roll back", bad)) or 0)
    loop = UpdateLoop(every_n_steps=2)
    loop.start(session, save=lambda captured: calls.append(("save", captured.step)) or f"handle {captured.step}",
               rollback=rollback)
    assert calls == [("start", 0)]  # the start state is the target of a rollback before the first snapshot
    calls.clear()
    capture = SimpleNamespace

    assert loop.updated(0, optimizers=1, capture=lambda step: capture(step=step)) and calls == ["step"]
    loop.forward()
    assert calls == ["step"] and loop.bad_step() == 2  # before the next update: that update is the bad one
    assert loop.updated(0, optimizers=1, capture=lambda step: capture(step=step))  # step 2 is due: captured
    assert loop.roll_back() == 0  # after it: its request is dropped, never issued
    loop.forward()
    assert calls == ["step", "step", ("roll back", 2)]
    calls.clear()

    assert loop.updated(0, optimizers=1, capture=lambda step: capture(step=step))  # step 3
    assert loop.updated(0, optimizers=1, capture=lambda step: capture(step=step))  # step 4, due
    with pytest.warns(RuntimeWarning, match="no forward"):
        loop.before_update(late="no forward ran")  # no forward between two updates: requested late, then barrier
    assert calls == ["step", "step", ("save", 4), "barrier"]
    assert loop.request(lambda step: capture(step=step)) == "handle 4"  # requested already: the same handle
    loop.restart(7)
    loop.resumed(5, "step-0000005")
    assert loop.step == 5 and calls[-1] == ("start", 5)  # a resumed state is the new start
    calls.clear()
    assert loop.close(release=lambda: calls.append("release")) == {} and calls == ["release", "close"]
    assert loop.closed and loop.close(release=lambda: calls.append("release")) == {} and len(calls) == 2


def test_run_feedback_reports_commits_and_the_summary_only_where_it_is_given_somewhere_to_report():
    from types import SimpleNamespace

    from lazyckpt.policy import Reporter, RunFeedback
    from lazyckpt.write.stats import CheckpointStats

    lines, metrics, saved = [], [], []
    reporter = Reporter(lines.append, metrics=lambda values, step: metrics.append((step, values)), each=saved.append)
    assert reporter.on_rank(0) is reporter and reporter.on_rank(1) == Reporter()
    feedback = RunFeedback()
    feedback.announce(3, "saved 'last.ckpt'")
    commits = [SimpleNamespace(step=3, stats=CheckpointStats(step=3, save_s=0.004, nbytes=2 * 10**6)),
               SimpleNamespace(step=4, stats=None)]  # a rank without the stats of that commit
    feedback.report(commits, reporter)
    assert lines == ["saved 'last.ckpt'"] and saved == [3, 4]
    assert [(step, values["lazyckpt/stall_ms"], values["lazyckpt/size_mb"]) for step, values in metrics] == [
        (3, pytest.approx(4.0), pytest.approx(2.0))]

    silent = RunFeedback()  # another rank: records, reports nothing
    silent.report(commits, reporter.on_rank(1))
    assert len(silent.stats) == 1 and silent.finish(reporter.on_rank(1), step=9) == {} and len(lines) == 1
    summary = feedback.finish(reporter, step=9)
    assert metrics[-1] == (9, summary) and lines[-1].startswith("lazyckpt: 1 checkpoints committed")
    assert RunFeedback().finish(reporter) == {} and len(metrics) == 2  # nothing committed: a line, no metrics
    assert lines[-1] == "lazyckpt: no checkpoint was committed"


@pytest.mark.parametrize("rank, world_size, saved, expected", [
    (1, 2, 2, PerRankSource(rank=1, own=True, unused=())),       # same ranks: each its own
    (2, 3, 2, PerRankSource(rank=0, own=False, unused=())),      # a new rank reads rank 0's per-rank tensors
    (0, 1, 2, PerRankSource(rank=0, own=True, unused=(1,))),     # fewer ranks: rank 0 reports the unused ones
    (1, 2, 4, PerRankSource(rank=1, own=True, unused=())),
])
def test_per_rank_values_come_from_the_own_rank_or_rank_zero_when_the_rank_count_changed(rank, world_size, saved,
                                                                                        expected):
    assert per_rank_source(rank, world_size, saved) == expected


def test_a_request_taken_by_a_save_that_raises_an_earlier_failure_is_still_the_session_s(tmp_path):
    """The engine raises an earlier background failure only after taking the new request: the session counts that
    request as made (its stall, its barrier, the same handle when asked again), so a framework that catches the
    error and asks again gets it, not StepAlreadyCommittedError, and every rank keeps its attempts in step."""
    from conftest import FailingStorage

    storage = FailingStorage()
    session = CheckpointSession(tmp_path, options(engine={"storage": storage}), rank=0, world_size=1)
    storage.fail = True
    first = session.save(1, replicated={"w": torch.ones(4)}, per_rank={})
    first._job.wait_done()  # failed in the background; nobody has heard of it yet
    storage.fail = False
    with pytest.raises(OSError, match="injected"):
        session.save(2, replicated={"w": torch.ones(4)}, per_rank={})
    taken = session.last_request
    assert taken is not None and taken.step == 2 and 2 in session.stalls
    assert session.save(2, replicated={"w": torch.ones(4)}, per_rank={}) is taken, "asked again: the same handle"
    session.barrier()
    assert taken.wait().endswith("step-0000002")
    session.close()
