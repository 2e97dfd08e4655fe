"""The shape of the code base, checked: the file tree is the pipeline (docs/design.md, "Layout").

Every rule is read off the source with ``ast`` (nothing is imported), so a change that breaks one fails here with
the module and line that broke it:

* imports go downward through the layers of :data:`LAYERS`, with no cycle among lazyckpt's modules (module-level,
  function-level and ``TYPE_CHECKING`` imports all count) nor among ``benchmarks/``;
* a package holds at most 12 modules (``integrations/`` may keep its adapters), ``lazyckpt/`` at most 8 besides
  ``__init__``; a module at most 400 lines, a function at most 60; module names are unique;
* every package ``__init__`` names each of its modules, and so does docs/design.md;
* no private name of another lazyckpt module is imported or read; private torch modules only in ``ranks/`` and
  ``interop/dcp.py``; private attributes of torch, fsspec and the frameworks only where
  :data:`FOREIGN_PRIVATE_ALLOWED` says, framework ones in ``integrations/_compat.py``; every exception class in
  ``errors.py``; no file-system call outside ``storage/``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"lazyckpt": ROOT / "lazyckpt", "lazyckpt.triton_kernels": ROOT / "triton_kernels",
           "lazyckpt.integrations": ROOT / "integrations"}

LAYERS: list[tuple[str, ...]] = [
    ("lazyckpt._version", "lazyckpt.errors", "lazyckpt.threads"),
    ("lazyckpt.storage",),
    ("lazyckpt.config", "lazyckpt.format"),
    ("lazyckpt.tree", "lazyckpt.triton_kernels"),
    ("lazyckpt.ranks",),
    ("lazyckpt.write", "lazyckpt.read"),
    ("lazyckpt.levels", "lazyckpt.interop"),
    ("lazyckpt.pending",),
    ("lazyckpt.engine",),
    ("lazyckpt.policy",),
    ("lazyckpt.integrations", "lazyckpt.cli", "lazyckpt"),
]
"""Each module imports only from its own package or a lower layer: never a sibling of its layer (``write`` and
``read`` never import each other), never upward."""

MAX_ROOT_MODULES, MAX_PACKAGE_MODULES, MAX_MODULE_LINES, MAX_FUNCTION_LINES = 8, 12, 400, 60
SHARED_BASENAMES = {"__init__", "base"}
PRIVATE_TORCH_ALLOWED = ("lazyckpt.ranks", "lazyckpt.interop.dcp")
FILESYSTEM_CALLS = re.compile(
    r"\bos\.path\.(isdir|isfile|exists|lexists|getmtime|getsize|realpath|islink|samefile)\(|"
    r"\bos\.(stat|lstat|makedirs|mkdir|listdir|scandir|remove|unlink|rename|replace|rmdir|open|fsync|symlink|"
    r"readlink|walk|statvfs|chmod|utime|link)\(|\bshutil\.|\btempfile\.|(?<![\w.])open\(|\bFileLock\(")
FOREIGN_PRIVATE_ALLOWED = {
    ("lazyckpt.write.capture", "_version"), ("lazyckpt.write.copier", "_version"),
    # a tensor's version counter: the safety net behind the barrier that the design brief prescribes; no public one
    ("lazyckpt.tree.values", "_indices"), ("lazyckpt.tree.values", "_values"),
    # an uncoalesced COO tensor's own parts (torch.sparse's documented accessors: indices() refuses uncoalesced)
    ("lazyckpt.storage.fsspec", "_strip_protocol"), ("lazyckpt.storage.fsspec", "_parent"),
    # fsspec's AbstractFileSystem classmethods, the path rules of the file system at hand (chained URLs too)
}
"""Private attributes of torch and fsspec read outside ``ranks/``, ``interop/dcp.py`` and ``integrations/_compat.py``,
each with its reason."""


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    text: str
    imports: dict[str, int] = field(default_factory=dict)
    """Imported lazyckpt modules, with the line of the first import of each."""

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rsplit(".", 1)[0]


def _collect() -> dict[str, Module]:
    found = {}
    for prefix, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if prefix == "lazyckpt" and parts[0] in ("triton_kernels", "integrations"):
                continue
            name = ".".join([prefix, *parts[:-1]] + ([] if parts[-1] == "__init__" else [parts[-1]]))
            text = path.read_text()
            found[name] = Module(name, path, ast.parse(text), text)
    for module in found.values():
        module.imports = _imports_of(module, found)
    return found


def _imports_of(module: Module, known: dict[str, Module]) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in ast.walk(module.tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
            if any(f"{base}.{a.name}" in known for a in node.names):
                targets.pop()  # "from package import module": the module, not the package's __init__
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module.name:
                out.setdefault(target, node.lineno)
    return out


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.package.split(".")[: len(module.package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


MODULES = _collect()


def _layer(name: str) -> tuple[int, str]:
    """The layer index of a module and the layer entry (package or module) it belongs to."""
    best = None
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            if (name == entry or name.startswith(entry + ".")) and (best is None or len(entry) > len(best[1])):
                best = (index, entry)
    assert best is not None, f"{name} is in no layer of LAYERS: add it"
    return best


def test_every_module_has_a_layer():
    for name in MODULES:
        _layer(name)


def test_imports_go_down_the_layers():
    wrong = []
    for module in MODULES.values():
        layer, entry = _layer(module.name)
        for target, line in module.imports.items():
            to_layer, to_entry = _layer(target)
            if to_entry == entry or to_layer < layer or entry == "lazyckpt" and module.name == "lazyckpt":
                continue
            wrong.append(f"{module.path.relative_to(ROOT)}:{line} ({entry}, layer {layer}) imports {target} "
                         f"({to_entry}, layer {to_layer})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles_in_lazyckpt():
    cycles = _cycles({name: set(m.imports) for name, m in MODULES.items()})
    assert not cycles, f"import cycles: {cycles}"


def test_no_import_cycles_in_benchmarks():
    folder = ROOT / "benchmarks"
    names = {p.stem for p in folder.glob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.removeprefix("benchmarks.") for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.removeprefix("benchmarks."))
        edges[path.stem] = (imported & names) - {path.stem}
    cycles = _cycles(edges)
    assert not cycles, f"import cycles among benchmarks/: {cycles}"


def _packages() -> dict[str, list[Module]]:
    packages: dict[str, list[Module]] = {}
    for module in MODULES.values():
        if not module.is_package:
            packages.setdefault(module.package, []).append(module)
    return packages


def test_package_sizes():
    packages = _packages()
    root = [m.name for m in packages["lazyckpt"]]
    assert len(root) <= MAX_ROOT_MODULES, f"lazyckpt/ holds {len(root)} modules besides __init__: {root}"
    crowded = {p: len(ms) for p, ms in packages.items()
               if len(ms) > MAX_PACKAGE_MODULES and p not in ("lazyckpt", "lazyckpt.integrations")}
    assert not crowded, f"packages with more than {MAX_PACKAGE_MODULES} modules: {crowded}"


def test_module_and_function_sizes():
    too_long = [f"{m.path.relative_to(ROOT)}: {len(m.text.splitlines())} lines" for m in MODULES.values()
                if len(m.text.splitlines()) > MAX_MODULE_LINES]
    for module in MODULES.values():
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{module.path.relative_to(ROOT)}:{node.lineno} {node.name}(): {length} lines")
    assert not too_long, "too long:\n" + "\n".join(too_long)


def test_module_names_are_unique():
    seen: dict[str, list[str]] = {}
    for module in MODULES.values():
        seen.setdefault(module.path.stem, []).append(str(module.path.relative_to(ROOT)))
    clashes = {stem: paths for stem, paths in seen.items() if len(paths) > 1 and stem not in SHARED_BASENAMES}
    assert not clashes, f"module names used twice: {clashes}"


def test_package_docstrings_name_their_modules():
    missing = []
    for package, members in _packages().items():
        init = MODULES[package]
        doc = ast.get_docstring(init.tree) or ""
        missing += [f"{init.path.relative_to(ROOT)} does not name ``{m.path.stem}``" for m in members
                    if f"``{m.path.stem}``" not in doc]
        if not doc:
            missing.append(f"{init.path.relative_to(ROOT)} has no docstring")
    assert not missing, "\n".join(missing)


def test_design_doc_names_every_module():
    doc = (ROOT / "docs" / "design.md").read_text()
    missing = [m.name for m in MODULES.values() if not m.is_package and f"`{m.path.name}`" not in doc]
    assert not missing, f"docs/design.md does not name: {missing}"


def test_no_private_names_imported_across_modules():
    """A private module of a package (``integrations/_compat.py``) is imported by name; a private name never."""
    wrong = []
    for module in MODULES.values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom) and _absolute(module, node).startswith("lazyckpt"):
                base = _absolute(module, node)
                wrong += [f"{module.path.relative_to(ROOT)}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name.startswith("_") and a.name != "__version__" and f"{base}.{a.name}" not in MODULES]
    assert not wrong, "\n".join(wrong)


def test_private_torch_modules_stay_in_their_rooms():
    private = re.compile(r"\btorch(\.\w+)*\._\w+|\b_get_default_store\b")
    wrong = []
    for module in MODULES.values():
        if module.name.startswith(PRIVATE_TORCH_ALLOWED):
            continue
        for number, line in enumerate(module.text.splitlines(), 1):
            if private.search(line.split("#", 1)[0]):
                wrong.append(f"{module.path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not wrong, "private torch APIs outside ranks/ and interop/dcp.py:\n" + "\n".join(wrong)


def _own_private_attributes(module: Module) -> set[str]:
    """The private attributes a module defines: ``self._x = ...``, and ``_x`` in a class body."""
    own = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_"):
            own.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                own |= {x.id for x in targets if isinstance(x, ast.Name) and x.id.startswith("_")}
                if isinstance(item, (ast.FunctionDef, ast.ClassDef)) and item.name.startswith("_"):
                    own.add(item.name)
    return own


def _foreign_private_accesses(module: Module) -> list[tuple[int, str]]:
    """``obj._x`` where ``obj`` is not ``self``, ``cls`` or ``super()`` and this module does not define ``_x``."""
    own = _own_private_attributes(module)
    found = []
    for node in ast.walk(module.tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls") or node.attr in own:
            continue
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
            continue  # an override of the base class's own method (ModelCheckpoint's are listed in _compat)
        found.append((node.lineno, node.attr))
    return found


def test_private_attributes_of_other_code_stay_in_their_rooms():
    """No module reads another lazyckpt module's private attributes; the private attributes of torch, fsspec and
    the frameworks are read only where :data:`FOREIGN_PRIVATE_ALLOWED` says (framework ones in ``_compat.py``)."""
    ours = set().union(*(_own_private_attributes(m) for m in MODULES.values()))
    wrong = []
    for module in MODULES.values():
        for line, attr in _foreign_private_accesses(module):
            if (module.name, attr) in FOREIGN_PRIVATE_ALLOWED or attr not in ours and module.name.endswith("._compat"):
                continue
            whose = "another lazyckpt module's" if attr in ours else "a foreign"
            wrong.append(f"{module.path.relative_to(ROOT)}:{line} reads {whose} private attribute {attr}")
    assert not wrong, "\n".join(wrong)


def test_exceptions_live_in_errors():
    wrong = []
    for module in MODULES.values():
        if module.name == "lazyckpt.errors":
            continue
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef) and any(_looks_like_exception(b) for b in node.bases):
                wrong.append(f"{module.path.relative_to(ROOT)}:{node.lineno} class {node.name}")
    assert not wrong, "exception classes outside lazyckpt/errors.py:\n" + "\n".join(wrong)


def test_no_module_defines_an_exception_outside_errors_once_imported():
    """The import-time view of the rule above: catches a subclass of one of lazyckpt's own exceptions too."""
    import importlib

    wrong = []
    for name in MODULES:
        if name == "lazyckpt.errors":
            continue
        for value in vars(importlib.import_module(name)).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == name:
                wrong.append(f"{name}.{value.__name__}")
    assert not wrong, f"exception classes outside lazyckpt/errors.py: {wrong}"


def _looks_like_exception(base: ast.expr) -> bool:
    name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
    return name.endswith(("Error", "Exception")) or name in ("LookupError", "BaseException")


def test_errors_users_can_meet_are_exported():
    import lazyckpt
    from lazyckpt import errors

    internal = {"IllegalTransitionError"}  # a bug in lazyckpt, never a user's mistake
    classes = [n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)]
    missing = [n for n in classes if n not in internal and n not in lazyckpt.__all__]
    assert not missing, f"exceptions not exported from lazyckpt: {missing}"


def test_no_filesystem_calls_outside_storage():
    wrong = []
    for module in MODULES.values():
        if module.name.startswith("lazyckpt.storage"):
            continue
        for number, line in enumerate(module.text.splitlines(), 1):
            code = line.split("#", 1)[0]
            if FILESYSTEM_CALLS.search(code) and not code.lstrip().startswith((">>>", "...")):
                wrong.append(f"{module.path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not wrong, "file-system calls outside lazyckpt/storage/:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", sorted({m.package for m in MODULES.values()} - {"lazyckpt"}))
def test_readme_layout_names_every_package(package):
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1]
    folder = package.removeprefix("lazyckpt.").split(".")[-1]
    assert f"{folder}/" in layout, f"README's layout section does not show {folder}/"


def test_pyproject_installs_every_package():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m.name for m in MODULES.values() if m.is_package}
    assert packages == listed, f"not installed: {sorted(packages - listed)}; listed but absent: {sorted(listed - packages)}"
