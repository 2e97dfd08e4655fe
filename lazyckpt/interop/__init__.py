"""Checkpoints shared with other tools: what they read of lazyckpt's, and lazyckpt's files in their formats.

| module | owns |
|---|---|
| ``lightning_format`` | the Lightning checkpoint dict inside a ``LazyCheckpoint`` checkpoint, and its ``torch.save`` bytes |
| ``weights_only`` | a loaded state made into what ``torch.load(weights_only=True)`` accepts |
| ``export`` | ``lazyckpt export``: a Lightning ``.ckpt``, a Hugging Face-style ``model.safetensors``, or the Trainer's checkpoint folder |
| ``deepspeed_format`` | whole tensors from the ZeRO 1/2/3 partitions of a DeepSpeed checkpoint, in one process (no DeepSpeed imported) |
| ``transformers_format`` | the Hugging Face Trainer's own checkpoint files of a ``LazyCheckpointCallback`` checkpoint (no transformers imported) |
| ``dcp`` | :class:`~lazyckpt.interop.dcp.StorageReader`: ``torch.distributed.checkpoint.load`` reads lazyckpt checkpoints (DCP's planner reshards) |
"""
