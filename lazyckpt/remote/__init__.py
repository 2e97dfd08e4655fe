"""The remote level: checkpoints uploaded through fsspec behind the node-local directory (docs/remote.md)."""
