"""The random state a resumed run needs: the global RNGs and the generators that shuffle its data loaders.

:func:`capture_rng_state` and :func:`restore_rng_state` (``lazyckpt.capture_rng_state``) take and put back every
generator a training loop depends on, as a plain tree lazyckpt stores without pickle. One way to find a loader's
generators serves every integration, and the captured tree holds only tensors and
plain values, so a Lightning checkpoint exported from it loads under ``torch.load(weights_only=True)``.
:class:`ResumedRng` holds a loaded checkpoint's state until the run's loaders exist to restore it into;
:class:`ContinuedEpoch` undoes the one draw a loader resumed mid-epoch takes that the uninterrupted run took before.

Example:
    >>> state = capture_rng_state()
    >>> restore_rng_state(state)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

# Where a data loader keeps the generators its order depends on: its own, its sampler's (a BatchSampler used as
# the sampler wraps the real one), its batch sampler's sampler. Accelerate's prepared loaders add one generator
# they synchronize across processes.
_HOLDERS: tuple[tuple[str, Callable[[Any], Any]], ...] = (
    ("loader", lambda dl: dl),
    ("sampler", lambda dl: getattr(dl, "sampler", None)),
    ("sampler.sampler", lambda dl: getattr(getattr(dl, "sampler", None), "sampler", None)),
    ("batch_sampler.sampler", lambda dl: getattr(getattr(dl, "batch_sampler", None), "sampler", None)),
)
_ATTRIBUTES = ("generator", "synchronized_generator")


def capture_rng_state(generators: dict[str, torch.Generator] | None = None) -> dict[str, Any]:
    """The states of python ``random``, numpy, torch (CPU and every CUDA device) and named extra generators.

    Args:
        generators: extra ``torch.Generator`` objects to capture (e.g. a sampler's), by name.
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generators:
        state["generators"] = {name: gen.get_state() for name, gen in generators.items()}
    return state


def restore_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator] | None = None) -> None:
    """Restore what :func:`capture_rng_state` captured (CUDA states only where CUDA is present)."""
    random.setstate(_as_python_state(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu().clone())  # a view of a larger buffer crashes torch
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    for name, gen in (generators or {}).items():
        saved = state.get("generators", {}).get(name)
        if saved is None:
            raise KeyError(f"the checkpoint holds no state for generator {name!r}; saved: "
                           f"{sorted(state.get('generators', {}))}")
        gen.set_state(saved.cpu())


def _as_python_state(value: Any) -> tuple:
    # random.setstate insists on tuples all the way down; be lenient with lists from older encodings.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


def find_generators(loaders: Sequence[Any], prefix: str) -> dict[str, torch.Generator]:
    """The distinct ``torch.Generator`` objects behind ``loaders``, by a stable name (``"train[0].sampler"``)."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()
    for index, loader in enumerate(loaders):
        for where, holder_of in _HOLDERS:
            holder = holder_of(loader)
            for attribute in _ATTRIBUTES:
                gen = getattr(holder, attribute, None)
                if isinstance(gen, torch.Generator) and id(gen) not in seen:
                    seen.add(id(gen))
                    suffix = "" if attribute == "generator" else f".{attribute}"
                    found[f"{prefix}[{index}].{where}{suffix}"] = gen
    return found


def capture_rng(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    """:func:`lazyckpt.capture_rng_state`, with numpy's key array as an int64 tensor (``weights_only``-safe)."""
    state = capture_rng_state(generators)
    name, keys, pos, has_gauss, cached = state["numpy"]
    state["numpy"] = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    return state


def restore_rng(state: dict[str, Any], generators: dict[str, torch.Generator]) -> list[str]:
    """Restore what :func:`capture_rng` captured (also numpy's keys stored as an array); generators the
    checkpoint does not hold keep their state. Returns the names of the generators restored."""
    name, keys, pos, has_gauss, cached = state["numpy"]
    state = {**state, "numpy": (name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, cached)}
    saved = state.get("generators") or {}
    common = {k: g for k, g in generators.items() if k in saved}
    restore_rng_state(state, common)
    return sorted(common)


class ResumedRng:
    """The RNG state a loaded checkpoint carries, kept from the load until the run can restore it (a framework may
    load the checkpoint before it creates the loaders whose generators it restores), then restored once."""

    def __init__(self) -> None:
        self._state: dict[str, Any] | None = None

    def loaded(self, extra: Any) -> None:
        """Keep the ``"rng"`` entry of a checkpoint's per-rank extra (a checkpoint without one: nothing to restore)."""
        self._state = extra.get("rng") if isinstance(extra, dict) else None

    def restore(self, generators: Callable[[], dict[str, torch.Generator]]) -> bool:
        """Restore the kept state, with the loaders' ``generators()``, and forget it; False when none was kept."""
        if self._state is None:
            return False
        state, self._state = self._state, None
        restore_rng(state, generators())
        return True


class ContinuedEpoch:
    """Undo the draw from torch's global RNG that a run resumed mid-epoch makes and the uninterrupted run did not.

    torch's ``DataLoader`` draws its iterator's base seed from the global RNG (a loader without a ``generator``)
    when an iterator is created: the uninterrupted run did so when the epoch began, before the checkpoint; the
    resumed run does it again when it iterates the rest of the epoch, after the restore, so every later draw
    (dropout) would be shifted by one. :meth:`arm` at the restore notes the state after exactly that one draw;
    :meth:`settle` at the first forward puts the restored state back when that, and nothing else, was drawn
    since (anything else: it leaves the state alone).
    """

    def __init__(self) -> None:
        self._states: tuple[torch.Tensor, torch.Tensor] | None = None

    def arm(self) -> None:
        """Right after restoring the RNG states of a checkpoint taken mid-epoch."""
        restored = torch.get_rng_state()
        torch.empty((), dtype=torch.int64).random_()  # what _BaseDataLoaderIter.__init__ draws
        self._states = (restored, torch.get_rng_state())
        torch.set_rng_state(restored)

    def settle(self) -> bool:
        """At the first forward after the restore; True when it put the restored state back."""
        if self._states is None:
            return False
        (restored, after_one_draw), self._states = self._states, None
        if not torch.equal(torch.get_rng_state(), after_one_draw):
            return False
        torch.set_rng_state(restored)
        return True
