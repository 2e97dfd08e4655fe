"""benchmarks/compare.py: the quick benchmark runs end to end on a tiny model, its JSON has the documented
schema, every available method's checkpoint was loaded back and matched, and a torn snapshot is caught.

No timing assertions: timings on a shared CI machine mean nothing; the schema and the verification do.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
METRICS = ("stall_ms", "in_loop_overhead_ms", "e2e_slowdown_pct", "time_to_durable_s", "extra_rss_mb",
           "restore_s", "raw_write_s")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out, plots, work = tmp / "out.json", tmp / "plots", tmp / "work"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "compare.py"), "--quick", "--params-m", "0.3",
                           "--json", str(out), "--plots", str(plots), "--workdir", str(work)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out) as f:
        return json.load(f), proc.stdout, plots, work


@pytest.mark.slow
def test_quick_json_has_the_schema(quick):
    data, _, _, _ = quick
    assert set(data) >= {"machine", "config", "methods"}
    machine = data["machine"]
    assert machine["logical_cores"] >= 1 and machine["memory_gib"] > 0 and machine["disk_write_mb_s"] > 0
    config = data["config"]
    assert config["quick"] is True and config["every"] >= 1 and config["state_bytes"] > 0
    keys = [m["key"] for m in data["methods"]]
    assert len(keys) == len(set(keys)) == 19, keys
    for method in data["methods"]:
        assert {"name", "verified", "available"} <= set(method), method
        if not method["available"]:
            assert method["unavailable"], method  # says why
            continue
        if method["kind"] == "baseline":
            assert method["step_ms"]["median"] > 0
            continue
        for metric in METRICS:
            value = method[metric]
            assert value is not None and value["min"] <= value["median"] <= value["max"], (method["key"], metric)


@pytest.mark.slow
def test_every_available_method_verified_its_checkpoint(quick):
    data, stdout, _, _ = quick
    available = [m for m in data["methods"] if m["available"]]
    assert {m["key"] for m in available} >= {"none", "raw", "torch_save", "dcp_thread", "dcp_stager", "lazyckpt"}
    failed = {m["key"]: m.get("errors") or m.get("verify_problems") for m in available if m["verified"] is not True}
    assert not failed, failed
    assert "| lazyckpt LazyCheckpointer | yes |" in stdout  # the markdown table on stdout
    peer = next(m for m in data["methods"] if m["key"] == "torch_checkpointing")
    if peer["available"]:  # an optional peer: verified above when installed, "unavailable" with a reason if not
        assert peer["first_checkpoint_stall_s"]["median"] > 0 and peer["child_rss_mb"]["median"] > 0
        assert "first checkpoint (untimed warm-up), stall: " in stdout and "torch_checkpointing " in stdout
    else:
        assert "import torch_checkpointing failed" in peer["unavailable"]


def test_torch_checkpointing_is_unavailable_with_a_reason_when_not_installed(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    monkeypatch.setitem(sys.modules, "torch_checkpointing", None)  # what a missing package looks like to import
    from dist_methods import TorchCheckpointingFsdp
    from methods import Unavailable
    from peer_torch_checkpointing import TorchCheckpointing

    for method in (TorchCheckpointing(), TorchCheckpointingFsdp()):
        with pytest.raises(Unavailable, match="import torch_checkpointing failed"):
            method.check()


def test_torch_checkpointing_fsyncs_the_files_of_its_rank_and_the_directories(tmp_path, monkeypatch):
    """The fsyncs the benchmark adds to torch-checkpointing's write (it has none): in the temporary directory each
    rank its own ``<item>_<rank>.pt`` files, rank 0 also the metadata, then the directory; after the rename rank 0
    the parent."""
    monkeypatch.syspath_prepend(BENCH)
    import peer_torch_checkpointing as peer

    synced = []
    monkeypatch.setattr(peer, "fsync_path", synced.append)
    tmp = tmp_path / "tmp_step-5"
    tmp.mkdir()
    for name in ("model_0.pt", "opt_0.pt", "model_1.pt", "opt_1.pt", "metadata.pkl"):
        (tmp / name).write_bytes(b"x")
    args = type("CallbackArgs", (), {"path": str(tmp)})
    peer.fsync_written(args, rank=1)
    assert sorted(synced) == sorted([str(tmp / "model_1.pt"), str(tmp / "opt_1.pt"), str(tmp)])
    synced.clear()
    peer.fsync_written(args, rank=0)
    assert sorted(synced) == sorted([str(tmp / n) for n in ("model_0.pt", "opt_0.pt", "metadata.pkl")] + [str(tmp)])
    synced.clear()
    args.path = str(tmp_path / "step-5")
    peer.fsync_committed(args, rank=1)
    peer.fsync_committed(args, rank=0)
    assert synced == [str(tmp_path)]


def test_rss_sampler_counts_a_childs_private_memory_only_when_asked(monkeypatch):
    """A method that writes from a process of its own pays for that process's memory: with ``children=True`` the
    peak adds the child's private (anonymous) memory."""
    monkeypatch.syspath_prepend(BENCH)
    from workload import MiB, RssSampler

    code = "import sys; held = bytearray(96 << 20); held[::4096] = b'x' * len(held[::4096]); print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with_children, alone = RssSampler(children=True), RssSampler()
        with_children.stop(), alone.stop()
    finally:
        child.communicate("")
    assert with_children.peak_children >= 90 * MiB and alone.peak_children == 0
    assert with_children.peak_rss >= alone.peak_rss + 90 * MiB - 16 * MiB  # own RSS moves a little between samples


@pytest.mark.slow
def test_plots_written_and_workdir_cleaned(quick):
    _, _, plots, work = quick
    for name in ("stall_per_method.png", "lazyckpt_timeline.png"):
        with open(plots / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    assert os.path.isdir(work) and os.listdir(work) == []


def test_a_torn_snapshot_is_reported_as_fail(tmp_path, monkeypatch):
    """A method that writes the state of a later step must come out verified=False, not as a fast result."""
    monkeypatch.syspath_prepend(BENCH)
    import runner
    from floors import RawFloor
    from workload import Workload

    class Stale(RawFloor):
        key = "stale"

        def request(self, step):  # no copy now: the bytes are taken only at finish(), after more updates
            self.stale_step = step

        def before_step(self):
            pass

        def finish(self):
            RawFloor.request(self, self.stale_step)
            RawFloor.finish(self)

    monkeypatch.setitem(runner.METHODS, "stale", Stale)
    w = Workload(params_m=0.05, batch=1, seq=8, every=2, checkpoints=1)
    runner.make_reference(w, str(tmp_path / "ref.pt"))
    spec = {"workload": dataclasses.asdict(w), "method": "stale", "repeat": 0, "dirpath": str(tmp_path / "run"),
            "reference": str(tmp_path / "ref.pt")}
    result = runner.execute(spec)
    assert result["training_matches_reference"] is True
    assert result["checkpoint_matches"] is False and result["verified"] is False
    assert "differ from the state at that step" in result["verify_problems"][0]
    assert not os.path.exists(spec["dirpath"])  # the run cleaned up after itself


def test_quiet_steps_skip_checkpoint_steps_their_successors_and_steps_before_durability(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import runner
    from workload import Workload

    w = Workload(params_m=0.05, every=4, checkpoints=2)  # measured steps 5..15; checkpoints at 4 (warm-up), 8 and 12
    rec = runner.Recorder(w)
    for step in range(1, w.total_steps + 1):
        rec.start[step], rec.end[step] = float(step), step + 0.01 * step
    rec.request_at = {8: 8.5, 12: 12.5}
    durable = {8: 2.0, 12: 0.1}  # step 8's checkpoint is durable at 10.5: step 10 is not quiet, step 11 is
    quiet = runner.quiet_step_durations(w, rec, durable)
    assert quiet == pytest.approx([0.01 * s for s in (6, 7, 11, 14, 15)])


@pytest.mark.slow
def test_distributed_mode_verifies_every_method_and_splits_the_bytes_across_ranks(tmp_path):
    """``--world-size 2``: FSDP2 and DDP on two gloo ranks; every method's checkpoint read back matched, each FSDP2
    rank held half the state, and DDP split writes put half of rank 0's bytes on each rank."""
    out = tmp_path / "dist.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "compare.py"), "--world-size", "2", "--params-m",
                           "0.05", "--batch", "1", "--seq", "8", "--every", "2", "--checkpoints", "1", "--repeats",
                           "1", "--json", str(out), "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out) as f:
        data = json.load(f)
    methods = {m["key"]: m for m in data["methods"]}
    assert set(methods) == {"none_fsdp2", "lazyckpt_fsdp2", "dcp_stager_fsdp2", "torch_checkpointing_fsdp2", "none_ddp",
                            "lazyckpt_ddp_split", "lazyckpt_ddp_rank0"}
    peer = methods["torch_checkpointing_fsdp2"]
    if not peer["available"]:  # an optional peer
        assert "import torch_checkpointing failed" in methods.pop("torch_checkpointing_fsdp2")["unavailable"]
    failed = {k: m["errors"] or m["verify_problems"] for k, m in methods.items() if m["verified"] is not True}
    assert not failed, failed
    runs = {run["method"]: run["ranks"] for run in data["runs"]}
    shard = [r["shard_bytes"] for r in runs["lazyckpt_fsdp2"]]
    replica = runs["lazyckpt_ddp_split"][0]["shard_bytes"]
    assert sum(shard) == pytest.approx(replica, rel=0.05)  # FSDP2 ranks hold halves of the state DDP replicates
    split = [r["written_bytes"] for r in runs["lazyckpt_ddp_split"]]
    alone = [r["written_bytes"] for r in runs["lazyckpt_ddp_rank0"]]
    assert alone[1] == 0 and split[0] == pytest.approx(alone[0] / 2, rel=0.1) == split[1]
    assert {t["target"] for rows in data["targets"].values() for t in rows} >= {
        "time to durable <= DCP + DefaultStager's", "time to durable <= 0.7x rank 0 writing all"}
    assert "| lazyckpt (FSDP2) | yes |" in proc.stdout
    assert os.listdir(tmp_path / "work") == []


def test_distributed_metrics_take_the_worst_and_the_median_rank(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import dist_compare
    from dist_methods import DIST_BASELINE_FOR, LazyParallel, NoCheckpointFsdp

    def rank(index, stall_s, peak_mb, e2e_s):
        return {"rank": index, "stall_s": stall_s, "durable_s": [1.0 + index], "peak_rss_bytes": peak_mb << 20,
                "e2e_s": e2e_s, "shard_bytes": 100 << 20, "written_bytes": 100 << 20, "verified": True}

    runs = [{"method": "none_fsdp2", "repeat": 0, "ranks": [rank(0, [], 500, 10.0), rank(1, [], 600, 10.0)]},
            {"method": "lazyckpt_fsdp2", "repeat": 0,
             "ranks": [rank(0, [0.01, 0.03], 610, 11.0), rank(1, [0.05, 0.05], 660, 12.0)]}]
    lazy = dist_compare.aggregate([NoCheckpointFsdp, LazyParallel], runs, DIST_BASELINE_FOR)[1]
    assert lazy["verified"] is True
    assert lazy["stall_ms"]["median"] == pytest.approx(50) and lazy["stall_ms_median"]["median"] == pytest.approx(35)
    assert lazy["durable_s"]["median"] == 2.0
    assert lazy["extra_rss_mb"]["median"] == pytest.approx(110)  # against the same rank of the baseline
    assert lazy["extra_rss_x_shard"]["median"] == pytest.approx(1.1)
    assert lazy["e2e_slowdown_pct"]["median"] == pytest.approx(20)


def test_malloc_mmap_threshold_is_set_for_the_fork_server_only_when_asked(monkeypatch):
    """glibc reads MALLOC_MMAP_THRESHOLD_ when a process starts: it must be in the environment the fork server
    (every run's parent) starts with, and absent unless ``--malloc-mmap-threshold`` asked for it."""
    monkeypatch.syspath_prepend(BENCH)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # fork_server edits the environment: keep ours clean
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # a caller's own setting does not pass through unasked
    import compare
    import harness
    from workload import Workload

    assert compare.parse_args(["--quick"]).malloc_mmap_threshold is None
    compare.fork_server(Workload())
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ
    args = compare.parse_args(["--quick", "--malloc-mmap-threshold", "1048576"])
    compare.fork_server(Workload(), args.malloc_mmap_threshold)
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == "1048576"
    assert harness.allocator_env()["MALLOC_MMAP_THRESHOLD_"] == "1048576"  # what the JSON's config records


@pytest.mark.slow
def test_stall_parts_times_every_part_on_every_rank():
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "stall_parts.py"), "--world-size", "2", "--saves", "1",
                           "--params-m", "0.3"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"]
    for line in lines:
        medians = json.loads(line.split("median ms ", 1)[1])
        assert set(medians) == {"get_state_dict", "lazy_save", "lazy_wait_staged", "dcp_async_save",
                                "dcp_staging_wait"} and all(v >= 0 for v in medians.values())


def test_tree_reads_runs_at_its_smallest_setting():
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "tree_reads.py"), "--scale", "0.01"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "2000 tensors: json.loads" in proc.stdout and "checkpoint: load" in proc.stdout, proc.stdout


# --- benchmarks/transformers_save.py: the Hugging Face Trainer's own save against LazyCheckpointCallback -------------


@pytest.mark.slow
def test_transformers_save_small_verifies_every_method_and_reports_the_ratio(tmp_path):
    pytest.importorskip("transformers")
    out, work = tmp_path / "hf.json", tmp_path / "work"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "transformers_save.py"), "--small", "--json", str(out),
                           "--workdir", str(work)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out) as f:
        data = json.load(f)
    methods = {m["key"]: m for m in data["methods"]}
    assert list(methods) == ["none", "trainer_save", "lazyckpt"]
    failed = {k: m["verify_problems"] for k, m in methods.items() if m["verified"] is not True}
    assert not failed, failed
    for key in ("trainer_save", "lazyckpt"):
        assert methods[key]["stall_ms"]["median"] > 0 and methods[key]["ckpt_mb"]["median"] > 0, key
    assert methods["lazyckpt"]["stall_ratio"]["n"] == 1 and methods["lazyckpt"]["callback_ms"]["median"] > 0
    assert [t["target"] for t in data["targets"]["lazyckpt"]] == [
        "stall <= 1/20 of the Trainer's own save", "the callback's time per save <= 1/20 of the Trainer's own save",
        "quiet step <= 1.05x no checkpoint", "overhead per save below the Trainer's own save's"]
    assert data["config"]["command"].startswith("python benchmarks/transformers_save.py --small")
    assert "| LazyCheckpointCallback | yes |" in proc.stdout
    assert os.listdir(work) == []


def test_transformers_save_reports_a_checkpoint_that_differs_from_its_step_as_fail(tmp_path, monkeypatch):
    """The state a checkpoint is compared with is that of its step: one changed value makes the run FAIL."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(BENCH)
    import transformers_save
    from workload import Workload

    w = Workload(params_m=0.05, batch=1, seq=8, every=2, checkpoints=1, threads=1)
    reference = transformers_save.run_one("none", w, str(tmp_path), -1, None)
    assert transformers_save.run_one("lazyckpt", w, str(tmp_path), 0, reference)["verified"] is True
    key = next(k for k in reference["at_step"] if k.startswith("model/"))
    reference["at_step"][key].view(-1)[0] += 1
    for method in ("trainer_save", "lazyckpt"):
        result = transformers_save.run_one(method, w, str(tmp_path), 0, reference)
        assert result["verified"] is False, method
        assert result["verify_problems"] == [f"checkpoint-{w.verified_step}: {key}: 1 of "
                                             f"{reference['at_step'][key].numel()} values differ from the state at "
                                             "that step (torn or stale)"], method
    assert os.listdir(tmp_path) == []  # every run removed its output_dir


def test_transformers_save_ratios_pair_the_runs_of_one_repeat(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import transformers_save

    def run(method, repeat, stall_s, quiet_s, e2e_s):
        return {"method": method, "repeat": repeat, "verified": True, "verify_problems": [], "step_s": [quiet_s],
                "quiet_step_s": [quiet_s], "e2e_s": e2e_s, "drain_s": 0.0, "stall_s": stall_s, "first_stall_s": 1.0,
                "callback_s_per_save": 0.02 if method == "lazyckpt" else None, "durable_s": [], "ckpt_bytes": 1 << 20,
                "measured_s": e2e_s, "saves": 2, "after_save_s": [quiet_s]}

    runs = [run("none", 0, [], 1.0, 10.0), run("none", 1, [], 1.2, 12.0),
            run("trainer_save", 0, [0.5, 0.7], 1.0, 14.0), run("trainer_save", 1, [1.0], 1.1, 16.0),
            run("lazyckpt", 0, [0.01, 0.01], 1.05, 11.0), run("lazyckpt", 1, [0.1], 1.26, 11.0)]
    entries = {e["key"]: e for e in transformers_save.aggregate(runs)}
    assert entries["lazyckpt"]["stall_ratio"]["min"] == pytest.approx(10)  # repeat 1: 1.0 / 0.1
    assert entries["lazyckpt"]["stall_ratio"]["max"] == pytest.approx(60)  # repeat 0: 0.6 / 0.01
    assert entries["lazyckpt"]["quiet_step_x"]["max"] == pytest.approx(1.05)  # 1.05 / 1.0 and 1.26 / 1.2
    assert entries["lazyckpt"]["quiet_step_x"]["min"] == pytest.approx(1.05)
    assert entries["trainer_save"]["e2e_x"]["median"] == pytest.approx((14 / 10 + 16 / 12) / 2)
    assert entries["lazyckpt"]["overhead_ms"]["median"] == pytest.approx(0)  # (11 - 10) / 2 and (11 - 12) / 2 s
    assert entries["trainer_save"]["overhead_ms"]["median"] == pytest.approx(2000)
    rows = transformers_save.targets(list(entries.values()))["lazyckpt"]
    # 55 ms > 800 / 20 ms; 20 ms <= 40 ms; 1.05 <= 1.05; 0 < 2000 ms, further apart than the noise (500 ms)
    assert [row["met"] for row in rows] == [False, True, True, True]
    assert rows[3]["noise"] == pytest.approx(500)


# --- benchmarks/deepspeed_save.py: DeepSpeed's torch engine against LazyCheckpointEngine -----------------------------


@pytest.mark.slow
def test_deepspeed_save_small_verifies_both_engines_and_reports_the_ratio(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "ds.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "deepspeed_save.py"), "--small", "--stages", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = json.loads(out.read_text())["table"]["1"]
    assert set(table) == {"torch", "lazy"} and all(row["verified"] for row in table.values())
    assert table["lazy"]["own_ms"] is not None and "lazy stall / torch engine stall" in proc.stdout


# --- benchmarks/host_level.py: restarts from the host folder, the loop with keep_in_memory="host" -------------------


@pytest.mark.slow
def test_host_level_small_restores_from_every_source_and_frees_the_host_folders(tmp_path):
    shm, work, out = tmp_path / "shm", tmp_path / "work", tmp_path / "host.json"
    shm.mkdir()
    remote = importlib.util.find_spec("moto") is not None
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "host_level.py"), "--small", "--host-memory-dir",
                           str(shm), "--workdir", str(work), "--json", str(out), *([] if remote else ["--no-remote"])],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads(out.read_text())
    runs = data["restore_runs"]
    assert set(runs) == {"host", "disk", *(["s3"] if remote else [])}
    assert all(r["path"].startswith(str(shm) + "/") for r in runs["host"])  # read from the host folder itself
    assert all(r["path"].startswith(str(work) + "/") for r in runs["disk"])
    assert len({r["loss"] for done in runs.values() for r in done}) == 1
    for threads, summary in data["loops"].items():
        assert set(summary) == {"none", "disk", "host"}, threads
        assert summary["host"]["stall_ms"] > 0 and summary["host"]["copy_to_dirpath_s"]["n"] >= 1
    assert [t["target"] for t in data["targets"]["host"]][0].startswith("restart to the first resumed step")
    assert "| host folder (tmpfs) |" in proc.stdout and '| `keep_in_memory="host"` |' in proc.stdout
    assert os.listdir(shm) == [] and os.listdir(work) == []


def test_host_level_refuses_a_restore_that_read_another_copy_or_another_state(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import host_restore

    sources = {"host": {"where": "/shm/abc"}, "disk": {"where": "/run"}}
    good = {"host": [{"path": "/shm/abc/step-0000002", "loss": 1.5}], "disk": [{"path": "/run/step-0000002",
                                                                                  "loss": 1.5}]}
    host_restore.check_restores(good, sources)
    with pytest.raises(RuntimeError, match="the disk restore read /shm/abc/step-0000002"):
        host_restore.check_restores({**good, "disk": good["host"]}, sources)
    with pytest.raises(RuntimeError, match="loss differs between the sources"):
        host_restore.check_restores({**good, "disk": [{"path": "/run/step-0000002", "loss": 1.25}]}, sources)


# --- benchmarks/peer_copy.py: restarts after a lost node from the peer's copy, the loop with memory_peers=1 --------


@pytest.mark.slow
def test_peer_copy_small_restores_a_lost_node_from_its_peer_and_frees_the_host_folders(tmp_path):
    shm, work, out = tmp_path / "shm", tmp_path / "work", tmp_path / "peer.json"
    shm.mkdir()
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "peer_copy.py"), "--small", "--host-memory-dir",
                           str(shm), "--workdir", str(work), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads(out.read_text())
    runs = data["restore_runs"]
    assert set(runs) == {"host", "peer", "disk"}
    for source, done in runs.items():  # each rank read its own node's copy: tmpfs, or the disk after a reboot
        for r in done:
            assert all(rank["path"].startswith(str(shm if source != "disk" else work) + "/") for rank in r["ranks"])
    for rank in (0, 1):
        assert len({r["ranks"][rank]["loss"] for done in runs.values() for r in done}) == 1
    for threads, summary in data["loops"].items():
        assert set(summary) == {"none", "peers0", "peers1"}, threads
        assert summary["peers1"]["stall_ms"] > 0
    assert "| node 0 lost: the peer's copy |" in proc.stdout and "| `memory_peers=1` |" in proc.stdout
    assert os.listdir(shm) == [] and os.listdir(work) == []
