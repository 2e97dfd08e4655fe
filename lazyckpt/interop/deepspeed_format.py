"""Whole tensors from the ZeRO partitions of a DeepSpeed checkpoint that lazyckpt wrote (docs/deepspeed.md).

A DeepSpeed step holds each rank's DeepSpeed files under ``files`` and the tag under ``tag``. ZeRO 1/2 store each
parameter group as one flat fp32 vector cut into one piece per rank (concatenated, it holds the group's parameters
in order, ``param_alignment_paddings`` apart); ZeRO-3 cuts every parameter into ``ceil(numel / ranks)``-sized pieces,
one per rank, each rank's pieces of a group back to back. :func:`consolidate` undoes both, in one process at any
world size, for the fp32 master weights (as DeepSpeed's ``zero_to_fp32`` does, bit for bit), the module's buffers, and
the optimizer's per-parameter state (cut like the weights). It reads the stored files only; DeepSpeed need not be
installed.

Example:
    >>> whole = consolidate("ckpts/global_step400")                                   # doctest: +SKIP
    >>> model.load_state_dict(whole["module"], strict=False)                          # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import torch

from lazyckpt.errors import CheckpointFormatError
from lazyckpt.read.load import load
from lazyckpt.read.reader import CheckpointReader
from lazyckpt.storage import Storage

_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")


def is_deepspeed_state(state: Any) -> bool:
    """Whether a state loaded for rank 0 is a DeepSpeed tag's files (as ``LazyCheckpointEngine`` saves them)."""
    return _files(state) is not None and any(str(n).endswith("model_states.pt") for n in state["files"])


def _files(state: Any) -> dict[str, Any] | None:
    files = state.get("files") if isinstance(state, dict) and "tag" in state else None
    return files if isinstance(files, dict) else None


def consolidate(path: str | os.PathLike[str], *, verify: bool = True, storage: Storage | None = None
                ) -> dict[str, Any]:
    """``{"module": {name: tensor}, "optimizer": {name: {key: tensor}}, "tag": str, "global_steps": int}`` of the
    DeepSpeed checkpoint at ``path``: whole fp32 weights and buffers, and each parameter's optimizer state.

    Raises:
        CheckpointFormatError: ``path`` is not a DeepSpeed checkpoint, or its partitions do not add up.
    """
    path = os.fspath(path)
    world_size = CheckpointReader(path, storage).world_size
    files: dict[str, Any] = {}
    tag = None
    for rank in range(world_size):
        state = load(path, rank=rank, verify=verify, storage=storage)
        if _files(state) is None or (rank == 0 and not is_deepspeed_state(state)):
            raise CheckpointFormatError(f"{path} is not a DeepSpeed checkpoint (rank {rank} has no DeepSpeed files "
                                        "under 'files')")
        files.update(state["files"])
        tag = state["tag"]
    model = files[min(n for n in files if n.endswith("model_states.pt"))]
    optim = [files[n] for n in sorted((n for n in files if _OPTIM_FILE.fullmatch(n)),
                                      key=lambda n: int(_OPTIM_FILE.fullmatch(n).group(1)))]
    module = {name: model["module"][name] for name in model.get("buffer_names") or ()}
    if not optim:  # no ZeRO: the model states hold the whole module and the client optimizer
        return {"module": dict(model["module"]), "optimizer": model.get("optimizer"), "tag": tag,
                "global_steps": model.get("global_steps")}
    shapes = [dict(group) for group in model["param_shapes"]]
    weights, per_param = _merge(optim, shapes, path)
    return {"module": {**module, **weights}, "optimizer": per_param, "tag": tag,
            "global_steps": model.get("global_steps")}


def _merge(optim: list[dict[str, Any]], shapes: list[dict[str, Any]], path: str
           ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """The weights and per-parameter optimizer state from every rank's optimizer file, in dp-rank order."""
    states = [o["optimizer_state_dict"] for o in optim]
    stage = int(states[0]["zero_stage"])
    if stage <= 2:
        flats = [s["single_partition_of_fp32_groups"] for s in states]
        base = [s["base_optimizer_state"]["state"] for s in states]
        paddings = states[0].get("param_alignment_paddings")
        cut = lambda groups: _zero2(groups, shapes, paddings, path)  # noqa: E731
    else:
        flats = [s["fp32_flat_groups"] for s in states]
        base = [s["optimizer_state_dict"]["state"] for s in states]
        merged = {name: shape for group in shapes for name, shape in group.items()}
        cut = lambda groups: _zero3([torch.cat(list(g)) for g in groups], merged, path)  # noqa: E731
    weights = cut(flats)
    per_param: dict[str, dict[str, Any]] = {name: {} for name in weights}
    for key in {k for state in base[0].values() for k in state}:
        sample = base[0][next(iter(base[0]))][key]
        if isinstance(sample, torch.Tensor) and sample.dim() == 1:
            groups = [[rank_state[g][key] for g in sorted(rank_state)] for rank_state in base]
            for name, tensor in cut(groups).items():
                per_param[name][key] = tensor
        else:  # a scalar (``step``): the same for every parameter of the group
            for name in per_param:
                per_param[name][key] = sample
    return weights, per_param


def _zero2(groups: list[list[torch.Tensor]], shapes: list[dict[str, Any]], paddings: Any, path: str
           ) -> dict[str, torch.Tensor]:
    out = {}
    for index, group_shapes in enumerate(shapes):
        whole = torch.cat([rank_groups[index] for rank_groups in groups])
        offset = 0
        for position, (name, shape) in enumerate(group_shapes.items()):
            numel = math.prod(shape)
            if offset + numel > whole.numel():
                raise CheckpointFormatError(f"{path}: parameter group {index} holds {whole.numel()} values, too few "
                                            f"for {name} {tuple(shape)} at offset {offset}")
            out[name] = whole[offset:offset + numel].view(tuple(shape)).clone()
            offset += numel + (paddings[index][position] if paddings else 0)
    return out


def _zero3(flat: list[torch.Tensor], shapes: dict[str, Any], path: str) -> dict[str, torch.Tensor]:
    """Each parameter is ``ceil(numel / ranks)`` values on every rank, at the same offset of each rank's vector."""
    ranks, out, offset = len(flat), {}, 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        piece = math.ceil(numel / ranks)
        if offset + piece > flat[0].numel():
            raise CheckpointFormatError(f"{path}: the partitions hold {flat[0].numel()} values per rank, too few for "
                                        f"{name} {tuple(shape)} at offset {offset}")
        out[name] = torch.cat([f[offset:offset + piece] for f in flat])[:numel].view(tuple(shape)).clone()
        offset += piece
    return out
