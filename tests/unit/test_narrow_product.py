# SPDX-License-Identifier: Apache-2.0
"""The narrow-weight kernel (`nextn_cpu::narrow_product`) against its torch reference: bf16
weights widened exactly, so the products equal the fp32 ones up to the order of the sums,
over row counts on both sides of a pass (8 rows), reduction lengths with and without a
vector tail, groups sharing a weight, and inside a compiled graph as one node."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension
from runtime.kernels import narrow_product as kernel


@pytest.fixture(scope="module", autouse=True)
def loaded():
    if not cpu_extension.load(default_cache_dir()):
        pytest.skip("the narrow-weight kernel cannot be built here")


def close(got, expected):
    """fp32 sums of a few hundred terms in another order: rounding-level differences."""
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def operands(groups, rows, k, n, experts, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(groups, rows, k, generator=g)
    weight = torch.randn(experts, n, k, generator=g).bfloat16()
    return x, weight


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
@pytest.mark.parametrize("k", [16, 40, 256, 300])
def test_one_weight_many_rows(rows, k):
    x, weight = operands(1, rows, k, 70, 1, seed=rows * k)
    got = kernel.narrow_product(x, weight)
    close(got, kernel.narrow_product_reference(x, weight))


@pytest.mark.parametrize("k", [16, 40, 256])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_pass(k):
    """A pass of several rows reduces its sums together (one shuffle tree for 8-16 of
    them), a lone row one by one; both add the lanes in the same pairs, so a decode row and
    the same row inside a verify's pass of 4 or 8 agree bit for bit."""
    x, weight = operands(1, 17, k, 70, 1, seed=k)
    together = kernel.narrow_product(x, weight)
    for r in range(17):
        alone = kernel.narrow_product(x[:, r : r + 1], weight)
        assert torch.equal(alone[0, 0], together[0, r])


@pytest.mark.parametrize("groups,rows", [(6, 1), (5, 3), (40, 1)])
def test_groups_read_their_indexed_weight_shared_ones_together(groups, rows):
    """Routed experts: several groups (pairs) index the same weight, some none; an index of
    every group its own weight (`E == G`, no index) and one weight for all (`E == 1`)."""
    x, weight = operands(groups, rows, 96, 130, 8, seed=groups)
    index = torch.randint(0, 8, (groups,), generator=torch.Generator().manual_seed(1))
    index[: groups // 2] = 3  # at least half share one expert
    close(
        kernel.narrow_product(x, weight, index), kernel.narrow_product_reference(x, weight, index)
    )
    own = weight[:1].expand(groups, -1, -1).contiguous()
    close(kernel.narrow_product(x, own), kernel.narrow_product_reference(x, own))
    close(kernel.narrow_product(x, weight[:1]), kernel.narrow_product_reference(x, weight[:1]))


def test_empty_operands_and_bad_index():
    x, weight = operands(0, 2, 32, 8, 2)
    assert kernel.narrow_product(x, weight, torch.zeros(0, dtype=torch.long)).shape == (0, 2, 8)
    x, weight = operands(2, 2, 0, 8, 2)
    assert torch.equal(kernel.narrow_product(x, weight), torch.zeros(2, 2, 8))
    x, weight = operands(2, 1, 32, 8, 2)
    with pytest.raises(RuntimeError, match="index out of range"):
        kernel.narrow_product(x, weight, torch.tensor([0, 2]))


def test_compiled_step_keeps_the_kernel_as_one_node():
    x, weight = operands(4, 1, 64, 48, 8)
    index = torch.tensor([5, 1, 5, 0])

    def step(x, weight, index):
        return torch.nn.functional.silu(kernel.narrow_product(x * 2, weight, index)).sum(-1)

    explained = torch._dynamo.explain(step)(x, weight, index)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(step, dynamic=False, options={"cpp_wrapper": True})
    close(compiled(x, weight, index), step(x, weight, index))


def test_a_build_lock_left_by_a_dead_builder_does_not_stall_loading(tmp_path):
    """torch's extension builder waits while a build directory's `lock` file exists: a
    stale one (its builder killed) is removed; a live one is waited for until it goes."""
    stale = tmp_path / "stale.lock"
    stale.touch()
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    cpu_extension.wait_for_build_lock(stale, stale_after=60)
    assert not stale.exists()

    live = tmp_path / "live.lock"
    live.touch()
    threading.Timer(0.3, live.unlink).start()  # another process finishing its build
    start = time.monotonic()
    cpu_extension.wait_for_build_lock(live, stale_after=60, poll=0.05)
    assert 0.25 <= time.monotonic() - start < 30
