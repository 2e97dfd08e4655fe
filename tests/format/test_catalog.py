"""Which checkpoints a directory holds: the format's one commit rule, on files and on an object store."""

from __future__ import annotations

import os

import lazyckpt
from helpers.remote import moto_endpoint, s3_remote  # noqa: F401 - fixtures
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
    def __init__(self, url, options=None):
        super().__init__(url, options)
        self.stats = self.listings = self.trees = 0

    def stat(self, path):
        self.stats += 1
        return super().stat(path)

    def list_dir(self, path):
        self.listings += 1
        return super().list_dir(path)

    def list_tree(self, path, *, depth):
        self.trees += 1
        return super().list_tree(path, depth=depth)


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
    storage.write_atomic(f"{url}/step-0000007/manifest.json/x", b"{}", sync=False)  # no commit object: a prefix
    storage.write_atomic(f"{url}/step-0000007/rank-00000.json", b"{}", sync=False)
    storage.write_atomic(f"{url}/step-0000007/rank-00000-of-00001.safetensors", b"", sync=False)
    storage.write_atomic(f"{url}/step-0000008", b"{}", sync=False)  # an object, not a step
    storage.stats = storage.listings = 0
    found = catalog(storage, url)
    assert sorted(found.committed) == [1, 2, 3]
    assert found.uncommitted == [f"{url}/step-{step:07d}" for step in (4, 5, 6, 7, 8)]
    assert (storage.trees, storage.listings, storage.stats) == (1, 0, 0), "one listing of the whole directory"
    assert lazyckpt.latest(url, storage=storage) == f"{url}/step-0000003"


def test_latest_of_a_remote_level_is_one_request_however_many_steps_it_holds(s3_remote):
    """latest(URL) runs after every remote commit, on every rank at start-up and at resume: it cost one listing
    and one look-up per step (1 + 2N requests); it is one paginated listing of the run."""
    url, options = s3_remote
    storage = _CountingStorage(url, options)
    for step in range(1, 13):
        _step(storage, f"{url}/step-{step:07d}")
        storage.write_atomic(f"{url}/step-{step:07d}/rank-00000-of-00001.safetensors", b"", sync=False)
    _step(storage, f"{url}/step-0000013", manifest=False)
    requests = []
    storage.fs.s3.meta.events.register("before-send.s3", lambda request, **_: requests.append(request.url))
    assert lazyckpt.latest(url, storage=storage) == f"{url}/step-0000012"
    assert sorted(catalog(storage, url).committed) == list(range(1, 13))
    assert len(requests) == 2, requests


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
