# SPDX-License-Identifier: Apache-2.0
"""What the parity tests of both families share: a runner over a tiny checkpoint, the
transformers oracle's logits, and the comparisons (a whole prompt, a ragged extend).

Tolerance: both sides compute in fp32 and differ only in reduction order (fused mixes,
gathered vs dense attention, grouped vs per-expert GEMMs, chunked vs recurrent delta rule);
over 4 layers that is ~1e-5 on logits of magnitude ~5. ATOL = 1e-4 is 10x that and still far
below what a wrong mask, a dropped cache entry or a mis-selected top-k produces (0.5 and
more).
"""

from __future__ import annotations

import torch

from runtime.cache import PagedTokenAllocator, ReqToTokenPool, SlotTable
from runtime.configs.model_config import ModelConfig
from runtime.core.forward_mode import ForwardMode
from runtime.execution.model_input import ModelInput
from tests.runners import load_runner

ATOL = 1e-4


def make_runner(path, page_size=1, max_reqs=8, tokens=1024):
    config = ModelConfig.from_path(path, "float32")
    table = SlotTable(
        ReqToTokenPool(max_reqs, tokens), PagedTokenAllocator(tokens // page_size, page_size)
    )
    return load_runner(config, table), table


def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids.unsqueeze(0)).logits[0]


def random_ids(n, seed, vocab=97):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def all_rows(n):
    return list(range(n))


def prompt_logits(runner, table, ids: torch.Tensor) -> torch.Tensor:
    """The logits of every row of one request's whole-prompt forward."""
    req = table.open_request()
    table.reserve(req, len(ids))
    out = runner.forward(
        ModelInput(
            ForwardMode.EXTEND, ids, [req], [0], [len(ids)], logits_row_indices=all_rows(len(ids))
        )
    )
    return out.next_token_logits


def assert_prefill_matches_transformers(path, hf, ids: torch.Tensor, page_size=1) -> None:
    """One request's whole-prompt forward: logits of every row equal transformers'."""
    runner, table = make_runner(path, page_size)
    torch.testing.assert_close(
        prompt_logits(runner, table, ids), hf_logits(hf, ids), atol=ATOL, rtol=0
    )


def assert_ragged_extend_matches(runner, hf, seqs, reqs, cached, extend) -> None:
    """One forward extending each request `reqs[i]` (its first `cached[i]` tokens of
    `seqs[i]` already in the cache) by its next `extend[i]` tokens: every row's logits equal
    transformers' over the request's whole sequence."""
    ids = torch.cat([s[c : c + e] for s, c, e in zip(seqs, cached, extend)])
    out = runner.forward(
        ModelInput(
            ForwardMode.EXTEND, ids, reqs, cached, extend, logits_row_indices=all_rows(len(ids))
        )
    )
    row = 0
    for seq, done, new in zip(seqs, cached, extend):
        torch.testing.assert_close(
            out.next_token_logits[row : row + new],
            hf_logits(hf, seq)[done : done + new],
            atol=ATOL,
            rtol=0,
        )
        row += new
