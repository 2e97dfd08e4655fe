"""What reading a tree costs beside parsing its JSON: the every-tensor-referenced check and ``unflatten``, for a
200,000-tensor state (an optimizer state of 50,000 parameters and a model of 50,000 tensors) and a list of
500,000 ints; and ``load``/``verify`` of a saved checkpoint of 20,000 tensors and a 300,000-int list.

Run: ``python benchmarks/tree_reads.py`` (best of three; figures in seconds); ``--scale 0.01`` shrinks every count
(a smoke run). Every tensor leaf is a tensor of its own: one tensor under many leaves would be stored once and
measure aliases (docs/FORMAT.md rule 22) instead.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

import lazyckpt
from lazyckpt.tree.decode import check_references, unflatten
from lazyckpt.tree.encode import flatten


def _best(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def trees(scale: float) -> None:
    n, ints = max(1, int(50_000 * scale)), max(1, int(500_000 * scale))
    optim = {"state": {i: {"exp_avg": torch.zeros(()), "exp_avg_sq": torch.zeros(()), "step": torch.zeros(())}
                       for i in range(n)}}
    for name, state in [(f"{4 * n} tensors", {"optim": optim, "model": {f"l{i}.w": torch.zeros(()) for i in range(n)}}),
                        (f"{ints}-int list", {"idx": list(range(ints)), "w": torch.zeros(())})]:
        flat = flatten(state)
        assert not flat.aliases, "every leaf its own tensor"
        stored, raw = dict(flat.tensors), json.dumps(flat.tree)
        print(f"{name}: json.loads {_best(lambda: json.loads(raw)):.2f}, check_references "
              f"{_best(lambda: check_references(flat.tree, stored, 'w')):.2f}, unflatten "
              f"{_best(lambda: unflatten(flat.tree, stored, 'w')):.2f}")


def checkpoint(scale: float) -> None:
    with tempfile.TemporaryDirectory() as d:
        with lazyckpt.LazyCheckpointer(d) as ckpt:
            state = {"idx": list(range(max(1, int(300_000 * scale)))),
                     "model": {f"l{i}.w": torch.zeros(2) for i in range(max(1, int(20_000 * scale)))}}
            path = ckpt.save(state, step=1).wait()
        print(f"checkpoint: load {_best(lambda: lazyckpt.load(path)):.2f}, verify "
              f"{_best(lambda: lazyckpt.verify(path)):.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every count by this (default 1)")
    args = parser.parse_args(argv)
    if args.scale <= 0:
        parser.error(f"--scale={args.scale}: must be > 0 (e.g. 0.01 for a smoke run)")
    trees(args.scale)
    checkpoint(args.scale)


if __name__ == "__main__":
    main()
