"""``lazyckpt memory ls/clear``: the host folders of ``keep_in_memory="host"``, live or dead, freed only when nothing
is lost; real folders under tmp_path (``--root``), a dead job being a child process that ended with ``os._exit``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import lazyckpt
from lazyckpt import cli
from lazyckpt.errors import DirectoryLockedError
from lazyckpt.storage import LocalStorage
from lazyckpt.storage.urls import host_dir

DIES_AFTER_A_SAVE = textwrap.dedent("""
    import os, sys, torch, lazyckpt
    ckpt = lazyckpt.LazyCheckpointer(sys.argv[1], keep_in_memory="host", host_memory_dir=sys.argv[2])
    ckpt.save({"w": torch.ones(256)}, step=5).wait_remote()  # committed in dirpath too: nothing left to lose
    os._exit(3)  # no close(): the host folder stays, and the kernel drops the lock
""")


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # rich would fold long tmp_path paths into several table lines


def run(capsys, *argv, storage=None):
    code = cli.main([str(a) for a in argv], storage=storage)
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str) -> dict[str, list[str]]:
    """The table's rows by dirpath: [job, size, steps, unsaved]."""
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.count("│") == 6]
    return {row[0]: row[1:] for row in cells}


def dead_job(tmp_path, root):
    """``dirpath`` of a job that saved step 5 (copied to dirpath) and died without close()."""
    dirpath = tmp_path / "dead"
    child = subprocess.run([sys.executable, "-c", DIES_AFTER_A_SAVE, str(dirpath), str(root)], timeout=120)
    assert child.returncode == 3
    assert os.path.isdir(host_dir(str(dirpath), root)), "the dead job's host folder outlives it"
    return dirpath


def unsaved_job(tmp_path, root):
    """``dirpath`` whose step 7 is committed in its host folder only (a crash before its copy to disk)."""
    dirpath = tmp_path / "unsaved"
    with lazyckpt.LazyCheckpointer(dirpath, keep_in_memory="host", host_memory_dir=root, keep_on_close=True) as ckpt:
        ckpt.save({"w": torch.arange(64.0)}, step=7).wait_remote()
    shutil.rmtree(dirpath / "step-0000007")
    return dirpath


@pytest.fixture
def three_jobs(tmp_path):
    """A live job (its checkpointer open), a dead one and one holding an unsaved step, under one root."""
    root = tmp_path / "shm"
    live = lazyckpt.LazyCheckpointer(tmp_path / "live", keep_in_memory="host", host_memory_dir=root)
    live.save({"w": torch.zeros(32)}, step=2).wait_remote()
    yield root, tmp_path / "live", dead_job(tmp_path, root), unsaved_job(tmp_path, root)
    live.close()


def test_ls_shows_each_folder_with_its_job_size_steps_and_unsaved_steps(three_jobs, capsys):
    root, live, dead, unsaved = three_jobs
    code, out, err = run(capsys, "memory", "ls", "--root", root)
    assert code == 0 and err == ""
    table = rows(out)
    assert set(table) == {str(live), str(dead), str(unsaved)}
    assert table[str(live)][0] == "live" and table[str(live)][2:] == ["2", ""]
    assert table[str(dead)][0] == "dead" and table[str(dead)][2:] == ["5", ""]
    assert table[str(unsaved)][0] == "dead" and table[str(unsaved)][2:] == ["7", "7"]
    assert all(row[1].endswith("kB") for row in table.values()), "the steps' bytes, human-readable"


def test_clear_frees_dead_jobs_and_keeps_live_and_unsaved_ones_saying_why(three_jobs, capsys):
    root, live, dead, unsaved = three_jobs
    code, out, err = run(capsys, "memory", "clear", "--root", root)
    assert code == 0 and err == ""
    assert not os.path.exists(host_dir(str(dead), root))
    assert os.path.isdir(host_dir(str(live), root)) and os.path.isdir(host_dir(str(unsaved), root))
    lines = out.splitlines()
    assert f"freed {host_dir(str(dead), root)} ({dead}, " in lines[0]
    assert any(line.startswith(f"kept {host_dir(str(live), root)}") and "running job" in line for line in lines)
    assert any(line.startswith(f"kept {host_dir(str(unsaved), root)}") and "steps [7]" in line
               and f"open LazyCheckpointer({str(unsaved)!r}, keep_in_memory='host', host_memory_dir={str(root)!r}) "
               "once to commit them to dirpath, or pass --discard" in line for line in lines)
    assert lazyckpt.latest(dead) == str(dead / "step-0000005"), "dirpath itself is untouched"

    code, out, _ = run(capsys, "memory", "clear", "--root", root, "--discard")
    assert code == 0 and "discarded steps [7]" in out
    assert not os.path.exists(host_dir(str(unsaved), root))
    assert os.path.isdir(host_dir(str(live), root)), "--discard never frees a live job's folder"
    assert sorted(rows(run(capsys, "memory", "ls", "--root", root)[1])) == [str(live)]
    assert [n for n in os.listdir(root) if n.startswith(".")] == [], "no renamed folder is left behind"


def test_the_advice_for_an_unsaved_step_commits_it_to_dirpath(tmp_path, capsys):
    root = tmp_path / "shm"
    dirpath = unsaved_job(tmp_path, root)
    lazyckpt.LazyCheckpointer(dirpath, keep_in_memory="host", host_memory_dir=root).close()
    assert torch.equal(lazyckpt.load(dirpath / "step-0000007")["w"], torch.arange(64.0))
    code, out, _ = run(capsys, "memory", "ls", "--root", root)
    assert code == 0 and out.strip() == f"no host folders under {root}", "the clean close freed it"


def test_a_host_step_older_than_dirpaths_newest_is_not_unsaved(tmp_path, capsys):
    """Only the steps newer than dirpath's newest are committed there by the next run (the advice given): an older
    one dirpath dropped (its keep_last_k) does not keep the folder."""
    root = tmp_path / "shm"
    dirpath = unsaved_job(tmp_path, root)
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:  # dirpath moved on without the host level
        ckpt.save({"w": torch.ones(8)}, step=9).wait()
    assert rows(run(capsys, "memory", "ls", "--root", root)[1])[str(dirpath)][2:] == ["7", ""]
    code, out, _ = run(capsys, "memory", "clear", "--root", root)
    assert code == 0 and out.startswith(f"freed {host_dir(str(dirpath), root)}") and "kept" not in out


def test_ls_and_clear_with_no_host_folders_say_so(tmp_path, capsys):
    for root in (tmp_path / "nowhere", tmp_path):
        for command in ("ls", "clear"):
            code, out, err = run(capsys, "memory", command, "--root", root)
            assert (code, out.strip(), err) == (0, f"no host folders under {root}", "")


def test_folders_the_host_level_did_not_write_are_never_listed_nor_removed(tmp_path, capsys):
    root = tmp_path / "shm"
    foreign = [root / "0123456789abcdef", root / "not-a-digest"]
    for folder in foreign:
        os.makedirs(folder)
        open(folder / "data.bin", "wb").close()
    open(root / "fedcba9876543210", "wb").close()  # a file with a digest's name
    for command in (["ls"], ["clear", "--discard"]):
        code, out, _ = run(capsys, "memory", *command, "--root", root)
        assert code == 0 and out.strip() == f"no host folders under {root}"
    assert all(os.path.exists(folder / "data.bin") for folder in foreign)


def test_clear_holds_the_folders_locks_while_it_frees_it(tmp_path, capsys):
    """A job of the same dirpath starting while a clear removes its folder is refused (it would write into a
    folder being removed); once the folder is renamed away, it starts in a fresh one."""
    root = tmp_path / "shm"
    dirpath = dead_job(tmp_path, root)
    refused = []

    class StartsAJobAtTheRename(LocalStorage):
        def rename(self, src, dst, *, sync):
            with pytest.raises(DirectoryLockedError):
                lazyckpt.LazyCheckpointer(dirpath, keep_in_memory="host", host_memory_dir=root)
            refused.append(src)
            super().rename(src, dst, sync=sync)

    code, out, _ = run(capsys, "memory", "clear", "--root", root, storage=StartsAJobAtTheRename())
    assert code == 0 and out.startswith("freed") and refused == [host_dir(str(dirpath), root)]
    assert os.listdir(root) == []


def test_a_folder_left_renamed_by_a_clear_that_died_goes_at_the_next_clear(tmp_path, capsys):
    root = tmp_path / "shm"
    dirpath = dead_job(tmp_path, root)
    os.rename(host_dir(str(dirpath), root), root / f".clearing-{os.path.basename(host_dir(str(dirpath), root))}-1")
    assert run(capsys, "memory", "ls", "--root", root)[1].strip() == f"no host folders under {root}"
    assert run(capsys, "memory", "clear", "--root", root)[0] == 0
    assert os.listdir(root) == []


def test_a_folder_whose_locks_this_user_may_not_open_is_shown_unknown_and_kept(tmp_path, capsys):
    root = tmp_path / "shm"
    dirpath = dead_job(tmp_path, root)

    class AnotherUsersLocks(LocalStorage):
        def lock(self, path):
            raise PermissionError(13, "Permission denied", path)

    code, out, _ = run(capsys, "memory", "ls", "--root", root, storage=AnotherUsersLocks())
    assert code == 0 and rows(out)[str(dirpath)][0] == "? (not this user's)"
    code, out, _ = run(capsys, "memory", "clear", "--root", root, "--discard", storage=AnotherUsersLocks())
    assert code == 0 and "may not take its locks" in out and os.path.isdir(host_dir(str(dirpath), root))


def test_an_unreadable_root_is_one_line_and_exit_1(tmp_path, capsys):
    class Unreadable(LocalStorage):
        def list_dir(self, path):
            raise PermissionError(13, "Permission denied", path)

    code, out, err = run(capsys, "memory", "ls", "--root", tmp_path, storage=Unreadable())
    assert code == 1 and out == "" and err.strip().splitlines() == [f"lazyckpt: [Errno 13] Permission denied: "
                                                                   f"'{tmp_path}'"]
