"""What ``LazyCheckpointHook`` reads from and restores into the objects an ``Accelerator`` prepared, and the torch
hooks it places on them (each calls the hook's :class:`~lazyckpt.policy.UpdateLoop`).

Every process writes its own RNG states and loader positions; the models, optimizers, schedulers, scaler and
registered objects are replicated, so they are written once, split across the processes
(``CheckpointSession.save`` decides that).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch

from lazyckpt.pending import PendingCheckpoint
from lazyckpt.policy import (CheckpointSession, ContinuedEpoch, RunLayout, UpdateLoop, capture_rng, check_fits,
                             find_generators, restore_rng)
from lazyckpt.storage.urls import options_for

from . import _accelerate_deepspeed as deepspeed
from . import _accelerate_sharded as sharded
from . import _compat

FORMAT = "lazyckpt.accelerate/1"
"""Tag stored in every checkpoint the hook writes; ``resume()`` refuses trees without it."""
NO_FORWARD = ("lazyckpt: no forward of a prepared model ran between two optimizer steps, so the checkpoint was "
              "requested at the next step and copied without overlap")


@dataclass
class Boundary:
    """What must be read at the step boundary itself, before the next batch is fetched."""

    step: int
    per_process: dict[str, Any]
    capture_s: float
    """Training-thread time the capture took: part of the checkpoint's stall, unlike the loop's own work between
    the boundary and the request (its epilogue, the next batch fetch)."""


@dataclass
class PreparedRun:
    """The accelerator and what it prepared, as the hook checkpoints them. Models and optimizers are those
    prepared before ``hook.register``; schedulers, loaders and registered objects are read when needed."""

    accelerator: Any
    models: list[torch.nn.Module]
    """The prepared models, unwrapped (DDP and ``torch.compile`` wrappers removed)."""
    prepared_optimizers: list[Any]
    hook: Any
    """The hook itself: registered for ``save_state`` too, but its step is stored once, not as an object."""
    sharded: bool = False
    """FSDP version 2: the model and optimizer states are DTensors, saved and restored by name and resharded."""
    handles: list[Any] = field(default_factory=list)
    """The torch and Accelerate hooks of :meth:`hook_into`, until :meth:`unhook`."""
    continued: ContinuedEpoch = field(default_factory=ContinuedEpoch)
    """Armed by a mid-epoch restore, settled at the next forward (the continuing loader's extra draw)."""
    deepspeed: Any = None
    """Under DeepSpeed: the ``LazyCheckpointEngine`` of the prepared ``DeepSpeedEngine`` (:mod:`._accelerate_deepspeed`),
    which owns the model's and optimizer's state."""
    engine: Any = None
    """Under DeepSpeed: the prepared ``DeepSpeedEngine``."""

    def hook_into(self, loop: UpdateLoop[Boundary]) -> None:
        """Translate the torch and Accelerate events into calls on ``loop``: an inner optimizer's step post-hook is
        an update (with the optimizer's index; a completed step's boundary is captured), its pre-hook the next
        update's barrier, a model's forward pre-hook the safe point of the request; ``save_state``/``load_state``
        drain first (``load_state`` overwrites the live tensors a lazy copy may still read)."""
        handles, optimizers = self.handles, len(self.prepared_optimizers)
        for index, optimizer in enumerate(self.optimizers):
            handles.append(optimizer.register_step_pre_hook(lambda *_: loop.before_update(late=NO_FORWARD)))
            handles.append(optimizer.register_step_post_hook(
                lambda *_, index=index: loop.updated(index, optimizers=optimizers, capture=self.boundary)))
        # prepend: before FSDP2's own pre-forward unshards the parameters (a state dict taken then would reshard them)
        handles += [model.register_forward_pre_hook(lambda *_: self.forward(loop), prepend=True)
                    for model in ([self.engine] if self.engine is not None else self.models)]  # DeepSpeed: its own
        handles.append(self.accelerator.register_save_state_pre_hook(lambda *_: loop.drain()))
        handles.append(self.accelerator.register_load_state_pre_hook(lambda *_: loop.drain()))
        self.accelerator.register_for_checkpointing(self.hook)

    def forward(self, loop: UpdateLoop[Boundary]) -> None:
        self.continued.settle()  # before the forward draws (dropout)
        loop.forward()

    def unhook(self) -> None:
        """Remove the hooks of :meth:`hook_into`."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    @classmethod
    def of(cls, accelerator: Any, hook: Any) -> PreparedRun:
        prepared = _compat.prepared(accelerator)
        models = [accelerator.unwrap_model(m, keep_torch_compile=False) for m in prepared.models]
        fsdp2 = sharded.is_fsdp2(accelerator)
        if fsdp2:
            sharded.check_supported(models, keep_in_memory=hook.options.engine.get("keep_in_memory") is True)
        lazy = deepspeed.attach(prepared.models) if deepspeed.is_deepspeed(accelerator) else None
        return cls(accelerator=accelerator, models=models, prepared_optimizers=prepared.optimizers, hook=hook,
                   sharded=fsdp2, deepspeed=lazy, engine=prepared.models[0] if lazy is not None else None)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        if self.engine is not None:  # DeepSpeed's base (torch) optimizer: its step hooks are the update's
            return deepspeed.optimizers_and_immutable(self.engine)[0]
        return [_compat.inner_optimizer(o) for o in self.prepared_optimizers]

    @property
    def schedulers(self) -> list[Any]:
        return _compat.prepared(self.accelerator).schedulers

    @property
    def dataloaders(self) -> list[Any]:
        return _compat.prepared(self.accelerator).dataloaders

    @property
    def objects(self) -> list[Any]:
        return [o for o in _compat.prepared(self.accelerator).objects if o is not self.hook]

    def generators(self) -> dict[str, torch.Generator]:
        for sampler in _compat.seedable_samplers(self.dataloaders):  # otherwise created only at its first iter()
            _compat.create_sampler_generator(sampler)
        return find_generators(self.dataloaders, "dataloader")

    # --- capture ----------------------------------------------------------------------------------------------

    def request(self, session: CheckpointSession, boundary: Boundary) -> PendingCheckpoint:
        """Request the checkpoint of the iteration ``boundary`` ended, lazily: the replicated state is read now
        (its tensors copied while training goes on), this process's own values were read at the boundary."""
        per_rank, immutable = boundary.per_process, self.models
        if self.engine is not None:  # the engine's files, this process's own (ZeRO partitions)
            per_rank = {**per_rank, "files": deepspeed.files(self.deepspeed, session.dirpath)}
            immutable = deepspeed.optimizers_and_immutable(self.engine)[1]
        return session.save(boundary.step, replicated=self.replicated, per_rank=per_rank,
                            optimizers=self.optimizers, immutable=immutable,
                            started=time.monotonic() - boundary.capture_s)

    def boundary(self, step: int) -> Boundary:
        """This process's RNG states and loader positions as of the end of the current iteration."""
        started = time.monotonic()
        accelerator = self.accelerator
        active = [id(dl) for dl in accelerator.gradient_state.dataloader_references if dl is not None]
        loaders = [_loader_position(dl, id(dl) in active) for dl in self.dataloaders]
        per_process = {"format": FORMAT, "step": step, "world_size": accelerator.num_processes,
                       "process_index": accelerator.process_index, "accelerator_step": int(accelerator.step),
                       "rng": capture_rng(self.generators()), "dataloaders": loaders,
                       "mid_epoch": _mid_epoch(accelerator.gradient_state)}
        return Boundary(step=step, per_process=per_process, capture_s=time.monotonic() - started)

    def replicated(self) -> dict[str, Any]:
        scaler = getattr(self.accelerator, "scaler", None)
        models, optimizers = ([], []) if self.engine is not None else self.model_and_optimizer_states()
        return {
            **({"tag": deepspeed.STEP_TAG} if self.engine is not None else {}),
            "models": models,
            "optimizers": optimizers,
            "schedulers": [s.state_dict() for s in self.schedulers],
            "scaler": None if scaler is None else scaler.state_dict(),
            "objects": [o.state_dict() for o in self.objects],
            "kinds": self.kinds(),
        }

    def model_and_optimizer_states(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        if self.sharded:
            model, optimizers = sharded.sharded_states(self.models[0], self.optimizers)
            return [model], optimizers
        return [m.state_dict() for m in self.models], [o.state_dict() for o in self.optimizers]

    def kinds(self) -> dict[str, list[str]]:
        """Class names of what is registered (and generator names): the first thing a mismatch shows."""
        return {
            "models": [type(m).__name__ for m in self.models],
            "optimizers": [type(o).__name__ for o in self.optimizers],
            "schedulers": [type(getattr(s, "scheduler", s)).__name__ for s in self.schedulers],
            "objects": [type(o).__name__ for o in self.objects],
            "generators": sorted(self.generators()),
        }

    # --- the fit check and the restore ------------------------------------------------------------------------

    def layouts(self, saved: Any) -> tuple[RunLayout, RunLayout, list[str]]:
        """``(the checkpoint's layout, this run's, problems found before comparing them)``."""
        kinds = self.kinds()
        names = [f"model {i} ({kind})" for i, kind in enumerate(kinds["models"])]
        ds = self.engine is not None  # DeepSpeed checks its own files when it loads them
        here = RunLayout(world_size=self.accelerator.num_processes, kinds=kinds, dataloaders=len(self.dataloaders),
                         models={} if ds else {n: m.state_dict() for n, m in zip(names, self.models)},
                         param_groups=[] if ds else [[len(g["params"]) for g in o.param_groups]
                                                     for o in self.optimizers])
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            found = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
            return RunLayout(), here, [f"it was not written by LazyCheckpointHook (format {found!r}, expected "
                                       f"{FORMAT!r}); load it with lazyckpt.load(path) instead"]
        there = RunLayout(world_size=saved["world_size"], kinds=saved["kinds"], dataloaders=len(saved["dataloaders"]),
                          models={} if ds else dict(zip(names, saved["models"])),
                          param_groups=[] if ds else [[len(g["params"]) for g in o["param_groups"]]
                                                      for o in saved["optimizers"]])
        return (sharded.any_world_size(there), sharded.any_world_size(here), []) if self.sharded else (there, here, [])

    def newest(self, session: CheckpointSession) -> str | None:
        """The newest committed checkpoint, as process 0 sees it: every process must restore the same one."""
        chosen = [session.newest() if self.accelerator.is_main_process else None]
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(chosen, from_process=0)
        return chosen[0]

    def restore_from(self, path: str, *, verify: bool, load: Callable[..., Any]) -> dict[str, Any]:
        """Check that the checkpoint at ``path`` fits, then restore it; returns its shared (process 0) tree.

        Raises:
            CheckpointMismatchError: it does not fit (nothing was changed).

        ``load`` is ``lazyckpt.load`` or the session's (which reads a remote URL with the run's options).
        """
        shared = None if self.sharded else load(path, verify=verify)  # read once: the fit check and the restore
        remote = options_for(path, self.hook.options.engine.get("storage_options"))  # sharded reads a URL directly
        saved, here, problems = self.layouts(sharded.outline(path, remote) if self.sharded else shared)
        check_fits(path, saved, here, problems=problems)
        index = self.accelerator.process_index
        if self.sharded:  # each process reads the parts of the shards it holds now, and its per-process values
            tree = sharded.restore(path, self.models[0], self.optimizers, rank=index,
                                   world_size=self.accelerator.num_processes, verify=verify, storage_options=remote)
            self.restore(tree, tree)
            return tree
        if self.engine is not None:
            deepspeed.restore(self.engine, path)
        self.restore(shared, shared if index == 0 else load(path, verify=verify, rank=index))
        return shared

    def restore(self, shared: dict[str, Any], own: dict[str, Any]) -> None:
        self.restore_replicated(shared)
        for dl, saved in zip(self.dataloaders, own["dataloaders"]):
            if hasattr(dl, "iteration"):
                dl.iteration = saved["iteration"]
            if saved["state"] is not None:
                dl.load_state_dict(saved["state"])
            for sampler, seed in zip(_compat.seedable_samplers([dl]), saved.get("sampler_seeds", [])):
                sampler.initial_seed = seed  # checkpoints written before it was saved: the run's own
        if own.get("rng") is not None:  # none saved (a process new to the run): it keeps its RNG states
            restore_rng(own["rng"], self.generators())
            if own.get("mid_epoch"):
                self.continued.arm()
        self.accelerator.step = own["accelerator_step"]

    def restore_replicated(self, shared: dict[str, Any]) -> None:
        """Models, optimizers, schedulers, scaler and registered objects (what :meth:`replicated` captured)."""
        if self.sharded:
            sharded.set_states(self.models[0], self.optimizers, shared["models"][0], shared["optimizers"])
        elif self.engine is not None:
            pass  # DeepSpeed restored them from its files (restore_from), or they are not in the snapshot
        else:
            for model, saved in zip(self.models, shared["models"]):
                model.load_state_dict(saved)
            for optimizer, saved in zip(self.optimizers, shared["optimizers"]):
                optimizer.load_state_dict(saved)
        for scheduler, saved in zip(self.schedulers, shared["schedulers"]):
            scheduler.load_state_dict(saved)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and shared["scaler"] is not None:
            scaler.load_state_dict(shared["scaler"])
        for obj, saved in zip(self.objects, shared["objects"]):
            obj.load_state_dict(saved)


def _loader_position(dl: Any, active: bool) -> dict[str, Any]:
    """Epoch counter (and state, for stateful loaders) as of the end of the current iteration."""
    iteration = int(getattr(dl, "iteration", 0))
    if active and getattr(dl, "end_of_dataloader", False):
        iteration += 1  # the last batch was yielded; the loader bumps its epoch only when the loop asks again
    state = dl.state_dict() if getattr(dl, "use_stateful_dataloader", False) else None
    # A seedable sampler's permutations follow initial_seed + epoch; initial_seed is the global seed at prepare()
    # unless a data_seed was given, so a resumed run seeded otherwise must get it back.
    seeds = [sampler.initial_seed for sampler in _compat.seedable_samplers([dl])]
    return {"iteration": iteration, "state": state, "sampler_seeds": seeds}


def _mid_epoch(gradient_state: Any) -> bool:
    """A loader (prepared or made by ``skip_first_batches``) is inside an epoch with batches left: the next fetch
    continues its iterator, which a resumed run has to create anew."""
    return bool(gradient_state.in_dataloader and not gradient_state.end_of_dataloader)
