"""What reading a tree costs beside parsing its JSON: the every-tensor-referenced check and ``unflatten``, for a
200,000-tensor state (an optimizer state of 50,000 parameters and a model of 50,000 tensors) and a list of
500,000 ints; and ``load``/``verify`` of a saved checkpoint of 20,000 tensors and a 300,000-int list.

Run: ``python benchmarks/tree_reads.py`` (best of three; figures in seconds).
"""

from __future__ import annotations

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


def trees() -> None:
    t = torch.zeros(())
    optim = {"state": {i: {"exp_avg": t, "exp_avg_sq": t, "step": t} for i in range(50_000)}}
    for name, state in [("200k tensors", {"optim": optim, "model": {f"l{i}.w": t for i in range(50_000)}}),
                        ("500k-int list", {"idx": list(range(500_000)), "w": t})]:
        tree, tensors, _, _ = flatten(state)
        stored, raw = dict(tensors), json.dumps(tree)
        print(f"{name}: json.loads {_best(lambda: json.loads(raw)):.2f}, check_references "
              f"{_best(lambda: check_references(tree, stored, 'w')):.2f}, unflatten "
              f"{_best(lambda: unflatten(tree, stored, 'w')):.2f}")


def checkpoint() -> None:
    with tempfile.TemporaryDirectory() as d:
        with lazyckpt.LazyCheckpointer(d) as ckpt:
            state = {"idx": list(range(300_000)), "model": {f"l{i}.w": torch.zeros(2) for i in range(20_000)}}
            path = ckpt.save(state, step=1).wait()
        print(f"checkpoint: load {_best(lambda: lazyckpt.load(path)):.2f}, verify "
              f"{_best(lambda: lazyckpt.verify(path)):.2f}")


if __name__ == "__main__":
    trees()
    checkpoint()
