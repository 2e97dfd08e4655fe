"""The commit protocol under injected faults: a save that wait() reports failed is never the newest committed one,
and a save that wait() returns always is. Every step of the protocol fails once, on every storage backend."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

import lazyckpt
from conftest import FaultyStorage, assert_tree_equal, load_through
from lazyckpt.format.catalog import committed_steps
from lazyckpt.format.files import MANIFEST, PARTIAL_SUFFIX


def _state(value: float) -> dict:
    return {"w": torch.full((1000,), value), "b": torch.arange(7), "meta": {"value": value}}


def _ends_with(suffix: str):
    return lambda path, *rest: os.fspath(path).endswith(suffix)


def _newest(storage, root) -> int | None:
    steps = committed_steps(root, storage)
    return max(steps) if steps else None


# (method, which call, raise after the call succeeded)
COMMIT_STEPS = {
    "make the partial directory": ("make_dir", _ends_with(PARTIAL_SUFFIX), False),
    "create the tensor file": ("open_write", _ends_with(".safetensors"), False),
    "write tensor bytes": ("write", lambda *a: True, False),
    "fsync and close the tensor file": ("close", lambda *a: True, False),
    "write the rank manifest": ("write_atomic", _ends_with("rank-00000.json"), False),
    "write manifest.json": ("write_atomic", _ends_with(MANIFEST), False),
    "rename to the final name": ("rename", _ends_with(PARTIAL_SUFFIX), False),
    "rename, then report an error": ("rename", _ends_with(PARTIAL_SUFFIX), True),
    "fsync the directory after the rename": ("sync_dir", lambda *a: True, False),
}


@pytest.mark.parametrize("point", sorted(COMMIT_STEPS))
def test_a_failure_at_any_commit_step_fails_the_save_and_leaves_the_previous_checkpoint_newest(
        storage_root, tmp_path, point):
    inner, root = storage_root
    storage = FaultyStorage(inner)
    method, when, after = COMMIT_STEPS[point]
    with lazyckpt.LazyCheckpointer(root, storage=storage, copy_backend="cpu") as ckpt:
        first = ckpt.save(_state(1.0), step=1).wait()
        injected = storage.fail(method, when=when, after=after)
        pending = ckpt.save(_state(2.0), step=2)
        with pytest.raises(OSError) as info:
            pending.wait()
        assert info.value is injected
        assert _newest(inner, root) == 1, "a save reported failed must never be the newest committed one"
        assert not any(n.endswith(PARTIAL_SUFFIX) for n in inner.list_dir(root)), "nothing of it is left"
        assert ckpt.save(_state(3.0), step=2).wait() == pending.path, "the failed step can be saved again"
    assert_tree_equal(load_through(inner, pending.path, tmp_path), _state(3.0))
    assert_tree_equal(load_through(inner, first, tmp_path / "first"), _state(1.0))


def test_when_the_rename_cannot_be_undone_the_visible_checkpoint_is_reported_committed(storage_root, caplog):
    inner, root = storage_root
    storage = FaultyStorage(inner)
    with lazyckpt.LazyCheckpointer(root, storage=storage, copy_backend="cpu") as ckpt:
        storage.fail("sync_dir")
        storage.fail("rename", when=lambda src, dst, **kw: dst.endswith(PARTIAL_SUFFIX))  # the roll-back
        with caplog.at_level(logging.WARNING, logger="lazyckpt.write.commit"):
            path = ckpt.save(_state(1.0), step=1).wait()
    assert _newest(inner, root) == 1 and path.endswith("step-0000001")
    assert "undoing the rename failed too" in caplog.text


def test_a_failing_retention_listing_or_removal_keeps_the_new_checkpoint_committed(storage_root, caplog):
    inner, root = storage_root
    storage = FaultyStorage(inner)
    with lazyckpt.LazyCheckpointer(root, storage=storage, copy_backend="cpu", keep_last_k=1) as ckpt:
        ckpt.save(_state(1.0), step=1).wait()
        # The listing of committed steps: one recursive listing on a URL, the directory's entries elsewhere.
        storage.fail("list_tree" if hasattr(inner, "list_tree") else "list_dir", when=_ends_with(root))
        with caplog.at_level(logging.WARNING, logger="lazyckpt.engine"):
            assert ckpt.save(_state(2.0), step=2).wait().endswith("step-0000002")
        storage.fail("remove_tree", when=lambda path: ".purge-" in path)
        assert ckpt.save(_state(3.0), step=3).wait().endswith("step-0000003")
    assert "keep_last_k clean-up after step 2 failed" in caplog.text
    assert _newest(inner, root) == 3


def test_a_failing_lock_or_listing_at_construction_raises_and_holds_nothing(storage_root):
    inner, root = storage_root
    storage = FaultyStorage(inner)
    storage.fail("lock")
    with pytest.raises(OSError, match="injected in lock"):
        lazyckpt.LazyCheckpointer(root, storage=storage)
    storage.fail("list_dir")
    with pytest.raises(OSError, match="injected in list_dir"):
        lazyckpt.LazyCheckpointer(root, storage=storage)
    lazyckpt.LazyCheckpointer(root, storage=storage).close()  # the failed construction released its lock


def test_a_failing_free_space_query_fails_the_save_call_itself(storage_root):
    inner, root = storage_root
    storage = FaultyStorage(inner)
    with lazyckpt.LazyCheckpointer(root, storage=storage, copy_backend="cpu") as ckpt:
        injected = storage.fail("free_bytes", error=OSError(errno.EIO, "statvfs failed (injected)"))
        with pytest.raises(OSError) as info:
            ckpt.save(_state(1.0), step=1)
        assert info.value is injected
        assert ckpt.in_flight is None
