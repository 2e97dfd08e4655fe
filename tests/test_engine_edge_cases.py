"""Edge cases found in review: failures at awkward moments still end the job, and the reader is strict.

Each test failed against an earlier engine. Tests that would hang on a regression wait on an Event with a
bound and then unstick the engine by hand, so the suite (and the atexit close of open checkpointers) never hangs.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import struct
import subprocess
import sys
import weakref

import pytest
import torch

import lazyckpt
from lazyckpt import engine as engine_mod
from lazyckpt.engine import LazyCheckpointer, PendingCheckpoint
from lazyckpt.errors import CheckpointFormatError
from lazyckpt.staging.cpu import CpuCopyBackend
from lazyckpt.state import Deferred
from lazyckpt.storage import LocalStorage

from conftest import GatedBackend

BOUND = 10.0  # seconds an Event wait may take before the test calls it a hang


def _abandon(ckpt: LazyCheckpointer) -> None:
    """Unhook a checkpointer whose job is stuck so pytest's exit (atexit close) does not hang."""
    if ckpt._job is not None:
        ckpt._job.done.set()
    engine_mod._OPEN.discard(ckpt)
    ckpt._closed = True
    ckpt._lock.release()


# --- 1. concurrency / lifecycle ------------------------------------------------------------------------------

def test_deferred_failing_at_the_barrier_after_the_file_is_durable_still_finishes_the_job(tmp_path):
    """engine._barrier fails the job *after* _finalize already ran (written set, commit waiting for the Deferred):
    nobody calls _discard, so job.done is never set -> pending.wait(), the next save() and close() hang forever,
    and step-0000001.partial is left behind."""
    ckpt = LazyCheckpointer(tmp_path, copy_backend="cpu", fsync=False)

    def broken_scheduler_state():
        raise RuntimeError("scheduler.state_dict() failed")

    pending = ckpt.save({"w": torch.ones(8), "sched": Deferred(broken_scheduler_state)}, step=1)
    job = pending._job
    try:
        assert job.written.wait(BOUND)  # the writer finalized the file; the commit now waits for the barrier only
        with pytest.raises(RuntimeError, match="scheduler"):
            ckpt.wait_staged()
        assert job.done.wait(BOUND), "job.done never set: pending.wait()/save()/close() would block forever"
        assert not os.path.exists(job.partial_dir)
    finally:
        _abandon(ckpt)


class _CleanupFails(LocalStorage):
    """Writes fail (EIO) and removing a directory fails too (a read-only or flaky mount)."""

    def write(self, handle, offset, buffers):
        raise OSError(errno.EIO, "I/O error (injected)")

    def remove_tree(self, path):
        raise PermissionError(errno.EACCES, "cannot remove (injected)", path)


def test_a_failing_cleanup_does_not_leave_the_job_unfinished(tmp_path):
    """engine._discard calls storage.remove_tree() before job.done.set() without try/finally: if the clean-up
    raises, the writer swallows it (job already failed) and done is never set -> every later call hangs."""
    ckpt = LazyCheckpointer(tmp_path, copy_backend="cpu", storage=_CleanupFails(), fsync=False)
    pending = ckpt.save({"w": torch.ones(8)}, step=1)
    try:
        assert pending._job.done.wait(BOUND), "job.done never set after a write failure + failing clean-up"
        with pytest.raises(OSError) as info:
            pending.wait(timeout=0)
        assert info.value.errno == errno.EIO  # the original failure, not the clean-up's
    finally:
        _abandon(ckpt)


class _BadChecksumsOnce(CpuCopyBackend):
    """A fused-checksum backend whose first call returns malformed checksums (one list too short)."""

    def __init__(self) -> None:
        self.calls = 0

    def copy_pieces(self, sources, pieces, slots):
        super().copy_pieces(sources, pieces, slots)
        self.calls += 1
        if self.calls == 1:
            return [[] for _ in pieces]  # should hold one checksum per segment
        return None


def test_a_failure_between_copy_and_submit_does_not_leak_pool_slots(tmp_path):
    """copier._copy_batch releases the slots only when copy_pieces() raises; an exception after it (here
    _record_checksums' zip(strict=True)) leaks every slot of the batch. The pool is reused, so with a 1-slot
    budget the next checkpoint's copier blocks in pool.acquire() forever and wait_staged() never returns."""
    backend = _BadChecksumsOnce()
    ckpt = LazyCheckpointer(tmp_path, backend=backend, host_buffer_bytes=8 << 20, fsync=False)
    w = torch.nn.Parameter(torch.ones(1024))
    opt = torch.optim.SGD([w], lr=0.1)
    first = ckpt.save({"w": w}, step=1, optimizers=[opt])
    with pytest.raises(ValueError):
        first.wait(timeout=BOUND)
    second = ckpt.save({"w": w}, step=2, optimizers=[opt])
    try:
        assert second._job.staged.wait(BOUND), "copier stuck in pool.acquire(): the failed job leaked its slot"
        assert second.wait(timeout=BOUND) is not None
    finally:
        if not second._job.staged.is_set():
            ckpt._copier.pool.release(0)  # unstick the copier so close() can finish
            second._job.done.wait(BOUND)
        ckpt.close()


class _PurgeFails(LocalStorage):
    def remove_tree(self, path):
        if ".purge-" in os.path.basename(path):
            raise PermissionError(errno.EACCES, "cannot remove (injected)", path)
        super().remove_tree(path)


def test_a_retention_failure_does_not_report_a_committed_checkpoint_as_failed(tmp_path):
    """engine._commit runs _purge() inside the same try as commit(): when retention of an *older* checkpoint
    fails, the just-committed one is marked failed (wait() raises) although
    it is committed and latest() returns it; a caller that retries the step then gets StepAlreadyCommittedError."""
    ckpt = LazyCheckpointer(tmp_path, copy_backend="cpu", storage=_PurgeFails(), keep_last_k=1, fsync=False)
    try:
        ckpt.save({"w": torch.ones(4)}, step=1).wait(timeout=BOUND)
        pending = ckpt.save({"w": torch.ones(4) * 2}, step=2)
        pending._job.done.wait(BOUND)
        assert lazyckpt.latest(tmp_path) == pending.path  # step 2 *is* committed ...
        assert pending.wait(timeout=BOUND) == pending.path  # ... but wait() raises retention's PermissionError
    finally:
        try:
            ckpt.close()
        except OSError:
            pass


# --- 4. API surprises ------------------------------------------------------------------------------------------

def test_in_flight_is_the_documented_pending_checkpoint(tmp_path):
    """docs/ENGINE_API.md: `ckpt.in_flight  # the PendingCheckpoint not yet committed, or None`; the engine
    returns the internal CheckpointJob, so `ckpt.in_flight.wait()` / `.done()` / `.path` fail."""
    backend = GatedBackend()
    ckpt = LazyCheckpointer(tmp_path, backend=backend, fsync=False)
    w = torch.nn.Parameter(torch.ones(16))
    opt = torch.optim.SGD([w], lr=0.1)
    pending = ckpt.save({"w": w}, step=1, optimizers=[opt])
    try:
        assert backend.entered.wait(BOUND)
        assert isinstance(ckpt.in_flight, PendingCheckpoint)
    finally:
        backend.gate.set()
        pending.wait(timeout=BOUND)
        ckpt.close()


# --- 3. strict reader: malformed inputs must raise CheckpointFormatError ---------------------------------------

def _committed(tmp_path, state):
    with LazyCheckpointer(tmp_path / "run", copy_backend="cpu", fsync=False) as ckpt:
        return ckpt.save(state, step=1).wait(timeout=BOUND)


def _edit_json(path, fn):
    with open(path) as f:
        doc = json.load(f)
    fn(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


def _edit_header(file_path, fn):
    with open(file_path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    fn(header)
    body = json.dumps(header).encode()
    with open(file_path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + raw[8 + n :])


def _tensor_key(doc):
    return next(iter(doc["tensors"]))


@pytest.mark.parametrize("field", ["dtype", "shape"])
def test_rank_manifest_tensor_missing_a_field_is_a_format_error(tmp_path, field):
    """format.check_rank_manifest checks only offsets/checksums; loading._match_manifest then does
    info['dtype'] / info['shape'] -> KeyError."""
    path = _committed(tmp_path, {"w": torch.ones(4)})
    _edit_json(os.path.join(path, "rank-00000.json"), lambda d: d["tensors"][_tensor_key(d)].pop(field))
    with pytest.raises(CheckpointFormatError):
        lazyckpt.load(path)


def test_rank_manifest_without_tree_is_a_format_error(tmp_path):
    """loading.load reads doc['tree'] unchecked -> KeyError (FORMAT.md rule 12: MUST hold tree)."""
    path = _committed(tmp_path, {"w": torch.ones(4)})
    _edit_json(os.path.join(path, "rank-00000.json"), lambda d: d.pop("tree"))
    with pytest.raises(CheckpointFormatError):
        lazyckpt.load(path)


def test_header_with_an_unhashable_dtype_is_a_format_error(tmp_path):
    """format.torch_dtype does `name not in dict`: a list dtype raises TypeError (unhashable)."""
    path = _committed(tmp_path, {"w": torch.ones(4)})
    file_path = os.path.join(path, "rank-00000-of-00001.safetensors")
    _edit_header(file_path, lambda h: h[next(k for k in h if k != "__metadata__")].update(dtype=["F32"]))
    with pytest.raises(CheckpointFormatError):
        lazyckpt.verify(path)


def test_empty_tensor_with_a_huge_dimension_is_a_format_error(tmp_path):
    """A zero-element shape passes the size/tiling checks whatever its other dims; torch.empty([0, 2**63])
    then raises TypeError (and [0, 2**62, 2**62] RuntimeError) from loading._read_tensor."""
    path = _committed(tmp_path, {"e": torch.empty(0, 3)})
    shape = [0, 2**63]
    _edit_header(os.path.join(path, "rank-00000-of-00001.safetensors"),
                 lambda h: h[next(k for k in h if k != "__metadata__")].update(shape=shape))
    _edit_json(os.path.join(path, "rank-00000.json"), lambda d: d["tensors"][_tensor_key(d)].update(shape=shape))
    with pytest.raises(CheckpointFormatError):
        lazyckpt.load(path)


@pytest.mark.parametrize("node", [
    {"$np_scalar": {"dtype": "|i1", "value": 100000}},                        # OverflowError
    {"$torch_device": "not-a-device"},                                        # RuntimeError
    {"$inline": {"dtype": "F32", "shape": [-1, -1], "data": "AAAAAA=="}},     # RuntimeError (reshape)
    {"$inline": {"dtype": "F32", "shape": [0, 10**20], "data": ""}},          # OverflowError (np.prod)
    {"$inline": {"dtype": "F32", "shape": [2**32, 2**32], "data": ""}},       # int64 product wraps to 0
], ids=["np_scalar_overflow", "bad_device", "inline_negative_shape", "inline_huge_shape", "inline_wrapping_shape"])
def test_malformed_tree_nodes_are_format_errors(tmp_path, node):
    """unflatten._Decoder.decode maps only TypeError/ValueError/KeyError/AttributeError to
    CheckpointFormatError; OverflowError and RuntimeError (torch) escape, and decode_inline_tensor trusts the
    shape (negative dims, int64 wrap-around in np.prod)."""
    path = _committed(tmp_path, {"w": torch.ones(4)})
    _edit_json(os.path.join(path, "rank-00000.json"), lambda d: d.update(tree={"$dict": [["x", node]]}))
    with pytest.raises(CheckpointFormatError):
        lazyckpt.load(path)


def test_deeply_nested_manifest_is_a_format_error(tmp_path):
    """loading._read_json catches UnicodeDecodeError/JSONDecodeError only; json.loads raises RecursionError on
    a deeply nested document (same in format.read_header for the safetensors header)."""
    path = _committed(tmp_path, {"w": torch.ones(4)})
    manifest = os.path.join(path, "rank-00000.json")
    with open(manifest) as f:
        text = f.read()
    with open(manifest, "w") as f:
        f.write(text[:-1] + ',"deep":' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(CheckpointFormatError):
        lazyckpt.load(path)


def test_torch_dtype_tag_imports_no_module(tmp_path):
    """unflatten._Decoder._torch_dtype does getattr(torch, <name from the file>): torch.__getattr__ imports its
    lazy submodules (onnx, _dynamo, _inductor, _export) and *calls* deprecated-attribute replacements, which
    FORMAT.md rule 15 forbids (MUST NOT import modules or call constructors named by the file)."""
    code = (
        "import sys, torch\n"
        "from lazyckpt.unflatten import unflatten\n"
        "from lazyckpt.errors import CheckpointFormatError\n"
        "assert 'torch.onnx' not in sys.modules\n"
        "try:\n    unflatten({'$torch_dtype': 'onnx'}, {})\nexcept CheckpointFormatError:\n    pass\n"
        "print('torch.onnx' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "decoding a $torch_dtype tag imported torch.onnx"


def test_a_symlinked_tensor_file_is_not_read_outside_the_checkpoint(tmp_path):
    """FORMAT.md rule 13 wants files *inside* the checkpoint directory; check_member_name checks the name only,
    so a symlink (e.g. from an untrusted tarball) makes load() read a file outside it. Policy finding: either
    refuse symlinks / realpath outside the directory, or document that the directory itself must be trusted."""
    path = _committed(tmp_path, {"w": torch.ones(4)})
    inside = os.path.join(path, "rank-00000-of-00001.safetensors")
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(inside, outside)
    os.symlink(outside, inside)
    with pytest.raises(CheckpointFormatError):
        lazyckpt.load(path)
