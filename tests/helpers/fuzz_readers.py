"""Every reader of a checkpoint run on mutated copies of a real 2-rank FSDP2 checkpoint (:mod:`helpers.mutations`),
each read under a watchdog, and each outcome classified: the same data as the untouched checkpoint gives that
reader, a refusal by an exception of lazyckpt's own (through DCP: DCP's ``CheckpointException`` wrapping only
such exceptions), or a violation (other data, a foreign exception, a hang).

    python tests/helpers/fuzz_readers.py --cases 5000 --seed 1     # a long run: one JSON line of counts

What "verify and load refuse the same inputs" means here (:func:`disagreement`): ``verify`` checks every rank and
``load(rank=r)`` reads rank ``r``'s file and every block of the global view, so ``verify`` refuses a checkpoint
iff ``load`` of some rank refuses it; ``lazyckpt verify`` says what ``verify`` says; ``load_into`` and the DCP reader
read part of a checkpoint (one rank's tree), so they may accept what ``verify`` refuses, never refuse what it
accepts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers.*

import lazyckpt  # noqa: E402
import lazyckpt.cli  # noqa: E402
import lazyckpt.errors  # noqa: E402
from helpers.mutations import draw, read_docs, write_case  # noqa: E402

OWN_ERRORS = tuple(v for v in vars(lazyckpt.errors).values()
                   if isinstance(v, type) and issubclass(v, BaseException) and v.__module__ == "lazyckpt.errors")
LOADS = ("load rank 0", "load rank 1")
PARTIAL = ("load_into", "dcp")
VERIFIERS = ("verify", "lazyckpt verify")
READERS = (*LOADS, *PARTIAL, *VERIFIERS)
WATCHDOG_S = 20.0
"""A read that takes longer is a hang (each takes milliseconds)."""


def save_fsdp2(rank: int, world_size: int, dirpath: str) -> None:
    """One rank's save of a tiny model under FSDP2 ``fully_shard`` (DTensor ``Shard(0)`` parameters, uneven and
    empty shards: 6, 3 and 1 rows over 2 ranks) with its AdamW state (sharded moments, replicated 0-dim steps),
    a replicated plain tensor, plain values and a ``PerRank`` value."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3), torch.nn.Linear(3, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, [opt])
    state = {"model": msd, "optim": osd, "table": torch.arange(1, 11), "step": 1, "extra": _extra(),
             "rank": lazyckpt.PerRank({"seed": rank, "rng": torch.full((3,), rank + 1, dtype=torch.int32),
                                       "pair": (torch.full((2,), rank + 1.5), rank)})}
    _make_distinct(state)
    with lazyckpt.LazyCheckpointer(dirpath) as ckpt:
        ckpt.save(state, step=1).wait()


@dataclass
class Cell:
    w: torch.Tensor
    n: int


def _extra() -> dict[Any, Any]:
    """Tensors at key paths of every kind a tree tracks (docs/FORMAT.md rule 21): list and tuple indices, int and
    tuple dict keys, a dataclass's fields, a Namespace's, a numpy array; a DCP target holds only :data:`DCP_KEYS`."""
    ones = torch.ones(2)
    return {"list": [ones, 3, torch.ones(3)], 7: torch.ones(2), (1, "x"): torch.ones(2), "cell": Cell(ones.clone(), 1),
            "tuple": (torch.ones(2), "x"), "nested": [{"k": (torch.ones(2),)}], "array": np.arange(1.0, 4.0),
            "ns": argparse.Namespace(w=torch.ones(2))}


DCP_KEYS = ("list", 7, (1, "x"), "cell")
"""The extra values DCP loads as tensors (it takes a tuple, a numpy array or a Namespace as one opaque value, which
lazyckpt's DCP reader refuses when it holds a tensor)."""


def _make_distinct(state: Any) -> None:
    """Every tensor of ``state`` made non-zero and unlike any other (``+ 100 * n``, the same on every rank), so a
    reference moved to another tensor, or a target left unwritten, never reads as the same data."""
    stack, n = [state], 0
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            n += 1
            local = value.to_local() if hasattr(value, "to_local") else value
            with torch.no_grad():
                local.add_(100 * n)
        elif isinstance(value, dict):
            stack.extend(reversed(value.values()))
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
        elif isinstance(value, (Cell, argparse.Namespace)):
            stack.extend(reversed(vars(value).values()))


class Hang(BaseException):
    """A read ran past :data:`WATCHDOG_S`."""


@contextlib.contextmanager
def watchdog(seconds: float):
    """Raise :class:`Hang` in this (the main) thread if the block runs longer than ``seconds``."""
    def expire(signum, frame):
        raise Hang(f"no result after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _sentinel(value: Any) -> Any:
    """A fresh target of ``value``'s layout: every tensor (and numpy array) filled with NaN, or -7 for ints, which
    no saved value holds, so a position a reader leaves unwritten never looks the same; other values as they are."""
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, math.nan if value.is_floating_point() else -7)
    if isinstance(value, np.ndarray):
        return np.full_like(value, math.nan if value.dtype.kind == "f" else -7)
    if isinstance(value, dict):
        return {k: _sentinel(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_sentinel(v) for v in value)
    if isinstance(value, argparse.Namespace):
        return argparse.Namespace(**_sentinel(vars(value)))
    return value


def _dcp_load(path: str, template: dict[str, Any]) -> Any:
    import torch.distributed.checkpoint as dcp

    from lazyckpt.interop.dcp import StorageReader

    state = _sentinel({k: v for k, v in template.items() if k not in ("rank", "extra")})  # no PerRank tensor
    state["extra"] = _sentinel({k: template["extra"][k] for k in DCP_KEYS})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... a single process"
        dcp.load(state, storage_reader=StorageReader(path), no_dist=True)
    return state


def _cli_verify(path: str) -> str:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = lazyckpt.cli.main(["verify", path])
    if code != 0:
        raise CliRefusal(f"exit status {code}: {err.getvalue().strip()[:300]}")
    return "ok"


class CliRefusal(Exception):
    """``lazyckpt verify`` exited 1 (it prints lazyckpt's errors and exits 1: a refusal)."""


def readers(template: Any) -> dict[str, Callable[[str], Any]]:
    """Each reader by name; ``template`` is what ``load`` of rank 0 reads from the untouched checkpoint (the
    layout of the targets ``load_into`` and DCP fill)."""
    def verify(path: str) -> str:
        lazyckpt.verify(path)
        return "ok"

    return {"load rank 0": lambda path: lazyckpt.load(path, rank=0),
            "load rank 1": lambda path: lazyckpt.load(path, rank=1),
            "load_into": lambda path: lazyckpt.load_into(path, _sentinel(template), rank=0),
            "dcp": lambda path: _dcp_load(path, template),
            "verify": verify, "lazyckpt verify": _cli_verify}


@dataclass(frozen=True)
class Outcome:
    kind: str
    """``same``, ``refused``, or a violation: ``wrong`` (other data), ``foreign`` (another exception), ``hang``."""
    detail: str = ""
    """The refusing error's class, or what went wrong."""


def outcome(read: Callable[[str], Any], path: str, expected: Any) -> Outcome:
    try:
        with watchdog(WATCHDOG_S):
            got = read(path)
    except Hang as e:
        return Outcome("hang", str(e))
    except CliRefusal:
        return Outcome("refused", "exit 1")
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - classified: lazyckpt's own refusals, or a violation
        return _classify(e)
    return Outcome("same") if same(got, expected) else Outcome("wrong", "returned other data than the untouched "
                                                                       "checkpoint, without an error")


def _classify(error: BaseException) -> Outcome:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):  # DCP wraps what a storage reader raises, per rank
        inner = [exc for exc, _ in error.failures.values()]
        bad = [exc for exc in inner if not isinstance(exc, OWN_ERRORS)]
        if any(isinstance(exc, Hang) for exc in inner):
            return Outcome("hang", "inside DCP")
        if bad or not inner:
            return Outcome("foreign", f"DCP wrapped {bad[0] if bad else 'nothing'!r}")
        return Outcome("refused", type(inner[0]).__name__)
    if isinstance(error, OWN_ERRORS):
        return Outcome("refused", type(error).__name__)
    return Outcome("foreign", f"{type(error).__name__}: {str(error)[:300]}")


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types: tensors of the same dtype, shape and bits; NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, argparse.Namespace):
        return same(vars(a), vars(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def disagreement(outcomes: dict[str, Outcome]) -> str | None:
    """What breaks "verify and load refuse the same inputs" in one case's outcomes (the module docstring), or
    None."""
    refused = {name for name, o in outcomes.items() if o.kind == "refused"}
    if ("verify" in refused) != bool(refused & set(LOADS)):
        return "verify and the loads of every rank disagree"
    if ("verify" in refused) != ("lazyckpt verify" in refused):
        return "verify and `lazyckpt verify` disagree"
    if refused & set(PARTIAL) and "verify" not in refused:
        return "a partial reader refused what verify accepts"
    return None


class Fuzz:
    """The untouched checkpoint at ``template`` and what each reader reads from it."""

    def __init__(self, template: str) -> None:
        self.template = template
        self.docs = read_docs(template)
        self.readers = readers(lazyckpt.load(template, rank=0))
        self.expected = {name: read(template) for name, read in self.readers.items()}

    def run(self, cases: int, seed: int, workdir: str) -> tuple[Counter, list[str]]:
        """``cases`` mutations through every reader: the outcome counts and every violation, in words."""
        counts: Counter = Counter()
        violations = []
        for n, (mutation, docs) in enumerate(draw(self.docs, cases, seed)):
            path = os.path.join(workdir, f"case-{n}", os.path.basename(self.template))
            write_case(self.template, mutation, docs, path)
            outcomes = {name: outcome(read, path, self.expected[name]) for name, read in self.readers.items()}
            shutil.rmtree(os.path.dirname(path))
            counts["cases"] += 1
            counts[f"{mutation.family}: verify {outcomes['verify'].kind}"] += 1
            counts.update(f"{name}: {o.kind}" + (f" ({o.detail})" if o.kind == "refused" else "")
                          for name, o in outcomes.items())
            problems = [f"{name}: {o.kind}: {o.detail}" for name, o in outcomes.items()
                        if o.kind not in ("same", "refused")]
            agreement = disagreement(outcomes)
            if agreement:
                problems.append(f"{agreement}: " + ", ".join(f"{k} {o.kind}" for k, o in outcomes.items()))
            if problems:
                violations.append(f"case {n} (seed {seed}, {mutation.family}): {mutation.what}:\n  "
                                  + "\n  ".join(problems))
        return counts, violations


def main(argv: list[str] | None = None) -> int:
    from helpers.distributed import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=600)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        run_ranks(save_fsdp2, 2, os.path.join(workdir, "ckpt"))
        started = time.monotonic()
        counts, violations = Fuzz(lazyckpt.latest(os.path.join(workdir, "ckpt"))).run(args.cases, args.seed,
                                                                                       workdir)
    print("\n".join(violations))
    print(json.dumps({**counts, "violations": len(violations), "seconds": round(time.monotonic() - started, 1)}))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
