# SPDX-License-Identifier: Apache-2.0
"""`DraftBatch` row bookkeeping against the untrimmed batch: dropping leading rows keeps
every remaining row's position, following token and hidden state, and the gather row."""

from __future__ import annotations

import torch

from runtime.core.request import Req
from runtime.core.sampling_params import SamplingParams
from runtime.speculative.draft_batch import DraftBatch


def ragged_batch() -> DraftBatch:
    extend = [5, 1, 7]
    total = sum(extend)
    reqs = [Req(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(len(extend))]
    for i, req in enumerate(reqs):
        req.req_pool_idx = 10 + i
    return DraftBatch(
        reqs=reqs,
        prefix_lens=[3, 20, 0],
        extend_lens=extend,
        next_tokens=torch.arange(100, 100 + total),
        target_hidden=torch.randn(total, 4, generator=torch.Generator().manual_seed(0)),
        gather_rows=[4, 0, 2],
        propose=[True, False, True],
    )


def rows_by_position(batch: DraftBatch, b: int) -> dict[int, tuple[int, list[float]]]:
    start, n = batch.row_starts()[b], batch.extend_lens[b]
    return {
        batch.prefix_lens[b] + j: (
            int(batch.next_tokens[start + j]),
            batch.target_hidden[start + j].tolist(),
        )
        for j in range(n)
    }


def test_row_indices():
    batch = ragged_batch()
    assert batch.row_starts() == [0, 5, 6]
    assert batch.gather_indices() == [4, 5, 8]
    assert batch.proposing() == [0, 2]
    assert batch.req_pool_indices == [10, 11, 12]
    assert [batch.first_chain_position(b) for b in range(3)] == [8, 21, 3]


def test_dropping_leading_rows_keeps_positions_tokens_and_gather_row():
    full = ragged_batch()
    skip = [3, 0, 2]
    trimmed = full.drop_leading_rows(skip)
    assert trimmed.extend_lens == [2, 1, 5]
    assert trimmed.next_tokens.shape[0] == trimmed.target_hidden.shape[0] == 8
    for b in range(full.batch_size):
        kept = rows_by_position(trimmed, b)
        original = rows_by_position(full, b)
        assert kept == {p: original[p] for p in sorted(original)[skip[b] :]}
        g_full, g_trim = full.gather_indices()[b], trimmed.gather_indices()[b]
        assert int(trimmed.next_tokens[g_trim]) == int(full.next_tokens[g_full])
        assert torch.equal(trimmed.target_hidden[g_trim], full.target_hidden[g_full])
        assert trimmed.first_chain_position(b) == full.first_chain_position(b)
    assert trimmed.propose == full.propose
    assert full.drop_leading_rows([0, 0, 0]) is full
