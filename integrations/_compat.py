"""Every private Lightning and Accelerate attribute the integrations use, each with the reason it is needed.

Supported versions are the ranges in ``pyproject.toml`` (``lightning``/``pytorch_lightning`` 2.4–2.6,
``accelerate`` 1.x up to 1.15); a new release is checked against this file first. Nothing else in
``integrations/`` reads a private attribute of either framework.

``LazyCheckpoint`` also overrides five private methods of ``ModelCheckpoint`` (marked ``@override``):
``_save_checkpoint`` (a save becomes a planned name and one lazy request), ``_link_checkpoint`` (``save_last``
becomes a second name of the same step), ``_remove_checkpoint`` (a top-k eviction waits for the next commit),
``_find_last_checkpoints`` (``ckpt_path="last"`` means the newest committed step directory, or
``ModelCheckpoint``'s ``last*.ckpt`` file when that is newer) and ``_update_best_and_save`` (its ``verbose`` message
waits for the commit).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch

# --- Lightning ------------------------------------------------------------------------------------------------

_REFUSED = ("FSDPStrategy", "DeepSpeedStrategy")
_SUPPORTED = ("SingleDeviceStrategy", "DDPStrategy", "ModelParallelStrategy")


def refuse_unsupported_strategy(namespace: str, strategy: Any) -> None:
    """Raise unless ``strategy`` is a single device, DDP or ModelParallel (FSDP2 / tensor parallel, whose state
    dicts hold DTensors that share storage with the parameters, so the copy stays lazy).

    ``FSDPStrategy`` (FSDP version 1) is refused: its sharded state dict all-gathers every parameter and clones
    each shard on the training thread at every save (torch's ``_sharded_pre_state_dict_hook`` unshards), and its
    shards are ``ShardedTensor``s unless a device mesh is given. DeepSpeed owns its checkpoint format.
    """
    strategies = importlib.import_module(f"{namespace}.strategies")
    refused = tuple(getattr(strategies, n) for n in _REFUSED if hasattr(strategies, n))
    supported = tuple(getattr(strategies, n) for n in _SUPPORTED if hasattr(strategies, n))
    if isinstance(strategy, refused) or not isinstance(strategy, supported):
        why = {"FSDPStrategy": "FSDP version 1 gathers every parameter on the training thread to build a sharded "
                               "state dict, so no checkpoint of it can be lazy; shard with FSDP2 instead: "
                               "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) and "
                               "fully_shard in configure_model",
               "DeepSpeedStrategy": "DeepSpeed writes its own checkpoint format through its engine"}
        raise NotImplementedError(
            f"LazyCheckpoint does not support {type(strategy).__name__}: "
            f"{why.get(type(strategy).__name__, 'its checkpoints bypass the snapshot path')}. Supported: a single "
            "device (strategy='auto'), DDP (strategy='ddp') and ModelParallelStrategy (FSDP2 / tensor parallel). "
            "Use ModelCheckpoint with others.")


def refuse_sharded_memory_level(strategy: Any, *, keep_in_memory: bool, rollback_on_nonfinite: bool) -> None:
    """Raise when a ModelParallelStrategy run asks for the memory level or rollback: both restore from one rank's
    whole copy of the state (DDP's replicated state), and under FSDP2 / tensor parallel each rank holds only its
    shards, so a restore would load one rank's shards as the whole model."""
    if not loads_checkpoints_itself(strategy):
        return
    for option, asked in (("keep_in_memory", keep_in_memory), ("rollback_on_nonfinite", rollback_on_nonfinite)):
        if asked:
            raise ValueError(
                f"LazyCheckpoint({option}=True) is not supported under ModelParallelStrategy: the in-memory "
                "snapshot and rollback restore replicated (DDP) state only, and here each rank holds only its "
                f"shards. Drop {option} (resume from the checkpoint files with ckpt_path='last'), or train with "
                "strategy='ddp'")


def loads_checkpoints_itself(strategy: Any) -> bool:
    """ModelParallelStrategy loads in ``strategy.load_checkpoint``, never through its CheckpointIO."""
    return type(strategy).__name__ == "ModelParallelStrategy"


def resolve_checkpoint_dir(callback: Any, trainer: Any) -> Any:
    """The directory ``ModelCheckpoint`` would use. ``ckpt_path="last"`` is resolved before ``setup()`` sets
    ``dirpath``, and ModelCheckpoint's rule (explicit path, logger's directory, ``default_root_dir``) is private."""
    return callback._ModelCheckpoint__resolve_ckpt_dir(trainer)


def model_checkpoint_fs(callback: Any) -> Any:
    """ModelCheckpoint's fsspec file system (``_fs``): its version counter asks whether a name exists through it."""
    return callback._fs


def record_saved(callback: Any, step: int, filepath: str) -> None:
    """What ``ModelCheckpoint._save_checkpoint`` records after a save, which our override replaces: the step (so
    the same step is not saved twice) and the path (``save_last="link"`` links to it)."""
    callback._last_global_step_saved = step
    callback._last_checkpoint_saved = filepath


def swaps_in_pre_step_weights(pl_module: Any) -> bool:
    """Whether ``ModelCheckpoint.on_train_batch_end`` saves with the weights of its documented manual-optimization
    recipe: when the module keeps the weights of ``self.layer`` from before ``optimizer.step()`` in a non-empty dict
    ``self.saved_models``, it loads the newest of them into ``layer``, saves, and loads the current weights back
    (Lightning's own condition, private to that method; an older Lightning without it saves the current weights,
    the same ones either way)."""
    import torch

    saved, layer = getattr(pl_module, "saved_models", None), getattr(pl_module, "layer", None)
    return (not pl_module.automatic_optimization and isinstance(saved, dict) and bool(saved)
            and isinstance(layer, torch.nn.Module))


def would_save_on_exception(callback: Any, trainer: Any) -> bool:
    """Whether ``ModelCheckpoint.on_exception`` would save here (rank 0 only), by its private
    ``_should_save_on_exception`` where it exists: asked when no lazyckpt session is open, to say that no checkpoint
    was made. A failure of the question never masks the exception being handled."""
    try:
        should = getattr(callback, "_should_save_on_exception", None)
        saves = should(trainer) if callable(should) else getattr(callback, "save_on_exception", False)
        return bool(saves) and trainer.is_global_zero
    except Exception:  # noqa: BLE001 - only decides whether to log
        return False


def replace_ckpt_path(trainer: Any, path: Any) -> None:
    """Make ``trainer.ckpt_path`` name ``path`` (the same checkpoint, found elsewhere) without the public setter,
    which would also mark the path user-managed and change what the next ``fit`` loads."""
    trainer._checkpoint_connector._ckpt_path = path


def dump_checkpoint(trainer: Any, weights_only: bool) -> dict[str, Any]:
    """The dict ``trainer.save_checkpoint`` would write (every callback's ``on_save_checkpoint`` included), without
    writing it: the public method always hands it to the CheckpointIO synchronously."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only)


def train_loaders(trainer: Any) -> list[Any]:
    """The train loaders the fit loop iterates over; their samplers' generators are part of the RNG state."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    return list(combined.flattened) if combined is not None else []


def restart_train_iterator(trainer: Any) -> None:
    """Create the train iterator again. Lightning created it (drawing from the RNGs) before ``on_train_start``,
    where the restored RNG states arrive; the fetcher that owns it has no public handle."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is not None:
        iter(fetcher)


# --- Accelerate -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    """What ``accelerator.prepare`` and ``register_for_checkpointing`` registered, in registration order."""

    models: list[Any]
    optimizers: list[Any]
    schedulers: list[Any]
    dataloaders: list[Any]
    objects: list[Any]


def prepared(accelerator: Any) -> Prepared:
    """Accelerate keeps what it prepared in private lists (``save_state`` reads them the same way) and offers no
    public accessor; the hook must checkpoint exactly what ``save_state`` would."""
    return Prepared(models=list(accelerator._models), optimizers=list(accelerator._optimizers),
                    schedulers=list(accelerator._schedulers), dataloaders=list(accelerator._dataloaders),
                    objects=list(accelerator._custom_objects))


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside an ``AcceleratedOptimizer``: the wrapper never calls ``Optimizer.__init__``, so
    torch's step hooks and a plain ``state_dict`` live on the wrapped one."""
    return getattr(optimizer, "optimizer", optimizer)


def seedable_samplers(dataloaders: list[Any]) -> list[Any]:
    """Accelerate's ``SeedableRandomSampler`` of each loader that has one (``use_seedable_sampler=True``, which
    ``prepare`` puts at ``batch_sampler.sampler``, or at ``batch_sampler.batch_sampler.sampler`` under a shard)."""
    from accelerate.data_loader import SeedableRandomSampler

    found = []
    for dl in dataloaders:
        holder = getattr(dl, "batch_sampler", None)
        for _ in range(2):
            sampler = getattr(holder, "sampler", None)
            if isinstance(sampler, SeedableRandomSampler):
                found.append(sampler)
                break
            holder = getattr(holder, "batch_sampler", None)
    return found


def create_sampler_generator(sampler: Any) -> None:
    """Give a ``SeedableRandomSampler`` the generator its first ``__iter__`` would create (Accelerate 1.x creates it
    there, seeded with ``initial_seed``): a checkpoint taken after the first epoch began holds its state, and a
    resume before the first ``iter()`` must find it to restore it. ``__iter__`` then reseeds it with
    ``initial_seed + epoch`` as before, so this changes no permutation."""
    if sampler.generator is None:
        device = torch.get_default_device() if hasattr(torch, "get_default_device") else "cpu"
        sampler.generator = torch.Generator(device=device)
        sampler.generator.manual_seed(sampler.initial_seed)


_UNSUPPORTED = ("MEGATRON_LM", "XLA")
"""Refused distributed types (FSDP is refused in version 1 only)."""


def refuse_unsupported_accelerator(accelerator: Any) -> None:
    """Raise unless ``accelerator`` prepared something, in one process group, with replicated state or FSDP
    version 2 (DTensor shards; version 1 builds its sharded state dict by all-gathering every parameter)."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper()
    if kind == "FSDP" and not getattr(accelerator, "is_fsdp2", False):
        raise ValueError("LazyCheckpointHook does not support FSDP version 1: its sharded state dict all-gathers "
                         "every parameter on the training thread at each save; use "
                         "FullyShardedDataParallelPlugin(fsdp_version=2), or accelerator.save_state()")
    if kind in _UNSUPPORTED:
        raise ValueError(f"LazyCheckpointHook does not support distributed_type={kind}: its state is sharded "
                         "or owned by the engine; use accelerator.save_state() there")
    prepared_objects = prepared(accelerator)
    if not prepared_objects.models and not prepared_objects.optimizers:
        raise RuntimeError("hook.register(accelerator) found no prepared model or optimizer; call "
                           "accelerator.prepare(...) first")
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched != accelerator.num_processes:
        raise RuntimeError(f"the launcher started WORLD_SIZE={launched} processes but the Accelerator runs "
                           f"{accelerator.num_processes}; each would write rank 0 of its own checkpoint. Without "
                           "CUDA, pass Accelerator(cpu=True) (or set ACCELERATE_USE_CPU=1) so they form one gloo "
                           "group")
