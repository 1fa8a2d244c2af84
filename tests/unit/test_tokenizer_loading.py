# SPDX-License-Identifier: Apache-2.0
"""`runtime.engine.tokenizer.load_tokenizer`, the one tokenizer loader of the repository:
None for a checkpoint without tokenizer files (the engine then takes token ids only), an
error from transformers when the caller requires one, and no other loader anywhere."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from runtime.engine.engine import DEFAULT_MODEL_DIR
from runtime.engine.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


def test_a_directory_without_tokenizer_files_has_none(tmp_path):
    assert load_tokenizer(tmp_path) is None
    with pytest.raises((OSError, ValueError)):  # transformers: nothing to load here
        load_tokenizer(tmp_path, required=True)


def test_the_default_model_tokenizer_round_trips():
    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR, required=True)
    text = "def add(a, b):\n    return a + b\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert type(load_tokenizer(DEFAULT_MODEL_DIR)) is type(tokenizer)


def test_nothing_else_calls_auto_tokenizer():
    """Every tokenizer is loaded by `load_tokenizer`: no other module of the runtime, the
    tools, the trainer or the tests names `AutoTokenizer` in code."""
    loader = REPO / "runtime" / "engine" / "tokenizer.py"
    offenders = []
    for top in ("runtime", "scripts", "training", "tests"):
        for path in (REPO / top).rglob("*.py"):
            if path == loader:
                continue
            tree = ast.parse(path.read_text())
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            names |= {
                a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
            }
            if "AutoTokenizer" in names:
                offenders.append(str(path.relative_to(REPO)))
    assert offenders == []
