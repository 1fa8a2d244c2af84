# SPDX-License-Identifier: Apache-2.0
"""Tokenizer loading (transformers) with a clear message when a checkpoint has none: the one
loader the engine, the tools, the trainer and the tests all call."""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str | Path, required: bool = False):
    """A transformers tokenizer from `path`; None when the directory has no tokenizer files,
    unless `required`: then transformers loads whatever `path` names (a hub id too) and
    raises its own error when there is nothing to load."""
    if not required and not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
