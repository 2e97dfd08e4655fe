"""Restore speed: ``lazyckpt.load`` (checksums verified) against one raw read of the same bytes and against
``torch.load`` + ``load_state_dict``, and the restart a user sees: process start -> first training step after
resuming, in a fresh process.

    python benchmarks/restore.py [--params-m 25] [--repeats 5] [--warm] [--dir DIR]

Reads are cold (each file's pages dropped from the page cache first) unless ``--warm``. Methods run in rotation,
so drift of the machine hits all of them alike; medians are printed as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lazyckpt  # noqa: E402
from workload import MiB, Workload, build_model, evict_from_page_cache, files_under, lm_loss, make_optimizer, median  # noqa: E402

READ_BYTES = 16 * MiB

RESTART = """
import sys, time, torch
sys.path.insert(0, sys.argv[1])
import lazyckpt
from workload import Workload, build_model, lm_loss, make_optimizer
w = Workload(params_m=float(sys.argv[2]))
model = build_model(w)
opt = make_optimizer(w, model.parameters())
if sys.argv[3] == "lazyckpt":
    state = lazyckpt.load(sys.argv[4])
else:
    state = torch.load(sys.argv[4], weights_only=True)
model.load_state_dict(state["model"])
opt.load_state_dict(state["optimizer"])
tokens = torch.randint(0, w.vocab, (w.batch, w.seq + 1), generator=torch.Generator().manual_seed(0))
lm_loss(model, (tokens[:, :-1], tokens[:, 1:])).backward()
opt.step()
print("FIRST_STEP", flush=True)
"""


def trained(w: Workload) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    model = build_model(w)
    opt = make_optimizer(w, model.parameters())
    tokens = torch.randint(0, w.vocab, (w.batch, w.seq + 1), generator=torch.Generator().manual_seed(0))
    lm_loss(model, (tokens[:, :-1], tokens[:, 1:])).backward()
    opt.step()
    return model, opt, {"model": model.state_dict(), "optimizer": opt.state_dict()}


def raw_read(path: str) -> None:
    """Every byte of every file of ``path`` into one fresh buffer with large reads: the floor for reading them
    into new memory (allocated like torch allocates tensors, so both pay the same page faults)."""
    files = files_under(path)
    buffer = memoryview(torch.empty(sum(os.path.getsize(f) for f in files), dtype=torch.uint8).numpy())
    at = 0
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            size, done = os.fstat(fd).st_size, 0
            while done < size:
                done += os.preadv(fd, [buffer[at + done : at + min(size, done + READ_BYTES)]], done)
            at += size
        finally:
            os.close(fd)


def restart_seconds(params_m: float, method: str, path: str, cold: bool) -> float:
    if cold:
        evict_from_page_cache(path)
    started = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", RESTART, os.path.dirname(os.path.abspath(__file__)),
                            str(params_m), method, path], capture_output=True, text=True, check=True)
    assert "FIRST_STEP" in child.stdout, child.stderr
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=25.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warm", action="store_true", help="leave the files in the page cache")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = parser.parse_args()
    w = Workload(params_m=args.params_m)
    model, opt, state = trained(w)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        with lazyckpt.LazyCheckpointer(os.path.join(root, "lazy")) as ckpt:
            lazy_path = ckpt.save(state, step=1, optimizers=[opt]).wait()
        pt_dir = os.path.join(root, "pt")
        os.makedirs(pt_dir)
        torch.save(state, os.path.join(pt_dir, "state.pt"))
        pt_path = os.path.join(pt_dir, "state.pt")

        def lazy_resume() -> None:
            loaded = lazyckpt.load(lazy_path)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])

        def torch_resume() -> None:
            loaded = torch.load(pt_path, weights_only=True)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])

        timed = {
            "raw_read": (lazy_path, lambda: raw_read(lazy_path)),
            "lazyckpt_load": (lazy_path, lambda: lazyckpt.load(lazy_path)),
            "lazyckpt_load_no_verify": (lazy_path, lambda: lazyckpt.load(lazy_path, verify=False)),
            "lazyckpt_resume": (lazy_path, lazy_resume),
            "torch_load_resume": (pt_dir, torch_resume),
        }
        seconds: dict[str, list[float]] = {name: [] for name in [*timed, "restart_lazyckpt", "restart_torch"]}
        for _ in range(args.repeats):
            for name, (path, fn) in timed.items():
                if not args.warm:
                    evict_from_page_cache(path)
                started = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - started)
            seconds["restart_lazyckpt"].append(restart_seconds(args.params_m, "lazyckpt", lazy_path, not args.warm))
            seconds["restart_torch"].append(restart_seconds(args.params_m, "torch", pt_path, not args.warm))
        result = {name: round(median(values), 3) for name, values in seconds.items()}
        result["load_over_raw_read"] = round(result["lazyckpt_load"] / result["raw_read"], 2)
        result["state_mib"] = round(sum(os.path.getsize(f) for f in files_under(lazy_path)) / MiB, 1)
    print(json.dumps({"cold": not args.warm, "threads": torch.get_num_threads(), "repeats": args.repeats, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
