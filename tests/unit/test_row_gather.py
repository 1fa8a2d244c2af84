# SPDX-License-Identifier: Apache-2.0
"""`take_rows` is advanced indexing `source[index]` (the oracle), value for value and shape
for shape: multi-dimensional indices, repeated and empty ones, non-contiguous sources,
integer and half-precision rows."""

from __future__ import annotations

import pytest
import torch

from runtime.kernels.row_gather import take_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize(
    "source_shape,index_shape",
    [((50, 8), (13,)), ((50, 4, 6), (7, 3)), ((9,), (4, 2, 5)), ((50, 8), (0, 3))],
)
def test_take_rows_is_advanced_indexing(dtype, source_shape, index_shape):
    g = torch.Generator().manual_seed(0)
    source = (torch.randn(source_shape, generator=g) * 8).to(dtype)
    index = torch.randint(0, source_shape[0], index_shape, generator=g)
    out = take_rows(source, index)
    assert out.shape == source[index].shape
    assert torch.equal(out, source[index])


def test_take_rows_of_non_contiguous_sources():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 40, 5, generator=g)
    for source in (base.transpose(0, 1), base[:, ::2].transpose(0, 1), base.permute(1, 2, 0)):
        index = torch.randint(0, source.shape[0], (11, 2), generator=g)
        assert torch.equal(take_rows(source, index), source[index])
