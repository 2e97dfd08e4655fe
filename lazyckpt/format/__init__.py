"""The on-disk format in code (docs/FORMAT.md): what a checkpoint's files are named and hold, how they are built,
and the strict checks every reader runs. Pure: nothing here writes, and reading goes through a ``Storage``.

| module | owns |
|---|---|
| ``files`` | the format version, and the names of a checkpoint's directory, tensor files and manifests |
| ``header`` | dtypes, :class:`~lazyckpt.format.header.TensorEntry`, the safetensors header (built, and checked when read) |
| ``manifest`` | the rank manifests and ``manifest.json`` (global view), built and sealed |
| ``schema`` | the strict checks of a manifest: its seal, then a table of fields per kind and version |
| ``checksum`` | the per-chunk ``lzc64-v1`` checksum (a C loop in ``_native``) and the SHA-256 of whole files |
| ``catalog`` | which checkpoints a directory holds, by the one commit rule of every level |
"""
