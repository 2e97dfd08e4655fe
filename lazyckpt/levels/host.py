"""The host level (``keep_in_memory="host"``): checkpoints commit first in shared memory that outlives the process.

Most failures kill the training process, not the machine. With the host level, ``dirpath``'s checkpoints are
written and committed first in a folder of a tmpfs (``host_memory_dir``, default ``/dev/shm/lazyckpt``, one
folder per ``dirpath``), by the same writer and commit protocol as any local directory, so they are complete
(every chunk written, its checksum in the rank manifest, the commit object last) within memory-copy time. The
remote level's uploader then copies each committed step to ``dirpath`` itself (``file://``, synced file by file,
the commit object written atomically last): ``dirpath`` is the disk level behind it, with the user's
``keep_last_k``; the host folder keeps the newest step (plus the one being copied). A save waits while the copy to
disk lags two snapshots behind, so the host folder holds at most two.

After a crash (SIGKILL at any moment) the host folder is still there. The next ``LazyCheckpointer`` of the same
``dirpath`` with ``keep_in_memory="host"`` commits any host step newer than ``dirpath``'s newest to ``dirpath``
first (:func:`~lazyckpt.levels.remote.recovery.recover_local_steps`), then removes what the crash tore (a step
without its commit object is never loaded). Resuming then reads the host copy, every chunk checked.

A clean ``close()`` frees the folder once every step is committed in ``dirpath`` (``keep_on_close=True`` keeps
it). :func:`host_folders` lists the folders under a root, whose job is alive, and their sizes (``lazyckpt memory
ls``); :func:`clear_host_folders` frees those of dead jobs (``lazyckpt memory clear``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lazyckpt.errors import StepAlreadyCommittedError
from lazyckpt.format.catalog import committed_steps, is_committed
from lazyckpt.format.files import step_dirname
from lazyckpt.levels.directory import CommittedSteps, DirectoryLock
from lazyckpt.levels.peer.level import KEPT_PREFIX, PeerLevel
from lazyckpt.levels.peer.restore import restore_lost_ranks
from lazyckpt.levels.remote.recovery import recover_local_steps
from lazyckpt.storage import FileKind, LocalStorage, Storage, StorageLock, kind_of
from lazyckpt.storage.urls import DEFAULT_HOST_ROOT, host_dir, host_root, is_url

if TYPE_CHECKING:
    from lazyckpt.config import CheckpointConfig
    from lazyckpt.levels.remote.upload import RemoteLevel
    from lazyckpt.write.job import CheckpointJob

logger = logging.getLogger(__name__)

OWNER_NOTE = ".host-owner.json"
"""In each host folder: the ``dirpath`` it belongs to (a folder is named by a hash of it)."""
FILE_URL = "file://"
LOCK_FILE = re.compile(r"\.lock-rank\d{5,}")
"""A rank's lock in a host folder (:class:`~lazyckpt.levels.directory.DirectoryLock`)."""


def split_host_level(dirpath: str, config: CheckpointConfig) -> tuple[str, CheckpointConfig]:
    """For ``keep_in_memory="host"``: the host folder of ``dirpath`` and a config whose remote level is
    ``dirpath`` itself (with the user's ``keep_last_k``); the host folder keeps the newest step.

    Raises:
        ValueError: ``dirpath`` is a URL, or the default root does not exist (no ``/dev/shm``).
    """
    root = config.host_memory_dir
    if config.remote is not None and config.remote.startswith(FILE_URL) and host_dir(disk_dir(config), root) == dirpath:
        return dirpath, config  # split already (an integration hands its engine the split it made)
    if is_url(dirpath) or config.remote is not None:
        raise ValueError(f"keep_in_memory='host' with dirpath={dirpath!r} and remote={config.remote!r}: a host "
                         "level in front of a remote level is not supported yet; pass a local dirpath and no remote")
    if root is None and kind_of(LocalStorage(), os.path.dirname(DEFAULT_HOST_ROOT)) is not FileKind.DIR:
        raise ValueError(f"keep_in_memory='host' keeps its copies under {DEFAULT_HOST_ROOT} by default, and this "
                         "machine has no /dev/shm; pass host_memory_dir= a tmpfs directory")
    folder = host_dir(dirpath, root)
    return folder, dataclasses.replace(config, remote=FILE_URL + dirpath, remote_keep_last_k=config.keep_last_k,
                                       remote_every_n=1, keep_last_k=1)


def disk_dir(config: CheckpointConfig) -> str:
    """The user's ``dirpath`` behind the host level (its remote level's ``file://`` URL, as a path)."""
    assert config.remote is not None and config.remote.startswith(FILE_URL)
    return config.remote[len(FILE_URL):]


class HostLevel:
    """One checkpointer's host folder: opened after the remote level, consulted before each save, freed at close.

    Args:
        folder: the host folder (the checkpointer's local directory).
        config: the checkpointer's config (after :func:`split_host_level`).
        storage: the local storage of both the folder and ``dirpath``.
        remote: the remote level that copies each step to ``dirpath``.
    """

    def __init__(self, folder: str, config: CheckpointConfig, storage: Storage, remote: RemoteLevel) -> None:
        self.folder, self.dirpath, self.config = folder, disk_dir(config), config
        self.storage, self.remote = storage, remote
        _check_owner(folder, self.dirpath, storage)
        made = storage.stat(self.dirpath) is None
        storage.make_dir(self.dirpath)
        # dirpath is this job's too: a checkpointer writing it without the host level is refused, as is a second one
        self._disk_lock = DirectoryLock(self.dirpath, config.rank, storage, config.world_size, made=made)
        if remote.rendezvous is not None:  # one dirpath per node: each node's lowest rank commits its own
            remote.share_url(remote.rendezvous.sharing(self.dirpath, storage, label="-disk"))
        self._disk_steps = CommittedSteps(self.dirpath, storage, config, rendezvous=None, remote=None)
        """``dirpath``'s steps: a save checks its order against them, a removal removes there (the remote level
        writes and prunes them)."""
        self._budget_checked = False
        self.peer: PeerLevel | None = None
        """The peer copy (``memory_peers=1``): this rank's host snapshots also kept on another node."""

    @classmethod
    def attach(cls, folder: str, config: CheckpointConfig, storage: Storage,
             remote: RemoteLevel | None) -> HostLevel | None:
        """The host level of a checkpointer (None without ``keep_in_memory="host"``), once every host step newer
        than ``dirpath``'s newest is committed in ``dirpath`` (collective: every rank opens it)."""
        if not config.host_level:
            return None
        assert remote is not None, "split_host_level() makes dirpath the remote level"
        level = cls(folder, config, storage, remote)
        try:
            level.peer = PeerLevel.join(folder, config, storage, remote.rendezvous)
            restore_lost_ranks(level.peer, level.dirpath)  # a lost node's ranks first get their newest step back from its peers
            recover_local_steps(level.remote, folder)
        except BaseException:
            level._disk_lock.release()
            raise
        return level

    def check_step(self, step: int) -> None:
        """Before a save of ``step``: ``dirpath``'s committed steps are this checkpointer's too, though the host
        folder holds only the newest (after a clean close, none): one of them is never overwritten, and a lower
        step is refused or moves the newer ones aside as in any directory (``on_older_step``).

        Raises:
            StepAlreadyCommittedError: ``dirpath`` holds ``step`` committed.
            StepOrderError: ``step`` is lower than ``dirpath``'s newest and ``on_older_step="error"``.
        """
        if is_committed(self.storage, os.path.join(self.dirpath, step_dirname(step))):
            raise StepAlreadyCommittedError(f"step {step} is already committed in {self.dirpath} (keep_in_memory="
                                            "'host'); lazyckpt never overwrites a checkpoint (use a new step number)")
        self._disk_steps.check_order(step)

    def remove(self, step: int) -> bool:
        """Delete ``dirpath``'s copy of ``step`` (renamed to a partial name first) once its copy there ended;
        False if there was none. Its local checkpoint must be committed (or failed) already."""
        self.remote.wait_for(step)  # a copy under way would write into the removed directory
        return self._disk_steps.remove(step)

    def before_save(self, job: CheckpointJob) -> None:
        """Before ``job`` is registered for its copy to disk: check once that two snapshots fit in the host
        folder's file system (four with the peer copy: two kept for a peer), and let at most one earlier copy to
        disk, and one transfer to the peer, be unfinished (double buffering)."""
        if not self._budget_checked:
            _check_room(self.folder, self.storage, _job_bytes(job), copies=2 if self.peer is None else 4)
            self._budget_checked = True
        self.remote.wait_backlog(1)
        if self.peer is not None:
            self.peer.wait_backlog(1)

    def committed(self, step: int, step_dir: str) -> None:
        """``step`` is committed in the host folder (commit thread): its transfer to the peer is queued."""
        if self.peer is not None:
            self.peer.submit(step, step_dir)

    def close(self, *, leader: bool) -> None:
        """After the last copy to disk ended: free the host folder (the leader removes every step that ``dirpath``
        holds committed; a step it does not hold stays, for the next run to commit), unless ``keep_on_close``."""
        if self.peer is not None:
            self.peer.close(free=not self.config.keep_on_close)
        self._disk_lock.release(tidy=True)
        if self.config.keep_on_close or not leader:
            return
        on_disk = committed_steps(self.dirpath, self.storage)
        kept = []
        for step, path in committed_steps(self.folder, self.storage).items():
            if step in on_disk:
                self.storage.remove_tree(path)
            else:
                kept.append(step)
        if kept:
            logger.warning("lazyckpt: steps %s are committed in the host folder %s but not in %s; kept there for "
                           "the next run to commit", kept, self.folder, self.dirpath)

    def tidy(self) -> None:
        """After the folder's lock is released: remove the folder when nothing of a checkpoint is left in it."""
        names = self.storage.list_dir(self.folder) if self.storage.stat(self.folder) is not None else []
        if not self.config.keep_on_close and all(n == OWNER_NOTE or n.startswith(".lock-rank") for n in names):
            self.storage.remove_tree(self.folder)


def _check_owner(folder: str, dirpath: str, storage: Storage) -> None:
    """Write the owner note, or refuse a folder that belongs to another ``dirpath``."""
    note = os.path.join(folder, OWNER_NOTE)
    if storage.stat(note) is not None:
        owner = json.loads(storage.read_bytes(note, max_bytes=1 << 16)).get("dirpath")
        if owner != dirpath:
            raise ValueError(f"the host folder {folder} belongs to dirpath={owner!r}, not {dirpath!r}; free it with "
                             "`lazyckpt memory clear` or pass another host_memory_dir")
        return
    data = {"dirpath": dirpath, "host": socket.gethostname(), "created": time.time()}
    storage.write_atomic(note, json.dumps(data).encode(), sync=False)


def _job_bytes(job: CheckpointJob) -> int:
    return len(job.header) + sum(entry.nbytes for entry in job.entries)


_COUNTS = {2: "two", 4: "four (two kept for the peer node)"}


def _check_room(folder: str, storage: Storage, snapshot_bytes: int, *, copies: int) -> None:
    held = sum(_tree_bytes(storage, path) for path in committed_steps(folder, storage).values())
    room = storage.free_bytes(folder) + held
    if room < copies * snapshot_bytes:
        raise ValueError(
            f"keep_in_memory='host' holds {_COUNTS[copies]} snapshots of {snapshot_bytes / 2**20:.1f} MiB in {folder}, and its file "
            f"system has room for {room / 2**20:.1f} MiB; enlarge it (e.g. mount /dev/shm with a larger size=), pass "
            "host_memory_dir= a larger tmpfs, or use keep_in_memory=False")


def _tree_bytes(storage: Storage, path: str) -> int:
    total = 0
    for name in storage.list_dir(path):
        info = storage.stat(os.path.join(path, name))
        if info is not None:
            total += _tree_bytes(storage, os.path.join(path, name)) if info.kind is FileKind.DIR else info.size
    return total


HOST_FOLDER = re.compile(r"[0-9a-f]{16}")
"""A host folder's name: the digest of its ``dirpath`` (:func:`~lazyckpt.storage.urls.host_dir`)."""
LEVEL_NAMES = (OWNER_NOTE, ".lock-rank", ".job-rank", "step-", KEPT_PREFIX)
"""What the host level writes in a folder (with their temporary names): a folder holding anything else, and no
owner note, is not one of its folders and is never listed nor freed."""
CLEARING = ".clearing-"
"""A folder being freed is first renamed to this prefix and its name: a job starting meanwhile makes a fresh folder
instead of writing into one being removed; one left by a clear that died midway goes at the next clear."""


@dataclass(frozen=True)
class HostFolder:
    """One host folder as ``lazyckpt memory ls`` shows it."""

    path: str
    dirpath: str | None
    """Whose folder it is (its owner note); None when the note is missing."""
    live: bool | None
    """A process holds one of its rank locks (a running job); None when this user may not open them."""
    nbytes: int
    steps: list[int]
    unsaved: list[int]
    """Committed here and newer than ``dirpath``'s newest: a crash came before their copy to disk (the next
    checkpointer of ``dirpath`` with ``keep_in_memory="host"`` commits them there)."""

    def why_kept(self, *, discard: bool) -> str | None:
        """Why :func:`clear_host_folders` keeps this folder and what to do; None when it is freed."""
        if self.live is None:
            return "this user may not take its locks (another user's job?); its owner can free it"
        if self.live:
            return "a running job holds its lock; that job frees it at a clean close()"
        if not self.unsaved or discard:
            return None
        if self.dirpath is None:
            return (f"it holds committed steps {self.unsaved} and no owner note names their dirpath; pass --discard "
                    "to free it")
        root = os.path.dirname(self.path)
        where = "" if root == DEFAULT_HOST_ROOT else f", host_memory_dir={root!r}"
        return (f"steps {self.unsaved} are committed here but not in {self.dirpath} (the job ended before their copy "
                f"to disk); open LazyCheckpointer({self.dirpath!r}, keep_in_memory='host'{where}) once to commit "
                "them to dirpath, or pass --discard")


def host_folders(root: str | None = None, storage: Storage | None = None) -> list[HostFolder]:
    """The host folders under ``root`` (None: the default root) by ``dirpath``, each with its job's liveness and
    size (each folder's locks are taken for a moment: a dead job's, as no live job holds them)."""
    storage = storage or LocalStorage()
    found = []
    for path in _folder_paths(storage, host_root(root)):
        try:
            live, locks = _take_locks(storage, path)
            _release(locks)
            found.append(_describe(storage, path, live=live))
        except FileNotFoundError:
            continue  # its job closed cleanly meanwhile, and freed it
    return sorted(found, key=lambda folder: (folder.dirpath or "", folder.path))


def clear_host_folders(root: str | None = None, *, discard: bool = False,
                       storage: Storage | None = None) -> tuple[list[HostFolder], list[HostFolder]]:
    """Free the host folders of dead jobs; ``(freed, kept)`` (:meth:`HostFolder.why_kept` says why). A folder
    holding a step newer than ``dirpath``'s newest is kept (open its ``dirpath`` with ``keep_in_memory="host"``
    once to commit it) unless ``discard``. Each folder is judged and renamed away while this process holds every rank lock of
    it, so a job that starts meanwhile either fails to take its lock or makes a fresh folder."""
    storage = storage or LocalStorage()
    root = host_root(root)
    freed, kept = [], []
    for name in storage.list_dir(root) if kind_of(storage, root) is FileKind.DIR else []:
        if name.startswith(CLEARING):
            storage.remove_tree(os.path.join(root, name))  # left by a clear that died midway
    for path in _folder_paths(storage, root):
        locks: list[StorageLock] = []
        try:
            live, locks = _take_locks(storage, path)
            folder = _describe(storage, path, live=live)
            if folder.why_kept(discard=discard) is not None:
                kept.append(folder)
                continue
            trash = os.path.join(root, f"{CLEARING}{os.path.basename(path)}-{os.getpid()}")
            storage.rename(path, trash, sync=False)
        except FileNotFoundError:
            continue  # its job closed cleanly meanwhile, and freed it
        finally:
            _release(locks)
        storage.remove_tree(trash)
        freed.append(folder)
    return freed, kept


def _folder_paths(storage: Storage, root: str) -> list[str]:
    """The host folders under ``root``, sorted: digest-named directories that hold an owner note, or nothing but
    what the host level writes (a job that died before its note)."""
    if kind_of(storage, root) is not FileKind.DIR:
        return []
    found = []
    for name in sorted(storage.list_dir(root)):
        path = os.path.join(root, name)
        if not HOST_FOLDER.fullmatch(name) or kind_of(storage, path) is not FileKind.DIR:
            continue
        try:
            names = storage.list_dir(path)
        except FileNotFoundError:
            continue
        if OWNER_NOTE in names or all(n.startswith(LEVEL_NAMES) for n in names):
            found.append(path)
    return found


def _describe(storage: Storage, path: str, *, live: bool | None) -> HostFolder:
    dirpath = host_folder_owner(storage, path)
    steps = committed_steps(path, storage)
    newest_on_disk = max(committed_steps(dirpath, storage), default=-1) if dirpath is not None else -1
    nbytes = sum(_tree_bytes(storage, os.path.join(path, n)) for n in storage.list_dir(path)
                 if kind_of(storage, os.path.join(path, n)) is FileKind.DIR)
    return HostFolder(path, dirpath, live, nbytes, sorted(steps), sorted(s for s in steps if s > newest_on_disk))


def host_folder_owner(storage: Storage, folder: str) -> str | None:
    """The ``dirpath`` whose host folder ``folder`` is (its owner note), or None when it is none."""
    try:
        owner = json.loads(storage.read_bytes(os.path.join(folder, OWNER_NOTE), max_bytes=1 << 16)).get("dirpath")
    except (OSError, ValueError, AttributeError):
        return None
    return owner if isinstance(owner, str) else None


def _take_locks(storage: Storage, folder: str) -> tuple[bool | None, list[StorageLock]]:
    """``(live, locks)``: ``(False, every rank lock of folder, now held by this process)``, or ``(True, [])`` when
    a process holds one (its job runs: the kernel drops a dead process's locks; this process's own count too), or
    ``(None, [])`` when this user may not open them."""
    taken: list[StorageLock] = []
    try:
        for name in sorted(storage.list_dir(folder)):
            if LOCK_FILE.fullmatch(name):
                taken.append(storage.lock(os.path.join(folder, name)))
    except (BlockingIOError, PermissionError) as e:
        _release(taken)
        return (None if isinstance(e, PermissionError) else True), []
    except BaseException:
        _release(taken)
        raise
    return False, taken


def _release(locks: list[StorageLock]) -> None:
    for lock in locks:
        lock.release()
