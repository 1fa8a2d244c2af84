# SPDX-License-Identifier: Apache-2.0
"""Row gathers for eager prefill steps.

`source[index]` with an integer tensor runs `aten::index`, which on CPU copies element by
element; `index_select` along dim 0 copies whole rows, much faster for the gathers of a
prefill (key windows, tiles, each row's selected entries; rows of 64-256 values). Same
values: both are the same gather.
"""

from __future__ import annotations

import torch


def take_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`source[index]` for a non-negative integer `index` of any shape: `[*index.shape,
    *source.shape[1:]]`."""
    picked = source.index_select(0, index.reshape(-1))
    return picked.view(*index.shape, *source.shape[1:])
