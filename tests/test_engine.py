"""LazyCheckpointer's own rules: step order, bounded statistics, and a free-space check that counts every byte."""

from __future__ import annotations

import gc
import errno
import json

import pytest
import torch

import lazyckpt
from conftest import GatedBackend
from lazyckpt.format.catalog import committed_steps
from lazyckpt.write.stats import StatsLog


def test_a_step_lower_than_the_newest_committed_one_is_refused_with_the_fix(storage_root):
    storage, root = storage_root
    with lazyckpt.LazyCheckpointer(root, storage=storage) as ckpt:
        for step in (10, 20):
            ckpt.save({"w": torch.ones(3) * step}, step=step).wait()
        with pytest.raises(lazyckpt.StepOrderError, match=r"step 15 .* \[20\].*on_older_step='move_aside'"):
            ckpt.save({"w": torch.zeros(3)}, step=15)
        assert ckpt.save({"w": torch.ones(3)}, step=21).wait().endswith("step-0000021")
    assert sorted(committed_steps(root, storage)) == [10, 20, 21]


def test_resuming_from_an_older_checkpoint_can_move_the_newer_ones_aside(storage_root):
    storage, root = storage_root
    with lazyckpt.LazyCheckpointer(root, storage=storage) as ckpt:
        for step in (10, 20, 30):
            ckpt.save({"w": torch.ones(3) * step}, step=step).wait()
    with lazyckpt.LazyCheckpointer(root, storage=storage, on_older_step="move_aside") as resumed:
        resumed.save({"w": torch.zeros(3)}, step=15).wait()
    assert sorted(committed_steps(root, storage)) == [10, 15], "latest() is now the resumed run's checkpoint"
    kept = sorted(n for n in storage.list_dir(root) if n.endswith(".superseded"))
    assert kept == ["step-0000020.superseded", "step-0000030.superseded"], "nothing is deleted"


def test_a_step_lower_than_one_removed_by_the_caller_is_accepted(storage_root):
    storage, root = storage_root
    with lazyckpt.LazyCheckpointer(root, storage=storage) as ckpt:
        ckpt.save({"w": torch.ones(3)}, step=5).wait()
        ckpt.save({"w": torch.ones(3)}, step=9).wait()
        assert ckpt.remove(9)
        assert ckpt.save({"w": torch.ones(3)}, step=7).wait().endswith("step-0000007")


def test_stats_keep_a_bounded_window_and_totals_over_every_checkpoint():
    log = StatsLog(window=3)
    for step in range(10):
        log.append(lazyckpt.CheckpointStats(step=step, save_s=0.5, wait_s=step, nbytes=100))
    assert [s.step for s in log] == [7, 8, 9] and len(log) == 3 and log[-1].step == 9
    assert log.total.count == 10 and log.total.nbytes == 1000
    assert log.total.max_stall_s == 9.5 and log.total.mean_stall_s == pytest.approx(5.0)


def test_the_checkpointer_records_stats_of_each_committed_checkpoint(storage_root):
    storage, root = storage_root
    with lazyckpt.LazyCheckpointer(root, storage=storage) as ckpt:
        for step in (1, 2):
            ckpt.save({"w": torch.ones(4)}, step=step).wait()
    assert [s.step for s in ckpt.stats] == [1, 2] and ckpt.stats.total.count == 2
    assert ckpt.stats[-1].nbytes > 0 and ckpt.stats.total.nbytes == sum(s.nbytes for s in ckpt.stats)


def test_the_free_space_check_counts_the_manifests_too(storage_root):
    inner, root = storage_root
    state = {"w": torch.ones(4), "config": {"names": ["x" * 1000] * 200}}  # a 200 kB tree, 16 tensor bytes
    storage = _FreeBytes(inner, free=1 << 40)
    with lazyckpt.LazyCheckpointer(root, storage=storage, copy_backend="cpu") as ckpt:
        path = ckpt.save(state, step=1).wait()
        written = sum(inner.stat(f"{path}/{name}").size for name in inner.list_dir(path))
        tensor_file = inner.stat(f"{path}/rank-00000-of-00001.safetensors").size
        assert written > tensor_file + 200_000
        storage.free = written - 1
        with pytest.raises(OSError, match="needs .* MB but only .* free") as info:
            ckpt.save(state, step=2)
        assert info.value.errno == errno.ENOSPC
        storage.free = written + 8192
        ckpt.save(state, step=2).wait()


def test_the_free_space_estimate_covers_sharded_tables_and_the_global_index():
    from lazyckpt.write.capture import _tensor_tables_bytes
    from lazyckpt.format.manifest import global_index, rank_manifest_doc, tensor_summary
    from lazyckpt.format.header import TensorEntry
    from lazyckpt.write.plan import layout
    from lazyckpt.ranks.sharding import Box

    world_size, rows = 4, 1_000_000
    entries, _ = layout([TensorEntry(f"layer{i}.weight", "F32", (rows // world_size, 8), rows // world_size * 32)
                         for i in range(50)])
    tables = {}
    for rank in range(world_size):
        boxes = {e.key: Box((rows, 8), (rank * (rows // world_size), 0)) for e in entries}
        doc = rank_manifest_doc(step=1, rank=rank, world_size=world_size, file="f", tree={}, header=b"", aliases={},
                                entries=entries, checksums={e.key: ["0" * 16] * 8 for e in entries}, boxes=boxes)
        tables[rank] = doc["tensors"]
    written = len(json.dumps(tables[world_size - 1], separators=(",", ":"))) + len(
        json.dumps(global_index({r: tensor_summary(t) for r, t in tables.items()}), separators=(",", ":")))
    boxes = {e.key: Box((rows, 8), ((world_size - 1) * (rows // world_size), 0)) for e in entries}
    assert _tensor_tables_bytes(entries, boxes, world_size) >= written


class _FreeBytes:
    """A storage that reports ``free`` bytes free and otherwise is ``inner``."""

    def __init__(self, inner, free: int) -> None:
        self.inner, self.free = inner, free

    def free_bytes(self, path):
        return self.free

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_checkpointer_dropped_without_close_frees_its_directory_at_once(tmp_path, trained):
    """Nothing in a checkpointer refers back to it (the job ends call it weakly), so dropping it runs its finalizer
    at once, not at some later garbage collection: the next checkpointer of that directory and rank is not refused."""
    model, opt = trained
    gc.disable()
    try:
        for saves in (0, 1):
            ckpt = lazyckpt.LazyCheckpointer(tmp_path / f"run{saves}")
            if saves:
                ckpt.save({"model": model.state_dict()}, step=1, optimizers=[opt]).wait()
            del ckpt
            lazyckpt.LazyCheckpointer(tmp_path / f"run{saves}").close()  # DirectoryLockedError if still alive
    finally:
        gc.enable()


@pytest.mark.parametrize(("options", "error", "hint"), [
    ({"keep_last": 3}, TypeError, "unknown option 'keep_last' (did you mean 'keep_last_k'?)"),
    ({"storge": None}, TypeError, "did you mean 'storage'?"),
    ({"copy_backend": "trtion"}, ValueError, "copy_backend='trtion' is not valid (did you mean 'triton'?)"),
    ({"on_busy": "skp"}, ValueError, "(did you mean 'skip'?)"),
])
def test_a_mistyped_option_names_the_closest_valid_one(tmp_path, options, error, hint):
    with pytest.raises(error) as info:
        lazyckpt.LazyCheckpointer(tmp_path, **options)
    assert hint in str(info.value)


def test_an_integration_names_the_closest_valid_option_too(tmp_path):
    with pytest.raises(TypeError, match=r"LazyCheckpointHook got an unknown option 'copy_backnd' \(did you mean "
                                        r"'copy_backend'\?\)"):
        lazyckpt.LazyCheckpointHook(tmp_path, copy_backnd="cpu")


def test_saving_before_the_optimizer_step_is_told_to_save_after_it(tmp_path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    backend = GatedBackend()  # the copy waits until the step has changed the weights
    with lazyckpt.LazyCheckpointer(tmp_path, backend=backend) as ckpt:
        pending = ckpt.save({"model": model.state_dict()}, step=1, optimizers=[opt])  # before the step: wrong
        opt.step()
        backend.gate.set()
        with pytest.raises(lazyckpt.SnapshotConsistencyError, match=r"call save\(\) right after optimizer.step\(\), "
                                                                    r"not between backward\(\) and optimizer.step\(\)"):
            pending.wait()


def test_an_integration_option_passed_as_an_engine_option_says_where_it_goes(tmp_path):
    pytest.importorskip("lightning")
    with pytest.raises(TypeError, match=r"'max_rollbacks' is an argument of LazyCheckpoint itself, not an engine "
                                        r"option"):
        lazyckpt.LazyCheckpoint(tmp_path, engine_options={"max_rollbacks": 2})
