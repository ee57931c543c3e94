"""The package layering DESIGN.md promises: the shared core stands alone, and nothing imports in a circle."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pagelab", "simulator", "traces", "viz", "gpu_backend", "cli", "bench")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Project module -> project modules it imports anywhere (type-only imports included)."""
    graph: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            deps = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                    deps.add(node.module)
                elif isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
            graph[_module_name(path)] = deps
    return graph


def _cycle_from(graph: dict[str, set[str]], start: str) -> list[str] | None:
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for dep in graph.get(node, ()):
            if dep == start:
                return path + [dep]
            if dep not in seen:
                seen.add(dep)
                stack.append((dep, path + [dep]))
    return None


def test_no_import_cycles_between_modules():
    graph = _imports()
    # A package's __init__ re-exporting its modules is not a cycle of logic: skip edges into __init__s.
    packages = {m for m in graph if (ROOT / Path(*m.split(".")) / "__init__.py").exists()}
    graph = {m: {d for d in deps if d not in packages} for m, deps in graph.items()}
    cycles = [c for m in graph if (c := _cycle_from(graph, m))]
    assert not cycles, cycles[0]


def test_memory_core_imports_only_itself_and_pagelab():
    graph = _imports()
    core = {m: deps for m, deps in graph.items() if m.startswith("simulator.core")}
    assert len(core) >= 10
    for module, deps in core.items():
        outside = {d for d in deps if not d.startswith(("simulator.core", "pagelab"))}
        assert not outside, f"{module} imports {outside}"


def test_importing_the_core_loads_no_numpy_pandas_or_torch():
    code = ("import sys, simulator.core; "
            "print(sorted(m for m in ('numpy', 'pandas', 'torch', 'matplotlib', 'simulator.simulate') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
