"""The Lightning and Accelerate methods (see ``methods`` for the interface)."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import torch

from methods import Method, Run, lazy_path
from workload import fsync_tree, normalize


# --- Accelerate ------------------------------------------------------------------------------------------------


class AccelerateSaveState(Method):
    key, label, driver = "accelerate_save_state", "Accelerate save_state (sync)", "accelerate"
    modules = ("accelerate",)

    def request(self, step: int) -> None:
        path = self.path_for(step)
        self.run.accelerator.save_state(path)
        fsync_tree(path)  # save_state does not fsync
        self.durable_at[step] = time.monotonic()

    def path_for(self, step: int) -> str:
        return os.path.join(self.run.dirpath, f"step-{step}")

    def load(self, path: str) -> Any:
        self.run.accelerator.load_state(path)  # into the live model and optimizer, as a resume would
        return {"model": self.run.model.state_dict(), "opt": self.run.optimizer.state_dict()}


class LazyHook(Method):
    key, label, kind, driver = "lazyckpt_accelerate", "lazyckpt LazyCheckpointHook (Accelerate)", "lazyckpt", \
        "accelerate"
    modules = ("accelerate", "lazyckpt.integrations.accelerate")

    def check(self) -> None:
        super().check()
        from lazyckpt import LazyCheckpointHook  # noqa: F401 - the public name must resolve

    def setup(self, run: Run) -> None:
        super().setup(run)
        from lazyckpt import LazyCheckpointHook

        self.hook = LazyCheckpointHook(run.dirpath, every_n_steps=run.workload.every, fsync=True)
        self.hook.register(run.accelerator)

    def drain(self) -> None:
        pending = self.hook.save()  # issues the request of the step just finished, if not issued yet
        if pending is not None:
            pending.wait()

    def finish(self) -> None:
        self.hook.close()

    def own_stalls(self) -> dict[int, float]:
        return self.hook.stalls

    def durable_seconds(self) -> dict[int, float]:
        return {s.step: s.flush_s for s in self.hook.checkpointer.stats}

    def path_for(self, step: int) -> str:
        return lazy_path(self.run.dirpath, step)

    def load(self, path: str) -> Any:
        import lazyckpt

        return lazyckpt.load(path)

    def normalize(self, loaded: Any) -> dict[str, torch.Tensor]:
        return normalize(loaded["models"][0], loaded["optimizers"][0]["state"])


# --- Lightning -------------------------------------------------------------------------------------------------


def _fsync_io_class() -> type:
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class FsyncTorchCheckpointIO(TorchCheckpointIO):
        """Lightning's own writer, plus an fsync so that "saved" means durable, as for every method here."""

        def __init__(self) -> None:
            super().__init__()
            self.durable_at: dict[str, float] = {}

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            fsync_tree(str(path))
            self.durable_at[str(path)] = time.monotonic()

    return FsyncTorchCheckpointIO


class LightningSync(Method):
    key, label, driver = "lightning_sync", "Lightning ModelCheckpoint (sync)", "trainer"
    modules = ("lightning.pytorch",)
    enable_checkpointing = True

    def callbacks(self, run: Run) -> list[Any]:
        from lightning.pytorch.callbacks import ModelCheckpoint

        self.run = run
        return [ModelCheckpoint(run.dirpath, filename="{step}", every_n_train_steps=run.workload.every,
                                save_top_k=-1, save_last=False)]

    def plugins(self, run: Run) -> list[Any]:
        self.io = _fsync_io_class()()
        return [self.io]

    def durable_timestamps(self) -> dict[int, float]:
        out = {}
        for path, when in self.io.durable_at.items():
            match = re.search(r"step=(\d+)", os.path.basename(path))
            if match:
                out[int(match.group(1))] = when
        return out

    def path_for(self, step: int) -> str:
        return os.path.join(self.run.dirpath, f"step={step}.ckpt")

    def load(self, path: str) -> Any:
        return torch.load(path, map_location="cpu", weights_only=False)

    def normalize(self, loaded: Any) -> dict[str, torch.Tensor]:
        return normalize(loaded["state_dict"], loaded["optimizer_states"][0]["state"], prefix="net.")


class LightningAsync(LightningSync):
    key, label = "lightning_async", "Lightning AsyncCheckpointIO"

    def plugins(self, run: Run) -> list[Any]:
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        self.io = _fsync_io_class()()
        self.async_io = AsyncCheckpointIO(self.io)
        return [self.async_io]

    def drain(self) -> None:
        executor = self.async_io._executor  # one worker, FIFO: a no-op returns after every queued save
        if executor is not None:
            executor.submit(lambda: None).result()


class LazyLightning(LightningSync):
    key, label, kind = "lazyckpt_lightning", "lazyckpt LazyCheckpoint (Trainer)", "lazyckpt"
    modules = ("lightning.pytorch", "lazyckpt.integrations.lightning")

    def check(self) -> None:
        super().check()
        from lazyckpt import LazyCheckpoint  # noqa: F401 - the public name must resolve

    def callbacks(self, run: Run) -> list[Any]:
        from lazyckpt import LazyCheckpoint

        self.run = run
        self.callback = LazyCheckpoint(run.dirpath, filename="{step}", every_n_train_steps=run.workload.every,
                                       save_top_k=-1, save_last=False, log_stats=False,
                                       engine_options={"fsync": True})
        return [self.callback]

    def plugins(self, run: Run) -> list[Any]:
        return []

    def drain(self) -> None:
        self.callback.wait()

    def durable_timestamps(self) -> dict[int, float]:
        return {}

    def durable_seconds(self) -> dict[int, float]:
        return {s.step: s.flush_s for s in self.callback.stats}

    def path_for(self, step: int) -> str:
        return lazy_path(self.run.dirpath, step)

    def load(self, path: str) -> Any:
        import lazyckpt

        return lazyckpt.load(path)
