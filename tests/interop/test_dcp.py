"""``torch.distributed.checkpoint.load`` through lazyckpt's StorageReader: what the strict reader refuses reaches
the caller as lazyckpt's own error (inside DCP's ``CheckpointException``, as DCP wraps every reader's error)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import lazyckpt
from helpers.forge import edit_manifest, reseal
from lazyckpt.interop.dcp import StorageReader


def test_a_refusal_while_describing_the_checkpoint_reaches_the_caller_as_lazyckpts_error(tmp_path):
    """DCP turns an exception of ``read_metadata`` into an AssertionError holding only its text; the reader
    raises it from ``set_up_storage_reader`` instead (before: AssertionError "metadata is None; ...")."""
    with lazyckpt.LazyCheckpointer(tmp_path) as ckpt:
        path = ckpt.save({"step": 1, "w": torch.ones(2)}, step=1).wait()
    edit_manifest(os.path.join(path, "rank-00000.json"), lambda d: d["tensors"]["w"].update(dtype="F16"))
    reseal(path)
    with pytest.raises(CheckpointException) as failure, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized"
        dcp.load({"step": 0}, storage_reader=StorageReader(path), no_dist=True)
    (error, _), = failure.value.failures.values()
    assert isinstance(error, lazyckpt.CheckpointFormatError), repr(error)
    assert "rank-00000.json" in str(error) and "'w'" in str(error)
