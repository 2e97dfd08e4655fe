"""Lightning Fabric: ``fabric.save`` through ``LazyFabricIO`` is one lazy request, ``fabric.load`` reads it back
bit-exact (a name, a step directory, a run folder), single process and DDP (two forked gloo processes)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning")
from lightning.fabric import Fabric  # noqa: E402

import lazyckpt  # noqa: E402
from conftest import GatedBackend  # noqa: E402
from helpers.remote import moto_endpoint, s3_remote  # noqa: E402,F401 - fixtures

ITERS = 6


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batches(rank=0):
    generator = torch.Generator().manual_seed(1 + rank)
    return [torch.randn(4, 8, generator=generator) for _ in range(ITERS)]


def train(fabric, model, opt, start, stop, save_dir=None):
    data = batches(fabric.global_rank)
    for i in range(start, stop):
        fabric.backward(model(data[i]).square().mean())
        opt.step()
        opt.zero_grad()
        if save_dir is not None:
            fabric.save(os.path.join(save_dir, f"iter-{i + 1}.ckpt"), {"model": model, "optimizer": opt, "iter": i + 1})


def fresh(io, **kwargs):
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io], **kwargs)
    model, opt = make()
    return fabric, *fabric.setup(model, opt)


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_fabric_save_and_load_resume_bit_exact_from_a_name_a_step_and_a_run_folder(tmp_path):
    io = lazyckpt.LazyFabricIO()
    fabric, model, opt = fresh(io)
    train(fabric, model, opt, 0, ITERS, save_dir=tmp_path)
    io.close()
    final = weights(model)
    for source in (tmp_path / "iter-3.ckpt", tmp_path / "step-0000003"):
        fabric, model, opt = fresh(lazyckpt.LazyFabricIO())
        remainder = fabric.load(source, {"model": model, "optimizer": opt})
        assert remainder == {"iter": 3}
        train(fabric, model, opt, 3, ITERS)
        assert all(torch.equal(final[k], v) for k, v in model.state_dict().items()), source
    assert fabric.load(tmp_path)["iter"] == ITERS, "a run folder: its newest step"


def test_fabric_save_returns_before_the_copy_and_the_next_update_waits_for_it(tmp_path):
    backend = GatedBackend()
    io = lazyckpt.LazyFabricIO(backend=backend)
    fabric, model, opt = fresh(io)
    train(fabric, model, opt, 0, 1)
    saved = weights(model)
    fabric.save(tmp_path / "a.ckpt", {"model": model, "optimizer": opt})
    backend.entered.wait()  # the request returned; its copy waits at the gate, nothing is committed
    assert not (tmp_path / "a.ckpt").exists()
    backend.gate.set()
    train(fabric, model, opt, 1, 2)  # the update's pre-hook is the barrier: the copy finished first
    io.close()
    loaded = lazyckpt.load(tmp_path / "a.ckpt")["model"]
    assert all(torch.equal(saved[k], loaded[k]) for k in saved), "the weights as of the save, not the next update"


def test_keep_last_k_keeps_the_newest_steps_with_their_names(tmp_path):
    io = lazyckpt.LazyFabricIO(keep_last_k=2)
    fabric, model, opt = fresh(io)
    train(fabric, model, opt, 0, ITERS, save_dir=tmp_path)
    io.close()
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == [
        "iter-5.ckpt", "iter-6.ckpt", "step-0000005", "step-0000006"]


def test_an_ordinary_file_still_loads_through_fabrics_own_io(tmp_path):
    torch.save({"x": torch.ones(2)}, tmp_path / "plain.pt")
    fabric, _, _ = fresh(lazyckpt.LazyFabricIO())
    assert torch.equal(fabric.load(tmp_path / "plain.pt")["x"], torch.ones(2))


def _ddp(fabric, root, phase):
    model, opt = make()
    model, opt = fabric.setup(model, opt)
    if phase == "train":
        train(fabric, model, opt, 0, ITERS, save_dir=root)
    else:
        fabric.load(os.path.join(root, "iter-3.ckpt"), {"model": model, "optimizer": opt})
        train(fabric, model, opt, 3, ITERS)
    fabric.strategy.checkpoint_io.close()
    fabric.barrier()
    # Plain lists: tensors returned from a forked process would be shared through a socket that dies with it.
    return {k: v.tolist() for k, v in model.state_dict().items()} if fabric.global_rank == 0 else None


def test_ddp_rank_0_saves_lazily_and_every_rank_resumes_bit_exact(tmp_path):
    def run(phase):
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_fork", plugins=[lazyckpt.LazyFabricIO()])
        return fabric.launch(_ddp, str(tmp_path), phase)

    final = run("train")
    resumed = run("resume")
    assert final == resumed


def test_a_save_to_a_directory_is_refused_and_deletes_nothing(tmp_path):
    io = lazyckpt.LazyFabricIO()
    fabric, model, opt = fresh(io)
    train(fabric, model, opt, 0, 2, save_dir=tmp_path / "run")
    io.wait()
    with pytest.raises(IsADirectoryError, match="give a file name"):
        fabric.save(tmp_path / "run", {"model": model})
    io.close()
    assert sorted(n for n in os.listdir(tmp_path / "run") if not n.startswith(".")) == [
        "iter-1.ckpt", "iter-2.ckpt", "step-0000001", "step-0000002"]


def test_keep_last_k_counts_the_names_an_earlier_process_left(tmp_path):
    io = lazyckpt.LazyFabricIO(keep_last_k=2)
    fabric, model, opt = fresh(io)
    train(fabric, model, opt, 0, 3, save_dir=tmp_path)  # iter-2.ckpt and iter-3.ckpt stay
    io.close()
    io = lazyckpt.LazyFabricIO(keep_last_k=2)  # a later process, same folder: its names count too
    fabric, model, opt = fresh(io)
    for i in (7, 8):
        fabric.save(tmp_path / f"more-{i}.ckpt", {"model": model})
    io.close()
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == [
        "more-7.ckpt", "more-8.ckpt", "step-0000004", "step-0000005"]


def test_saving_into_a_new_folder_finishes_the_previous_ones_engine(tmp_path):
    io = lazyckpt.LazyFabricIO()
    fabric, model, opt = fresh(io)
    for i in range(3):  # LitGPT: out/step-00000i/lit_model.pth
        fabric.save(tmp_path / f"step-{i:06d}" / "lit_model.pth", {"model": model, "iter": i})
        assert len(io._runs) == 1, "one engine at a time"
    io.close()
    assert [lazyckpt.load(tmp_path / f"step-{i:06d}" / "lit_model.pth")["iter"] for i in range(3)] == [0, 1, 2]


def test_the_plugin_pickles_for_spawned_processes_and_keeps_its_barrier():
    import pickle

    io = pickle.loads(pickle.dumps(lazyckpt.LazyFabricIO(keep_last_k=2)))
    assert io.options.keep_last_k == 2 and io._hook is not None


def test_remote_level_gives_each_folder_its_url_and_a_fresh_node_resumes_from_it(tmp_path, s3_remote):
    url, options = s3_remote
    io = lazyckpt.LazyFabricIO(remote=url, storage_options=options)
    fabric, model, opt = fresh(io)
    train(fabric, model, opt, 0, 3, save_dir=tmp_path / "node0" / "ckpts")
    io.close()
    final = weights(model)
    newest = f"{url}/ckpts/step-0000003"
    assert lazyckpt.latest(f"{url}/ckpts", storage_options=options) == newest
    # A fresh node: its folder is empty; it resumes from the remote, and its steps count on from there.
    io = lazyckpt.LazyFabricIO(remote=url, storage_options=options)
    fabric, model, opt = fresh(io)
    assert fabric.load(newest, {"model": model, "optimizer": opt}) == {"iter": 3}
    assert all(torch.equal(final[k], v) for k, v in model.state_dict().items())
    fabric.save(tmp_path / "node1" / "ckpts" / "iter-4.ckpt", {"model": model, "iter": 4})
    io.close()
    assert os.path.realpath(tmp_path / "node1" / "ckpts" / "iter-4.ckpt").endswith("step-0000004")
    assert lazyckpt.latest(f"{url}/ckpts", storage_options=options) == f"{url}/ckpts/step-0000004"


def test_two_folders_of_one_name_are_refused_on_one_remote(tmp_path, s3_remote):
    url, options = s3_remote
    io = lazyckpt.LazyFabricIO(remote=url, storage_options=options)
    fabric, model, opt = fresh(io)
    fabric.save(tmp_path / "a" / "ckpts" / "last.ckpt", {"model": model})
    with pytest.raises(ValueError, match="would both upload to"):
        fabric.save(tmp_path / "b" / "ckpts" / "last.ckpt", {"model": model})
    io.close()
    assert not (tmp_path / "b").exists()


def test_a_spool_dir_is_refused_it_has_no_use_here(tmp_path):
    with pytest.raises(ValueError, match=r"spool_dir=.* has no use"):
        lazyckpt.LazyFabricIO(spool_dir=str(tmp_path / "spool"))
