# SPDX-License-Identifier: Apache-2.0
"""`scripts/` is a package whose tools run as `python -m scripts.<tool>` from the repository
root: every module imports under its package name, each tool has a `main`, and nothing in
`scripts/` or `tests/` edits `sys.path` to make an import work."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import scripts

REPO_ROOT = Path(scripts.__file__).resolve().parent.parent
TOOLS = (
    "bench_one_batch",
    "bench_offline_throughput",
    "bench_serving",
    "make_code_prompts",
    "train_tiny_model",
)


def sys_path_uses(path: Path) -> list[int]:
    """Line numbers where `sys.path` is touched (read or written)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    ]


def test_no_sys_path_edits_in_scripts_or_tests():
    files = sorted((REPO_ROOT / "scripts").rglob("*.py")) + sorted(
        (REPO_ROOT / "tests").rglob("*.py")
    )
    offenders = {
        str(path.relative_to(REPO_ROOT)): lines for path in files if (lines := sys_path_uses(path))
    }
    assert len(files) > 20 and offenders == {}


def test_every_scripts_module_imports_under_the_package():
    names = [m.name for m in pkgutil.walk_packages(scripts.__path__, "scripts.")]
    assert {f"scripts.{tool}" for tool in TOOLS} <= set(names)
    assert {"scripts.bench.flags", "scripts.tiny_training.corpus"} <= set(names)
    for name in names:
        importlib.import_module(name)
    for tool in TOOLS:
        assert callable(importlib.import_module(f"scripts.{tool}").main)
