"""Hugging Face Accelerate integration: lazy checkpoints from one ``hook.register(accelerator)``.

``LazyCheckpointHook`` translates the events of a plain Accelerate loop into :class:`~lazyckpt.LazyCheckpointer`
calls; it holds no format or threading code. A step is one real optimizer update: gradient-accumulation
micro-batches and updates skipped by mixed precision do not count.

Example:
    >>> hook = LazyCheckpointHook("runs/ckpt", every_n_steps=100, keep_last_k=3)      # doctest: +SKIP
    >>> model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)            # doctest: +SKIP
    >>> hook.register(accelerator)                                                    # doctest: +SKIP
    >>> start_epoch = hook.resume() // len(dl)                                        # doctest: +SKIP
    >>> for epoch in range(start_epoch, epochs):                                      # doctest: +SKIP
    ...     for batch in dl:
    ...         accelerator.backward(model(batch).loss)
    ...         opt.step(); sched.step(); opt.zero_grad()
    >>> hook.close()                                                                  # doctest: +SKIP
    >>> accelerator.end_training()                                                    # doctest: +SKIP

A checkpoint of step N is the state after iteration N (docs/accelerate.md, "The capture rule"): RNG and
dataloader positions are read at the optimizer post-hook; the request goes to the engine at the first forward
afterwards (so the loop's scheduler step and EMA updates are in it; buffers, schedulers, ``param_groups``, the
scaler and registered objects are copied then); parameters and optimizer state are copied lazily until the
barrier, the inner optimizer's pre-hook before the next update.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from lazyckpt import (CheckpointConfig, LazyCheckpointer, OnBusy, PendingCheckpoint, capture_rng_state,
                      checkpoint_step, latest, load, restore_rng_state)
from lazyckpt.config import normalize_dirpath
from lazyckpt.errors import CheckpointMismatchError
from lazyckpt.integrations._accelerate_state import (FORMAT, differences, inner_optimizer, loader_generators,
                                                     loader_position)

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger(__name__)

_UNSUPPORTED = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


@dataclass
class _Boundary:
    """What must be read at the step boundary itself, before the next batch is fetched."""

    step: int
    rng: dict[str, Any]
    dataloaders: list[dict[str, Any]]
    accelerator_step: int
    started: float


class LazyCheckpointHook:
    """Lazy asynchronous checkpoints of an Accelerate training loop.

    Args:
        dirpath: directory of the checkpoints (one ``step-NNNNNNN/`` per committed checkpoint).
        every_n_steps: request a checkpoint after every n-th optimizer update; None: only on :meth:`save`.
        keep_last_k: keep only the newest k committed checkpoints (None keeps all).
        **options: other :class:`~lazyckpt.LazyCheckpointer` options (``host_buffer_bytes``, ``copy_backend``,
            ``on_busy``, ``verify_on_load``, ``fsync``, ``storage``, ...). ``rank`` and ``world_size`` come from
            the accelerator.

    Raises:
        ValueError: an invalid option (the message names it).
    """

    def __init__(self, dirpath: str | os.PathLike[str], *, every_n_steps: int | None = None,
                 keep_last_k: int | None = None, **options: Any) -> None:
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ValueError(f"every_n_steps={every_n_steps!r} must be a positive int or None (only hook.save())")
        taken = sorted({"rank", "world_size"} & set(options))
        if taken:
            raise ValueError(f"LazyCheckpointHook({', '.join(taken)}=...) is not accepted: the rank and world size "
                             "come from the accelerator in hook.register(accelerator)")
        self.dirpath = normalize_dirpath(dirpath)
        self.every_n_steps = every_n_steps
        engine_options = {k: v for k, v in options.items() if k not in ("storage", "backend")}
        self._config = CheckpointConfig(keep_last_k=keep_last_k, **engine_options)  # validate now
        self._options = {"keep_last_k": keep_last_k, **options}
        self._accelerator: Accelerator | None = None
        self._checkpointer: LazyCheckpointer | None = None
        self._optimizers: list[Any] = []
        self._models: list[torch.nn.Module] = []
        self._handles: list[Any] = []
        self._closed = False
        self._step = 0
        self._stepped: set[int] = set()
        self._boundary: _Boundary | None = None
        self._pending: PendingCheckpoint | None = None
        self._requested_step: int | None = None
        self._awaiting_barrier = False
        self._warned_no_forward = False
        self._stalls: dict[int, float] = {}

    # --- the public surface ---------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer updates counted so far (restored by :meth:`resume`)."""
        return self._step

    @property
    def checkpointer(self) -> LazyCheckpointer:
        """The engine (its ``stats`` list the committed checkpoints); exists after :meth:`register`."""
        if self._checkpointer is None:
            raise RuntimeError("call hook.register(accelerator) before using hook.checkpointer")
        return self._checkpointer

    @property
    def stalls(self) -> dict[int, float]:
        """Training-thread seconds each checkpoint cost, by step: capture, request and barrier wait."""
        return dict(self._stalls)

    def register(self, accelerator: Accelerator) -> LazyCheckpointHook:
        """Hook every prepared model and optimizer of ``accelerator``; call it after ``accelerator.prepare``.

        Also registers Accelerate's ``save_state``/``load_state`` pre-hooks (they drain pending copies) and
        ``register_for_checkpointing(self)``, so ``accelerator.save_state()``/``load_state()`` carry the step.

        Raises:
            RuntimeError: already registered, or nothing was prepared.
            ValueError: a distributed type or option this hook does not support.
        """
        if self._accelerator is not None:
            raise RuntimeError("this LazyCheckpointHook is registered already; create one hook per Accelerator")
        kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper()
        if kind in _UNSUPPORTED:
            raise ValueError(f"LazyCheckpointHook does not support distributed_type={kind}: its state is sharded "
                             "or owned by the engine; use accelerator.save_state() there")
        if not accelerator._models and not accelerator._optimizers:
            raise RuntimeError("hook.register(accelerator) found no prepared model or optimizer; call "
                               "accelerator.prepare(...) first")
        world_size = accelerator.num_processes
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if launched != world_size:
            raise RuntimeError(f"the launcher started WORLD_SIZE={launched} processes but the Accelerator runs "
                               f"{world_size}; each would write rank 0 of its own checkpoint. Without CUDA, pass "
                               "Accelerator(cpu=True) (or set ACCELERATE_USE_CPU=1) so they form one gloo group")
        if world_size > 1 and self._config.on_busy is OnBusy.SKIP:
            raise ValueError("on_busy='skip' is not supported with several processes: each process decides alone, "
                             "so they could skip different steps and the checkpoint would never commit; use 'wait'")
        self._checkpointer = LazyCheckpointer(self.dirpath, rank=accelerator.process_index,
                                              world_size=world_size, **self._options)
        self._accelerator = accelerator
        self._optimizers = list(accelerator._optimizers)
        self._models = [accelerator.unwrap_model(m, keep_torch_compile=False) for m in accelerator._models]
        for index, optimizer in enumerate(self._optimizers):
            inner = inner_optimizer(optimizer)
            self._handles.append(inner.register_step_pre_hook(self._before_optimizer_step))
            self._handles.append(inner.register_step_post_hook(partial(self._after_optimizer_step, index)))
        for model in self._models:
            self._handles.append(model.register_forward_pre_hook(self._on_forward))
        self._handles.append(accelerator.register_save_state_pre_hook(self._before_save_state))
        self._handles.append(accelerator.register_load_state_pre_hook(self._before_load_state))
        accelerator.register_for_checkpointing(self)
        return self

    def resume(self, path: str | os.PathLike[str] | None = None) -> int:
        """Restore the newest committed checkpoint (or ``path``) into everything registered; returns its step.

        Call it on every process, after :meth:`register`. Returns 0 and changes nothing when ``dirpath`` holds
        no committed checkpoint. Nothing is changed either when the checkpoint does not fit.

        Raises:
            CheckpointMismatchError: the checkpoint was written for other models, optimizers, schedulers,
                registered objects, dataloaders or another number of processes (the message lists each).
            CheckpointCorruptError: a checksum does not match (the message names the file and tensor).
            CheckpointNotFoundError: ``path`` is not a committed checkpoint.
        """
        accelerator = self._require_registered("resume")
        self._drain_copies()
        resolved = self._resolve(path)
        if resolved is None:
            logger.info("lazyckpt: no committed checkpoint in %s; starting from step 0", self.dirpath)
            return 0
        verify = self._checkpointer.config.verify_on_load
        shared = load(resolved, verify=verify)
        problems = differences(shared, self._layout())
        if problems:
            raise CheckpointMismatchError(f"{resolved} does not match this run:\n  - " + "\n  - ".join(problems))
        own = shared if accelerator.process_index == 0 else load(resolved, verify=verify,
                                                                rank=accelerator.process_index)
        self._restore(shared, own)
        self._step = self._requested_step = shared["step"]
        self._pending, self._boundary, self._stepped = None, None, set()
        newest = latest(self.dirpath)
        if newest is not None and checkpoint_step(newest) > self._step:
            warnings.warn(f"lazyckpt: resumed {resolved}, but {newest} is newer; saving a step that is already "
                          "committed fails, so move the newer checkpoints away before training on",
                          RuntimeWarning, stacklevel=2)
        logger.info("lazyckpt: resumed step %d from %s", self._step, resolved)
        return self._step

    def save(self) -> PendingCheckpoint | None:
        """Request a checkpoint of the current step now (lazily); call it between iterations, on every process.

        Returns:
            The handle (``wait()`` gives the committed directory); the same one when this step was requested
            already; None when this step's checkpoint was committed by an earlier run (after :meth:`resume`).
        """
        self._require_registered("save")
        if self._boundary is None and self._requested_step != self._step:
            self._boundary = self._capture_boundary()
        if self._boundary is not None:
            self._issue()
        return self._pending

    def close(self) -> None:
        """Issue a pending request, drain every checkpoint and remove the hooks. Idempotent.

        Call it before ``accelerator.end_training()``: multi-process commits need every process alive.
        """
        if self._closed or self._checkpointer is None:
            self._closed = True
            return
        self._closed = True
        try:
            if self._boundary is not None:
                self._issue()
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self._checkpointer.close()

    def __enter__(self) -> LazyCheckpointHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, int]:
        """The step counter, for ``accelerator.save_state()`` (registered through ``register_for_checkpointing``)."""
        return {"step": self._step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the step counter from ``accelerator.load_state()``."""
        self._step = int(state["step"])
        self._boundary, self._stepped, self._requested_step = None, set(), None

    # --- framework events -----------------------------------------------------------------------------------

    def _after_optimizer_step(self, index: int, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # A step completes once every prepared optimizer has really updated (skipped AMP steps never get here).
        self._stepped.add(index)
        if len(self._stepped) < len(self._optimizers):
            return
        self._stepped.clear()
        self._step += 1
        if self.every_n_steps is not None and self._step % self.every_n_steps == 0:
            self._boundary = self._capture_boundary()

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        # The first forward after the step: the loop's scheduler step and other end-of-iteration updates are done.
        if self._boundary is not None:
            self._issue()

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._boundary is not None:
            if not self._warned_no_forward:
                self._warned_no_forward = True
                warnings.warn("lazyckpt: no forward of a prepared model ran between two optimizer steps, so the "
                              "checkpoint was requested at the next step and copied without overlap",
                              RuntimeWarning, stacklevel=2)
            self._issue()
        self._barrier()

    def _before_save_state(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        self._drain_copies()

    def _before_load_state(self, models: list[Any], input_dir: str) -> None:
        # Accelerate is about to overwrite the live tensors a lazy copy may still read.
        self._drain_copies()

    # --- capture --------------------------------------------------------------------------------------------

    def _capture_boundary(self) -> _Boundary:
        started = time.monotonic()
        accelerator = self._accelerator
        active = [id(dl) for dl in accelerator.gradient_state.dataloader_references if dl is not None]
        loaders = [loader_position(dl, id(dl) in active) for dl in accelerator._dataloaders]
        return _Boundary(step=self._step, rng=capture_rng_state(self._generators()), dataloaders=loaders,
                         accelerator_step=int(accelerator.step), started=started)

    def _issue(self) -> None:
        boundary, self._boundary = self._boundary, None
        accelerator = self._accelerator
        state: dict[str, Any] = {
            "format": FORMAT, "step": boundary.step, "world_size": accelerator.num_processes,
            "process_index": accelerator.process_index, "accelerator_step": boundary.accelerator_step,
            "rng": boundary.rng, "dataloaders": boundary.dataloaders,
        }
        optimizers, immutable = [], []
        if accelerator.process_index == 0:  # replicas are identical: one process writes them, as Accelerate does
            state.update(self._shared_state())
            optimizers, immutable = [inner_optimizer(o) for o in self._optimizers], self._models
        self._pending = self._checkpointer.save(state, step=boundary.step, optimizers=optimizers,
                                                immutable=immutable)
        self._requested_step = boundary.step
        self._awaiting_barrier = True
        self._add_stall(boundary.step, time.monotonic() - boundary.started)

    def _shared_state(self) -> dict[str, Any]:
        accelerator = self._accelerator
        scaler = getattr(accelerator, "scaler", None)
        return {
            "models": [m.state_dict() for m in self._models],
            "optimizers": [inner_optimizer(o).state_dict() for o in self._optimizers],
            "schedulers": [s.state_dict() for s in accelerator._schedulers],
            "scaler": None if scaler is None else scaler.state_dict(),
            "objects": [o.state_dict() for o in self._objects()],
            "kinds": self._kinds(),
        }

    def _kinds(self) -> dict[str, list[str]]:
        """Class names of what is registered (and generator names): the first thing a mismatch shows."""
        return {
            "models": [type(m).__name__ for m in self._models],
            "optimizers": [type(inner_optimizer(o)).__name__ for o in self._optimizers],
            "schedulers": [type(getattr(s, "scheduler", s)).__name__ for s in self._accelerator._schedulers],
            "objects": [type(o).__name__ for o in self._objects()],
            "generators": sorted(self._generators()),
        }

    def _objects(self) -> list[Any]:
        return [o for o in self._accelerator._custom_objects if o is not self]

    def _generators(self) -> dict[str, torch.Generator]:
        found: dict[str, torch.Generator] = {}
        for index, dl in enumerate(self._accelerator._dataloaders):
            for k, gen in enumerate(loader_generators(dl)):
                found[f"dataloader{index}.{k}"] = gen
        return found

    # --- restore --------------------------------------------------------------------------------------------

    def _resolve(self, path: str | os.PathLike[str] | None) -> str | None:
        if path is not None:
            return os.fspath(path)
        accelerator = self._accelerator
        chosen = [latest(self.dirpath) if accelerator.is_main_process else None]
        if accelerator.num_processes > 1:  # every process must restore the same checkpoint
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(chosen, from_process=0)
        return chosen[0]

    def _layout(self) -> dict[str, Any]:
        accelerator = self._accelerator
        return {
            "world_size": accelerator.num_processes,
            "models": [{k: (tuple(v.shape), v.dtype) for k, v in m.state_dict().items()} for m in self._models],
            "optimizers": [[len(g["params"]) for g in inner_optimizer(o).param_groups] for o in self._optimizers],
            "kinds": self._kinds(),
            "dataloaders": len(accelerator._dataloaders),
        }

    def _restore(self, shared: dict[str, Any], own: dict[str, Any]) -> None:
        accelerator = self._accelerator
        for model, saved in zip(self._models, shared["models"]):
            model.load_state_dict(saved)
        for optimizer, saved in zip(self._optimizers, shared["optimizers"]):
            inner_optimizer(optimizer).load_state_dict(saved)
        for scheduler, saved in zip(accelerator._schedulers, shared["schedulers"]):
            scheduler.load_state_dict(saved)
        scaler = getattr(accelerator, "scaler", None)
        if scaler is not None and shared["scaler"] is not None:
            scaler.load_state_dict(shared["scaler"])
        for obj, saved in zip(self._objects(), shared["objects"]):
            obj.load_state_dict(saved)
        for dl, saved in zip(accelerator._dataloaders, own["dataloaders"]):
            if hasattr(dl, "iteration"):
                dl.iteration = saved["iteration"]
            if saved["state"] is not None:
                dl.load_state_dict(saved["state"])
        restore_rng_state(own["rng"], self._generators())
        accelerator.step = own["accelerator_step"]

    # --- helpers --------------------------------------------------------------------------------------------

    def _drain_copies(self) -> None:
        """Issue a request waiting for its iteration's end, then pass the barrier of the one in flight."""
        self._require_registered("drain")
        if self._boundary is not None:
            self._issue()
        self._barrier()

    def _barrier(self) -> None:
        started = time.monotonic()
        self._checkpointer.wait_staged()
        if self._awaiting_barrier:  # the first barrier after a request is part of that checkpoint's stall
            self._awaiting_barrier = False
            self._add_stall(self._requested_step, time.monotonic() - started)

    def _add_stall(self, step: int | None, seconds: float) -> None:
        if step is not None:
            self._stalls[step] = self._stalls.get(step, 0.0) + seconds

    def _require_registered(self, what: str) -> Accelerator:
        if self._accelerator is None:
            raise RuntimeError(f"call hook.register(accelerator) before hook.{what}()")
        if self._closed:
            raise RuntimeError(f"this LazyCheckpointHook is closed; cannot {what}()")
        return self._accelerator

    def __repr__(self) -> str:
        return (f"LazyCheckpointHook({self.dirpath!r}, every_n_steps={self.every_n_steps}, step={self._step}, "
                f"registered={self._accelerator is not None}, closed={self._closed})")


__all__ = ["CheckpointMismatchError", "LazyCheckpointHook"]
