"""What LazyCheckpointCallback refuses, at on_init_end (before train() prepares and loads anything) and again at
on_train_begin (a callback added later): DeepSpeed and sharded models (FSDP from the arguments or from the
accelerator's state, DTensor parameters), whose weights the Trainer loads through loaders of their own."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import TrainerControl, TrainerState, TrainingArguments  # noqa: E402

from lazyckpt import LazyCheckpointCallback  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402


def _refused(args: TrainingArguments, model: torch.nn.Module, match: str) -> None:
    """Both events refuse, and neither wrote anything."""
    kwargs = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), lr_scheduler=None)
    for event in ("on_init_end", "on_train_begin"):
        with pytest.raises(ValueError, match=match):
            getattr(LazyCheckpointCallback(), event)(args, TrainerState(), TrainerControl(), **kwargs)


@pytest.mark.parametrize("field,value,match", [("deepspeed", "ds_config.json", "DeepSpeed"),
                                                ("fsdp", ["full_shard"], "sharded models")])
def test_deepspeed_and_fsdp_arguments_are_refused_and_nothing_is_written(tmp_path, field, value, match):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    setattr(args, field, value)  # set after construction: building such arguments needs the backend installed
    _refused(args, torch.nn.Linear(2, 2), match)
    assert not (tmp_path / "out").exists()


def _dtensor_model(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    model = torch.nn.Linear(4, 4)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), init_device_mesh("cpu", (world_size,))))
    _refused(TrainingArguments(output_dir=out, use_cpu=True, report_to=[]), model, "DTensor parameters: True")


def _fsdp_from_the_launcher(rank: int, world_size: int, out: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[])  # no fsdp= in the arguments
    Accelerator(cpu=True).state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=1)  # accelerate launch's
    _refused(args, torch.nn.Linear(2, 2), "an FSDP plugin: True")


@pytest.mark.parametrize("setup", [_dtensor_model, _fsdp_from_the_launcher], ids=["dtensor", "launcher-fsdp"])
def test_a_sharded_model_is_refused_however_it_was_configured(tmp_path, setup):
    run_ranks(setup, 1, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
