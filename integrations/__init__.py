"""Thin adapters from training frameworks to the lazyckpt engine: each translates its framework's events into calls
on the policy layer (:mod:`lazyckpt.policy`) and holds no format, threading or retention code.

| module | owns |
|---|---|
| ``lightning`` | ``LazyCheckpoint``, ``LazyCheckpointIO`` for ``lightning`` (``import lightning.pytorch``) |
| ``pytorch_lightning`` | the same classes on ``pytorch_lightning``'s base classes |
| ``_lightning_core`` | the ``LazyCheckpoint`` mixin: ModelCheckpoint's decisions, each save one lazy request |
| ``_lightning_barrier`` | the callback that runs the barrier first, before the optimizer step |
| ``_lightning_files`` | ModelCheckpoint's file names as names of committed step directories |
| ``_lightning_io`` | the ``CheckpointIO`` that loads lazyckpt checkpoints, the Lightning checkpoint dict, exports |
| ``_lightning_rollback`` | a rollback on a non-finite loss under the Trainer |
| ``accelerate`` | ``LazyCheckpointHook`` for an ``Accelerator``'s loop |
| ``_accelerate_state`` | what the hook reads from and restores into the prepared objects, and its torch hooks |
| ``_accelerate_sharded`` | Accelerate's FSDP version 2: each process its own shards, resharded on resume |
| ``_accelerate_rollback`` | ``hook.rollback()``: the loop's state into the rollback policy and back |
| ``fabric`` | ``LazyFabricIO``: ``fabric.save``/``fabric.load`` with lazy checkpoints (the barrier is every optimizer's step pre-hook) |
| ``transformers`` | ``LazyCheckpointCallback`` for the Hugging Face ``Trainer`` (and TRL's trainers) |
| ``_transformers_state`` | what the callback captures from and restores into the Trainer, the Trainer's files in a step directory, its retention rule |
| ``deepspeed`` | ``LazyCheckpointEngine`` and ``use_lazy_checkpoints(engine)`` for a ``DeepSpeedEngine`` (ZeRO 1/2/3) |
| ``_deepspeed_files`` | a DeepSpeed tag as one lazyckpt step: its files, the markers DeepSpeed's loader globs, the tag link, ``latest`` and its repair |
| ``_accelerate_deepspeed`` | Accelerate's DeepSpeed plugin: the engine's files in the hook's step, DeepSpeed's own load on resume |
| ``url`` | ``lazyckpt://`` URLs: Lightning's own loading reads lazyckpt checkpoints |
| ``_compat`` | every private Lightning and Accelerate attribute the adapters use, each with its reason |
"""
