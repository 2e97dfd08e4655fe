"""The raw floors: what writing the same bytes costs with no serialization, checksums or commit.

``raw`` is the raw floor (warm-buffer copy on a background thread + one ``write`` + ``fsync``);
``raw_direct`` and ``raw_paced`` push it down with ``O_DIRECT`` and with pacing.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import torch

from methods import Method, Run, Unavailable
from workload import state_tensors, write_all


class RawFloor(Method):
    """Copy every state tensor into one warm buffer on a background thread, then one write + fsync; no
    serialization, checksums or commit. The training thread waits for the copy right before the next step."""

    key, label, kind = "raw", "raw floor (warm-buffer copy + 1 write+fsync)", "floor"

    def setup(self, run: Run) -> None:
        super().setup(run)
        self.buffer: torch.Tensor | None = None
        self.layout: list[tuple[str, torch.dtype, torch.Size, int, int]] = []
        self.copied = threading.Event()
        self.idle = threading.Event()
        self.copied.set()
        self.idle.set()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.requested_at: dict[int, float] = {}
        self.thread = threading.Thread(target=self._work, name="raw-floor", daemon=True)
        self.thread.start()

    def request(self, step: int) -> None:
        self.idle.wait()  # one checkpoint in flight, like every async method here
        self._raise()
        tensors = state_tensors(self.run.model, self.run.optimizer)
        if self.buffer is None:
            offset = 0
            for name, t in tensors:
                nbytes = t.numel() * t.element_size()
                self.layout.append((name, t.dtype, t.shape, offset, nbytes))
                offset += nbytes
            self.buffer = self._allocate(offset)
        self.copied.clear()
        self.idle.clear()
        self.requested_at[step] = time.monotonic()
        self.jobs.put((step, [t for _, t in tensors]))

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)  # zeroed: warm, every page touched

    def _write(self, step: int) -> None:
        fd = os.open(self.path_for(step), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, memoryview(self.buffer.numpy()))
            os.fsync(fd)
        finally:
            os.close(fd)

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            step, tensors = job
            try:
                for (_, _, _, offset, nbytes), t in zip(self.layout, tensors, strict=True):
                    self.buffer[offset : offset + nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
                self.copied.set()
                self._write(step)
                self.durable_at[step] = time.monotonic()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self.error = e
            finally:
                self.copied.set()
                self.idle.set()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def before_step(self) -> None:
        self.copied.wait()
        self._raise()

    def drain(self) -> None:
        self.idle.wait()
        self._raise()

    def finish(self) -> None:
        self.drain()
        self.jobs.put(None)
        self.thread.join()

    def path_for(self, step: int) -> str:
        return os.path.join(self.run.dirpath, f"raw-{step}.bin")

    def load(self, path: str) -> torch.Tensor:
        data = torch.empty(os.path.getsize(path), dtype=torch.uint8)
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(data.numpy()))
        return data

    def normalize(self, loaded: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: loaded[off : off + n].view(dtype).reshape(shape)
                for name, dtype, shape, off, n in self.layout}


class RawDirect(RawFloor):
    """The floor pushed down: the same copy, written with ``O_DIRECT`` in 8 MiB aligned blocks, so the
    bytes skip the page cache and its write-back burst."""

    key, label = "raw_direct", "raw floor, O_DIRECT 8 MiB writes"
    BLOCK = 8 << 20

    def check(self) -> None:
        if not hasattr(os, "O_DIRECT"):
            raise Unavailable("this platform has no O_DIRECT")

    def _allocate(self, nbytes: int) -> torch.Tensor:
        import mmap

        self._mmap = mmap.mmap(-1, -(-nbytes // 4096) * 4096)  # page-aligned, as O_DIRECT needs
        buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)
        buffer.fill_(0)  # warm: every page touched
        return buffer[:nbytes]

    def _write(self, step: int) -> None:
        path = self.path_for(step)
        total = self.buffer.numel()
        view = memoryview(self._mmap)  # the full, page-padded buffer
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            padded = len(view)
            for offset in range(0, padded, self.BLOCK):
                write_all(fd, view[offset : min(offset + self.BLOCK, padded)])
                self._pace(step, min(offset + self.BLOCK, padded), padded)
            os.ftruncate(fd, total)
            os.fsync(fd)
        finally:
            os.close(fd)
            view.release()

    def _pace(self, step: int, done: int, total: int) -> None: ...


class RawPaced(RawDirect):
    """``O_DIRECT`` blocks spread over 60 % of the previous checkpoint interval instead of written at once."""

    key, label = "raw_paced", "raw floor, O_DIRECT paced over the interval"
    SHARE = 0.6

    def _pace(self, step: int, done: int, total: int) -> None:
        earlier = [s for s in self.requested_at if s < step]
        if not earlier:
            return
        interval = self.requested_at[step] - self.requested_at[max(earlier)]
        due = self.requested_at[step] + self.SHARE * interval * done / total
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
