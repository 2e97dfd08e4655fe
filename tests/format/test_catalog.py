"""Which checkpoints a directory holds: the format's one commit rule, on files and on an object store."""

from __future__ import annotations

import os

from lazyckpt.format.catalog import catalog, committed_steps
from lazyckpt.storage import LocalStorage
from lazyckpt.storage.fsspec import FsspecStorage


def _step(storage, path, *, manifest=True):
    storage.make_dir(path)
    storage.write_atomic(f"{path}/rank-00000.json", b"{}", sync=False)
    if manifest:
        storage.write_atomic(f"{path}/manifest.json", b"{}", sync=False)


def test_a_step_directory_with_a_manifest_is_committed_and_nothing_else_is(tmp_path):
    storage, root = LocalStorage(), str(tmp_path)
    _step(storage, os.path.join(root, "step-0000010"))
    _step(storage, os.path.join(root, "step-0000020"), manifest=False)  # a crash before the commit
    _step(storage, os.path.join(root, "step-0000030.partial"))
    os.symlink(os.path.join(root, "step-0000010"), os.path.join(root, "step-0000040"))  # a link is no checkpoint
    os.mkdir(os.path.join(root, "last.ckpt"))
    found = catalog(storage, root)
    assert found.committed == {10: os.path.join(root, "step-0000010")}
    assert sorted(os.path.basename(p) for p in found.uncommitted) == ["step-0000020", "step-0000030.partial",
                                                                      "step-0000040"]
    assert committed_steps(str(tmp_path / "absent")) == {}


class _CountingStorage(FsspecStorage):
    def __init__(self, url):
        super().__init__(url)
        self.stats = self.listings = 0

    def stat(self, path):
        self.stats += 1
        return super().stat(path)

    def list_dir(self, path):
        self.listings += 1
        return super().list_dir(path)


def test_on_an_object_store_a_step_counts_once_it_holds_every_rank_s_objects(tmp_path):
    url = f"memory://{tmp_path}/run"
    storage = _CountingStorage(url)
    for step in (1, 2, 3, 5):
        _step(storage, f"{url}/step-{step:07d}")
        storage.write_atomic(f"{url}/step-{step:07d}/rank-00000-of-00001.safetensors", b"", sync=False)
    storage.write_atomic(f"{url}/step-0000002/rank-00001-of-00002.safetensors", b"", sync=False)  # another run's
    _step(storage, f"{url}/step-0000004", manifest=False)  # a partial upload: no commit object
    storage.remove_file(f"{url}/step-0000005/rank-00000.json")  # the commit object without a rank's manifest
    storage.write_atomic(f"{url}/step-0000006/manifest.json", b"{}", sync=False)  # the commit object alone
    storage.stats = storage.listings = 0
    found = catalog(storage, url)
    assert sorted(found.committed) == [1, 2, 3]
    assert found.uncommitted == [f"{url}/step-{step:07d}" for step in (4, 5, 6)]
    assert (storage.listings, storage.stats) == (1 + 6, 3), \
        "one listing of each step, one look-up of each complete step's commit object, no stat of the prefixes"


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HUGE_WORLD = r'''
import resource, sys
from lazyckpt.format.catalog import catalog
from lazyckpt.storage.fsspec import FsspecStorage

url = sys.argv[1]
storage = FsspecStorage(url)
for name in ("manifest.json", "rank-00000.json", "rank-00000-of-4294967296.safetensors"):
    storage.write_atomic(f"{url}/step-0000001/{name}", b"{}", sync=False)
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))  # 256 MiB more, at most
print(sorted(catalog(storage, url).committed))
'''


def test_a_tensor_file_claiming_four_billion_ranks_costs_a_reader_nothing(tmp_path):
    """One object ``rank-00000-of-4294967296.safetensors`` must not make a reader build 8.6e9 names (it hung or ran
    out of memory): a world size longer than the listing cannot be complete."""
    import subprocess
    import sys

    script = tmp_path / "huge_world.py"
    script.write_text(_HUGE_WORLD)
    done = subprocess.run([sys.executable, str(script), f"memory://{tmp_path.name}/run"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": _REPO})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
