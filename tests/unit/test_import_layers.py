# SPDX-License-Identifier: Apache-2.0
"""The declared import graph: each package of `runtime/` imports only the packages it is
declared to (`RUNTIME_IMPORTS`), each top-level package of the repository likewise
(`REPO_IMPORTS`: `runtime` never imports the tools or tests that sit on it), and no two
modules import each other in a cycle.

Every import counts, wherever it is written: inside functions, under `TYPE_CHECKING`, in a
`try`: a lazy import is still a dependency. The graphs are written once, here;
docs/architecture.md shows them as tables, and a test below keeps the two the same.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "runtime"
ARCHITECTURE = REPO / "docs" / "architecture.md"

# package of `runtime/` -> the other packages of `runtime/` it may import ("__init__" is
# `runtime/__init__.py`, the public API). Bottom to top, so each row names only rows above.
RUNTIME_IMPORTS: dict[str, set[str]] = {
    "core": set(),
    "constrained": {"core"},
    "configs": {"core"},
    "distributed": {"core", "configs"},
    "kernels": {"core", "configs"},
    "cache": {"core", "configs"},
    "layers": {"core", "configs", "distributed", "kernels", "cache"},
    "models": {"core", "configs", "distributed", "kernels", "cache", "layers"},
    # handed a built model: never imports `models`
    "execution": {"core", "constrained", "configs", "distributed", "kernels", "cache", "layers"},
    "speculative": {"core", "constrained", "configs", "execution"},
    "scheduler": {"core", "configs", "cache"},
    "model_loader": {"core", "configs", "distributed", "models"},
    "engine": {
        "core",
        "constrained",
        "configs",
        "distributed",
        "cache",
        "layers",
        "models",
        "execution",
        "speculative",
        "scheduler",
        "model_loader",
    },
    "server_args": {"core", "configs"},
    "server": {"core", "configs", "engine", "server_args"},
    "launch_server": {"core", "configs", "engine", "server_args", "server"},
    "__init__": {"core", "engine"},
}

# top-level package of the repository -> the others it may import
REPO_IMPORTS: dict[str, set[str]] = {
    "runtime": set(),
    "training": {"runtime"},  # the tiny-model trainer: a dev tool, not installed
    "scripts": {"runtime", "training"},
    "tests": {"runtime", "training", "scripts"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def runtime_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(imported module or `module.name`, line) for every import anywhere in the file
    (relative imports resolved), nested ones included."""
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_in(source: str, module: str, is_package: bool) -> list[tuple[str, int]]:
    tree = ast.parse(source)
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.append((base, node.lineno))
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return found


def repo_modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for top in REPO_IMPORTS
        for p in (REPO / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module of the repository it imports: line}; `from pkg import name` counts
    as importing `pkg.name` where that is a module, else `pkg`."""
    modules = repo_modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for name, line in imports_of(path):
            if name in modules and name != module:
                edges.setdefault(name, line)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as a path (first node repeated at the end), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_the_declared_graphs_have_no_cycles():
    assert find_cycle(RUNTIME_IMPORTS) == []
    assert find_cycle(REPO_IMPORTS) == []
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # finds one


def test_every_package_is_declared():
    runtime_packages = {runtime_package(m) for m in repo_modules() if m.startswith("runtime")}
    assert runtime_packages == set(RUNTIME_IMPORTS), "declare them in RUNTIME_IMPORTS"
    top_level = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert top_level == set(REPO_IMPORTS), "declare them in REPO_IMPORTS"


def test_every_import_is_declared():
    undeclared = []
    for module, edges in import_graph().items():
        source_top, target_tops = module.split(".")[0], REPO_IMPORTS
        for name, line in edges.items():
            where = f"{module.replace('.', '/')}.py:{line}"
            target_top = name.split(".")[0]
            if target_top != source_top and target_top not in target_tops[source_top]:
                undeclared.append(f"{where} {source_top} -> {target_top}")
            if source_top == target_top == "runtime":
                source, target = runtime_package(module), runtime_package(name)
                if target != source and target not in RUNTIME_IMPORTS[source]:
                    undeclared.append(f"{where} {source} -> {target}")
    assert not undeclared, "imports the declared graph does not allow:\n" + "\n".join(undeclared)


def test_no_import_cycles_between_modules():
    graph = {module: set(edges) for module, edges in import_graph().items()}
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_nested_and_relative_imports_are_seen():
    """The walk finds an import inside a function and under `TYPE_CHECKING`, and resolves a
    relative one (else a lazy import could hide an undeclared edge or a cycle)."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from runtime.engine import Engine\n"
        "def f():\n    from runtime.models import registry\n"
        "from .sampler import sample\n"
        "from . import penalties\n"
    )
    found = {name for name, _ in imports_in(source, "runtime.execution.probe", False)}
    expected = {"runtime.engine", "runtime.models.registry", "runtime.execution.sampler"}
    assert expected | {"runtime.execution.penalties"} <= found


def documented_graph(heading: str) -> dict[str, set[str]]:
    """The table under `heading` in docs/architecture.md: package -> the packages in its
    "may import" column (backquoted names; "nothing" for none)."""
    text = ARCHITECTURE.read_text()
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    package_col, imports_col = header.index("package"), header.index("may import")
    graph = {}
    for row in rows[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        (package,) = re.findall(r"`([\w.]+)`", cells[package_col])
        graph[package.removeprefix("runtime/").rstrip("/")] = set(
            re.findall(r"`([\w.]+)`", cells[imports_col])
        )
    return graph


def test_the_architecture_tables_match_the_declared_graphs():
    runtime_table = documented_graph("## 1. Packages and what each may import")
    assert runtime_table == RUNTIME_IMPORTS
    assert documented_graph("### Top-level packages") == REPO_IMPORTS
