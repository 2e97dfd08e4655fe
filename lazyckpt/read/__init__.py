"""The read path, the write path's mirror: strict, checksum-verified, and never executing stored code.

| module | owns |
|---|---|
| ``load`` | ``load``, ``verify``, ``latest``, ``checkpoint_step``; :func:`~lazyckpt.read.load.check_committed` |
| ``reader`` | :class:`~lazyckpt.read.reader.CheckpointReader`: one committed directory opened strictly (every file, seal and header check) |
| ``tensor_io`` | tensor bytes into tensors: large reads straight into their memory, checksums on worker threads |
| ``fresh_memory`` | fresh CPU tensors for loaded bytes, on transparent huge pages where the kernel offers them |
| ``shard_files`` | :class:`~lazyckpt.read.shard_files.ShardFiles`: verified reads of byte ranges of every rank's file, boxes assembled |
| ``reshard`` | ``load_into``: a checkpoint into targets of any layout, mesh and world size, filled in place |
| ``snapshot_copy`` | a held snapshot copied and checked in one pass, straight into the live tensors |
"""
