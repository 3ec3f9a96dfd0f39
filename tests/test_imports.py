"""Dependencies point one way (docs/DESIGN.md, "Kernels"): core <- kvq_metal <- method plugins, tooling on top.

A static walk of every workspace package: each module's AST is parsed and every ``import`` / ``from ... import``
counts, at module level or inside a function (a lazy import is still a dependency), relative imports resolved;
so does ``importlib.import_module("...")`` with a constant name, and a constant string that names a plugin module
(``"kvq_backends_x.mod"``, ``"kvq_backends_x:attr"``: an import by name). Nothing is imported. Imports under
``if TYPE_CHECKING:`` never run: they count for the direction between distributions and for cycles (a type is an
API one depends on; a cycle through one is still a tangle for the reader), but not for the layers of modules,
which are about what runs.

Layers of ``kvq`` (:data:`LAYERS`), lowest first; a module may import its own layer and those below, never above:

- contract: the contract's Protocols, hook specs, method declarations, Encoded, Problem and the device,
  validation, packing, cost model, attention helpers, text data, install hints, the cache folder (kvq.paths);
- registry: kvq.plugins (entry points), kvq.tuning (stored autotune crossovers), kvq.provenance;
- selection: kvq.selection (the module of the function kvq.select);
- runtime: the baselines and the mlx-lm cache;
- integration: distributed caches, quality measures, model loading and GGUF conversion;
- api: the package ``kvq`` (its ``__init__`` re-exports the above);
- tools: kvq.bench (with ``kvq autotune``'s measuring), kvq.evaluation, kvq.cli: nothing below imports them.

One kind of edge is left out of the layers and of the cycle check (which counts type-checking imports): a module
importing a package that contains it (``from .. import __version__`` in kvq.cache.state, ``from . import
ModelError`` in kvq.models.fetch). Python
runs every enclosing package's ``__init__`` before any module inside it, so that dependency exists for every
module anyway and the edge adds none; it only reads a name the ``__init__`` defines before it imports its
submodules (or, lazily, at call time), which is why such a cycle cannot fail at import.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = {
    "contract": ("kvq.contract", "kvq.hookspecs", "kvq.declaration", "kvq.encoded", "kvq.problem", "kvq.validate",
                 "kvq.packing", "kvq.costmodel", "kvq.attention", "kvq.textdata", "kvq.install_hints", "kvq.paths",
                 "kvq.defaults"),
    "registry": ("kvq.plugins", "kvq.tuning", "kvq.provenance"),
    "selection": ("kvq.selection",),
    "runtime": ("kvq.baselines", "kvq.cache"),
    "integration": ("kvq.distributed", "kvq.quality", "kvq.models"),
    "api": ("kvq",),
    "tools": ("kvq.bench", "kvq.evaluation", "kvq.cli"),
}
#: What docs/DESIGN.md's hot path needs ("The contract"): none of these may reach the tooling, even lazily.
NOT_TOOLING = ("kvq", "kvq.selection", "kvq.plugins", "kvq.hookspecs", "kvq.tuning", "kvq.cache", "kvq.baselines",
               "kvq.attention", "kvq.distributed")
TOOLING = ("kvq.bench", "kvq.evaluation", "kvq.cli")
KERNELS = "kvq_metal"
CORE = "kvq"


# -- the workspace ---------------------------------------------------------------------------------------
@cache
def distributions() -> dict[str, dict]:
    """Every distribution of the workspace (and examples/) by import name: its name, source folder, and the
    workspace distributions it declares (required, and per extra)."""
    found = {}
    for pyproject in sorted([*ROOT.glob("*/pyproject.toml"), *ROOT.glob("examples/*/pyproject.toml")]):
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        (package,) = data["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
        extras = project.get("optional-dependencies", {})
        found[Path(package).name] = {
            "name": project["name"], "src": pyproject.parent / package,
            "requires": {_name(d) for d in project.get("dependencies", [])},
            "extras": {_name(d) for reqs in extras.values() for d in reqs}}
    return found


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;@]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def kind(package: str) -> str:
    """``core``, ``kernels`` or ``plugin``."""
    return "core" if package == CORE else "kernels" if package == KERNELS else "plugin"


@cache
def modules() -> dict[str, Path]:
    """Module name -> file, for every module of every workspace package."""
    found = {}
    for package, dist in distributions().items():
        for path in sorted(dist["src"].rglob("*.py")):
            parts = path.relative_to(dist["src"].parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def top(module: str) -> str:
    return module.split(".")[0]


def _is_package(module: str) -> bool:
    return modules()[module].name == "__init__.py"


def _resolve(module: str, level: int, name: str | None) -> str:
    """The absolute module of a ``from`` import in ``module`` (``level`` dots, then ``name``)."""
    if level == 0:
        return name or ""
    parts = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = parts[:len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


PLUGIN_REFERENCE = re.compile(r"^(kvq_metal|kvq_backends_\w+|kvq_example_plugin)(\.[\w.]+|:[\w.]+)+$")


def _typing_only(tree: ast.AST) -> set[int]:
    """``id`` of every node under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            found |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
    return found


def _imported(module: str, tree: ast.AST, typing: bool) -> set[str]:
    """Every module ``module`` imports, as written (may name modules outside the workspace); with ``typing``,
    also those imported for type checkers only."""
    names, skip = set(), set() if typing else _typing_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node.level, node.module)
            for alias in node.names:  # `from package import submodule` imports the submodule
                sub = f"{base}.{alias.name}"
                names.add(sub if sub in modules() else base)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            names.add(str(node.args[0].value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PLUGIN_REFERENCE.match(node.value):
            names.add(node.value.partition(":")[0])
    return names


def _workspace_module(name: str) -> str | None:
    """The longest workspace module that ``name`` is or lies in, or ``None`` (outside the workspace)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules():
            return ".".join(parts[:end])
    return None


@cache
def graph(typing: bool = False) -> dict[str, set[str]]:
    """Module -> workspace modules it imports when it runs (not itself); with ``typing``, also those imported
    for type checkers only."""
    edges = {}
    for module, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        found = {_workspace_module(n) for n in _imported(module, tree, typing)}
        edges[module] = {m for m in found if m is not None and m != module}
    return edges


def _contains(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def downward(module: str, typing: bool = False) -> set[str]:
    """``module``'s imports less those of a package that contains it (see the module docstring); with ``typing``,
    imports for type checkers included."""
    return {m for m in graph(typing)[module] if not _contains(m, module)}


def reachable(start: str) -> dict[str, list[str]]:
    """Every module reachable from ``start`` through :func:`downward` edges, with one path to it."""
    paths, todo = {start: [start]}, [start]
    while todo:
        module = todo.pop()
        for nxt in sorted(downward(module)):
            if nxt not in paths:
                paths[nxt] = paths[module] + [nxt]
                todo.append(nxt)
    return paths


def components(typing: bool = False) -> list[list[str]]:
    """Strongly connected components of the :func:`downward` graph with more than one module (Tarjan); with
    ``typing``, imports for type checkers count as edges."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(downward(v, typing)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for module in sorted(graph()):
        if module not in index:
            visit(module)
    return found


def layer_of(module: str) -> str | None:
    """The layer of a ``kvq`` module: that of the longest package or module listed in :data:`LAYERS` that is or
    contains it (``kvq`` itself stands for its ``__init__`` only)."""
    best = None
    for name, members in LAYERS.items():
        for prefix in members:
            inside = module == prefix or (prefix != CORE and _contains(prefix, module))
            if inside and (best is None or len(prefix) > len(best[1])):
                best = (name, prefix)
    return None if best is None else best[0]


def _edges_to(packages: set[str], of: str) -> list[str]:
    """Imports (type-checking ones included) from package ``of`` into any of ``packages``."""
    edges = graph(typing=True)
    return sorted(f"{m} -> {n}" for m in edges if top(m) == of for n in edges[m] if top(n) in packages)


# -- the tests -------------------------------------------------------------------------------------------
def test_the_walk_sees_every_package_and_lazy_imports():
    assert {CORE, KERNELS, "kvq_backends_turboquant", "kvq_backends_qjl", "kvq_backends_vecinfer"} <= set(
        distributions())
    assert "kvq.cli.calibrate_cmd" in modules() and "kvq.tuning" in graph()["kvq.selection"]
    assert "kvq.cache" in graph()["kvq"]  # kvq.__getattr__'s lazy `from . import cache`
    assert "kvq.cli.list_cmd" not in graph()["kvq.cli"]  # a dict of names is not an import (the CLI dispatcher)


def test_the_walk_resolves_relative_lazy_by_name_and_type_checking_imports():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvq_metal\n"
                     "def f():\n    from . import selection\n    return load('kvq_backends_x.calibrate')\n")
    runs = {"typing", "kvq.selection", "kvq_backends_x.calibrate"}
    assert _imported("kvq.plugins", tree, typing=False) == runs
    assert _imported("kvq.plugins", tree, typing=True) == runs | {"kvq_metal"}


def test_core_imports_no_plugin_and_not_the_kernels():
    found = _edges_to({p for p in distributions() if p != CORE}, CORE)
    assert not found, "\n".join(found)


def test_kernels_import_no_method_plugin():
    found = _edges_to({p for p in distributions() if kind(p) == "plugin"}, KERNELS)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("package", sorted(p for p in distributions() if p != CORE))
def test_each_distribution_imports_only_what_it_declares(package):
    """A plugin imports the core, the kernels (declared) and other plugins only where its pyproject.toml declares
    them (in ``dependencies``, or in an extra for an optional import)."""
    dist, by_name = distributions()[package], {d["name"]: p for p, d in distributions().items()}
    declared = {by_name[n] for n in dist["requires"] | dist["extras"] if n in by_name} | {package}
    undeclared = _edges_to(set(distributions()) - declared, package)
    assert not undeclared, f"{dist['name']} imports what its pyproject.toml does not declare:\n" + "\n".join(undeclared)


def test_every_core_module_has_a_layer():
    unplaced = [m for m in graph() if top(m) == CORE and layer_of(m) is None]
    assert not unplaced, f"add these to LAYERS: {unplaced}"


def test_nothing_outside_the_core_imports_its_tooling():
    """Tooling sits on top (STYLE.md): kernels and plugins use the core's runtime, never its CLI or benchmarks."""
    edges = graph(typing=True)
    found = [f"{m} -> {n}" for m in edges if top(m) != CORE for n in edges[m]
             if any(n == t or _contains(t, n) for t in TOOLING)]
    assert not found, "\n".join(found)


def test_core_modules_import_only_their_layer_and_below():
    order = list(LAYERS)
    upward = [f"{m} ({layer_of(m)}) -> {n} ({layer_of(n)})" for m in graph() if top(m) == CORE
              for n in downward(m) if top(n) == CORE and order.index(layer_of(n)) > order.index(layer_of(m))]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


@pytest.mark.parametrize("start", NOT_TOOLING)
def test_selection_registry_and_cache_never_reach_the_tooling(start):
    paths = reachable(start)
    reached = [" -> ".join(path) for m, path in sorted(paths.items()) if any(
        m == t or _contains(t, m) for t in TOOLING)]
    assert not reached, "\n".join(reached)


def package_of(module: str) -> str:
    """The package a module belongs to: itself for a package's ``__init__``, else the package containing it."""
    return module if _is_package(module) else module.rpartition(".")[0]


def test_no_import_cycle():
    """No cycle among the workspace's modules, within a package or across packages, imports for type checkers
    counted (a type is an API one depends on); only the edge from a module to a package that contains it is left
    out (module docstring). The message lists every cycle's modules."""
    found = components(typing=True)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


NAMES_ARE_MODULES = r"""
import importlib, sys, types
wrong = []
for name in sys.argv[1:]:
    parent, _, leaf = name.rpartition(".")
    importlib.import_module(name)
    value = getattr(importlib.import_module(parent), leaf)
    if not isinstance(value, types.ModuleType):
        wrong.append(f"{name} is {value!r}")
print("\n".join(wrong))
"""


def test_every_submodule_name_gives_the_module():
    """Issue #50: ``import kvq.selection as s`` (and every other submodule, of every workspace distribution) binds
    the module, never a function of its package's ``__init__`` with the same name (``kvq.select`` and
    ``kvq.methods`` are functions; their modules are kvq.selection and kvq.declaration). Imported in a fresh
    process (``__main__`` modules, which run a command, left out)."""
    ours = {p for p, d in distributions().items() if d["src"].parents[2] == ROOT}
    names = sorted(m for m in modules() if "." in m and top(m) in ours and not m.endswith(".__main__"))
    assert "kvq.selection" in names and "kvq.declaration" in names
    done = subprocess.run([sys.executable, "-c", NAMES_ARE_MODULES, *names], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == ""


DIR_LISTS_LAZY_NAMES = r"""
import sys, kvq
names = dir(kvq)
print(int("mlx_lm" in sys.modules))  # dir() lists the lazy names without loading them
print(" ".join(n for n in [*kvq.__all__, "cache", "models", "distributed", "defaults"] if n not in names))
print(" ".join(n for n in names if not hasattr(kvq, n)))
"""


def test_dir_lists_the_lazily_exported_api():
    """``dir(kvq)`` names what ``kvq.__getattr__`` loads on first use (the cache API, ``models``, ``distributed``),
    as tab completion and ``help()`` read it, without importing mlx-lm; every name it lists resolves."""
    done = subprocess.run([sys.executable, "-c", DIR_LISTS_LAZY_NAMES], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded, missing, unresolved = (done.stdout.split("\n") + ["", ""])[:3]
    assert loaded == "0" and missing == "", missing
    assert unresolved == "", unresolved
