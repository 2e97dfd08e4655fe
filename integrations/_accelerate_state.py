"""What LazyCheckpointHook reads from Accelerate objects, and pure checks of a checkpoint against this run."""

from __future__ import annotations

from typing import Any

import torch

FORMAT = "lazyckpt.accelerate/1"
"""Tag stored in every checkpoint the hook writes; ``resume()`` refuses trees without it."""


def differences(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Every way the checkpoint's rank-0 tree differs from this run's layout (pure; empty when it fits)."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        found = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        return [(f"it was not written by LazyCheckpointHook (format {found!r}, expected {FORMAT!r}); load it "
                 "with lazyckpt.load(path) instead")]
    problems = []
    if saved["world_size"] != here["world_size"]:
        problems.append(f"it was written by {saved['world_size']} process(es), this run has {here['world_size']} "
                        "(RNG and sampler states are per process; resume with the same number of processes)")
    kinds = saved["kinds"]
    for what in ("models", "optimizers", "schedulers", "objects"):
        if kinds[what] != here["kinds"][what]:
            problems.append(f"{what}: the checkpoint holds {kinds[what]}, this run registered {here['kinds'][what]}")
    if kinds["generators"] != here["kinds"]["generators"]:
        problems.append(f"dataloader generators: the checkpoint holds {kinds['generators']}, this run has "
                        f"{here['kinds']['generators']}")
    if len(saved["dataloaders"]) != here["dataloaders"]:
        problems.append(f"dataloaders: the checkpoint holds {len(saved['dataloaders'])}, this run prepared "
                        f"{here['dataloaders']}")
    for index, (state, shapes) in enumerate(zip(saved["models"], here["models"])):
        problems += _model_differences(f"model {index} ({kinds['models'][index]})", state, shapes)
    for index, (state, groups) in enumerate(zip(saved["optimizers"], here["optimizers"])):
        saved_groups = [len(g["params"]) for g in state["param_groups"]]
        if saved_groups != groups:
            problems.append(f"optimizer {index}: parameter groups hold {saved_groups} parameters in the checkpoint "
                            f"and {groups} here")
    return problems


def _model_differences(name: str, state: dict[str, torch.Tensor], shapes: dict[str, tuple]) -> list[str]:
    problems = []
    missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing:
        problems.append(f"{name}: keys missing from the checkpoint: {_few(missing)}")
    if unexpected:
        problems.append(f"{name}: keys only in the checkpoint: {_few(unexpected)}")
    for key in sorted(set(state) & set(shapes)):
        shape, dtype = shapes[key]
        got = state[key]
        if tuple(got.shape) != shape or got.dtype != dtype:
            problems.append(f"{name}: {key!r} is {str(got.dtype).removeprefix('torch.')}{list(got.shape)} in the "
                            f"checkpoint and {str(dtype).removeprefix('torch.')}{list(shape)} here")
    return problems


def _few(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # AcceleratedOptimizer never calls Optimizer.__init__, so torch's step hooks live on the wrapped optimizer.
    return getattr(optimizer, "optimizer", optimizer)


def loader_position(dl: Any, active: bool) -> dict[str, Any]:
    """Epoch counter (and state, for stateful loaders) as of the end of the current iteration."""
    iteration = int(getattr(dl, "iteration", 0))
    if active and getattr(dl, "end_of_dataloader", False):
        iteration += 1  # the last batch was yielded; the loader bumps its epoch only when the loop asks again
    state = dl.state_dict() if getattr(dl, "use_stateful_dataloader", False) else None
    return {"iteration": iteration, "state": state}


def loader_generators(dl: Any) -> list[torch.Generator]:
    """The distinct generators a prepared dataloader draws from (its sampler's, the synchronized one, its own)."""
    from accelerate.data_loader import get_sampler

    candidates = [getattr(dl, "synchronized_generator", None), getattr(get_sampler(dl), "generator", None),
                  getattr(dl, "generator", None)]
    unique: dict[int, torch.Generator] = {}
    for gen in candidates:
        if isinstance(gen, torch.Generator):
            unique.setdefault(id(gen), gen)
    return list(unique.values())
