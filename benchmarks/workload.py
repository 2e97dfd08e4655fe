"""The benchmark workload and the measuring tools every method shares.

A small decoder-only transformer (token + position embeddings, pre-norm attention/MLP blocks, an untied LM head)
trained with AdamW on synthetic tokens from fixed seeds, so every run of the same configuration computes the same
bits. Plus: a peak-RSS sampler, page-cache eviction, a raw write+fsync timer, and the bit-exact comparison of a
loaded checkpoint with the reference state.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

MiB = 1 << 20


@dataclass(frozen=True)
class Workload:
    """What every run trains and when it checkpoints (all runs of one benchmark share one)."""

    params_m: float = 25.0
    """Target model size in millions of parameters (the state is ~12 bytes per parameter with AdamW)."""
    batch: int = 8
    seq: int = 64
    threads: int = 1
    """``torch.set_num_threads`` of the training process (``compare.py`` defaults to torch's own default)."""
    every: int = 5
    """Checkpoint every ``every`` optimizer steps."""
    checkpoints: int = 6
    """Measured checkpoints per run (one more, at step ``every``, is the untimed warm-up checkpoint)."""
    seed: int = 0
    lr: float = 1e-3
    adamw: str = "fused"
    """AdamW implementation: ``fused``, ``foreach`` or ``loop``."""

    # --- derived shape ----------------------------------------------------------------------------------------

    @property
    def d_model(self) -> int:
        p = self.params_m * 1e6
        return 512 if p >= 16e6 else 256 if p >= 2e6 else 128 if p >= 0.5e6 else 64

    @property
    def vocab(self) -> int:
        return 12 * self.d_model

    @property
    def layers(self) -> int:
        d = self.d_model
        rest = self.params_m * 1e6 - 2 * self.vocab * d - self.seq * d
        return max(1, round(rest / (12 * d * d + 13 * d)))

    @property
    def heads(self) -> int:
        return max(1, self.d_model // 64)

    # --- the schedule -----------------------------------------------------------------------------------------

    @property
    def tail(self) -> int:
        """Steps after the verified checkpoint: they update the parameters, so a torn snapshot would show."""
        return max(1, self.every - 1)

    @property
    def verified_step(self) -> int:
        return (self.checkpoints + 1) * self.every

    @property
    def total_steps(self) -> int:
        return self.verified_step + self.tail

    @property
    def first_measured_step(self) -> int:
        return self.every + 1

    def is_checkpoint(self, step: int) -> bool:
        return step % self.every == 0 and step <= self.verified_step

    def describe(self) -> dict:
        out = asdict(self)
        out.update(d_model=self.d_model, vocab=self.vocab, layers=self.layers, heads=self.heads,
                   tail=self.tail, verified_step=self.verified_step, total_steps=self.total_steps)
        return out


# --- the model -------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, w: Workload) -> None:
        super().__init__()
        self.tok = nn.Embedding(w.vocab, w.d_model)
        self.pos = nn.Embedding(w.seq, w.d_model)
        self.blocks = nn.ModuleList(Block(w.d_model, w.heads) for _ in range(w.layers))
        self.ln_f = nn.LayerNorm(w.d_model)
        self.head = nn.Linear(w.d_model, w.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(w: Workload) -> TinyLM:
    torch.manual_seed(w.seed)
    return TinyLM(w)


def make_optimizer(w: Workload, params) -> torch.optim.Optimizer:
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[w.adamw]
    return torch.optim.AdamW(params, lr=w.lr, **kind)


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Batches(torch.utils.data.Dataset):
    """Synthetic token batches: a small fixed pool, cycled; item ``i`` is the batch of step ``i + 1``."""

    def __init__(self, w: Workload, pool: int = 8) -> None:
        gen = torch.Generator().manual_seed(w.seed + 1)
        self.pool = []
        for _ in range(pool):
            tokens = torch.randint(w.vocab, (w.batch, w.seq + 1), generator=gen)
            self.pool.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        self.length = w.total_steps + 1

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool[index % len(self.pool)]


def set_threads(w: Workload) -> None:
    os.environ["OMP_NUM_THREADS"] = str(w.threads)  # Lightning reads it before it would pick its own count
    torch.set_num_threads(w.threads)


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the training state, in a fixed order: parameters, buffers, then optimizer state."""
    out = [(f"model/{k}", v) for k, v in model.state_dict().items()]
    for index, state in opt.state_dict()["state"].items():
        out += [(f"opt/{index}/{k}", v) for k, v in state.items() if isinstance(v, torch.Tensor)]
    return out


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for _, t in state_tensors(model, opt))


# --- comparing a loaded checkpoint with the reference state ------------------------------------------------------


def normalize(model_sd: dict, opt_state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The comparable form of a checkpoint: ``model/<name>`` and ``opt/<index>/<key>`` tensors."""
    out = {f"model/{k[len(prefix):] if k.startswith(prefix) else k}": v for k, v in model_sd.items()}
    for index, state in opt_state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"opt/{int(index)}/{key}"] = value
    return out


def compare(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str | None:
    """None when ``actual`` equals ``expected`` bit for bit, else the first difference in words."""
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing or extra:
        return f"keys differ: missing {missing[:3]}, unexpected {extra[:3]}"
    for key, want in expected.items():
        got = actual[key]
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return f"{key}: {getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))} != " \
                   f"{want.dtype} {tuple(want.shape)}"
        a, b = got.detach().cpu().contiguous().reshape(-1), want.contiguous().reshape(-1)
        if a.numel() and not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            changed = (a != b).sum().item() if a.is_floating_point() else "some"
            return f"{key}: {changed} of {a.numel()} values differ from the state at that step (torn or stale)"
    return None


# --- memory, files and the disk --------------------------------------------------------------------------------


class RssSampler:
    """Samples this process's RSS on a thread every ``interval_s`` and keeps the peak. With ``children``, each
    sample adds the private (anonymous) memory of this process's child processes: a method that writes from a
    process of its own costs that memory too, while pages the child shares with this process (shared-memory
    staging buffers, libraries) are already in this process's RSS."""

    def __init__(self, interval_s: float = 0.005, children: bool = False) -> None:
        import psutil

        self._proc = psutil.Process()
        self.interval_s = interval_s
        self.children = children
        self.start_rss = self.peak_rss = self._proc.memory_info().rss
        self.peak_children = 0
        """The children's share of the peak sample (bytes)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self._thread.start()

    def _children_private(self, found: list) -> int:
        import psutil

        total = 0
        for child in found:
            try:
                info = child.memory_info()
            except psutil.Error:  # it ended between the listing and the sample
                continue
            total += info.rss - info.shared
        return total

    def _sample(self, found: list) -> None:
        own = self._proc.memory_info().rss
        extra = self._children_private(found) if found else 0
        if own + extra > self.peak_rss:
            self.peak_rss, self.peak_children = own + extra, extra

    def _run(self) -> None:
        found, tick = [], 0
        while not self._stop.wait(self.interval_s):
            if self.children and tick % 20 == 0:  # listing children scans /proc: every 100 ms is enough
                found = self._proc.children(recursive=True)
            tick += 1
            self._sample(found)

    def stop(self) -> int:
        """Stop sampling; returns the peak RSS in bytes."""
        self._stop.set()
        self._thread.join()
        self._sample(self._proc.children(recursive=True) if self.children else [])
        return self.peak_rss


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    found = []
    for root, _, names in os.walk(path, followlinks=True):
        found += [os.path.join(root, n) for n in names]
    return sorted(found)


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in files_under(path))


def evict_from_page_cache(path: str) -> None:
    """Write back and drop ``path``'s pages, so a restore reads from the disk (works unprivileged)."""
    for name in files_under(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` and the directories holding them (for methods that do not)."""
    dirs = {os.path.dirname(path) or "."}
    for name in files_under(path):
        fsync_path(name)
        dirs.add(os.path.dirname(name))
    for d in dirs:
        fsync_path(d)


def fsync_path(path: str) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data):]


def raw_write_seconds(dirpath: str, nbytes: int, *, direct: bool = False, block: int = 8 * MiB) -> float:
    """Seconds to write ``nbytes`` from a warm buffer and fsync them: one ``write`` (or aligned ``O_DIRECT``
    blocks when ``direct``), the floor of any checkpoint of that size on this disk."""
    size = -(-nbytes // 4096) * 4096 if direct else nbytes
    buf = torch.ones(max(size, 1), dtype=torch.uint8)  # allocated and touched before the clock starts
    if direct:
        import mmap

        aligned = mmap.mmap(-1, block)  # O_DIRECT needs page-aligned memory
        aligned.write(bytes(block))
    path = os.path.join(dirpath, f"raw-write-{os.getpid()}.bin")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        started = time.perf_counter()
        if direct:
            view = memoryview(aligned)
            for _ in range(size // block):
                write_all(fd, view)
            if size % block:
                write_all(fd, view[: size % block])
        else:
            write_all(fd, memoryview(buf.numpy()))
        os.fsync(fd)
        return time.perf_counter() - started
    finally:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        os.remove(path)


def median(values: list[float]) -> float:
    values = sorted(v for v in values if v is not None and not math.isnan(v))
    if not values:
        return float("nan")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
