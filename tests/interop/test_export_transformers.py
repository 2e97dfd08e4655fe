"""``export --format transformers``: the Hugging Face Trainer's own checkpoint folder of a checkpoint laid out as
``LazyCheckpointCallback`` writes it (built here in-process from the callback's own layout functions; the Trainer
runs that resume from an export are in tests/integrations/test_transformers.py)."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import lazyckpt
from helpers.distributed import run_ranks
from helpers.remote import moto_endpoint, s3_remote  # noqa: F401 - fixtures
from lazyckpt.interop.export import export
from lazyckpt.storage import LocalStorage

transformers = pytest.importorskip("transformers")
from lazyckpt.integrations import _transformers_state as layout  # noqa: E402 - imports transformers
from transformers.trainer_pt_utils import safe_globals  # noqa: E402

TRAINER_FILES = ["config.json", "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt",
                 "trainer_state.json"]


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16,
                                                                n_positions=8))


def trained(model):
    """The model after one AdamW step, with its optimizer and a stepped LambdaLR (as the Trainer builds them)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    ids = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    return opt, sched


def callback_tree(model, opt, sched, *, rank=0, model_only=False):
    """The tree LazyCheckpointCallback passes at a save (its own functions), its Deferred leaves resolved."""
    at_save = layout.capture_at_save(transformers.TrainerState(global_step=1, max_steps=4), None)
    tree = {**layout.replicated_state(model, opt, sched, None, model_only=model_only, at_save=lambda: at_save),
            **layout.per_rank_state(rank, lambda: at_save)}
    tree[layout.TRAINER]["trainer_state"] = at_save.trainer_state
    tree[layout.RANK]["rng"] = at_save.rng
    return tree, at_save


def save_as_the_callback(dirpath, *, model_only=False):
    model = tiny_model()
    opt, sched = trained(model)
    tree, at_save = callback_tree(model, opt, sched, model_only=model_only)
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        path = ckpt.save(tree, step=1).wait()
    layout.write_trainer_files(LocalStorage(), path, trainer_state=at_save.trainer_state,
                               model_keys=sorted(model.state_dict()), config_json=layout.config_json(model))
    return path, model, opt, sched, at_save


def test_the_export_is_the_trainers_folder_and_from_pretrained_loads_the_model(tmp_path):
    path, model, opt, sched, at_save = save_as_the_callback(tmp_path / "ckpt")
    out = export(path, tmp_path / "handed-over", format="transformers")
    assert out == str(tmp_path / "handed-over") and sorted(os.listdir(out)) == TRAINER_FILES
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert "lm_head.weight" not in weights and "transformer.wte.weight" in weights, "tied weights once, as saved"
    assert (tmp_path / "handed-over" / "trainer_state.json").read_text() == at_save.trainer_state
    optimizer = torch.load(os.path.join(out, "optimizer.pt"), weights_only=True)  # as the Trainer loads them
    assert optimizer["param_groups"] == opt.state_dict()["param_groups"]
    for index, state in opt.state_dict()["state"].items():
        assert all(torch.equal(optimizer["state"][index][k], v) for k, v in state.items())
    assert torch.load(os.path.join(out, "scheduler.pt"), weights_only=True) == sched.state_dict()
    config = json.loads((tmp_path / "handed-over" / "config.json").read_text())
    assert (config["architectures"], config["dtype"]) == (["GPT2LMHeadModel"], "float32"), "as save_pretrained"
    assert model.config.architectures is None, "the live config is left alone"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_the_rng_file_is_the_trainers_dict_and_restores_the_saved_states(tmp_path):
    path, _, _, _, at_save = save_as_the_callback(tmp_path / "ckpt")
    out = export(path, tmp_path / "out", format="transformers")
    with safe_globals():  # what Trainer._load_rng_state does
        rng = torch.load(os.path.join(out, "rng_state.pth"), weights_only=True)
    assert sorted(rng) == ["cpu", "numpy", "python"]
    saved = at_save.rng
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.random.set_rng_state(rng["cpu"])
    assert random.getstate() == saved["python"]
    assert np.array_equal(np.random.get_state()[1], saved["numpy"][1].numpy().astype(np.uint32))
    assert np.random.get_state()[2:] == saved["numpy"][2:]
    assert torch.equal(torch.random.get_rng_state(), saved["torch"])


def test_a_cuda_state_takes_the_form_the_trainer_restores():
    from lazyckpt.interop.transformers_format import trainer_rng

    rng = {"python": random.getstate(), "numpy": ("MT19937", torch.arange(624), 3, 0, 0.0),
           "torch": torch.get_rng_state(), "cuda": [torch.ones(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)]}
    assert torch.equal(trainer_rng(rng, distributed=False)["cuda"], rng["cuda"][0])  # set_rng_state: one device
    assert [t.sum() for t in trainer_rng(rng, distributed=True)["cuda"]] == [16, 0]  # set_rng_state_all


def test_a_model_only_checkpoint_exports_only_what_it_holds(tmp_path):
    path, *_ = save_as_the_callback(tmp_path / "ckpt", model_only=True)
    out = export(path, tmp_path / "out", format="transformers")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "trainer_state.json"]


def test_a_checkpoint_the_callback_did_not_write_is_refused_naming_the_formats_that_fit(tmp_path, capsys):
    from lazyckpt.cli import main

    with lazyckpt.LazyCheckpointer(tmp_path / "ckpt") as ckpt:
        plain = ckpt.save({"model": {"w": torch.ones(3)}}, step=1).wait()
        lightning = ckpt.save({"pytorch-lightning_version": "2.6.0", "state_dict": {"w": torch.ones(3)}},
                              step=2).wait()
    with pytest.raises(lazyckpt.CheckpointFormatError, match="not written by LazyCheckpointCallback") as refused:
        export(plain, tmp_path / "a", format="transformers")
    assert "--format safetensors" in str(refused.value) and "--format lightning" not in str(refused.value)
    with pytest.raises(lazyckpt.CheckpointFormatError, match="Lightning checkpoint.*--format lightning"):
        export(lightning, tmp_path / "b", format="transformers")
    assert main(["export", lightning, str(tmp_path / "c"), "--format", "transformers"]) == 1
    assert "not written by LazyCheckpointCallback" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], "nothing written, no temporary directory left"


def test_an_out_dir_that_is_not_empty_is_refused_before_anything_is_read(tmp_path, capsys):
    from lazyckpt.cli import main

    path, *_ = save_as_the_callback(tmp_path / "ckpt")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    for taken, said in [("busy", "a directory that is not empty"), ("file", "is a file")]:
        with pytest.raises(FileExistsError, match=f"out_dir=.*{taken}.* {said}"):
            export(path, tmp_path / taken, format="transformers")
        assert main(["export", path, str(tmp_path / taken), "--format", "transformers"]) == 1
        assert said in capsys.readouterr().err
    assert os.listdir(tmp_path / "busy") == ["notes.txt"] and (tmp_path / "file").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert main(["export", path, str(tmp_path / "empty"), "--format", "transformers"]) == 0
    said = capsys.readouterr().out
    assert f"wrote {tmp_path / 'empty'} (" in said and "transformers: config.json, model.safetensors" in said
    assert sorted(os.listdir(tmp_path / "empty")) == TRAINER_FILES
    with pytest.raises(ValueError, match="key='state_dict'.*format='safetensors'"):
        export(path, tmp_path / "new", format="transformers", key="state_dict")


def test_a_failure_while_writing_leaves_no_out_dir_and_no_temporary_one(tmp_path, monkeypatch):
    path, *_ = save_as_the_callback(tmp_path / "ckpt")
    written = []

    def failing(self, target, data, *, sync):
        if written:
            raise OSError(28, "No space left on device")
        written.append(target)
        original(self, target, data, sync=sync)

    original = LocalStorage.write_atomic
    monkeypatch.setattr(LocalStorage, "write_atomic", failing)
    with pytest.raises(OSError, match="No space left"):
        export(path, tmp_path / "out" / "handed-over", format="transformers")
    assert written and os.listdir(tmp_path / "out") == []


def test_a_remote_checkpoint_exports_to_a_local_directory(tmp_path, s3_remote):
    url, options = s3_remote
    model = tiny_model()
    tree, _ = callback_tree(model, *trained(model))
    with lazyckpt.LazyCheckpointer(url, storage_options=options, spool_dir=str(tmp_path / "spool")) as ckpt:
        remote = ckpt.save(tree, step=1).wait_remote()
    out = export(remote, tmp_path / "out", format="transformers", storage_options=options)
    assert sorted(os.listdir(out)) == [n for n in TRAINER_FILES if n != "config.json"], "no config.json written there"
    assert torch.equal(load_file(os.path.join(out, "model.safetensors"))["transformer.wpe.weight"],
                       model.transformer.wpe.weight)


def _save_two_ranks(rank, world_size, dirpath, sharded):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = tiny_model()
    opt, sched = trained(model)
    torch.manual_seed(100 + rank)  # each rank's own RNG states
    tree, _ = callback_tree(model, opt, sched, rank=rank)
    tree[layout.RANK] = lazyckpt.PerRank(tree[layout.RANK])  # as CheckpointSession passes it in a process group
    if sharded:
        tree["transformer.wpe.weight"] = distribute_tensor(tree["transformer.wpe.weight"],
                                                           DeviceMesh("cpu", [0, 1]), [Shard(0)])
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        ckpt.save(tree, step=1).wait()


def test_two_ranks_export_one_rng_file_each_and_a_sharded_model_is_refused(tmp_path):
    run_ranks(_save_two_ranks, 2, str(tmp_path / "ddp"), False)
    out = export(lazyckpt.latest(tmp_path / "ddp"), tmp_path / "out", format="transformers")
    assert sorted(os.listdir(out)) == ["model.safetensors", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth",
                                       "scheduler.pt", "trainer_state.json"]
    for rank in (0, 1):
        torch.manual_seed(100 + rank)
        with safe_globals():
            rng = torch.load(os.path.join(out, f"rng_state_{rank}.pth"), weights_only=True)
        assert torch.equal(rng["cpu"], torch.get_rng_state()), rank
    run_ranks(_save_two_ranks, 2, str(tmp_path / "fsdp"), True)
    with pytest.raises(lazyckpt.CheckpointFormatError, match="'transformer.wpe.weight' is sharded across 2 ranks"):
        export(lazyckpt.latest(tmp_path / "fsdp"), tmp_path / "out2", format="transformers")
    assert not (tmp_path / "out2").exists()
