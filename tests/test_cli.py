"""``lazyckpt ls/show/verify``: readable output, one clear line per problem, exit codes 0 / 1 / 2."""

from __future__ import annotations

import os

import pytest
import torch

import lazyckpt
from lazyckpt import cli

from helpers.forge import FILE, RANK0, edit_manifest


@pytest.fixture
def dirpath(tmp_path):
    state = {"model": {"0.weight": torch.ones(4, 4), "a/b": torch.zeros(3, dtype=torch.bfloat16)}, "epoch": 3}
    with lazyckpt.LazyCheckpointer(tmp_path / "ckpt") as ckpt:
        for step in (10, 20):
            ckpt.save(state, step=step).wait()
    os.symlink("step-0000020", tmp_path / "ckpt" / "last.ckpt")
    return tmp_path / "ckpt"


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_lists_steps_with_names_sizes_and_the_latest(dirpath, capsys):
    os.symlink("nowhere", dirpath / "dangling")
    code, out, err = run(capsys, "ls", dirpath)
    assert code == 0 and err == ""
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    assert set(rows) == {"10", "20"}
    assert "last.ckpt (latest)" in rows["20"] and "step-0000020" in rows["20"]
    assert "kB" in rows["10"] and "latest" not in rows["10"]


def test_ls_of_a_missing_directory_exits_1_with_one_line(tmp_path, capsys):
    code, out, err = run(capsys, "ls", tmp_path / "nowhere")
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [f"lazyckpt: {tmp_path / 'nowhere'} is not a directory"]


def test_show_prints_the_state_as_a_tree_never_raw_json(dirpath, capsys):
    code, out, err = run(capsys, "show", dirpath / "step-0000020")
    assert code == 0, err
    assert "a/b  bfloat16 [3]  6 bytes" in out, "key paths appear unescaped with dtype, shape and size"
    assert "0.weight  float32 [4, 4]  64 bytes" in out
    assert "model  dict of 2  70 bytes" in out and "epoch  3" in out
    assert "$dict" not in out and "format_version" not in out and "%2F" not in out


@pytest.mark.parametrize("damage", [
    lambda p: open(os.path.join(p, RANK0), "wb").write(b"{not json"),
    lambda p: open(os.path.join(p, RANK0), "wb").write(b"\xff\xfe"),
    lambda p: edit_manifest(os.path.join(p, RANK0), lambda d: d.pop("tensors")),
    lambda p: os.remove(os.path.join(p, FILE)),
    lambda p: os.remove(os.path.join(p, "manifest.json")),
], ids=["bad_json", "not_utf8", "missing_field", "missing_tensor_file", "uncommitted"])
@pytest.mark.parametrize("command", ["show", "verify"])
def test_damaged_checkpoints_give_one_line_and_exit_1(dirpath, capsys, damage, command):
    path = dirpath / "step-0000010"
    damage(str(path))
    code, out, err = run(capsys, command, path)
    assert code == 1
    problems = [line for line in err.splitlines() if line.startswith("lazyckpt: ")]
    assert len(problems) == 1 and str(path) in problems[0], err
    assert "Traceback" not in err + out


def test_verify_reports_each_damaged_rank_on_its_own_line(tmp_path, capsys):
    path = _two_rank_checkpoint(tmp_path)
    for rank in (0, 1):
        with open(os.path.join(path, f"rank-{rank:05d}-of-00002.safetensors"), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\x7f")
    code, out, err = run(capsys, "verify", path)
    assert code == 1
    problems = [line for line in err.splitlines() if line.startswith("lazyckpt: ")]
    assert len(problems) == 2 and "rank-00000-of-00002" in problems[0] and "rank-00001-of-00002" in problems[1]
    assert "FAILED" in err and "2 of 2 rank(s)" in err


def _two_rank_checkpoint(tmp_path):
    ranks = [lazyckpt.LazyCheckpointer(tmp_path / "multi", rank=r, world_size=2) for r in range(2)]
    pending = [ckpt.save({"w": torch.full((8,), float(r))}, step=5) for r, ckpt in enumerate(ranks)]
    path = [p.wait() for p in pending][0]
    for ckpt in ranks:
        ckpt.close()
    return path


def test_verify_ok_prints_a_summary_and_draws_progress_for_large_checkpoints(dirpath, capsys, monkeypatch):
    monkeypatch.setattr(cli, "PROGRESS_MIN_BYTES", 0)
    code, out, err = run(capsys, "verify", dirpath / "step-0000010", dirpath / "last.ckpt")
    assert code == 0, err
    assert [line.split(":")[0] for line in out.splitlines()] == [f"OK {dirpath / 'step-0000010'}",
                                                               f"OK {dirpath / 'step-0000020'}"]
    assert "step 10, 1 rank(s)" in out


def test_bad_usage_exits_2(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["verify"])
    assert exited.value.code == 2


def test_export_safetensors_writes_the_weights_under_plain_names(dirpath, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "out" / "model.safetensors"
    code, stdout, err = run(capsys, "export", dirpath / "last.ckpt", out, "--format", "safetensors")
    assert code == 0, err
    weights = load_file(out)
    assert sorted(weights) == ["0.weight", "a/b"]
    assert torch.equal(weights["0.weight"], torch.ones(4, 4)) and weights["a/b"].dtype == torch.bfloat16


def test_export_without_a_weights_dict_names_the_fix(dirpath, tmp_path, capsys):
    code, _, err = run(capsys, "export", dirpath / "last.ckpt", tmp_path / "m.safetensors", "--format",
                       "safetensors", "--key", "epoch")
    assert code == 1 and "pass --key" in err and len(err.strip().splitlines()) == 1


def test_export_lightning_writes_a_ckpt_that_loads_with_weights_only(tmp_path, capsys):
    pytest.importorskip("lightning")
    state = {"pytorch-lightning_version": "2.4.0", "state_dict": {"layer.weight": torch.ones(2, 2)}, "epoch": 1,
             "global_step": 8}
    with lazyckpt.LazyCheckpointer(tmp_path / "pl") as ckpt:
        path = ckpt.save(state, step=8).wait()
    code, _, err = run(capsys, "export", path, tmp_path / "out.ckpt")
    assert code == 0, err
    loaded = torch.load(tmp_path / "out.ckpt", weights_only=True)
    assert torch.equal(loaded["state_dict"]["layer.weight"], torch.ones(2, 2)) and loaded["global_step"] == 8


def test_ls_shows_the_monitored_score_of_the_top_k_names_of_a_step(tmp_path, capsys):
    dirpath = tmp_path / "ckpt"
    scores = {"epoch=0-step=10.ckpt": torch.tensor(0.75), "epoch=1-step=20.ckpt": torch.tensor(0.5)}
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        for step, name in ((10, "epoch=0-step=10.ckpt"), (20, "epoch=1-step=20.ckpt"), (30, None)):
            best = {str(dirpath / n): s for n, s in scores.items() if int(n.split("=")[-1][:-5]) <= step}
            state = {"state_dict": {"w": torch.ones(64)}, "callbacks": {
                "ModelCheckpoint{'monitor': 'val_loss'}": {"monitor": "val_loss", "best_k_models": best}}}
            ckpt.save(state, step=step).wait()
            if name is not None:
                os.symlink(f"step-{step:07d}", dirpath / name)
    code, out, err = run(capsys, "ls", dirpath)
    assert code == 0 and err == ""
    rows = {line.split("│")[1].strip(): line.split("│")[-2].strip() for line in out.splitlines() if line.count("│") > 3}
    assert "monitored" in out and {k: v for k, v in rows.items() if k.isdigit()} == {
        "10": "val_loss=0.75", "20": "val_loss=0.5", "30": ""}


def test_show_and_verify_of_a_run_directory_act_on_its_newest_checkpoint(dirpath, capsys):
    code, out, err = run(capsys, "verify", dirpath)
    assert code == 0, err
    assert out.startswith(f"OK {dirpath / 'step-0000020'}: step 20")
    assert f"{dirpath} is a run directory: using its newest checkpoint, {dirpath / 'step-0000020'}" in err
    code, out, err = run(capsys, "show", dirpath)
    assert code == 0 and "step 20, rank 0 of 1" in out


def test_export_says_what_it_is_doing_before_the_long_read(dirpath, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "PROGRESS_MIN_BYTES", 0)  # as if the checkpoint were large
    code, out, err = run(capsys, "export", dirpath / "step-0000020", tmp_path / "m.safetensors", "--format",
                         "safetensors")
    assert code == 0, err
    assert f"exporting {dirpath / 'step-0000020'} to {tmp_path / 'm.safetensors'}, reading and checking every " \
           "checksum: " in err and "of tensors" in err


def test_exports_progress_counts_every_tensor_byte_it_reads(dirpath, tmp_path):
    """The bar of `lazyckpt export` advances by the bytes the export reads (it was a spinner, no bytes)."""
    from lazyckpt.storage import LocalStorage
    from lazyckpt.storage.metered import MeteredReads

    counted = []
    step = dirpath / "step-0000020"
    lazyckpt.export(step, tmp_path / "m.safetensors", format="safetensors",
                    storage=MeteredReads(LocalStorage(), on_bytes=counted.append))
    tensor_file_bytes = sum(os.path.getsize(step / name) for name in os.listdir(step) if name.endswith(".safetensors"))
    assert sum(counted) >= tensor_file_bytes > 0 and len(counted) > 1


def test_the_export_function_is_part_of_the_package(dirpath, tmp_path):
    out = lazyckpt.export(dirpath / "last.ckpt", tmp_path / "model.safetensors", format="safetensors")
    from safetensors.torch import load_file

    assert torch.equal(load_file(out)["0.weight"], torch.ones(4, 4))


def test_show_counts_a_tied_weight_once_and_marks_it_tied(tmp_path, capsys):
    w = torch.zeros(4, 4)
    with lazyckpt.LazyCheckpointer(tmp_path / "run") as ckpt:
        path = ckpt.save({"embed": {"weight": w}, "head": {"weight": w}}, step=1).wait()
    code, out, err = run(capsys, "show", path)
    assert code == 0, err
    assert "64 bytes of tensors" in out, "stored once, counted once"
    assert "weight  float32 [4, 4]  tied to embed/weight" in out
