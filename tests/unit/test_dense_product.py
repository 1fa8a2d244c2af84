# SPDX-License-Identifier: Apache-2.0
"""oneDNN's fp32 GEMM (`nextn_cpu::dense_product`) against `F.linear` and a float64
product: the same values up to the order of fp32 sums, for row counts, widths, a bias,
non-contiguous rows and leading dims; one opaque node inside a compiled graph (both of
inductor's wrappers); the per-process choice (`choose`) and the routing of `linear_product`
by rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension
from runtime.kernels import dense_product as dense
from runtime.kernels.grouped_gemm import grouped_gemm_reference
from runtime.layers import narrow_weights


@pytest.fixture(scope="module", autouse=True)
def loaded():
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ CPU kernels cannot be built here")
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")


@pytest.fixture
def choice(monkeypatch):
    """Set this process's choice for one test (restored after)."""

    def set_choice(enabled: bool, reason: str = "set by a test"):
        monkeypatch.setitem(dense._state, "enabled", enabled)
        monkeypatch.setitem(dense._state, "reason", reason)

    return set_choice


def operands(shape, k, n, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, k, generator=g)
    weight = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    return x, weight, b


def float64_product(x, weight, bias):
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("shape", [(1,), (4,), (32,), (64,), (3, 40), (1024,)])
@pytest.mark.parametrize("k,n", [(256, 256), (128, 512), (1024, 24), (96, 4096), (300, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_the_fp32_product_up_to_the_order_of_its_sums(shape, k, n, bias):
    x, weight, b = operands(shape, k, n, bias=bias)
    with torch.inference_mode():
        got = dense.dense_product(x, weight, b)
        expected = dense.dense_product_reference(x, weight, b)
    assert got.shape == expected.shape == (*shape, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    # as accurate as an fp32 GEMM, measured against float64: within a few times the default
    # GEMM's error plus the random-walk scale of k fp32 roundings (sqrt(k) eps |x||w|), since
    # the default's own max error can be lucky over a few outputs. A product done in bf16 or
    # tf32 misses that bound by orders of magnitude.
    exact = float64_product(x, weight, b)
    err, reference_err = (got - exact).abs().max(), (expected - exact).abs().max()
    rounding_scale = k**0.5 * torch.finfo(torch.float32).eps * (x.abs() @ weight.abs().T).max()
    assert err <= 4 * reference_err + rounding_scale


@pytest.mark.parametrize("rows", [0, 17, 129, 300, 513, 2047, 2049, 2600])
def test_row_counts_off_the_ladder_are_padded_and_cut_back(rows):
    """Products are built for the rows rounded up to a short ladder (oneDNN builds one
    primitive per shape): any row count gives the product of exactly its rows, contiguous,
    the padding's rows dropped, and the values of those rows in a larger product."""
    x, weight, b = operands((rows,), 256, 64, bias=True)
    with torch.inference_mode():
        got = dense.dense_product(x, weight, b)
        torch.testing.assert_close(got, dense.dense_product_reference(x, weight, b))
        assert got.shape == (rows, 64) and got.is_contiguous()
        if rows:
            padded = torch.cat([x, torch.zeros(31, 256)])
            torch.testing.assert_close(dense.dense_product(padded, weight, b)[:rows], got)


def test_rows_that_are_a_strided_view_and_an_expanded_bias():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(70, 2, 200, generator=g)
    x = wide[:, 1, :160]  # neither contiguous nor dense
    weight = torch.randn(48, 160, generator=g)
    bias = torch.randn(1, generator=g).expand(48)
    with torch.inference_mode():
        torch.testing.assert_close(
            dense.dense_product(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4
        )


@pytest.mark.parametrize("cpp_wrapper", [False, True])
def test_one_node_of_a_compiled_graph(cpp_wrapper):
    x, weight, b = operands((2, 48), 256, 512)

    def step(x, weight, b):
        return torch.relu(dense.dense_product(x * 2.0, weight, b)).sum(-1)

    explained = torch._dynamo.explain(step)(x, weight, b)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(
        step, dynamic=False, fullgraph=True, options={"cpp_wrapper": cpp_wrapper}
    )
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x, weight, b), step(x, weight, b))
        expected = torch.relu(F.linear(x * 2.0, weight, b)).sum(-1)
        torch.testing.assert_close(compiled(x, weight, b), expected, rtol=1e-5, atol=1e-3)


def test_the_choice_is_made_once_and_an_explicit_setting_wins(monkeypatch, choice):
    choice(False, "not probed")
    monkeypatch.setenv(dense.CHOICE_ENV, "onednn")
    assert dense.choose() is True and dense._state["reason"] == f"{dense.CHOICE_ENV}=onednn"
    monkeypatch.setenv(dense.CHOICE_ENV, "default")
    assert dense.choose() is True  # decided already: a process keeps its choice
    choice(True, "not probed")
    assert dense.choose() is False and dense.enabled() is False


def test_the_probe_compares_both_libraries_on_the_same_products(monkeypatch, choice):
    choice(False, "not probed")
    monkeypatch.delenv(dense.CHOICE_ENV, raising=False)
    timed = []
    monkeypatch.setattr(dense, "_speed_up", lambda *shape: timed.append(shape) or 1.1)
    assert dense.choose() is False and timed == list(dense.PROBE_SHAPES)
    choice(False, "not probed")
    monkeypatch.setattr(dense, "_speed_up", lambda *shape: 2.0)
    assert dense.choose() is True and "2.00x" in dense._state["reason"]
    # the real probe measures a ratio of two positive times
    assert dense._speed_up(64, 64, 64) > 0


def count_calls(monkeypatch, name: str) -> list:
    """The calls to `dense.<name>` from now on (each still runs)."""
    calls, real = [], getattr(dense, name)
    monkeypatch.setattr(dense, name, lambda *a: calls.append(a) or real(*a))
    return calls


def both_choices(choice, calls: list, product):
    """`product()` without oneDNN chosen (which must not call it), then with it chosen."""
    with torch.inference_mode():
        choice(False)
        default = product()
        assert calls == []
        choice(True)
        return default, product()


class Projection(nn.Module):
    narrow_weight_names = tile_weight_names = ("weight",)

    def __init__(self, k, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, k) / k**0.5, requires_grad=False)


@pytest.mark.parametrize(
    "rows,outputs",
    [
        (dense.DENSE_MIN_ROWS - 1, 4096),  # too few rows
        (dense.DENSE_MIN_ROWS, dense.DENSE_MIN_OUTPUTS // dense.DENSE_MIN_ROWS - 1),  # too narrow
        (dense.DENSE_MIN_ROWS, dense.DENSE_MIN_OUTPUTS // dense.DENSE_MIN_ROWS),
        (300, 384),
    ],
)
def test_linear_products_of_many_rows_go_through_onednn_once_chosen(
    monkeypatch, choice, rows, outputs
):
    module = Projection(256, outputs)
    x = torch.randn(rows, 256)
    bias = torch.randn(outputs)
    calls = count_calls(monkeypatch, "dense_product")
    default, chosen = both_choices(
        choice, calls, lambda: narrow_weights.linear_product(x, module, "weight", bias)
    )
    wanted = rows >= dense.DENSE_MIN_ROWS and rows * outputs >= dense.DENSE_MIN_OUTPUTS
    assert len(calls) == wanted
    torch.testing.assert_close(chosen, default, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(default, F.linear(x, module.weight, bias), rtol=1e-5, atol=1e-4)
    # with grad wanted the product stays differentiable (the operator has no backward)
    calls.clear()
    narrow_weights.linear_product(x, module, "weight", bias)
    assert calls == []


@pytest.mark.parametrize("counts", [[5, 0, 37, 1, 0, 300, 2, 40], [0, 0, 64], [256]])
@pytest.mark.parametrize("tail", [0, 7])
def test_grouped_products_equal_the_reference_group_by_group(counts, tail):
    """Rows sorted by group, empty groups, and rows past the last group (zeros)."""
    g = torch.Generator().manual_seed(len(counts) + tail)
    rows = sum(counts) + tail
    x = torch.randn(rows, 96, generator=g)
    weight = torch.randn(len(counts), 160, 96, generator=g) / 96**0.5
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    with torch.inference_mode():
        got = dense.dense_grouped_product(x, weight, ends)
    expected = grouped_gemm_reference(x, weight, ends)
    expected[sum(counts) :] = 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


class Experts(nn.Module):
    def __init__(self, groups, k, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(groups, n, k) / k**0.5, requires_grad=False)


@pytest.mark.parametrize("rows", [dense.DENSE_MIN_GROUPED_ROWS - 1, dense.DENSE_MIN_GROUPED_ROWS])
def test_grouped_products_of_many_rows_go_through_onednn_once_chosen(monkeypatch, choice, rows):
    module = Experts(8, 128, 256)
    x = torch.randn(rows, 128)
    ends = torch.linspace(0, rows, 9)[1:].round().to(torch.int32)
    calls = count_calls(monkeypatch, "dense_grouped_product")
    default, chosen = both_choices(
        choice, calls, lambda: narrow_weights.grouped_product(x, module, "w", ends)
    )
    assert len(calls) == (rows >= dense.DENSE_MIN_GROUPED_ROWS)
    torch.testing.assert_close(chosen, default, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        default, grouped_gemm_reference(x, module.w, ends), rtol=1e-5, atol=1e-4
    )


def test_the_grouped_product_is_one_node_of_a_compiled_graph():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 64, generator=g)
    weight = torch.randn(4, 48, 64, generator=g)
    experts = torch.randint(0, 4, (300,), generator=g).sort().values  # rows sorted by expert

    def step(x, weight, experts):
        # fixed shapes, as a captured step computes them: rows routed to experts <= g
        ends = (experts.unsqueeze(0) <= torch.arange(4).unsqueeze(1)).sum(1).to(torch.int32)
        return dense.dense_grouped_product(x * 2.0, weight, ends).sum(-1)

    explained = torch._dynamo.explain(step)(x, weight, experts)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(step, dynamic=False, fullgraph=True)
    ends = torch.bincount(experts, minlength=4).cumsum(0)
    expected = grouped_gemm_reference(x * 2.0, weight, ends).sum(-1)
    with torch.inference_mode():
        got = compiled(x, weight, experts)  # its sum over the outputs in the compiler's order
        torch.testing.assert_close(got, step(x, weight, experts), rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-3)
