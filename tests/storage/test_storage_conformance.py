"""The Storage contract: every backend in conftest.STORAGE_BACKENDS behaves the same way on every method."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from lazyckpt.storage import FileKind, Storage, wait_for_lock


def _write_file(storage: Storage, path: str, data: bytes) -> None:
    handle = storage.open_write(path)
    storage.write(handle, 0, [memoryview(data)])
    storage.close(handle, sync=True)


def _read_all(storage: Storage, path: str) -> bytes:
    handle = storage.open_read(path)
    try:
        buf = bytearray(handle.size)
        got = handle.read_into(0, memoryview(buf))
        return bytes(buf[:got])
    finally:
        handle.close()


def _has_links(storage: Storage) -> bool:
    """Object stores have no symbolic links: their backends say so with ``has_links = False``."""
    return getattr(storage, "has_links", True)


def test_the_backend_satisfies_the_protocol(storage_root):
    storage, _ = storage_root
    assert isinstance(storage, Storage)


def test_pieces_written_in_any_order_read_back_exactly(storage_root):
    storage, root = storage_root
    data = np.random.default_rng(0).integers(0, 256, (3 << 20) + 17, dtype=np.uint8).tobytes()
    path = os.path.join(root, "t.bin")
    handle = storage.open_write(path)
    cuts = [0, 4096, 9999, 2 << 20, len(data)]
    for start, end in reversed(list(zip(cuts, cuts[1:]))):  # back to front
        storage.write(handle, start, [memoryview(data[start:end])])
    storage.write(handle, 0, [memoryview(data[:5]), memoryview(data[5:100])])  # several buffers at once
    storage.close(handle, sync=True)
    assert _read_all(storage, path) == data
    assert storage.read_bytes(path, max_bytes=len(data)) == data
    info = storage.stat(path)
    assert info.kind is FileKind.FILE and info.size == len(data)


def test_read_into_stops_at_the_end_of_the_file(storage_root):
    storage, root = storage_root
    _write_file(storage, os.path.join(root, "f"), b"0123456789")
    handle = storage.open_read(os.path.join(root, "f"))
    buf = bytearray(8)
    assert handle.read_into(6, memoryview(buf)) == 4 and bytes(buf[:4]) == b"6789"
    handle.close()


def test_open_write_truncates_an_existing_file(storage_root):
    storage, root = storage_root
    path = os.path.join(root, "f")
    _write_file(storage, path, b"long old content")
    _write_file(storage, path, b"new")
    assert storage.read_bytes(path, max_bytes=100) == b"new"


def test_write_atomic_replaces_the_whole_file(storage_root):
    storage, root = storage_root
    path = os.path.join(root, "m.json")
    storage.write_atomic(path, b"first version", sync=True)
    storage.write_atomic(path, b"2nd", sync=False)
    assert storage.read_bytes(path, max_bytes=100) == b"2nd"
    assert sorted(storage.list_dir(root)) == ["m.json"], "no temporary file is left behind"


def test_read_bytes_refuses_a_file_over_the_limit_before_reading(storage_root):
    storage, root = storage_root
    storage.write_atomic(os.path.join(root, "big"), b"x" * 100, sync=False)
    with pytest.raises(ValueError, match="more than the limit of 99"):
        storage.read_bytes(os.path.join(root, "big"), max_bytes=99)


def test_reading_a_directory_or_a_missing_file_raises(storage_root):
    storage, root = storage_root
    with pytest.raises(OSError):
        storage.read_bytes(root, max_bytes=100)
    with pytest.raises(FileNotFoundError):
        storage.open_read(os.path.join(root, "missing"))


def test_make_dir_creates_parents_and_tolerates_an_existing_directory(storage_root):
    storage, root = storage_root
    storage.make_dir(os.path.join(root, "a", "b", "c"))
    storage.make_dir(os.path.join(root, "a", "b"))
    assert storage.list_dir(os.path.join(root, "a")) == ["b"]
    assert storage.stat(os.path.join(root, "a", "b", "c")).kind is FileKind.DIR
    storage.write_atomic(os.path.join(root, "file"), b"", sync=False)
    with pytest.raises(FileExistsError):
        storage.make_dir(os.path.join(root, "file"))


def test_list_dir_names_the_entries_and_refuses_what_is_not_a_directory(storage_root):
    storage, root = storage_root
    storage.make_dir(os.path.join(root, "d"))
    storage.write_atomic(os.path.join(root, "f"), b"x", sync=False)
    assert sorted(storage.list_dir(root)) == ["d", "f"]
    with pytest.raises(FileNotFoundError):
        storage.list_dir(os.path.join(root, "missing"))
    with pytest.raises((FileNotFoundError, NotADirectoryError)):
        storage.list_dir(os.path.join(root, "f"))


def test_stat_is_none_for_missing_paths_and_never_follows_a_final_link(storage_root):
    storage, root = storage_root
    storage.write_atomic(os.path.join(root, "f"), b"abc", sync=False)
    assert storage.stat(os.path.join(root, "missing")) is None
    assert storage.stat(os.path.join(root, "f", "below-a-file")) is None
    if _has_links(storage):
        storage.link("f", os.path.join(root, "l"))
        assert storage.stat(os.path.join(root, "l")).kind is FileKind.LINK
    assert storage.stat(root).kind is FileKind.DIR


def test_rename_moves_files_and_whole_directories(storage_root):
    storage, root = storage_root
    storage.make_dir(os.path.join(root, "a.partial", "sub"))
    storage.write_atomic(os.path.join(root, "a.partial", "sub", "x"), b"payload", sync=False)
    storage.rename(os.path.join(root, "a.partial"), os.path.join(root, "a"), sync=True)
    assert storage.stat(os.path.join(root, "a.partial")) is None
    assert storage.read_bytes(os.path.join(root, "a", "sub", "x"), max_bytes=100) == b"payload"
    storage.rename(os.path.join(root, "a", "sub", "x"), os.path.join(root, "y"), sync=False)
    assert storage.read_bytes(os.path.join(root, "y"), max_bytes=100) == b"payload"


def test_rename_replaces_an_empty_directory_but_never_a_full_one(storage_root):
    storage, root = storage_root
    for name in ("src", "empty", "full"):
        storage.make_dir(os.path.join(root, name))
    storage.write_atomic(os.path.join(root, "full", "keep"), b"k", sync=False)
    with pytest.raises(OSError):
        storage.rename(os.path.join(root, "src"), os.path.join(root, "full"), sync=False)
    assert storage.list_dir(os.path.join(root, "full")) == ["keep"]
    storage.rename(os.path.join(root, "src"), os.path.join(root, "empty"), sync=False)
    assert storage.stat(os.path.join(root, "src")) is None


def test_renaming_a_missing_path_raises_file_not_found(storage_root):
    storage, root = storage_root
    with pytest.raises(FileNotFoundError):
        storage.rename(os.path.join(root, "missing"), os.path.join(root, "x"), sync=False)


def test_remove_file_removes_one_file_or_link_and_raises_when_there_is_none(storage_root):
    storage, root = storage_root
    storage.write_atomic(os.path.join(root, "f"), b"x", sync=False)
    if _has_links(storage):
        storage.link("f", os.path.join(root, "l"))
        storage.remove_file(os.path.join(root, "l"))
        assert storage.stat(os.path.join(root, "f")) is not None, "removing a link keeps its target"
    storage.remove_file(os.path.join(root, "f"))
    assert storage.list_dir(root) == []
    with pytest.raises(FileNotFoundError):
        storage.remove_file(os.path.join(root, "f"))


def test_remove_tree_removes_everything_below_and_tolerates_a_missing_directory(storage_root):
    storage, root = storage_root
    storage.make_dir(os.path.join(root, "t", "u"))
    storage.write_atomic(os.path.join(root, "t", "u", "f"), b"x", sync=False)
    storage.remove_tree(os.path.join(root, "t"))
    assert storage.stat(os.path.join(root, "t")) is None
    storage.remove_tree(os.path.join(root, "t"))


def test_sync_dir_accepts_a_directory_and_refuses_a_missing_one(storage_root):
    storage, root = storage_root
    storage.sync_dir(root)
    with pytest.raises(FileNotFoundError):
        storage.sync_dir(os.path.join(root, "missing"))


def test_links_store_their_target_and_are_followed_by_reads(storage_root):
    storage, root = storage_root
    if not _has_links(storage):
        with pytest.raises(OSError):
            storage.link("f", os.path.join(root, "l"))
        return
    storage.make_dir(os.path.join(root, "step-1"))
    storage.write_atomic(os.path.join(root, "step-1", "m"), b"one", sync=False)
    storage.make_dir(os.path.join(root, "step-2"))
    storage.write_atomic(os.path.join(root, "step-2", "m"), b"two", sync=False)
    alias = os.path.join(root, "last")
    storage.link("step-1", alias)
    assert storage.read_link(alias) == "step-1"
    assert storage.read_bytes(os.path.join(alias, "m"), max_bytes=10) == b"one"
    storage.link("step-2", alias)  # replaces the link in place
    assert storage.read_link(alias) == "step-2"
    assert storage.list_dir(alias) == ["m"]
    assert storage.resolve(os.path.join(alias, "m")) == storage.resolve(os.path.join(root, "step-2", "m"))
    with pytest.raises(OSError):
        storage.read_link(os.path.join(root, "step-1"))


def test_a_lock_is_exclusive_until_released(storage_root):
    storage, root = storage_root
    path = os.path.join(root, ".lock")
    held = storage.lock(path)
    with pytest.raises(BlockingIOError):
        storage.lock(path)
    held.release()
    held.release()  # idempotent
    storage.lock(path).release()


def test_waiting_for_a_lock_ends_when_its_holder_releases_it(storage_root):
    storage, root = storage_root
    path = os.path.join(root, ".lock")
    held = storage.lock(path)
    with pytest.raises(TimeoutError, match="stayed locked"):
        wait_for_lock(storage, path, timeout_s=0.05)
    taken = threading.Event()
    waiter = threading.Thread(target=lambda: (wait_for_lock(storage, path, timeout_s=30).release(), taken.set()))
    waiter.start()
    held.release()
    waiter.join(30)
    assert taken.is_set()


def test_free_bytes_is_a_count_of_bytes(storage_root):
    storage, root = storage_root
    free = storage.free_bytes(root)
    assert isinstance(free, int) and free > 0


def test_concurrent_writers_to_different_files_do_not_interfere(storage_root):
    storage, root = storage_root
    payloads = {f"f{i}": bytes([i]) * (1 << 16) for i in range(8)}
    start = threading.Barrier(len(payloads))

    def write(name: str) -> None:
        start.wait()
        _write_file(storage, os.path.join(root, name), payloads[name])

    threads = [threading.Thread(target=write, args=(name,)) for name in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {n: storage.read_bytes(os.path.join(root, n), max_bytes=1 << 20) for n in payloads} == payloads
