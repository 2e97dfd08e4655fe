"""Capture and restore every random number generator a training loop depends on.

The captured state is a plain tree (tensors, ints, tuples, numpy arrays) that lazyckpt stores without pickle.

Example:
    >>> state = capture_rng_state()
    >>> restore_rng_state(state)
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


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
