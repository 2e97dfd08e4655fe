"""What a lazyckpt checkpoint of a DeepSpeed tag holds, and the files DeepSpeed's own loader looks for.

One DeepSpeed ``save_checkpoint(save_dir, tag)`` is one lazyckpt step: every rank's state dicts, by DeepSpeed's file
name (``mp_rank_00_model_states.pt``, ``zero_pp_rank_1_mp_rank_00_optim_states.pt``, ...), under the state key
``files`` (each rank's own files: a :class:`~lazyckpt.PerRank` value in a process group) and the tag under ``tag``.
Once the step is committed rank 0 puts, in this order:

1. a short marker file of each saved file's name in the step directory: DeepSpeed's loader finds the model-state
   files with ``glob`` before it asks the checkpoint engine for them;
2. the tag, a link ``save_dir/<tag> -> step-NNNNNNN`` (by :class:`~lazyckpt.policy.CheckpointNames`);
3. ``save_dir/latest`` with the tag, written atomically: DeepSpeed's ``load_checkpoint(save_dir)`` reads it, so it
   only ever names a committed checkpoint.

A crash between the commit and 3 leaves ``latest`` one checkpoint behind: :func:`repair_latest` (run before every
``load_checkpoint``) puts 1–3 in place for the newest committed step.

DeepSpeed stores its loss scaler object in the optimizer's state dict; :func:`encode_objects` turns it into plain
data that lazyckpt's safe encoding stores, :func:`decode_objects` rebuilds it (only classes named in
``_OBJECTS``: the file never chooses what is constructed).
"""

from __future__ import annotations

import json
import os
from typing import Any

from lazyckpt.format.catalog import committed_steps
from lazyckpt.format.files import MANIFEST, step_dirname
from lazyckpt.levels.aliases import alias_step, link_alias
from lazyckpt.read.reader import CheckpointReader
from lazyckpt.storage import FileKind, Storage
from lazyckpt.storage.base import kind_of

LATEST = "latest"
"""DeepSpeed's file naming the newest tag of a ``save_dir``."""
_OBJECT = "__lazyckpt_deepspeed_object__"
_MARKER = {"lazyckpt": "this DeepSpeed file is stored in the lazyckpt checkpoint of this directory",
           "read it with": "use_lazy_checkpoints(engine) then engine.load_checkpoint(save_dir), or lazyckpt load"}


def _object_classes() -> dict[str, type]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    return {cls.__name__: cls for cls in (LossScaler, DynamicLossScaler)}


def encode_objects(value: Any) -> Any:
    """``value`` with each DeepSpeed loss scaler replaced by ``{marker: class name, "state": its attributes}``."""
    classes = _object_classes()
    if type(value) in classes.values():
        return {_OBJECT: type(value).__name__, "state": dict(vars(value))}
    if isinstance(value, dict):
        return {k: encode_objects(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encode_objects(v) for v in value]
    return value


def decode_objects(value: Any) -> Any:
    """The inverse of :func:`encode_objects` on a loaded state dict."""
    if isinstance(value, dict) and set(value) == {_OBJECT, "state"}:
        cls = _object_classes().get(value[_OBJECT])
        if cls is None:
            return value
        scaler = cls.__new__(cls)
        scaler.__dict__.update(value["state"])
        return scaler
    if isinstance(value, dict):
        return {k: decode_objects(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_objects(v) for v in value]
    return value


def is_lazyckpt_tag(storage: Storage, tag_dir: str) -> bool:
    """Whether ``save_dir/<tag>`` is (a link to) a committed lazyckpt step, not a tag DeepSpeed wrote itself."""
    return kind_of(storage, os.path.join(tag_dir, MANIFEST)) is FileKind.FILE


def file_names(step_dir: str, storage: Storage) -> dict[int, list[str]]:
    """Each rank's DeepSpeed file names in a committed step (from the manifests: no tensor bytes are read)."""
    reader = CheckpointReader(step_dir, storage)
    return {rank: sorted(reader.outline(rank)["files"]) for rank in range(reader.world_size)}


def saved_tag(step_dir: str, storage: Storage) -> str:
    return CheckpointReader(step_dir, storage).outline(0)["tag"]


def write_markers(step_dir: str, storage: Storage) -> None:
    """Step 1 above: a marker file of every rank's every file name (what DeepSpeed's ``glob`` finds)."""
    marker = json.dumps(_MARKER, indent=1).encode()
    for names in file_names(step_dir, storage).values():
        for name in names:
            storage.write_atomic(os.path.join(step_dir, name), marker, sync=True)


def write_latest(storage: Storage, save_dir: str, tag: str) -> None:
    storage.write_atomic(os.path.join(save_dir, LATEST), tag.encode(), sync=True)


def read_latest(storage: Storage, save_dir: str) -> str | None:
    path = os.path.join(save_dir, LATEST)
    if kind_of(storage, path) is not FileKind.FILE:
        return None
    return storage.read_bytes(path, max_bytes=4096).decode().strip()


def repair_latest(storage: Storage, save_dir: str, steps_dir: str) -> str | None:
    """Rank 0, before DeepSpeed reads ``latest``: when the newest committed step of ``steps_dir`` is newer than
    the step ``latest`` names, put its markers, tag link and ``latest`` in place (a crash came between its commit
    and those). Returns the tag it made ``latest``, or None when nothing needed doing."""
    steps = committed_steps(steps_dir, storage)
    if not steps:
        return None
    newest = max(steps)
    current = read_latest(storage, save_dir)
    if current is not None and alias_step(storage, os.path.join(save_dir, current)) == newest:
        return None
    step_dir = os.path.join(steps_dir, step_dirname(newest))
    tag = saved_tag(step_dir, storage)
    write_markers(step_dir, storage)
    link_alias(storage, os.path.join(save_dir, tag), step_dir)
    write_latest(storage, save_dir, tag)
    return tag
