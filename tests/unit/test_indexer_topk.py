# SPDX-License-Identifier: Apache-2.0
"""The indexer top-k keeps what transformers' `topk` over each row's own entries keeps, in
any batch and under any padding, ties included: the Python custom op and the C++ one
(`nextn_cpu::indexer_topk`, which captured CPU steps call) alike."""

from __future__ import annotations

import pytest
import torch

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension
from runtime.kernels.indexer_topk import indexer_topk, indexer_topk_op, indexer_topk_reference


@pytest.fixture(params=["python", "cpp"])
def topk(request):
    if request.param == "python":
        return indexer_topk_op
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")
    return torch.ops.nextn_cpu.indexer_topk


def tied_scores(rows: int, width: int, seed: int):
    """Scores from a few levels (exact ties everywhere), a per-row visible prefix and the
    reference length (at least the visible prefix, as for a prefill row)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (rows, width), generator=g).float()
    visible = torch.randint(0, width + 1, (rows,), generator=g)
    lengths = torch.minimum(
        visible + torch.randint(0, 5, (rows,), generator=g), torch.tensor(width)
    )
    scores = scores.masked_fill(torch.arange(width) >= visible.unsqueeze(1), float("-inf"))
    return scores, lengths, visible


def selected_sets(indices: torch.Tensor, valid: torch.Tensor) -> list[list[int]]:
    return [row[ok].tolist() for row, ok in zip(indices, valid)]


def test_matches_the_row_by_row_reference_with_ties(topk):
    for seed in range(20):
        scores, lengths, visible = tied_scores(24, 40, seed)
        for k in (1, 3, 8, 40, 50):
            got = selected_sets(*topk(scores, lengths, visible, k))
            want = selected_sets(*indexer_topk_reference(scores, lengths, visible, k))
            assert got == want, (seed, k)


def test_padding_and_batch_neighbours_do_not_change_a_row(topk):
    scores, lengths, visible = tied_scores(16, 30, seed=3)
    alone = [
        selected_sets(*topk(scores[i : i + 1], lengths[i : i + 1], visible[i : i + 1], 4))
        for i in range(16)
    ]
    padded = torch.cat([scores, torch.full((16, 34), float("-inf"))], dim=1)
    together = selected_sets(*topk(padded, lengths, visible, 4))
    assert together == [row[0] for row in alone]


def test_output_shape_is_fixed_and_ascending(topk):
    scores, lengths, visible = tied_scores(5, 6, seed=1)
    indices, valid = topk(scores, lengths, visible, 9)
    assert indices.shape == valid.shape == (5, 9)
    assert (indices.diff(dim=1) >= 0).all()
    assert (valid.sum(1) == torch.minimum(visible, torch.tensor(9))).all()


def test_captured_steps_call_the_cpp_op_with_the_same_result():
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")
    scores, lengths, visible = tied_scores(12, 40, seed=5)
    nodes = []

    def backend(gm, example_inputs):
        nodes.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    step = torch.compile(lambda *a: indexer_topk(*a, 8), backend=backend, fullgraph=True)
    got = step(scores, lengths, visible)
    assert "nextn_cpu.indexer_topk" in nodes
    want = indexer_topk_op(scores, lengths, visible, 8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
