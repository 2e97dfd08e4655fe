"""Lightning Fabric integration: ``fabric.save`` and ``fabric.load`` with lazy checkpoints, in Fabric's own idiom.

``Fabric(plugins=[LazyFabricIO()])`` makes every ``fabric.save(path, state)`` one lazy request: ``state`` (modules
and optimizers, which Fabric turns into their state dicts, and any other values) is captured at once, its bytes are
copied while training goes on, and ``path`` becomes a name of the committed step directory
(``ckpts/last.ckpt -> step-0000003``, in ``path``'s folder). The barrier is every optimizer's step pre-hook: an
update waits only while a copy still reads the weights. ``fabric.load(path, state)`` reads a lazyckpt checkpoint
(a name, a step directory, or a run folder: its newest step) through the strict reader; any other file goes to
Fabric's own ``TorchCheckpointIO``.

Example (docs/fabric.md has the whole loop):
    >>> fabric = Fabric(accelerator="cpu", plugins=[LazyFabricIO(keep_last_k=3)])          # doctest: +SKIP
    >>> fabric.save("ckpts/last.ckpt", {"model": model, "optimizer": opt, "iter": i})      # doctest: +SKIP
    >>> remainder = fabric.load("ckpts/last.ckpt", {"model": model, "optimizer": opt})     # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lazyckpt.levels.aliases import alias_step
from lazyckpt.format.files import MANIFEST
from lazyckpt.pending import PendingCheckpoint
from lazyckpt.policy import CheckpointNames, CheckpointSession, SessionOptions
from lazyckpt.read.load import checkpoint_step, latest, load
from lazyckpt.storage import FileKind, LocalStorage
from lazyckpt.storage.base import kind_of
from lazyckpt.storage.urls import is_url, join, options_for
from lazyckpt.threads import weakly


class LazyFabricIO(CheckpointIO):
    """Fabric's ``CheckpointIO`` that saves lazily (see the module docstring).

    Fabric calls ``save_checkpoint`` on the global rank 0 only (DDP: the replicated state, written once), and
    ``load_checkpoint`` on every rank.

    Args:
        keep_last_k: keep the newest k steps of each folder, with their names (None: every step a name points at);
            a step whose name moved to a newer step (``fabric.save`` to the same path again) is removed unless it is
            one of those k.
        **options: :class:`~lazyckpt.LazyCheckpointer` options (``host_buffer_bytes``, ``copy_backend``,
            ``keep_in_memory``, ...), checked at construction. ``remote=URL``: each folder's steps go to
            ``URL/<folder name>`` (folders of one name in two places are refused: their steps would collide).
    """

    def __init__(self, *, keep_last_k: int | None = None, **options: Any) -> None:
        if options.get("spool_dir") is not None:
            raise ValueError(f"LazyFabricIO(spool_dir={options['spool_dir']!r}) has no use: fabric.save writes the "
                             "local folder it is given (remote=URL adds the remote level behind it); drop spool_dir")
        self.options, _ = SessionOptions.from_keywords(options, owner="LazyFabricIO", source="Fabric",
                                                       keep_last_k=keep_last_k)
        self._runs: dict[str, _Run] = {}
        self._remote_folders: dict[str, str] = {}
        """With ``remote=``: each folder's URL under it (``<remote>/<folder name>``) and the folder that has it."""
        self._torch_io = TorchCheckpointIO()
        self._start()

    def _start(self) -> None:
        """What does not cross a process boundary: the barrier hook, the optimizers seen stepping, the exit hook."""
        self._stepped: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._hook = register_optimizer_step_pre_hook(weakly(self._before_update))
        self._at_exit = weakref.finalize(self, _close_runs, self._runs)  # names put in place at a normal exit too

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the strategy, and this plugin with it
        state = {k: v for k, v in self.__dict__.items() if k not in ("_stepped", "_hook", "_at_exit")}
        return {**state, "_runs": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start()

    # --- Fabric's calls -------------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("LazyFabricIO takes no storage_options at save; give remote= and storage_options= to "
                            "LazyFabricIO(...) instead")
        if is_url(os.fspath(path)):
            raise ValueError(f"LazyFabricIO saves to local folders; path={os.fspath(path)!r} is a URL")
        name = os.path.abspath(os.fspath(path))
        if kind_of(LocalStorage(), name) is FileKind.DIR and LocalStorage().stat(name).kind is FileKind.DIR:
            raise IsADirectoryError(f"fabric.save(path={os.fspath(path)!r}): that is a directory (a run folder or a "
                                    "step?); lazyckpt makes path a name of the new step, so give a file name, "
                                    "e.g. os.path.join(path, 'last.ckpt')")
        run = self._run_for(os.path.dirname(name))
        run.save(name, checkpoint, list(self._stepped))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict:
        verify = self.options.engine.get("verify_on_load", True)
        url = is_url(os.fspath(path))  # a step on the remote level (a fresh node's folder is empty)
        name = os.fspath(path) if url else os.path.abspath(os.fspath(path))
        for folder, run in list(self._runs.items()):
            run.session.engine.wait_staged()  # the load may write into tensors a copy still reads
            if folder in (name, os.path.dirname(name)):
                run.names.poll(block=True)  # a name or run folder this process saved into: its commits first
                run.session.engine.wait_staged()  # and a failed one raises here, not at the next update
        if url:
            return load(name, map_location=map_location, verify=verify, storage_options=self.options.storage_options)
        self._commit_host_step(name if _is_run_folder(name) else os.path.dirname(name))
        target = _lazyckpt_checkpoint(name)
        if target is None:
            return self._torch_io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return load(target, map_location=map_location, verify=verify)

    def _commit_host_step(self, folder: str) -> None:
        """With ``keep_in_memory="host"``: a step a crash kept in ``folder``'s host folder only is committed in
        ``folder`` before a load looks there (its run opens, as the next save would open it: steps count on from
        it), so what is loaded, and what a name may point at, is never in a host folder a clean close frees."""
        engine = self.options.engine
        if engine.get("keep_in_memory") != "host" or folder in self._runs or \
                kind_of(LocalStorage(), folder) is not FileKind.DIR:
            return
        newest = latest(folder, host_memory_dir=engine.get("host_memory_dir"))
        if newest is not None and os.path.dirname(newest) != folder:
            self._run_for(folder)

    def remove_checkpoint(self, path: Any) -> None:
        name = os.path.abspath(os.fspath(path))
        run = self._runs.get(os.path.dirname(name))
        if run is not None and name in run.names:
            run.names.drop(name)
            run.names.submit()
        else:
            self._torch_io.remove_checkpoint(path)

    def teardown(self) -> None:
        self.close()

    # --- the rest -------------------------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until every requested checkpoint is committed and its name in place (re-raises a failure)."""
        for run in self._runs.values():
            run.names.poll(block=True)
            run.session.engine.wait_staged()

    def close(self) -> None:
        """Finish every checkpoint in flight and put its name in place; release the folders. Idempotent."""
        _close_runs(self._runs)

    @property
    def stalls(self) -> dict[int, float]:
        """Training-thread seconds each checkpoint cost, by step (capture, request and the first barrier)."""
        return {step: s for run in self._runs.values() for step, s in run.session.stalls.items()}

    def _before_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Every optimizer's step pre-hook: the barrier; and the optimizers seen stepping are the ones whose
        parameters and state the next saves copy lazily (they stay unchanged until this hook runs again)."""
        self._stepped.add(optimizer)
        for run in list(self._runs.values()):
            run.session.barrier()

    def _run_for(self, dirpath: str) -> _Run:
        """The folder's run; a save into another folder first finishes and closes the others (a LitGPT-style loop
        saves each step into a folder of its own: one engine and host pool at a time, not one per folder)."""
        run = self._runs.get(dirpath)
        if run is None:
            options = self._options_for(dirpath)
            _close_runs(self._runs)
            session = CheckpointSession(dirpath, options, rank=0, world_size=1, engine_retention=False)
            run = self._runs[dirpath] = _Run(session)
        return run

    def _options_for(self, dirpath: str) -> SessionOptions:
        """The folder's options: with a remote level, its own URL under it (steps count per folder)."""
        if self.options.remote is None:
            return self.options
        url = join(self.options.remote, os.path.basename(dirpath))
        other = self._remote_folders.setdefault(url, dirpath)
        if other != dirpath:
            raise ValueError(f"LazyFabricIO(remote={self.options.remote!r}): the folders {other!r} and {dirpath!r} "
                             f"would both upload to {url!r} and overwrite each other's steps; give the folders "
                             "different names")
        return dataclasses.replace(self.options, remote=url, engine={k: v for k, v in self.options.engine.items()
                                                                     if k != "remote"})

    def __del__(self) -> None:
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()


class _Run:
    """One folder's session and the names of its checkpoints; steps count on from the newest committed one."""

    def __init__(self, session: CheckpointSession) -> None:
        self.session = session
        self._state: tuple[dict[str, Any], list[torch.optim.Optimizer]] | None = None
        self.names = CheckpointNames(session, self._request)
        self._named: dict[str, int] = {}
        """The folder's names and the steps they point at (for ``keep_last_k``), an earlier process's too."""
        for entry in session.storage.list_dir(session.dirpath):
            step = alias_step(session.storage, os.path.join(session.dirpath, entry))
            if step is not None:
                self._named[os.path.join(session.dirpath, entry)] = step
        newest = session.newest()  # with a remote level: its newest too (a fresh node's folder is empty)
        self._next = 1 if newest is None else checkpoint_step(
            newest, storage_options=options_for(newest, session.engine.config.storage_options)) + 1

    def save(self, name: str, checkpoint: dict[str, Any], optimizers: list[torch.optim.Optimizer]) -> None:
        step, self._next = self._next, self._next + 1
        self._state = (checkpoint, optimizers)
        with self.names.deciding():
            self.names.plan(step, name)
            self._named[name] = step
            self._retire_names(self.session.options.keep_last_k)

    def _retire_names(self, keep: int | None) -> None:
        """With ``keep_last_k``: the names of steps beyond the newest k go once the new step commits (then the
        steps themselves, which nothing keeps any more)."""
        if keep is None:
            return
        kept = sorted(set(self._named.values()))[-keep:]
        for name, step in list(self._named.items()):
            if step not in kept:
                self.names.drop(name)
                del self._named[name]

    def _request(self, step: int) -> PendingCheckpoint | None:
        checkpoint, optimizers = self._state
        self._state = None
        return self.session.save(step, replicated=checkpoint, per_rank={}, optimizers=optimizers)


def _close_runs(runs: dict[str, _Run]) -> None:
    """Finish and close every run (all of them, even after one raised: the first failure is raised then)."""
    error = None
    while runs:
        _, run = runs.popitem()
        try:
            run.names.close(raise_errors=True)
        except BaseException as e:  # noqa: BLE001 - raised once every run is closed
            error = error or e
    if error is not None:
        raise error


def _is_run_folder(name: str) -> bool:
    """``name`` is a directory and no step directory (a folder ``fabric.save`` wrote names and steps into)."""
    storage = LocalStorage()
    return kind_of(storage, name) is FileKind.DIR and kind_of(storage, os.path.join(name, MANIFEST)) is not FileKind.FILE


def _lazyckpt_checkpoint(name: str) -> str | None:
    """The lazyckpt checkpoint ``name`` stands for: itself (a step directory, or a name linking to one), the newest
    step of a run folder, or None (an ordinary file, or nothing)."""
    storage = LocalStorage()
    if kind_of(storage, name) is not FileKind.DIR:
        return None
    return latest(name) if _is_run_folder(name) else name


__all__ = ["LazyFabricIO"]
