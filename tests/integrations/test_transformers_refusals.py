"""What LazyCheckpointCallback refuses, at on_train_begin, before it writes anything: DeepSpeed and sharded
models (FSDP, DTensor parameters), whose weights the Trainer loads through loaders of their own."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import TrainerControl, TrainerState, TrainingArguments  # noqa: E402

from lazyckpt import LazyCheckpointCallback  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402


def _begin(args: TrainingArguments, model: torch.nn.Module) -> None:
    LazyCheckpointCallback().on_train_begin(args, TrainerState(), TrainerControl(), model=model,
                                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1), lr_scheduler=None)


def _args(tmp_path) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])


@pytest.mark.parametrize("field,value,match", [("deepspeed", "ds_config.json", "DeepSpeed"),
                                                ("fsdp", ["full_shard"], "sharded models")])
def test_deepspeed_and_fsdp_arguments_are_refused_and_nothing_is_written(tmp_path, field, value, match):
    args = _args(tmp_path)
    setattr(args, field, value)  # set after construction: building such arguments needs the backend installed
    with pytest.raises(ValueError, match=match):
        _begin(args, torch.nn.Linear(2, 2))
    assert not (tmp_path / "out").exists()


def _dtensor_model(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    model = torch.nn.Linear(4, 4)
    mesh = init_device_mesh("cpu", (world_size,))
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh))
    args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="DTensor parameters: True"):
        _begin(args, model)


def test_a_model_with_dtensor_parameters_is_refused(tmp_path):
    run_ranks(_dtensor_model, 1, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
