"""The public surface: short names re-exported from their defining modules."""

from __future__ import annotations

import subprocess
import sys

import lazyckpt
from lazyckpt import engine
from lazyckpt.read import load as loading
from lazyckpt.tree import encode as state


def test_exports_are_the_original_objects():
    assert lazyckpt.LazyCheckpointer is engine.LazyCheckpointer
    assert lazyckpt.load is loading.load and lazyckpt.latest is loading.latest and lazyckpt.verify is loading.verify
    assert lazyckpt.Deferred is state.Deferred
    for name in lazyckpt.__all__:
        if name not in ("LazyCheckpoint", "LazyCheckpointHook"):
            assert getattr(lazyckpt, name) is not None, name


def test_importing_the_core_does_not_import_lightning_accelerate_or_triton():
    code = "import sys, lazyckpt; print(sorted(m for m in ('lightning','accelerate','triton') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
