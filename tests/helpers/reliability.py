"""The reliability suite's engines, shared by the CI tests (small fixed-seed runs) and long runs from the shell:

    python tests/helpers/reliability.py fuzz --fuzz-cases 20000 [--seed 1]    structure-aware reader fuzzing
    python tests/helpers/reliability.py corrupt --flips-per-file 5000          flip bytes in every file of a checkpoint
    python tests/helpers/reliability.py kill --kills 200 [--seed 1]            SIGKILL a saving process at random points
    python tests/helpers/reliability.py soak --checkpoints 5000                save+load in a loop; fds, threads, objects flat

Each prints one summary line (the figures docs/reliability.md records) and exits 1 on the first violation.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers.*

import lazyckpt  # noqa: E402
import lazyckpt.read.reader  # noqa: E402
from helpers.forge import edit_manifest, read_json, reseal, split_tensor_file, write_tensor_file  # noqa: E402
from helpers.soak import soak  # noqa: E402
from lazyckpt.format.files import MANIFEST  # noqa: E402
from lazyckpt.format.manifest import MAX_MANIFEST_BYTES  # noqa: E402

REFUSALS = (lazyckpt.CheckpointFormatError, lazyckpt.CheckpointNotFoundError)


# --- a checkpoint that uses every kind of tree node --------------------------------------------------------

def rich_state(step: int) -> dict[str, Any]:
    import argparse as ap
    import pathlib

    generator = torch.Generator().manual_seed(step)
    return {
        "model": {"0.weight": torch.randn(64, 33, generator=generator), "0.bias": torch.zeros(33),
                  "norm": torch.ones(7, dtype=torch.bfloat16), "big": torch.randn(300_000, generator=generator),
                  "empty": torch.empty(0, 3), "mask": torch.tensor([True, False])},
        "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "meta": {"step": step, "ratio": float("nan"), "pair": (1, "x"), "tags": {"a", "b"}, "raw": b"\x00\x01",
                 "z": 1 + 2j, "np": np.float32(0.5), "array": np.arange(4), "dtype": torch.float16,
                 "device": torch.device("cpu"), "path": pathlib.Path("runs/x"), "ns": ap.Namespace(a=1),
                 "weird/key %": None},
        "inline": lazyckpt.Deferred(lambda: {"t": torch.arange(3)}),
    }


def make_template(root: str, world_size: int = 2) -> str:
    """A committed checkpoint of ``world_size`` ranks under ``root``; returns its path."""
    ranks = [lazyckpt.LazyCheckpointer(root, rank=r, world_size=world_size) for r in range(world_size)]
    pending = []
    for ckpt in ranks:
        pending.append(ckpt.save(rich_state(3), step=3))
        ckpt.wait_staged()
    path = [p.wait() for p in pending][0]
    for ckpt in ranks:
        ckpt.close()
    return path


# --- structure-aware fuzzing --------------------------------------------------------------------------------

HOSTILE_VALUES: list[Any] = [
    -1, 0, 1, 2**63, 2**64 + 1, 1e308, -0.0, "", "x", "../../etc/passwd", "/etc/passwd", "..", None, True, [], {},
    [[[[[]]]]], {"__reduce__": ["os.system", ["id"]]}, {"$tensor": "../../etc/passwd"}, {"$torch_dtype": "onnx"},
    {"$np_scalar": {"dtype": "O", "value": 1}}, {"$inline": {"dtype": "F32", "shape": [2**40], "data": ""}},
    {"$ndarray": {"$inline": {"dtype": "BF16", "shape": [1], "data": "AAA="}}}, {"$float": "nan()"},
    {"$dict": [[[1], 2]]}, {"$set": [[1]]}, {"$complex": ["1", 2]}, {"$bytes": "***"}, "F32", "FB2", [0, 2**62],
    {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "0" * 16, "f" * 64,
]


def _json_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a node of a JSON document (the root included)."""
    paths = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            paths += _json_paths(value, prefix + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            paths += _json_paths(value, prefix + (index,))
    return paths


def mutate_json(doc: Any, rng: random.Random) -> Any:
    """One structural mutation of a JSON document: replace, delete, duplicate, rename or add at a random node."""
    paths = [p for p in _json_paths(doc) if p]
    if not paths:
        return rng.choice(HOSTILE_VALUES)
    path = rng.choice(paths)
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    last, op = path[-1], rng.randrange(5)
    if op == 0:
        parent[last] = copy.deepcopy(rng.choice(HOSTILE_VALUES))
    elif op == 1:
        del parent[last]
    elif op == 2:  # duplicate a subtree next to itself
        if isinstance(parent, list):
            parent.append(copy.deepcopy(parent[last]))
        else:
            parent[f"{last}_"] = copy.deepcopy(parent[last])
    elif op == 3 and isinstance(parent, dict):
        parent[_flip_char(str(last), rng)] = parent.pop(last)
    else:
        target = parent[last]
        if isinstance(target, dict):
            target[rng.choice(["extra", "__metadata__", "$tensor", "tree", "ranks"])] = rng.choice(HOSTILE_VALUES)
        elif isinstance(target, list):
            target.insert(rng.randrange(len(target) + 1), copy.deepcopy(rng.choice(HOSTILE_VALUES)))
        elif isinstance(target, str):
            parent[last] = _flip_char(target, rng)
        elif isinstance(target, int) and not isinstance(target, bool):
            parent[last] = target + rng.choice([-1, 1, 8, -8, 4096])
    return doc


def _flip_char(text: str, rng: random.Random) -> str:
    if not text:
        return "x"
    i = rng.randrange(len(text))
    return text[:i] + chr((ord(text[i]) + rng.randrange(1, 5)) % 128 or 65) + text[i + 1:]


def mutate_checkpoint(path: str, rng: random.Random) -> tuple[str, bool]:
    """Apply one random mutation; returns (a description, whether the bytes were resealed afterwards)."""
    top = read_json(os.path.join(path, MANIFEST))
    names = [MANIFEST, *top["ranks"]]
    files = sorted(os.listdir(path))
    kind = rng.choice(["manifest", "manifest", "header", "header", "bytes", "filesystem"])
    if kind == "manifest":
        name = rng.choice(names)
        edit_manifest(os.path.join(path, name), lambda d: mutate_json(d, rng), seal=False)
        what = f"manifest {name}"
    elif kind == "header":
        name = rng.choice([f for f in files if f.endswith(".safetensors")])
        header, data = split_tensor_file(os.path.join(path, name))
        header = mutate_json(header, rng)
        write_tensor_file(os.path.join(path, name), header, data, pad_to=4088 if rng.random() < 0.5 else None)
        what = f"header {name}"
    elif kind == "bytes":
        name = rng.choice(files)
        _mutate_bytes(os.path.join(path, name), rng)
        return f"bytes of {name}", False
    else:
        return _mutate_filesystem(path, rng.choice(files), rng), False
    if rng.random() < 0.75:
        try:
            reseal(path)
            return what + " (resealed)", True
        except (ValueError, KeyError, TypeError, OSError, AttributeError, IndexError, RecursionError):
            pass
    return what, False


def _mutate_bytes(file: str, rng: random.Random) -> None:
    size = os.path.getsize(file)
    op = rng.randrange(4)
    with open(file, "r+b") as f:
        if op == 0 and size:
            at = rng.randrange(size)
            f.seek(at)
            old = f.read(1)
            f.seek(at)
            f.write(bytes([old[0] ^ rng.randrange(1, 256)]))
        elif op == 1:
            f.truncate(rng.randrange(size + 1))
        elif op == 2:
            f.seek(0, os.SEEK_END)
            f.write(rng.randbytes(rng.randrange(1, 64)))
        else:
            f.write(rng.choice([2**64 - 1, 2**40, 0, 7, size]).to_bytes(8, "little"))


def _mutate_filesystem(path: str, name: str, rng: random.Random) -> str:
    full = os.path.join(path, name)
    op = rng.randrange(5)
    os.remove(full)
    if op == 0:
        os.mkfifo(full)
        return f"{name} replaced by a FIFO"
    if op == 1:
        os.symlink("/etc/passwd", full)
        return f"{name} linked outside"
    if op == 2:
        os.mkdir(full)
        return f"{name} replaced by a directory"
    if op == 3:
        with open(full, "wb") as f:
            f.truncate(MAX_MANIFEST_BYTES + 1)
        return f"{name} replaced by a huge sparse file"
    return f"{name} removed"


def load_every_rank(path: str) -> None:
    """``load`` of each rank in turn: what ``verify`` (which checks every rank, in order) must agree with."""
    for rank in range(lazyckpt.read.reader.CheckpointReader(path).world_size):
        lazyckpt.load(path, rank=rank)


def _outcome(fn, path: str) -> tuple[str, str]:
    try:
        fn(path)
        return "ok", ""
    except REFUSALS as e:
        return type(e).__name__, str(e)


def fuzz(cases: int, seed: int, workdir: str) -> dict[str, int]:
    """Run ``cases`` mutations; every one must be refused cleanly or loaded, identically by load and verify,
    and a mutation that was not resealed must always be refused. Raises AssertionError on a violation."""
    template = make_template(os.path.join(workdir, "template"))
    rng = random.Random(seed)
    modules = set(sys.modules)
    counts = {"cases": 0, "refused": 0, "accepted": 0}
    for case in range(cases):
        path = os.path.join(workdir, f"case-{case}", os.path.basename(template))
        shutil.copytree(template, path)
        what, resealed = mutate_checkpoint(path, rng)
        loaded, verified = _outcome(load_every_rank, path), _outcome(lazyckpt.verify, path)
        context = f"case {case} (seed {seed}): {what}: load -> {loaded}, verify -> {verified}"
        assert loaded == verified, f"load and verify disagree; {context}"
        assert resealed or loaded[0] != "ok", f"an unsealed change was not detected; {context}"
        counts["cases"] += 1
        counts["refused" if loaded[0] != "ok" else "accepted"] += 1
        shutil.rmtree(os.path.dirname(path))
    imported = sorted(set(sys.modules) - modules)
    assert not imported, f"reading fuzzed checkpoints imported modules: {imported}"
    return counts


# --- byte flips across every file ---------------------------------------------------------------------------

def corrupt_every_file(path: str, *, per_file: int = 48, seed: int = 0) -> dict[str, int]:
    """Flip one byte at a time (then restore it) at about ``per_file`` offsets of every file (all of a file's
    bytes when it is smaller), spread evenly plus random ones; load and verify must both refuse each flip."""
    rng = random.Random(seed)
    flips = 0
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        size = os.path.getsize(file)
        offsets = range(size) if per_file >= size else sorted(
            {0, size - 1, *rng.sample(range(size), per_file // 2), *range(0, size, max(1, 2 * size // per_file))})
        for offset in offsets:
            with open(file, "r+b") as f:
                f.seek(offset)
                old = f.read(1)
                f.seek(offset)
                f.write(bytes([old[0] ^ rng.randrange(1, 256)]))
            try:
                for reader in (load_every_rank, lazyckpt.verify):
                    outcome = _outcome(reader, path)
                    assert outcome[0] != "ok", f"{reader.__name__} missed a changed byte at {name}:{offset}"
            finally:
                with open(file, "r+b") as f:
                    f.seek(offset)
                    f.write(old)
            flips += 1
    lazyckpt.verify(path)  # every byte restored: valid again
    return {"files": len(os.listdir(path)), "flips": flips}


# --- SIGKILL at random points --------------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys, torch, lazyckpt
    dirpath, first = sys.argv[1], int(sys.argv[2])
    with lazyckpt.LazyCheckpointer(dirpath, keep_last_k=2) as ckpt:
        for step in range(first, first + 1000):
            state = {"w": torch.full((1_500_000,), float(step)), "step": step}
            ckpt.save(state, step=step)
            print("saved", step, flush=True)
            ckpt.wait_staged()
            print("staged", step, flush=True)
""")


def kill_at_random(dirpath: str, kills: int, seed: int) -> dict[str, int]:
    """Start a process saving every step, SIGKILL it after a random number of its progress lines, and check after
    each kill that the newest committed checkpoint loads, verifies and holds exactly its step's state. The next
    process resumes in the same directory (removing what the killed one left) from the step after it."""
    rng = random.Random(seed)
    next_step, survived, mid_write = 1, 0, 0
    for _ in range(kills):
        child = subprocess.Popen([sys.executable, "-c", CHILD, dirpath, str(next_step)], stdout=subprocess.PIPE,
                                 text=True)
        try:
            for _ in range(rng.randrange(1, 12)):
                if not child.stdout.readline():
                    break
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.wait(timeout=120)
            child.stdout.close()
        mid_write += any(n.endswith(".partial") for n in os.listdir(dirpath))
        latest = lazyckpt.latest(dirpath)
        if latest is not None:
            lazyckpt.verify(latest)
            state = lazyckpt.load(latest)
            step = lazyckpt.checkpoint_step(latest)
            assert state["step"] == step and torch.equal(state["w"], torch.full((1_500_000,), float(step))), latest
            next_step = step + 1
        survived += 1
    return {"kills": survived, "landed_mid_save": mid_write, "latest_step": next_step - 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fuzz")
    p.add_argument("--fuzz-cases", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p = sub.add_parser("corrupt")
    p.add_argument("--flips-per-file", type=int, default=48)
    p = sub.add_parser("soak")
    p.add_argument("--checkpoints", type=int, default=1000)
    p.add_argument("--sample-every", type=int, default=100)
    p = sub.add_parser("kill")
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as workdir:
        if args.command == "fuzz":
            result = fuzz(args.fuzz_cases, args.seed, workdir)
        elif args.command == "corrupt":
            result = corrupt_every_file(make_template(workdir), per_file=args.flips_per_file)
        elif args.command == "soak":
            result = soak(workdir, args.checkpoints, sample_every=args.sample_every)
        else:
            result = kill_at_random(workdir, args.kills, args.seed)
    print(json.dumps({"command": args.command, **result, "seconds": round(time.monotonic() - started, 1)}))
    return 1 if result.get("violations") else 0


if __name__ == "__main__":
    sys.exit(main())
