"""The package layering: the shared core stands alone, the model never reaches up into the engine, bench
never runs the CLI, and no module imports in a circle, counting what each import statement executes.

Edges of the import graph, for an importing module M:
- `import a.b.c` executes a, a.b and a.b.c: an edge to each project module among them, except the
  packages that enclose M (they started executing before M did, so the import runs nothing of theirs);
- `from a.b import x` reads names off a.b: an edge to a.b always (also when a.b encloses M: the names
  are then looked up on a package still executing), to a.b.x when x is a submodule, and to the packages
  above a.b that do not enclose M.
So a package `__init__` that imports its submodules closes a cycle with any submodule that imports names
from the package, and a module that imports a.b.x from outside package a.b depends on a/b/__init__.py
too. Imports inside functions count: a lazy import delays a cycle, it does not remove it.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pagelab", "simulator", "traces", "viz", "gpu_backend", "cli", "bench")
# gpu_backend's model and ops layers: the engine builds on them, so they import nothing from it.
MODEL_LAYER = ("gpu_backend.model", "gpu_backend.model_input", "gpu_backend.model_config",
               "gpu_backend.model_presets", "gpu_backend.loader", "gpu_backend.rope", "gpu_backend.kv_cache",
               "gpu_backend.cache_engine")
# Packages whose submodules import each other's defining module, never the package's re-exports.
NO_SELF_IMPORT = ("traces", "gpu_backend.ops")


def _modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Every module of `packages` under `root` by dotted name (a package by its own name, for its
    __init__.py)."""
    modules = {}
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _enclosing(name: str) -> set[str]:
    """The packages above a dotted name (a.b.c -> a, a.b)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` blocks (never executed)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return inside


def _edges(module: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(modules `module` imports when it runs, modules it imports only for type checkers)."""
    tree = ast.parse(path.read_text())
    typing_only = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    above = _enclosing(module)
    runtime, typing = set(), set()

    def executed(target: str) -> set[str]:
        """The project modules `import target` executes that are not already executing."""
        return {m for m in _enclosing(target) if m in modules and m not in above} | \
            ({target} if target in modules else set())

    for node in ast.walk(tree):
        found: set[str] = set()
        if isinstance(node, ast.Import):
            for alias in node.names:
                found |= executed(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= executed(base)
            found |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
        (typing if id(node) in typing_only else runtime).update(found - {module})
    return runtime, typing


def _graph(with_typing: bool, root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Project module -> project modules it imports; `with_typing` adds the type-checking-only imports."""
    modules = _modules(root, packages)
    graph = {}
    for module, path in modules.items():
        runtime, typing = _edges(module, path, modules)
        graph[module] = runtime | typing if with_typing else runtime
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path that returns to its start) through each strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest cycle through the group's first module, by breadth-first search inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for dep in sorted(graph[node] & group):
                if dep == start:
                    return paths[node] + [start]
                if dep not in paths:
                    paths[dep] = paths[node] + [dep]
                    following.append(dep)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def _runtime_cycles() -> list[list[str]]:
    """The import cycles of the project. Imports under `if TYPE_CHECKING:` are left out of this check only:
    they never execute, so they cannot make one module run before another is done (the layering checks
    below do count them)."""
    return _cycles(_graph(with_typing=False))


def _listed(cycles: list[list[str]]) -> str:
    return "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles_between_modules():
    cycles = _runtime_cycles()
    assert not cycles, _listed(cycles)


def test_the_graph_counts_what_each_import_executes(tmp_path):
    files = {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "from pkg import sibling\nfrom pkg.sub.c import C\nA = 1\n",
        "pkg/b.py": "import pkg.a as a\nfrom . import sibling\n",
        "pkg/sibling.py": "",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from ..b import a\nC = 1\n",
        "other/__init__.py": "",
        "other/d.py": "import pkg.sub.c\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                      "    import other\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = _graph(with_typing=False, root=tmp_path, packages=("pkg", "other"))
    assert graph["pkg"] == {"pkg.a"}
    # Names read off the package that encloses it: an edge into pkg/__init__.py (and the sub-package's
    # __init__, which does not enclose pkg.a).
    assert graph["pkg.a"] == {"pkg", "pkg.sibling", "pkg.sub", "pkg.sub.c"}
    # pkg encloses pkg.b: `import pkg.a` runs only pkg.a, but `from . import` reads names off pkg.
    assert graph["pkg.b"] == {"pkg", "pkg.a", "pkg.sibling"}
    assert graph["pkg.sub.c"] == {"pkg.b"}  # relative, two levels up
    assert graph["other.d"] == {"pkg", "pkg.sub", "pkg.sub.c"}
    assert _graph(with_typing=True, root=tmp_path, packages=("pkg", "other"))["other.d"] == \
        {"other", "pkg", "pkg.sub", "pkg.sub.c"}
    assert _cycles(graph) == [["pkg", "pkg.a", "pkg"]]


def test_bench_never_imports_the_cli():
    graph = _graph(with_typing=True)
    bench = {m: deps for m, deps in graph.items() if m == "bench" or m.startswith("bench.")}
    assert len(bench) >= 10
    offending = {m: sorted(d for d in deps if d == "cli" or d.startswith("cli."))
                 for m, deps in bench.items()}
    assert not any(offending.values()), {m: d for m, d in offending.items() if d}


def test_the_model_and_ops_layers_import_nothing_from_the_engine():
    graph = _graph(with_typing=True)
    layer = {m: deps for m, deps in graph.items()
             if m in MODEL_LAYER or m == "gpu_backend.ops" or m.startswith("gpu_backend.ops.")}
    engine = "gpu_backend.engine"
    offending = {m: sorted(d for d in deps if d == engine or d.startswith(engine + "."))
                 for m, deps in layer.items()}
    assert not any(offending.values()), {m: d for m, d in offending.items() if d}
    assert set(MODEL_LAYER) <= set(layer) and len(layer) > len(MODEL_LAYER) + 5  # every layer module seen


def test_memory_core_imports_only_itself_and_pagelab():
    graph = _graph(with_typing=True)
    core = {m: deps for m, deps in graph.items() if m == "simulator.core" or m.startswith("simulator.core.")}
    assert len(core) >= 10
    for module, deps in core.items():
        outside = {d for d in deps if not (d.split(".")[0] == "pagelab" or d == "simulator.core"
                                           or d.startswith("simulator.core."))}
        assert not outside, f"{module} imports {outside}"


def test_traces_and_ops_submodules_import_their_siblings_not_their_package():
    offending = []
    for module, path in _modules().items():
        package = next((p for p in NO_SELF_IMPORT if module.startswith(p + ".")), None)
        if package is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == package and not node.level:
                offending.append(f"{module}: from {package} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Import) and any(a.name == package for a in node.names):
                offending.append(f"{module}: import {package}")
    assert not offending, offending


def test_importing_the_core_loads_no_numpy_pandas_or_torch():
    # Every name the core exports, each loading its module: the whole core.
    code = ("import sys; from simulator.core import *; import simulator.core.beam, simulator.core.models; "
            "print(sorted(m for m in ('numpy', 'pandas', 'torch', 'matplotlib', 'simulator.loop') "
            "if m in sys.modules), len([m for m in sys.modules if m.startswith('simulator.core.')]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    heavy, num_core = out.stdout.rsplit(" ", 1)
    assert heavy == "[]" and int(num_core) >= 15


def test_the_replay_runs_on_the_simulations_driver():
    """One loop drives a simulation and an engine replay: the replay imports the driver, and defines no
    loop of its own over the trace's arrivals."""
    graph = _graph(with_typing=False)
    assert graph["gpu_backend.replay"] & {"simulator.loop", "simulator.loop.simulate"}
    source = (ROOT / "gpu_backend" / "replay.py").read_text()
    assert "drive(" in source and "while " not in source.split("def _replay(")[1]
