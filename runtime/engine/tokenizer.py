# SPDX-License-Identifier: Apache-2.0
"""Tokenizer loading (transformers) with a clear message when a checkpoint has none."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    """A transformers tokenizer from `path`, or None when the directory has no tokenizer files."""
    path = Path(path)
    if not any(
        (path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
