"""``lazyckpt://`` URLs: Lightning's own loading reads lazyckpt checkpoints, with no patching.

Lightning opens checkpoint paths through fsspec (``load_from_checkpoint``, ``Trainer.fit/validate/test/predict
(ckpt_path=...)``, the LightningCLI ``--ckpt_path``). The package registers this read-only filesystem for the
``lazyckpt`` protocol through the ``fsspec.specs`` entry point group, so fsspec finds it by the URL alone. Opening
``lazyckpt://<path>`` yields the Lightning checkpoint stored there as bytes of ``torch.save``, holding only types
that ``torch.load(weights_only=True)`` accepts: the checkpoint itself is read by ``lazyckpt.load`` (checksums
verified, no pickle), and Lightning's ``torch.load`` only ever sees what lazyckpt re-serialized from it.

``<path>`` is anything Lightning reports or lazyckpt writes: a step directory (``runs/ckpt/step-0000040``) or
a name pointing at one (``runs/ckpt/last.ckpt``, ``trainer.checkpoint_callback.best_model_path``); relative to
the working directory, or absolute with a third slash (``lazyckpt:///data/runs/ckpt/last.ckpt``).

Example:
    >>> model = MyModule.load_from_checkpoint("lazyckpt://runs/ckpt/last.ckpt")             # doctest: +SKIP
    >>> Trainer().test(model, ckpt_path="lazyckpt://runs/ckpt/step-0000040")               # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import io
import os
from typing import Any

from fsspec import AbstractFileSystem

from lazyckpt.format.files import MANIFEST
from lazyckpt.interop.lightning_format import lightning_checkpoint_bytes
from lazyckpt.storage import FileKind, LocalStorage

from ._lightning_io import URL_PREFIX, local_path

PROTOCOL = URL_PREFIX.removesuffix("://")


class LazyCheckpointFileSystem(AbstractFileSystem):
    """Read-only fsspec filesystem for ``lazyckpt://`` URLs; each checkpoint reads as one ``.ckpt`` file."""

    protocol = PROTOCOL
    root_marker = ""

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        if not isinstance(path, str):
            return super()._strip_protocol(path)
        return local_path(path if path.startswith(URL_PREFIX) else URL_PREFIX + super()._strip_protocol(path))

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        manifest = LocalStorage().stat(os.path.join(self._strip_protocol(path), MANIFEST))
        if manifest is None or manifest.kind is not FileKind.FILE:
            raise FileNotFoundError(f"{path} is not a committed lazyckpt checkpoint (no {MANIFEST} there)")
        return {"name": self._strip_protocol(path), "size": None, "type": "file", "mtime": manifest.mtime}

    def modified(self, path: str) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], tz=datetime.timezone.utc)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        entry = self.info(path)
        return [entry] if detail else [entry["name"]]

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> io.BytesIO:
        if mode != "rb":
            raise PermissionError(f"{PROTOCOL}:// is read-only; write checkpoints with LazyCheckpoint or "
                                  f"LazyCheckpointer (mode={mode!r})")
        return io.BytesIO(lightning_checkpoint_bytes(self._strip_protocol(path)))
