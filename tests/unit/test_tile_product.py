# SPDX-License-Identifier: Apache-2.0
"""The AMX tile product (`runtime.kernels.tile_product`): fp32 rows split into three bf16
parts times a bf16 weight must be as accurate as an fp32 product (checked against float64),
grouped rows must read their own weight, and eager prefill products must take it exactly
where they should (enough rows, no grad, outside captured steps, weights packed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension, tile_product
from runtime.layers import narrow_weights
from runtime.layers.linear import ReplicatedLinear
from runtime.layers.moe import experts as experts_mod
from runtime.layers.moe.experts import FusedMoEExperts
from runtime.layers.narrow_weights import TILE_MIN_ROWS, attach_narrow_copies, linear_product

READY = tile_product.host_has_tiles() and cpu_extension.load(default_cache_dir())
needs_tiles = pytest.mark.skipif(
    not (READY and tile_product.ready()), reason="no AMX tiles or no C++ kernels here"
)


def bf16_valued(shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).bfloat16().float()


def rows(shape, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


def assert_fp32_accurate(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Within the error bound of an fp32 sum of K products (K * eps * sum |x_k w_k|) of
    the exact result, and no further from it than the fp32 product is, give or take."""
    exact = x.double() @ weight.double().T
    bound = x.shape[-1] * 2.0**-24 * (x.double().abs() @ weight.double().abs().T)
    err = (out.double() - exact).abs()
    assert (err <= bound + 1e-300).all()
    fp32_err = (F.linear(x, weight).double() - exact).abs().max()
    assert err.max() <= 2 * fp32_err + 1e-30


def test_pack_pads_to_tiles_and_interleaves_pairs_of_k():
    weight = torch.arange(3 * 5, dtype=torch.float32).view(3, 5).bfloat16()
    packed = tile_product.pack(weight)
    assert packed.shape == (16, 32, 2)  # K 5 -> 32 (16 pairs), N 3 -> 32
    assert torch.equal(packed[0, :3], weight[:, 0:2])  # pair 0 of each column
    assert torch.equal(packed[2, :3, 0], weight[:, 4])  # K 4, its pair padded with 0
    assert not packed[2, :, 1].any() and not packed[:, 3:].any() and not packed[3:].any()
    grouped = tile_product.pack(torch.stack([weight, weight + 1]))
    assert grouped.shape == (2, 16, 32, 2) and torch.equal(grouped[0], packed)


@needs_tiles
@pytest.mark.parametrize("m", [1, 31, 32, 33, 100, 257])
@pytest.mark.parametrize("k,n", [(5, 3), (32, 32), (33, 17), (100, 70), (256, 256), (1024, 24)])
def test_product_is_as_accurate_as_fp32(m, k, n):
    weight = bf16_valued((n, k), seed=m + k)
    x = rows((m, k), seed=n)
    out = tile_product.tile_product(x, tile_product.pack(weight.bfloat16()), n)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert_fp32_accurate(out, x, weight)


@needs_tiles
def test_rows_of_any_magnitude_and_strided_rows():
    """The split is exact at every scale (each part keeps its own exponent), and the
    kernel reads a row-strided view as the rows it holds."""
    weight = bf16_valued((48, 80), seed=3)
    scales = 2.0 ** torch.arange(-60, 60, 2.0)
    x = rows((scales.numel(), 80), seed=4) * scales[:, None]
    packed = tile_product.pack(weight.bfloat16())
    assert_fp32_accurate(tile_product.tile_product(x, packed, 48), x, weight)
    wide = rows((70, 160), seed=5)
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    out = tile_product.tile_product(strided, packed, 48)
    assert_fp32_accurate(out, strided.contiguous(), weight)


@needs_tiles
def test_grouped_rows_read_their_own_weight():
    weights = bf16_valued((4, 40, 72), seed=6)
    x = rows((150, 72), seed=7)
    ends = torch.tensor([0, 70, 70, 141], dtype=torch.int32)  # empty groups; 9 rows past
    out = tile_product.tile_product(x, tile_product.pack(weights.bfloat16()), 40, ends)
    start = 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            assert_fp32_accurate(out[start:end], x[start:end], weights[g])
        start = end
    assert not out[141:].any()
    oracle = tile_product.tile_product_grouped_reference(x, weights, ends)
    torch.testing.assert_close(out, oracle, rtol=1e-5, atol=1e-5)


@needs_tiles
def test_bad_operands_are_refused():
    packed = tile_product.pack(bf16_valued((16, 40)).bfloat16())
    with pytest.raises(RuntimeError, match="disagree"):
        tile_product.tile_product(rows((4, 70)), packed, 16)  # K pads to 96, not 64
    with pytest.raises(RuntimeError, match="float32"):
        tile_product.tile_product(rows((4, 40)).double(), packed, 16)
    grouped = tile_product.pack(bf16_valued((2, 16, 40)).bfloat16())
    with pytest.raises(RuntimeError, match="group_ends"):
        tile_product.tile_product(rows((4, 40)), grouped, 16, torch.tensor([3, 1]))
    assert tile_product.tile_product(rows((0, 40)), packed, 16).shape == (0, 16)


def layer_with_tiles(rows_in=256, rows_out=128):
    layer = ReplicatedLinear(rows_in, rows_out, bias=True)
    layer.weight.data = bf16_valued((rows_out, rows_in), seed=8)
    layer.bias.data = rows((rows_out,), seed=9)
    attach_narrow_copies([layer], tiles=True)
    return layer


def test_packed_copies_follow_the_flag_and_the_module():
    layer = layer_with_tiles()
    assert torch.equal(layer.weight_tiles, tile_product.pack(layer.weight_narrow))
    plain = ReplicatedLinear(256, 128)
    plain.weight.data = bf16_valued((128, 256), seed=8)
    made = attach_narrow_copies([plain], tiles=False)
    assert made == 128 * 256 * 2 and not hasattr(plain, "weight_tiles")
    lossy = ReplicatedLinear(256, 128)
    lossy.weight.data = rows((128, 256))
    attach_narrow_copies([lossy], tiles=True)
    assert not hasattr(lossy, "weight_tiles")


@needs_tiles
def test_eager_products_of_many_rows_take_the_tiles(monkeypatch):
    layer = layer_with_tiles()
    calls = []
    real = tile_product.tile_product

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(tile_product, "tile_product", counted)
    many = rows((2, TILE_MIN_ROWS // 2 + 3, 256), seed=10)  # leading dims are flattened
    assert TILE_MIN_ROWS > 2
    with torch.inference_mode():
        out = linear_product(many, layer, "weight", layer.bias)
    assert calls == [(many.shape[0] * many.shape[1], 256)]
    exact = many.double() @ layer.weight.double().T + layer.bias.double()
    fp32 = F.linear(many, layer.weight, layer.bias)
    assert (out.double() - exact).abs().max() <= 2 * (fp32.double() - exact).abs().max() + 1e-6
    with torch.inference_mode():
        linear_product(many[:, :2], layer, "weight", layer.bias)  # too few rows
    linear_product(many, layer, "weight", layer.bias)  # grad mode: no kernel backward
    assert len(calls) == 1


@needs_tiles
def test_eager_experts_take_the_grouped_tiles(monkeypatch):
    experts = FusedMoEExperts(num_experts=4, hidden_size=64, intermediate_size=32)
    experts.w13_weight.data = bf16_valued(experts.w13_weight.shape, seed=11, scale=0.2)
    experts.w2_weight.data = bf16_valued(experts.w2_weight.shape, seed=12, scale=0.2)
    x = rows((200, 64), seed=13)
    g = torch.Generator().manual_seed(14)
    topk_ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(200)])
    topk_weights = torch.rand(200, 2, generator=g)
    with torch.inference_mode():
        wide = experts(x, topk_weights, topk_ids)
    attach_narrow_copies([experts], min_numel=1, tiles=True)
    assert hasattr(experts, "w13_weight_tiles") and hasattr(experts, "w2_weight_tiles")
    calls = []
    real = tile_product.tile_product
    monkeypatch.setattr(
        tile_product, "tile_product", lambda *a: calls.append(a[0].shape) or real(*a)
    )
    with torch.inference_mode():
        tiled = experts(x, topk_weights, topk_ids)
    assert len(calls) == 2  # gate-up and down, every pair in one call each
    torch.testing.assert_close(tiled, wide, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(narrow_weights, "TILE_MIN_ROWS", 10**6)
    with torch.inference_mode():
        experts(x, topk_weights, topk_ids)
    assert len(calls) == 2


@needs_tiles
def test_compiled_step_keeps_the_tile_product_as_one_node():
    weight = bf16_valued((40, 72), seed=15)
    packed = tile_product.pack(weight.bfloat16())
    x = rows((48, 72), seed=16)

    def step(x, packed):
        return torch.nn.functional.silu(tile_product.tile_product(x * 2, packed, 40)).sum(-1)

    explained = torch._dynamo.explain(step)(x, packed)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(step, dynamic=False, options={"cpp_wrapper": True})
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x, packed), step(x, packed), rtol=1e-5, atol=1e-5)


@needs_tiles
@pytest.mark.parametrize("tiles", [True, False])
def test_captured_experts_leave_the_narrow_kernel_for_the_tiles_sooner(tiles):
    """Inside a captured step the routed experts take the narrow-weight kernel up to
    `KERNEL_MAX_PAIRS_BESIDE_TILES` pairs where their weights are packed for the tiles and
    the sorted form on the tiles above it; without packed weights the kernel keeps every
    step up to `KERNEL_MAX_PAIRS` pairs (the sorted form over fp32 weights is slower there).
    Every form gives the eager result."""
    experts = FusedMoEExperts(num_experts=8, hidden_size=64, intermediate_size=32)
    experts.w13_weight.data = bf16_valued(experts.w13_weight.shape, seed=17, scale=0.2)
    experts.w2_weight.data = bf16_valued(experts.w2_weight.shape, seed=18, scale=0.2)
    attach_narrow_copies([experts], min_numel=1, tiles=tiles)
    assert hasattr(experts, "w2_weight_tiles") == tiles
    limit = experts_mod.KERNEL_MAX_PAIRS_BESIDE_TILES if tiles else experts_mod.KERNEL_MAX_PAIRS
    assert experts.kernel_max_pairs() == limit
    assert experts_mod.KERNEL_MAX_PAIRS_BESIDE_TILES < experts_mod.KERNEL_MAX_PAIRS
    for tokens in (limit // 2, limit // 2 + 1):  # top-2: `limit` pairs, then two more
        g = torch.Generator().manual_seed(tokens)
        x = rows((tokens, 64), seed=tokens)
        topk_ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])
        topk_weights = torch.rand(tokens, 2, generator=g)
        ops: list[str] = []

        def recording_backend(gm, example_inputs, ops=ops):
            ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        with torch.inference_mode():
            eager = experts(x, topk_weights, topk_ids)
            torch._dynamo.reset()
            traced = torch.compile(experts, backend=recording_backend, fullgraph=True)
            captured = traced(x, topk_weights, topk_ids)
        narrow = any("narrow_product" in op for op in ops)
        tiled = any("tile_product" in op for op in ops)
        # above the limit the sorted form: on the tiles where packed, else a grouped GEMM
        assert (narrow, tiled) == ((True, False) if 2 * tokens <= limit else (False, tiles))
        torch.testing.assert_close(captured, eager, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
