# SPDX-License-Identifier: Apache-2.0
"""`scripts/` and `training/` are packages whose tools run as `python -m scripts.<tool>` /
`python -m training.<tool>` from the repository root: every module imports under its
package name, each tool has a `main`, nothing in `scripts/`, `training/` or `tests/` edits
`sys.path` to make an import work, and `training` (a dev tool) is not installed with the
runtime."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import scripts
import training

REPO_ROOT = Path(scripts.__file__).resolve().parent.parent
TOOLS = {
    scripts: ("bench_one_batch", "bench_offline_throughput", "bench_serving", "make_code_prompts"),
    training: ("train_tiny_model", "distill_draft"),
}


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


def test_no_sys_path_edits_in_scripts_training_or_tests():
    files = [p for top in ("scripts", "training", "tests") for p in (REPO_ROOT / top).rglob("*.py")]
    offenders = {
        str(path.relative_to(REPO_ROOT)): lines for path in files if (lines := sys_path_uses(path))
    }
    assert len(files) > 20 and offenders == {}


@pytest.mark.parametrize("package", [scripts, training], ids=lambda p: p.__name__)
def test_every_module_imports_under_its_package(package):
    prefix = f"{package.__name__}."
    names = [m.name for m in pkgutil.walk_packages(package.__path__, prefix)]
    tools = TOOLS[package]
    assert {prefix + tool for tool in tools} <= set(names)
    assert {"scripts.bench.flags", "training.corpus", "training.families.qwen4_exp"} & set(names)
    for name in names:
        importlib.import_module(name)
    for tool in tools:
        assert callable(importlib.import_module(prefix + tool).main)


def test_the_trainer_is_not_installed_with_the_runtime():
    """setup.py packages `runtime` only: `training` and `scripts` run from a clone."""
    setup = ast.parse((REPO_ROOT / "setup.py").read_text())
    (call,) = [
        node
        for node in ast.walk(setup)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "find_packages"
    ]
    (include,) = [ast.literal_eval(k.value) for k in call.keywords if k.arg == "include"]
    assert sorted(include) == ["runtime", "runtime.*"]
