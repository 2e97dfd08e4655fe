"""The code in README.md and docs/ stays true: every ```python block runs, in order, in one namespace per file.

Names an example leaves to the reader (``model``, ``optimizer``, ``train_dl`` ...) come from a small setup per file.
A block preceded by ``<!-- docs-check: signatures -->`` lists call signatures instead of running: every keyword
it names must exist, and a call written with ``*`` must list every keyword the real signature has.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import lazyckpt
from lazyckpt.config import CheckpointConfig
from lazyckpt.pending import PendingCheckpoint

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"(?P<marker><!-- docs-check: (?P<kind>\w+) -->\n)?```python\n(?P<code>.*?)```", re.S)


def python_blocks(path: Path) -> list[tuple[str, str, int]]:
    """``(kind, code, line)`` for each python block; kind is ``"run"`` unless a marker says otherwise."""
    text = path.read_text()
    return [(m["kind"] or "run", m["code"], text.count("\n", 0, m.start("code")) + 1) for m in FENCE.finditer(text)]


def documented_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [f for f in files if python_blocks(f)]


# --- the names each page leaves to the reader --------------------------------------------------------------------

def _plain_loop() -> dict:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = iter([torch.randn(2, 8) for _ in range(100)])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    return {"model": model, "optimizer": optimizer, "batches": batches, "scheduler": scheduler, "num_steps": 100}


class _LossModel(nn.Module):
    """A model called as ``model(**batch).loss``, like a Hugging Face one."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x, y):
        return types.SimpleNamespace(loss=nn.functional.mse_loss(self.linear(x).squeeze(-1), y))


def _accelerate_loop() -> dict:
    torch.manual_seed(0)
    model = _LossModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [{"x": torch.randn(8), "y": torch.randn(())} for _ in range(16)]
    return {"model": model, "opt": opt, "train_dl": DataLoader(data, batch_size=4),
            "sched": torch.optim.lr_scheduler.StepLR(opt, step_size=2), "num_epochs": 2}


def _lightning_module() -> dict:
    from helpers.lightning_run import make_module_class, namespace

    module_class = make_module_class(namespace()[0])
    torch.manual_seed(0)
    return {"model": module_class(samples=800), "MyModule": module_class}  # 100 steps per epoch


SETUPS = {"README.md": _plain_loop, "accelerate.md": _accelerate_loop, "lightning.md": _lightning_module,
          "rollback.md": _accelerate_loop}


# --- signature listings --------------------------------------------------------------------------------------------

def _documented_callables() -> dict:
    config_fields = {f.name for f in dataclasses.fields(CheckpointConfig)}
    engine_init = set(inspect.signature(lazyckpt.LazyCheckpointer).parameters) - {"options"}
    return {
        "lazyckpt.LazyCheckpointer": engine_init | config_fields,
        "ckpt.save": _parameters(lazyckpt.LazyCheckpointer.save),
        "pending.wait": _parameters(PendingCheckpoint.wait),
        **{f"lazyckpt.{name}": _parameters(getattr(lazyckpt, name))
           for name in ("load", "latest", "verify", "checkpoint_step")},
    }


def _parameters(fn) -> set[str]:
    return set(inspect.signature(fn).parameters) - {"self"}


def _calls(code: str):
    """``(callee, argument text)`` for each ``name.attr(...)`` call, with balanced parentheses."""
    code = re.sub(r"#[^\n]*", "", code)
    for match in re.finditer(r"([\w.]+)\(", code):
        depth, end = 1, match.end()
        while depth and end < len(code):
            depth += {"(": 1, ")": -1}.get(code[end], 0)
            end += 1
        yield match[1], code[match.end():end - 1]


def _listed_names(arguments: str) -> list[str]:
    """The parameter names a listing shows: the leading name of each top-level argument (``*`` excluded)."""
    pieces, depth, current = [], 0, ""
    for char in arguments:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            pieces, current = pieces + [current], ""
        else:
            current += char
    names = (re.match(r"\s*(\w+)", piece) for piece in pieces + [current])
    return [name[1] for name in names if name]


def check_signatures(code: str) -> None:
    known = _documented_callables()
    for callee, arguments in _calls(code):
        if callee not in known:
            continue
        listed = set(_listed_names(arguments))
        unknown = listed - known[callee]
        assert not unknown, f"{callee} documents parameters it does not take: {sorted(unknown)}"
        if re.search(r"(^|,)\s*\*\s*,", arguments):
            missing = known[callee] - listed
            assert not missing, f"{callee} is listed with '*' but misses parameters: {sorted(missing)}"


# --- the test ------------------------------------------------------------------------------------------------------

def test_documented_python_examples_run_one_after_another_in_one_folder(tmp_path, monkeypatch):
    """Every documented example runs, and a user trying the README and then each guide in the same folder sees none
    of them trip over another's files (each writes a directory of its own under ``runs/``)."""
    monkeypatch.chdir(tmp_path)
    for path in documented_files():
        namespace = SETUPS.get(path.name, dict)()
        for kind, code, line in python_blocks(path):
            if kind == "signatures":
                check_signatures(code)
                continue
            assert kind == "run", f"{path.name}:{line}: unknown docs-check marker {kind!r}"
            exec(compile(code, f"{path.name}:{line}", "exec"), namespace)


def test_ci_runs_the_readme_commands_as_written():
    """``.ci/run`` takes both commands from the README, so the README cannot drift from what CI proves."""
    import runpy

    command = runpy.run_path(str(ROOT / ".ci" / "readme_command.py"))["command"]
    main, tests = command("main"), command("test")
    assert main.startswith("python -m pip install torch==2.13.0") and main.endswith("lightning_finetune.py --demo")
    assert tests.startswith("python -m pip install -q torch==2.13.0") and tests.endswith("&& python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "readme_command.py main" in ci and "readme_command.py test" in ci
