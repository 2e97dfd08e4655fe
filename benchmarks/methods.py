"""The checkpointing methods under test, each behind one small interface.

A method is driven by a training loop (``driver``): ``"loop"`` (plain PyTorch), ``"accelerate"`` (the same loop
through an ``Accelerator``) or ``"trainer"`` (a Lightning ``Trainer``). In the loops the runner calls
``request(step)`` right after ``optimizer.step()`` on checkpoint steps, ``before_step()`` right before every
``optimizer.step()``, ``drain()`` once after the warm-up checkpoint and ``finish()`` after the last step. Under a
``Trainer`` the method contributes callbacks and plugins instead, and Lightning makes those calls itself.

Every method makes its checkpoints durable (fsync) before it calls them done; ``load`` reads one back with the
method's own reader and ``normalize`` turns it into the comparable ``model/...``, ``opt/...`` form.
"""

from __future__ import annotations

import importlib
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from workload import Workload, normalize


class Unavailable(Exception):
    """The method cannot run here (a missing package or integration); the message says why."""


@dataclass
class Run:
    """What a method gets to work with in one run."""

    workload: Workload
    dirpath: str
    model: Any = None
    optimizer: Any = None
    accelerator: Any = None
    trainer: Any = None


class Method:
    key = ""
    label = ""
    driver = "loop"
    kind = "peer"
    """``baseline``, ``floor``, ``peer`` or ``lazyckpt``."""
    modules: tuple[str, ...] = ()
    child_processes = False
    """The method writes from processes of its own: their private memory counts in its peak RSS."""

    def __init__(self) -> None:
        self.run: Run | None = None
        self.durable_at: dict[int, float] = {}
        """Step -> ``time.monotonic()`` when that checkpoint was durable (the runner knows the request time)."""

    def check(self) -> None:
        for name in self.modules:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - any import failure makes the method unavailable
                raise Unavailable(f"import {name} failed: {type(e).__name__}: {e}") from e

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as the driver trains it (the distributed methods shard or replicate it here)."""
        return model

    def setup(self, run: Run) -> None:
        self.run = run

    def state(self) -> dict[str, Any]:
        return {"model": self.run.model.state_dict(), "opt": self.run.optimizer.state_dict()}

    def request(self, step: int) -> None: ...

    def before_step(self) -> None: ...

    def drain(self) -> None:
        """Block until every requested checkpoint is durable (the run goes on afterwards)."""

    def finish(self) -> None:
        self.drain()

    def durable_timestamps(self) -> dict[int, float]:
        return self.durable_at

    def durable_seconds(self) -> dict[int, float] | None:
        """Step -> seconds from request to durable, when the method measures it itself."""
        return None

    def own_stalls(self) -> dict[int, float] | None:
        """Step -> training-thread seconds, when the stall happens where the runner cannot time it."""
        return None

    def path_for(self, step: int) -> str:
        raise NotImplementedError

    def load(self, path: str) -> Any:
        raise NotImplementedError

    def normalize(self, loaded: Any) -> dict[str, torch.Tensor]:
        return normalize(loaded["model"], loaded["opt"]["state"])

    # Trainer methods
    enable_checkpointing = False

    def callbacks(self, run: Run) -> list[Any]:
        return []

    def plugins(self, run: Run) -> list[Any]:
        return []


# --- baselines and the floor -----------------------------------------------------------------------------------


class NoCheckpoint(Method):
    key, label, kind = "none", "no checkpoint", "baseline"


class NoCheckpointTrainer(NoCheckpoint):
    key, label, driver = "none_trainer", "no checkpoint (Lightning Trainer)", "trainer"
    modules = ("lightning.pytorch",)


class NoCheckpointAccelerate(NoCheckpoint):
    key, label, driver = "none_accelerate", "no checkpoint (Accelerate loop)", "accelerate"
    modules = ("accelerate",)


# --- plain-loop peers ------------------------------------------------------------------------------------------


class TorchSave(Method):
    key, label = "torch_save", "torch.save (sync)"

    def request(self, step: int) -> None:
        with open(self.path_for(step), "wb") as f:
            torch.save(self.state(), f)
            f.flush()
            os.fsync(f.fileno())
        self.durable_at[step] = time.monotonic()

    def path_for(self, step: int) -> str:
        return os.path.join(self.run.dirpath, f"step-{step}.pt")

    def load(self, path: str) -> Any:
        return torch.load(path, map_location="cpu", weights_only=True)


class DcpThread(Method):
    """``dcp.async_save`` with its defaults (THREAD; the ``FileSystemWriter`` stages, blocking, into fresh
    memory); the next request first waits for the previous upload, as TorchTitan does."""

    key, label = "dcp_thread", "DCP async_save (thread)"
    modules = ("torch.distributed.checkpoint",)

    def setup(self, run: Run) -> None:
        super().setup(run)
        self.upload = None

    def _save(self, step: int, **kwargs: Any) -> Any:
        import torch.distributed.checkpoint as dcp

        if self.upload is not None:
            self.upload.result()
        path = self.path_for(step)
        writer = dcp.FileSystemWriter(path, sync_files=True)
        return dcp.async_save(self.state(), checkpoint_id=path, storage_writer=writer, **kwargs)

    def _track(self, step: int, upload: Any) -> None:
        self.upload = upload
        upload.add_done_callback(lambda _f, s=step: self.durable_at.__setitem__(s, time.monotonic()))

    def request(self, step: int) -> None:
        self._track(step, self._save(step))

    def drain(self) -> None:
        if self.upload is not None:
            self.upload.result()

    def path_for(self, step: int) -> str:
        return os.path.join(self.run.dirpath, f"step-{step}")

    def load(self, path: str) -> Any:
        import torch.distributed.checkpoint as dcp

        template = self.template  # built (allocated) before the clock started
        dcp.load(template, checkpoint_id=path)
        return template

    def prepare_load(self) -> None:
        self.template = empty_state_like(self.run.model, self.run.optimizer)


def empty_state_like(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model", "opt"}`` shaped like the live state, every tensor freshly allocated and every other leaf the live
    one (readers that fill a template in place want both)."""
    model_sd, opt_sd = model.state_dict(), optimizer.state_dict()
    return {"model": {k: torch.empty_like(v) for k, v in model_sd.items()},
            "opt": {"state": {i: {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
                                  for k, v in s.items()} for i, s in opt_sd["state"].items()},
                    "param_groups": opt_sd["param_groups"]}}


def default_stager(*, cuda: bool) -> Any:
    """DCP's ``DefaultStager`` as the peers' docs suggest: async staging into cached host storage, pinned and
    non-blocking only with CUDA."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=cuda))


class DcpStager(DcpThread):
    """``dcp.async_save`` + ``DefaultStager`` (async staging into cached host storage; pinned and non-blocking
    only with CUDA), with ``staging_completion`` awaited right before the next ``optimizer.step()``."""

    key, label = "dcp_stager", "DCP async_save + DefaultStager (wait before step)"

    def setup(self, run: Run) -> None:
        super().setup(run)
        self.stager = default_stager(cuda=torch.cuda.is_available())
        self.staging = None

    def request(self, step: int) -> None:
        response = self._save(step, async_stager=self.stager)
        self.staging = response.staging_completion
        self._track(step, response.upload_completion)

    def before_step(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def finish(self) -> None:
        self.before_step()
        self.drain()
        self.stager.close()


# --- lazyckpt through the engine -------------------------------------------------------------------------------


def _timed_storage(**options: Any) -> Any:
    """``LocalStorage`` that also records when each write, fsync and commit step ran (for the timeline)."""
    from lazyckpt.storage import LocalStorage

    class TimedStorage(LocalStorage):
        def __init__(self) -> None:
            super().__init__(**options)
            self.events: list[tuple[str, float, float, int, int | None]] = []
            """(kind, start, end, bytes, step of a commit rename)."""

        def _timed(self, kind: str, fn: Any, nbytes: int = 0, step: int | None = None) -> Any:
            started = time.monotonic()
            try:
                return fn()
            finally:
                self.events.append((kind, started, time.monotonic(), nbytes, step))

        def write(self, handle, offset, buffers):
            return self._timed("write", lambda: super(TimedStorage, self).write(handle, offset, buffers),
                               sum(len(b) for b in buffers))

        def close(self, handle, *, sync):
            return self._timed("fsync", lambda: super(TimedStorage, self).close(handle, sync=sync))

        def write_atomic(self, path, data, *, sync):
            return self._timed("manifest", lambda: super(TimedStorage, self).write_atomic(path, data, sync=sync),
                               len(data))

        def rename(self, src, dst, *, sync):
            match = re.search(r"(\d+)$", os.path.basename(os.path.normpath(dst)))
            return self._timed("rename", lambda: super(TimedStorage, self).rename(src, dst, sync=sync),
                               step=int(match.group(1)) if match else None)

    return TimedStorage()


class LazyEngine(Method):
    key, label, kind = "lazyckpt", "lazyckpt LazyCheckpointer", "lazyckpt"
    modules = ("lazyckpt",)
    storage_options: dict[str, Any] = {}
    engine_options: dict[str, Any] = {}

    def setup(self, run: Run) -> None:
        super().setup(run)
        import lazyckpt

        self.storage = _timed_storage(**self.storage_options)
        self.ckpt = lazyckpt.LazyCheckpointer(run.dirpath, fsync=True, storage=self.storage, **self.engine_options)
        self.pending = None

    def request(self, step: int) -> None:
        self.pending = self.ckpt.save(self.state(), step=step, optimizers=[self.run.optimizer])

    def before_step(self) -> None:
        self.ckpt.wait_staged()

    def drain(self) -> None:
        if self.pending is not None:
            self.pending.wait()

    def finish(self) -> None:
        self.ckpt.close()

    def durable_seconds(self) -> dict[int, float]:
        return {s.step: s.flush_s for s in self.ckpt.stats}

    def path_for(self, step: int) -> str:
        return lazy_path(self.run.dirpath, step)

    def load(self, path: str) -> Any:
        import lazyckpt

        return lazyckpt.load(path)


class LazyEngineBuffered(LazyEngine):
    """Diagnostic: the engine with its writer's ``O_DIRECT`` turned off (page-cache writes, then fsync)."""

    key, label, kind = "lazyckpt_buffered", "lazyckpt LazyCheckpointer, buffered writes (diagnostic)", "diagnostic"
    storage_options = {"direct_io": False}

    def check(self) -> None:
        super().check()
        try:
            _timed_storage(**self.storage_options)
        except TypeError as e:
            raise Unavailable(f"this engine's LocalStorage has no direct_io option ({e})") from e


class LazyEngineTwoInFlight(LazyEngine):
    """The engine with ``max_in_flight=2``: the next checkpoint is copied while the previous one is written."""

    key, label = "lazyckpt_two", "lazyckpt LazyCheckpointer, max_in_flight=2"
    engine_options = {"max_in_flight": 2}


class LazyEngineTwoPools(LazyEngine):
    """Diagnostic: ``max_in_flight=2`` with a host budget that holds two checkpoints of the default workload, so
    the next copy never waits for the writer to free a slot."""

    key, label, kind = "lazyckpt_two_pool", "lazyckpt, max_in_flight=2, 640 MiB pool (diagnostic)", "diagnostic"
    engine_options = {"max_in_flight": 2, "host_buffer_bytes": 640 << 20}


def lazy_path(dirpath: str, step: int) -> str:
    import lazyckpt

    path = lazyckpt.latest(dirpath)
    if path is None or lazyckpt.checkpoint_step(path) != step:
        raise FileNotFoundError(f"no committed lazyckpt checkpoint of step {step} in {dirpath} (newest: {path})")
    return path
