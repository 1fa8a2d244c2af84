# SPDX-License-Identifier: Apache-2.0
"""The draft hot-vocabulary table (`--speculative-token-map`, FR-Spec): the most frequent
token ids of a corpus and the end-of-sequence ids. The trainer writes one for its corpus
next to the checkpoint; `scripts.make_token_map` writes one for any model and corpus."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

HOT_VOCAB_SIZE = 2048
HOT_VOCAB_FILE = f"freq_{HOT_VOCAB_SIZE}.json"


def hot_tokens(counts: Counter, num_tokens: int, eos_ids: list[int]) -> list[int]:
    """The `num_tokens` most frequent ids (ties: the smaller id first) and the EOS ids, so
    the draft can propose the end of a reply. Sorted."""
    ranked = sorted((t for t in counts if counts[t] > 0), key=lambda t: (-counts[t], t))
    return sorted(set(ranked[:num_tokens]) | set(eos_ids))


def stream_counts(stream: torch.Tensor, skip: set[int]) -> Counter:
    """Token counts of an id stream, leaving out `skip` (framing tokens)."""
    counts = torch.bincount(stream.long().flatten()).tolist()
    return Counter({t: n for t, n in enumerate(counts) if n and t not in skip})


def write_table(table: list[int], output: Path) -> None:
    """A JSON list when `output` ends in `.json`, else `torch.save`d (FR-Spec's format)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.suffix == ".json":
        output.write_text(json.dumps(table) + "\n")
    else:
        torch.save(table, output)
