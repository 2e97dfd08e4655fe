"""What a lazyckpt checkpoint of a DeepSpeed tag holds, and the files DeepSpeed's own loader looks for.

One DeepSpeed ``save_checkpoint(save_dir, tag)`` is one lazyckpt step: every rank's state dicts, by DeepSpeed's file
name (``mp_rank_00_model_states.pt``, ``zero_pp_rank_1_mp_rank_00_optim_states.pt``, ...), under the state key
``files`` (each rank's own files: a :class:`~lazyckpt.PerRank` value in a process group) and the tag under ``tag``.
Once the step is committed rank 0 puts, in this order:

1. a short marker file of each saved file's name in the step directory and in its ``checkpoint/`` folder, and
   ``latest`` naming ``checkpoint`` in the step directory: DeepSpeed's loader finds the model-state files with
   ``glob`` before it asks the checkpoint engine for them, and so ``engine.load_checkpoint(step_dir)`` (or a
   name linking to the step, as Lightning's and Accelerate's checkpoints are) reads the step as a DeepSpeed
   directory whose one tag is ``checkpoint``;
2. the tag, a link ``save_dir/<tag> -> step-NNNNNNN`` (by :class:`~lazyckpt.policy.CheckpointNames`);
3. ``save_dir/latest`` with the tag, written atomically: DeepSpeed's ``load_checkpoint(save_dir)`` reads it, so it
   only ever names a committed checkpoint.

A crash between the commit and 3 leaves ``latest`` one checkpoint behind: :func:`repair_latest` (run before every
``load_checkpoint``) puts 1–3 in place for the newest committed step. A step that is loaded as a DeepSpeed
directory itself gets 1 then, if it lacks it (:func:`ensure_markers`: steps the Accelerate hook wrote, whose
commit writes no markers).

:class:`TagFolder` is one ``save_dir``'s tags as names of steps, and its ``latest``, for
:class:`~lazyckpt.integrations.deepspeed.LazyCheckpointEngine`.

DeepSpeed stores its loss scaler object in the optimizer's state dict; :func:`encode_objects` turns it into plain
data that lazyckpt's safe encoding stores, :func:`decode_objects` rebuilds it (only classes named in
``_OBJECTS``: the file never chooses what is constructed).
"""

from __future__ import annotations

import json
import os
from typing import Any

from lazyckpt.format.catalog import committed_steps
from lazyckpt.pending import PendingCheckpoint
from lazyckpt.policy import CheckpointNames, CheckpointSession
from lazyckpt.format.files import MANIFEST, step_dirname
from lazyckpt.levels.aliases import alias_step, link_alias
from lazyckpt.read.reader import CheckpointReader
from lazyckpt.storage import FileKind, Storage
from lazyckpt.storage.base import kind_of

LATEST = "latest"
"""DeepSpeed's file naming the newest tag of a ``save_dir``."""
STEP_TAG = "checkpoint"
"""The tag of a step directory read as a DeepSpeed directory (the name Lightning's DeepSpeed checkpoints use)."""
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


def step_of_tag(storage: Storage, tag_dir: str) -> str | None:
    """The committed lazyckpt step that ``save_dir/<tag>`` is (a link to it, or its ``checkpoint/`` folder), or
    None: a tag DeepSpeed wrote itself."""
    for candidate in (tag_dir, os.path.dirname(tag_dir) if os.path.basename(tag_dir) == STEP_TAG else None):
        if candidate is not None and kind_of(storage, os.path.join(candidate, MANIFEST)) is FileKind.FILE:
            return storage.resolve(candidate)
    return None


def file_names(step_dir: str, storage: Storage) -> dict[int, list[str]]:
    """Each rank's DeepSpeed file names in a committed step (from the manifests: no tensor bytes are read)."""
    reader = CheckpointReader(step_dir, storage)
    return {rank: sorted(reader.outline(rank)["files"]) for rank in range(reader.world_size)}


def saved_tag(step_dir: str, storage: Storage) -> tuple[str, bool]:
    """The tag a step was saved under, and whether that save asked to be ``latest``."""
    outline = CheckpointReader(step_dir, storage).outline(0)
    return outline["tag"], bool(outline.get("save_latest", True))


def write_markers(step_dir: str, storage: Storage) -> None:
    """Step 1 above: a marker file of every rank's every file name (what DeepSpeed's ``glob`` finds), in the step
    directory and in its ``checkpoint/`` folder, then the step's own ``latest``."""
    marker = json.dumps(_MARKER, indent=1).encode()
    storage.make_dir(os.path.join(step_dir, STEP_TAG))
    for names in file_names(step_dir, storage).values():
        for name in names:
            for folder in (step_dir, os.path.join(step_dir, STEP_TAG)):
                storage.write_atomic(os.path.join(folder, name), marker, sync=True)
    write_latest(storage, step_dir, STEP_TAG)


def ensure_markers(step_dir: str, storage: Storage) -> bool:
    """Rank 0, before DeepSpeed loads the committed step ``step_dir`` itself (a step another integration wrote, or
    one whose markers a crash cut short): put step 1 in place unless it is. Returns whether it wrote them."""
    if kind_of(storage, os.path.join(step_dir, MANIFEST)) is not FileKind.FILE or \
            kind_of(storage, os.path.join(step_dir, LATEST)) is FileKind.FILE:
        return False
    write_markers(step_dir, storage)
    return True


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
    and those); steps saved with ``save_latest=False`` are passed over. Returns the tag it made ``latest``, or None
    when nothing needed doing."""
    current = read_latest(storage, save_dir)
    named = None if current is None else alias_step(storage, os.path.join(save_dir, current))
    for step in sorted(committed_steps(steps_dir, storage), reverse=True):
        if named is not None and step <= named:
            return None
        step_dir = os.path.join(steps_dir, step_dirname(step))
        tag, asked = saved_tag(step_dir, storage)
        if asked:  # a save with save_latest=False never becomes latest
            break
    else:
        return None
    write_markers(step_dir, storage)
    link_alias(storage, os.path.join(save_dir, tag), step_dir)
    write_latest(storage, save_dir, tag)
    return tag


class TagFolder:
    """One ``save_dir``: the session writing its steps, the tags as names of them, ``latest`` after each commit."""

    def __init__(self, session: CheckpointSession, save_dir: str) -> None:
        self.session, self.save_dir = session, save_dir
        self._pending: tuple[dict[str, Any], dict[str, Any], list[Any], list[Any]] | None = None
        self._tags: dict[int, tuple[str, bool]] = {}
        """Each requested step's tag and whether ``latest`` should name it."""
        self.names = CheckpointNames(session, self._request, names_dir=save_dir, before_names=self._markers)

    def save(self, step: int, info: Any, files: dict[str, Any], optimizers: list[Any],
             immutable: list[Any]) -> PendingCheckpoint | None:
        known = self._tags.get(step)
        if known is not None and known[0] != info.tag:
            raise ValueError(f"LazyCheckpointEngine: save_checkpoint(tag={info.tag!r}) at global step {step}, "
                             f"which this run saved already as tag {known[0]!r}; one lazyckpt step holds one tag: "
                             "save again after the next engine.step(), or under the same tag")
        self._pending = ({"tag": info.tag, "save_latest": bool(info.save_latest)}, {"files": files}, optimizers,
                         immutable)
        self._tags[step] = (info.tag, bool(info.save_latest))
        self._latest(self.names.poll())  # what committed since: latest first moves to it
        self.names.plan(step, os.path.join(self.save_dir, info.tag))
        self._retire_tags(self.session.options.keep_last_k)
        self._latest(self.names.submit())
        return self.session.last_request

    def _request(self, step: int) -> PendingCheckpoint | None:
        replicated, per_rank, optimizers, immutable = self._pending
        self._pending = None
        return self.session.save(step, replicated=replicated, per_rank=per_rank, optimizers=optimizers,
                                 immutable=immutable)

    def _retire_tags(self, keep: int | None) -> None:
        """With ``keep_last_k``: the tags of steps beyond the newest k go once the new step commits."""
        if keep is None:
            return
        kept = sorted(self._tags)[-keep:]
        kept_tags = {self._tags[s][0] for s in kept}  # a tag saved again (a fixed tag) now names a kept step
        for step in [s for s in self._tags if s not in kept]:
            tag, _ = self._tags.pop(step)
            if tag not in kept_tags:
                self.names.drop(os.path.join(self.save_dir, tag))

    def _markers(self, step: int) -> None:
        write_markers(os.path.join(self.session.dirpath, step_dirname(step)), self.session.storage)

    def poll(self) -> None:
        self._latest(self.names.poll())

    def finish(self) -> None:
        self._latest(self.names.poll(block=True))
        self.session.engine.wait_staged()

    def close(self) -> None:
        try:
            self._latest(self.names.poll(block=True))
        finally:
            self.names.close(raise_errors=True)

    def _latest(self, committed: list[Any]) -> None:
        """Rank 0: ``latest`` names the newest committed tag asked to be latest (after its link is in place)."""
        named = [c.step for c in committed if self._tags.get(c.step, ("", False))[1]]
        if named and self.session.rank == 0:
            write_latest(self.session.storage, self.save_dir, self._tags[max(named)][0])


def close_folders(folders: list[TagFolder | None]) -> None:
    for folder in folders:
        if folder is not None:
            folder.close()
