# SPDX-License-Identifier: Apache-2.0
"""The package layering of `runtime/`: a package imports only itself and the packages
below it, and no two modules import each other in a cycle.

The order is written once, here (docs/architecture.md explains it). Imports inside functions and
under `TYPE_CHECKING` count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"

# Bottom to top: each entry may import every entry before it (and itself).
LAYERS = (
    "core",  # plain shared types: forward modes and context, sampling params, requests, errors
    "constrained",  # structured output on xgrammar: grammars, matchers, token bitmasks
    "configs",
    "distributed",
    "kernels",
    "cache",
    "layers",
    "models",
    "execution",  # model runner, graph runner, sampler, workers; handed a built model
    "speculative",
    "scheduler",
    "model_loader",
    "engine",  # loads the model and hands it to the runner
    "server_args",
    "server",
    "launch_server",
    "__init__",
)
RANK = {name: i for i, name in enumerate(LAYERS)}


def module_name(path: Path) -> str:
    parts = path.relative_to(RUNTIME.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def runtime_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported runtime module, line, at module level) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == "runtime" or name.startswith("runtime."):
                found.append((name, node.lineno, id(node) in top_level))
    return found


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in RUNTIME.rglob("*.py")}


def test_every_package_has_a_place_in_the_order():
    packages = {package_of(m) for m in all_modules()}
    assert packages <= set(RANK), f"add {sorted(packages - set(RANK))} to LAYERS"


def test_no_package_imports_one_above_it():
    upward = []
    modules = all_modules()
    for module, path in modules.items():
        source = package_of(module)
        for name, line, _ in runtime_imports(path):
            if name not in modules:  # `from runtime.x import SomeClass`: its module counts
                continue
            target = package_of(name)
            if RANK[target] > RANK[source]:
                upward.append(f"{path.relative_to(RUNTIME.parent)}:{line} {source} -> {target}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_module_level_import_cycles():
    modules = all_modules()
    graph = {
        m: {n for n, _, top in runtime_imports(p) if top and n in modules and n != m}
        for m, p in modules.items()
    }
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, stack: list[str]) -> bool:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycle.extend(stack[stack.index(nxt) :] + [node, nxt])
                return True
            if state.get(nxt) is None and visit(nxt, [*stack, nxt]):
                return True
        state[node] = 2
        return False

    for module in graph:
        if state.get(module) is None and visit(module, [module]):
            break
    assert not cycle, "import cycle: " + " -> ".join(dict.fromkeys(cycle))
