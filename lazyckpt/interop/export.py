"""Export a checkpoint for tools that know nothing of lazyckpt: a Lightning ``.ckpt`` that loads with
``torch.load(weights_only=True)``, a Hugging Face-style ``model.safetensors`` (plain parameter names, tied
weights stored once, no lazyckpt metadata) that ``safetensors.torch.load_file`` and ``from_pretrained`` read next
to the model's config, or the Hugging Face ``Trainer``'s own checkpoint folder of a checkpoint
``LazyCheckpointCallback`` wrote (:mod:`lazyckpt.interop.transformers_format`).

Example:
    >>> export("runs/ckpt/last.ckpt", "out/model.ckpt")                                   # doctest: +SKIP
    >>> export("runs/ckpt/last.ckpt", "hf/model.safetensors", format="safetensors")       # doctest: +SKIP
    >>> AutoModel.from_pretrained("hf")   # with the model's config.json next to it       # doctest: +SKIP
    >>> export("hf-run/checkpoint-6", "handed-over", format="transformers")               # doctest: +SKIP
    >>> Trainer(...).train(resume_from_checkpoint="handed-over")   # no lazyckpt needed   # doctest: +SKIP
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from lazyckpt.errors import CheckpointFormatError
from lazyckpt.interop.deepspeed_format import consolidate, is_deepspeed_state
from lazyckpt.interop.lightning_format import lightning_checkpoint_bytes
from lazyckpt.interop.transformers_format import trainer_checkpoint
from lazyckpt.read.load import check_committed, load
from lazyckpt.storage import FileKind, LocalStorage, Storage
from lazyckpt.storage.urls import is_url, reaching, storage_for

FORMATS = ("lightning", "safetensors", "transformers")
MODEL_KEYS = ("state_dict", "model")
"""Where the weights are looked for when no key is given: Lightning's layout, then the plain-PyTorch habit."""


def export(path: str | os.PathLike[str], out_file: str | os.PathLike[str], *, format: str = "lightning",
           key: str | None = None, strip_prefix: str | None = None, dedupe: bool = True,
           storage: Storage | None = None, storage_options: dict[str, Any] | None = None) -> str:
    """Write the checkpoint at ``path`` to the local file ``out_file`` (atomically) and return ``out_file``.

    Args:
        path: a committed step directory or a name linking to one, or its URL on a remote level
            (``s3://bucket/run/step-0000040``).
        out_file: the local file to write (for ``"transformers"``: the directory, which must not exist or be empty).
        format: ``"lightning"``: a Lightning ``.ckpt`` that loads with ``torch.load(weights_only=True)``;
            ``"safetensors"``: the model's weights under plain parameter names, as ``from_pretrained`` reads them;
            ``"transformers"``: the Hugging Face Trainer's checkpoint folder of a ``LazyCheckpointCallback``
            checkpoint (see :func:`export_transformers`).
        key, strip_prefix: safetensors only; see :func:`export_safetensors`.
        dedupe: safetensors and transformers: store tied weights once.
        storage: where the checkpoint is read from (default: local files, or fsspec for a URL).
        storage_options: passed to fsspec when ``path`` is a URL.

    Raises:
        ValueError: an unknown ``format``, or ``out_file`` is a URL.
        CheckpointNotFoundError: ``path`` is no committed checkpoint (a directory of them: the message names the
            newest step to export).
        RemoteUnreachableError: the remote ``path`` could not be read (endpoint, credentials, an unknown storage
            option); the message names the URL and ``storage_options``.
        CheckpointFormatError: no model weights found for a safetensors export, or a value the output would hold
            that ``torch.load(weights_only=True)`` refuses (the message names file and key path).
    """
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not one of {FORMATS}")
    _check_local("out_file", out_file)
    if format == "transformers" and (key is not None or strip_prefix is not None):
        raise ValueError(f"key={key!r} and strip_prefix={strip_prefix!r} apply to format='safetensors'; a "
                         "transformers export takes the model's own state_dict() names: drop them")
    with reaching("path", path, storage_options, storage=storage):
        source, reading = storage_for(path, storage, storage_options)
        chosen = "" if format == "lightning" else f" --format {format}"
        check_committed(source, reading, advice=f"export that step: lazyckpt export <that step> "
                                                f"{os.fspath(out_file)}{chosen}")
        if format == "transformers":
            return export_transformers(source, out_file, dedupe=dedupe, storage=reading)
        if format == "safetensors":
            return export_safetensors(source, out_file, key=key, strip_prefix=strip_prefix, dedupe=dedupe,
                                      storage=reading)
        return export_lightning(source, out_file, storage=reading)


def export_lightning(path: str | os.PathLike[str], out_file: str | os.PathLike[str], *, verify: bool = True,
                     storage: Storage | None = None, storage_options: dict[str, Any] | None = None) -> str:
    """Write a lazyckpt checkpoint written by ``LazyCheckpoint`` as a plain Lightning ``.ckpt`` file (atomically);
    returns ``out_file``.

    The file holds only tensors and plain values, so ``torch.load(out_file, weights_only=True)``,
    ``LightningModule.load_from_checkpoint(out_file)`` and ``Trainer.fit(ckpt_path=out_file)`` all accept it
    (:func:`lazyckpt.interop.lightning_format.lightning_checkpoint_bytes`). ``storage`` and ``storage_options``
    as for :func:`export`.
    """
    _check_local("out_file", out_file)
    data = lightning_checkpoint_bytes(path, verify=verify, storage=storage, storage_options=storage_options)
    return _write_atomic(out_file, data)


def export_safetensors(path: str | os.PathLike[str], out_file: str | os.PathLike[str], *, key: str | None = None,
                       strip_prefix: str | None = None, dedupe: bool = True, storage: Storage | None = None,
                       storage_options: dict[str, Any] | None = None) -> str:
    """Write the model weights of a checkpoint (read and verified by :func:`lazyckpt.load`) to the local file
    ``out_file``, atomically; returns ``out_file``.

    Args:
        key: the top-level key holding the weights (default: the first of :data:`MODEL_KEYS` present, or the
            whole state when it is already a flat dict of tensors; a DeepSpeed checkpoint's whole fp32 weights and
            buffers, consolidated from its ZeRO partitions).
        strip_prefix: remove this prefix from every name (default: a Lightning checkpoint's ``state_dict`` loses
            the attribute prefix all its names share, e.g. ``model.`` of ``self.model``).
        dedupe: store bit-identical tensors (tied embeddings) once, under their first name.
        storage, storage_options: where the checkpoint is read from, as for :func:`export`.
    """
    _check_local("out_file", out_file)
    source, storage = storage_for(path, storage, storage_options)
    state = load(source, storage=storage)
    if key is None and is_deepspeed_state(state):  # ZeRO partitions: the whole fp32 weights and buffers
        state = {"model": consolidate(source, storage=storage)["module"]}
    weights = model_weights(state, key, where=os.fspath(path))
    lightning = "pytorch-lightning_version" in state
    prefix = strip_prefix if strip_prefix is not None else (_shared_prefix(weights) if lightning else "")
    weights = {name.removeprefix(prefix): t for name, t in weights.items()}
    if dedupe:
        weights = drop_duplicates(weights)
    data = safetensors_bytes(_unshared(weights), metadata={"format": "pt"})
    return _write_atomic(out_file, data)


def export_transformers(path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, dedupe: bool = True,
                        verify: bool = True, storage: Storage | None = None,
                        storage_options: dict[str, Any] | None = None) -> str:
    """Write the Hugging Face ``Trainer``'s own checkpoint folder of a checkpoint ``LazyCheckpointCallback`` wrote
    into the local directory ``out_dir``, atomically (a directory next to it, renamed once complete); returns
    ``out_dir``. A plain ``Trainer`` resumes from it (``train(resume_from_checkpoint=out_dir)``) and
    ``from_pretrained(out_dir)`` loads the model, without lazyckpt.

    It holds what ``Trainer._save_checkpoint`` writes: ``model.safetensors`` (tied weights once, under the first
    name of ``state_dict()``, as ``save_pretrained`` keeps them), ``config.json`` (when the step directory has
    one), ``trainer_state.json``, and unless the run saved the model only, ``optimizer.pt``, ``scheduler.pt``,
    ``scaler.pt`` (if any) and ``rng_state.pth`` (``rng_state_{i}.pth`` for each process of a multi-process run).
    Not the ``training_args.bin``, tokenizer or ``generation_config.json``: the checkpoint holds none of them.

    Raises:
        FileExistsError: ``out_dir`` exists and is not an empty directory.
        CheckpointFormatError: ``path`` was not written by ``LazyCheckpointCallback`` (the message names the
            formats that fit it), or its model is sharded across ranks (FSDP).
    """
    _check_local("out_dir", out_dir)
    out_dir, local = os.fspath(out_dir), LocalStorage()
    _check_out_dir(local, out_dir)  # before the long read
    source, storage = storage_for(path, storage, storage_options)
    checkpoint = trainer_checkpoint(source, verify=verify, storage=storage)
    weights = drop_duplicates(checkpoint.weights) if dedupe else checkpoint.weights
    model = safetensors_bytes({name: t.contiguous() for name, t in weights.items()}, metadata={"format": "pt"})
    return _write_dir_atomic(local, out_dir, {"model.safetensors": model, **checkpoint.files})


def _check_out_dir(storage: Storage, out_dir: str) -> None:
    info = storage.stat(out_dir)
    if info is None or info.kind is FileKind.DIR and not storage.list_dir(out_dir):
        return
    what = {FileKind.DIR: "a directory that is not empty", FileKind.FILE: "a file",
            FileKind.LINK: "a symbolic link"}.get(info.kind, "a special file")
    raise FileExistsError(f"out_dir={out_dir!r} is {what}; a transformers export writes a new directory and never "
                          "mixes its files with others: pass a path that does not exist yet (or remove that one)")


def _write_dir_atomic(storage: Storage, out_dir: str, files: dict[str, bytes]) -> str:
    """Every file into a fresh directory next to ``out_dir``, then one rename: ``out_dir`` is whole or absent."""
    target = os.path.abspath(out_dir)
    parent = os.path.dirname(target)
    storage.make_dir(parent)
    tmp = os.path.join(parent, f".{os.path.basename(target)}.{secrets.token_hex(6)}.tmp")
    storage.make_dir(tmp)
    try:
        for name, data in files.items():
            storage.write_atomic(os.path.join(tmp, name), data, sync=True)
        _check_out_dir(storage, out_dir)  # again: something may have appeared there during the read
        storage.rename(tmp, target, sync=True)
    except BaseException:
        storage.remove_tree(tmp)
        raise
    return out_dir


def _check_local(name: str, out_file: str | os.PathLike[str]) -> None:
    if is_url(out_file):
        raise ValueError(f"{name}={out_file!r} is a URL; an export writes a local file: pass a local path and copy "
                         "the file to the remote afterwards (e.g. fsspec's put)")


def _write_atomic(out_file: str | os.PathLike[str], data: bytes) -> str:
    """The export goes to a local file, wherever the checkpoint was read from."""
    out_file, storage = os.fspath(out_file), LocalStorage()
    storage.make_dir(os.path.dirname(os.path.abspath(out_file)))
    storage.write_atomic(out_file, data, sync=True)
    return out_file


def model_weights(state: Any, key: str | None = None, *, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The flat ``{parameter name: tensor}`` mapping of ``state[key]`` (default: the first of :data:`MODEL_KEYS`
    present, or the whole state when it is already such a mapping)."""
    if not isinstance(state, dict):
        raise CheckpointFormatError(f"{where} holds a {type(state).__name__}, not a dict of weights")
    if key is None:
        key = next((k for k in MODEL_KEYS if isinstance(state.get(k), dict)), None)
    if key is not None and not isinstance(state.get(key), dict):
        raise CheckpointFormatError(f"{where} has no dict under {key!r}; its top-level keys are "
                                    f"{sorted(map(str, state))[:10]}; pass --key with the one holding the weights")
    weights = state if key is None else state[key]
    bad = [name for name, value in weights.items() if not isinstance(name, str) or not isinstance(value, torch.Tensor)]
    if bad or not weights:
        raise CheckpointFormatError(f"{where}: {key or 'the state'} is not a flat dict of tensors (e.g. "
                                    f"{bad[:3]!r}); pass --key with the one holding the model's state_dict")
    return dict(weights)


def drop_duplicates(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep one name of each group of bit-identical, non-constant tensors (tied weights; a checkpoint stores
    each name's bytes, so ties show as equal contents). Constant tensors (zero biases) are never merged."""
    kept: dict[str, torch.Tensor] = {}
    seen: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for name, tensor in weights.items():
        signature = (tensor.dtype, tuple(tensor.shape))
        constant = tensor.numel() < 2 or bool((tensor.reshape(-1) == tensor.reshape(-1)[0]).all())
        if not constant and any(torch.equal(tensor, other) for other in seen.get(signature, [])):
            continue
        seen.setdefault(signature, []).append(tensor)
        kept[name] = tensor
    return kept


def _unshared(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors of their own memory each: ``load`` gives a tied weight (stored once) as one tensor under
    each of its names, and safetensors refuses tensors that share memory; kept duplicates get a copy."""
    seen: set[int] = set()
    out = {}
    for name, tensor in weights.items():
        tensor = tensor.contiguous()
        address = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if address in seen and tensor.numel() else tensor
        seen.add(address)
    return out


def _shared_prefix(weights: Mapping[str, torch.Tensor]) -> str:
    """``"model."`` when every name starts with that one attribute (the LightningModule's wrapped model)."""
    heads = {name.split(".", 1)[0] for name in weights}
    if len(heads) == 1 and all("." in name for name in weights):
        return f"{heads.pop()}."
    return ""
