# SPDX-License-Identifier: Apache-2.0
"""`nextn_cpu::group_attention` (a uniform step's attention: each request's rows and heads
over the request's shared keys and each row's own selected keys, with a per-head sink)
against the definition in fp64: head sizes with and without whole vectors of lanes, head
counts that do not divide a vector, key counts across blocks of the kernel, no keys at all,
rows that see no key (the sink's alone: zeros), large scores; a query's result bit for bit
the same whichever batch, rows per request and lanes it is computed in (so decode and verify
steps of any bucket agree); and the dispatch of `grouped_sink_attention`, which keeps its
batched products for bf16 and wherever a grad is wanted."""

from __future__ import annotations

import pytest
import torch

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension
from runtime.kernels.sink_attention import grouped_sink_attention, grouped_sink_attention_bmm


@pytest.fixture(scope="module", autouse=True)
def loaded():
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")


def case(groups, rows, heads, dim, keys, own_keys, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(groups, rows, heads, dim, generator=g) * spread
    kv = torch.randn(groups, keys, dim, generator=g)
    valid = torch.rand(groups, rows, keys, generator=g) < 0.7
    valid[0, 0] = False  # the first row of the first group sees no shared key
    row_kv = row_valid = None
    if own_keys:
        row_kv = torch.randn(groups * rows, own_keys, dim, generator=g)
        row_valid = torch.rand(groups * rows, own_keys, generator=g) < 0.6
        row_valid[0] = False  # ... nor any key of its own
    sink = torch.randn(heads, generator=g)
    return q, kv, valid, row_kv, row_valid, sink


def expected(q, kv, valid, row_kv, row_valid, sink, scale):
    """Every row and head's softmax over its valid keys and the sink, by definition, fp64."""
    groups, rows, heads, dim = q.shape
    q64 = q.double()
    scores = torch.einsum("brhd,bkd->brhk", q64, kv.double()) * scale
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    parts = [scores.reshape(groups * rows, heads, -1)]
    values = [kv.double().repeat_interleave(rows, 0).unsqueeze(1)]  # [B * R, 1, K, D]
    if row_kv is not None:
        own = torch.einsum("thd,tjd->thj", q64.reshape(groups * rows, heads, dim), row_kv.double())
        parts.append((own * scale).masked_fill(~row_valid.unsqueeze(1), float("-inf")))
        values.append(row_kv.double().unsqueeze(1))
    parts.append(sink.double().view(1, heads, 1).expand(groups * rows, heads, 1))
    probs = torch.softmax(torch.cat(parts, -1), -1)[..., :-1]  # the sink has no value
    keys = torch.cat(values, 2)  # [B * R, 1, K + Kr, D]
    return torch.einsum("thk,tkd->thd", probs, keys.squeeze(1)).float()


def kernel(q, kv, valid, row_kv, row_valid, sink, scale):
    return torch.ops.nextn_cpu.group_attention(q, kv, valid, row_kv, row_valid, sink, scale)


@pytest.mark.parametrize("dim", [8, 24, 64, 80])
@pytest.mark.parametrize("keys", [0, 1, 13, 24, 25, 131])
@pytest.mark.parametrize("own_keys", [0, 5, 32])
def test_kernel_matches_the_definition(dim, keys, own_keys):
    for groups, rows, heads in ((3, 1, 8), (2, 4, 8), (2, 3, 5), (1, 2, 16)):
        args = case(groups, rows, heads, dim, keys, own_keys, seed=dim + keys)
        out = kernel(*args, dim**-0.5)
        assert out.shape == (groups * rows, heads, dim)
        torch.testing.assert_close(out, expected(*args, dim**-0.5), rtol=1e-5, atol=2e-5)
        # the first row sees only the sink when it has no keys of its own either
        if not own_keys:
            assert bool((out[0] == 0).all())


def test_large_scores_need_the_shift():
    args = case(2, 4, 8, 64, 40, 8, seed=3, spread=40.0)
    out = kernel(*args, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected(*args, 1.0), rtol=1e-4, atol=1e-4)


def test_a_query_gives_the_same_bits_in_any_batch_and_row_layout():
    """Verify rows (four per request) computed together equal each row computed alone as a
    decode row, and a request's rows equal themselves inside a larger batch."""
    q, kv, valid, row_kv, row_valid, sink = case(5, 4, 8, 64, 131, 32, seed=7)
    together = kernel(q, kv, valid, row_kv, row_valid, sink, 0.125).view(5, 4, 8, 64)
    for b in range(5):
        for r in range(4):
            t = b * 4 + r
            alone = kernel(
                q[b : b + 1, r : r + 1],
                kv[b : b + 1],
                valid[b : b + 1, r : r + 1],
                row_kv[t : t + 1],
                row_valid[t : t + 1],
                sink,
                0.125,
            )
            assert torch.equal(alone.view(8, 64), together[b, r])
    first_two = kernel(q[:2], kv[:2], valid[:2], row_kv[:8], row_valid[:8], sink, 0.125)
    assert torch.equal(first_two.view(2, 4, 8, 64), together[:2])


def test_dispatch_keeps_the_batched_products_for_bf16_and_grad():
    args = case(3, 4, 8, 64, 40, 8, seed=5)
    q, kv, valid, row_kv, row_valid, sink = args
    with torch.no_grad():
        torch.testing.assert_close(
            grouped_sink_attention(*args, 0.125), kernel(*args, 0.125), rtol=0, atol=0
        )
        bf16 = (q.bfloat16(), kv.bfloat16(), valid, row_kv.bfloat16(), row_valid, sink)
        torch.testing.assert_close(
            grouped_sink_attention(*bf16, 0.125), grouped_sink_attention_bmm(*bf16, 0.125)
        )
    leaf = q.clone().requires_grad_()
    out = grouped_sink_attention(leaf, kv, valid, row_kv, row_valid, sink, 0.125)
    out.sum().backward()  # the batched products: the kernel has no backward
    assert leaf.grad is not None
    torch.testing.assert_close(out.detach(), kernel(*args, 0.125), rtol=1e-5, atol=1e-5)
