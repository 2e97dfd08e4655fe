"""The remote level: committed checkpoints uploaded through fsspec behind the node-local directory (docs/remote.md).

| module | owns |
|---|---|
| ``upload`` | :class:`~lazyckpt.levels.remote.upload.RemoteLevel`: one uploader thread per checkpointer, the remote commit and retention |
| ``tickets`` | one step's upload as the engine sees it (:class:`~lazyckpt.levels.remote.tickets.RemoteUpload`), waiting for it, what is kept of a finished one |
| ``meeting`` | how the ranks' uploads of one step meet before rank 0 writes the commit object (the store, or the remote itself) |
| ``contents`` | what a remote holds (by the format's commit rule), partial uploads, commit-aware removal, the newest of both levels |
| ``fetch`` | a remote checkpoint brought to this node for frameworks that resume only from a local path |
| ``spool`` | a URL ``dirpath`` split into a node-local spool directory and the remote level behind it |
| ``recovery`` | at restart, the committed local steps a crash kept from the remote, agreed on by every rank and uploaded first |
"""
